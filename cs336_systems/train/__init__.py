"""The training step composed from named parts: :mod:`cs336_systems.train.step`."""

from cs336_systems.train.step import (
    SHARDED_STACKS,
    STACKS,
    Parts,
    TrainingStep,
    build_training_step,
    make_optimizer,
)

__all__ = ["SHARDED_STACKS", "STACKS", "Parts", "TrainingStep", "build_training_step", "make_optimizer"]
