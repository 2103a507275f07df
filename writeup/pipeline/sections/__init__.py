"""One function per problem, registered in document order (see :mod:`.registry`).

Importing this package imports every section module, which fills :data:`SECTIONS`.
"""

from pipeline.sections import single_gpu  # noqa: F401  (registers its sections)
from pipeline.sections.registry import SECTIONS, Output, problem

__all__ = ["SECTIONS", "Output", "problem"]
