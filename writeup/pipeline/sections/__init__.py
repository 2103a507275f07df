"""One function per problem (see :mod:`.registry`); ``typ/*.typ`` decides the order in the document.

Importing this package imports every section module, which fills :data:`SECTIONS`.
"""

from pipeline.sections import (  # noqa: F401  (they register sections)
    beyond,
    ddp,
    flash,
    leaderboard_2026,
    op_overhead,
    parallelism,
    sharding,
    single_gpu,
    train_step,
)
from pipeline.sections.registry import SECTIONS, Output, problem

__all__ = ["SECTIONS", "Output", "problem"]
