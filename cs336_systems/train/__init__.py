"""The training step composed from named parts (SPEC section 9): :mod:`cs336_systems.train.step`."""

from cs336_systems.train.step import STACKS, Parts, TrainingStep, build_training_step, make_optimizer

__all__ = ["STACKS", "Parts", "TrainingStep", "build_training_step", "make_optimizer"]
