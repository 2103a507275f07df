"""Fully sharded data parallel (FSDP) by blocks (the course's 2026 ``fsdp``).

``FSDP(module, compute_dtype=None, units=None)`` shards the parameters of ``module`` over the ranks of the
default process group one *unit* at a time: by default each ``TransformerBlock``, each ``Embedding``, and the
final norm with the LM head (:func:`default_units`). A unit's parameters are one flat fp32 buffer; each rank keeps
its slice as one optimizer-visible parameter. Before a unit runs its buffer is all-gathered in one collective (in
``compute_dtype`` when given), the next unit's gather already issued; after use it is freed, gathered again for
backward, and its gradients are reduce-scattered (averaged) in one collective.

Modules, in reading order:

* :mod:`.units`: what a unit is (its modules, its parameters' flat layout, this rank's shard);
* :mod:`.state`: where a unit is in a step (``SHARDED``, ``GATHERING``, ``UNSHARDED``, ``RUNNING``; gradients
  ``NONE``, ``ACCUMULATING``, ``REDUCING``) and where the step is, with checked transitions;
* :mod:`.transport`: the collectives, over CUDA streams and NCCL or over gloo, behind one interface;
* :mod:`.wrapper`: :class:`FSDP`, whose hooks drive the units through their states.

fp32 training matches one process only to float tolerance: the ranks sum their own tokens, then the collective
sums the ranks' partial sums, while one process sums all tokens in one matmul (``python
scripts/fsdp_equality_demo.py``; ``tests/test_fsdp_wrapper.py`` compares to tolerance).
"""

from cs336_systems.parallel.fsdp.state import Grads, IllegalTransition, Phase, Weights
from cs336_systems.parallel.fsdp.transport import (
    NATIVE_MEAN_REDUCE_SCATTER,
    CudaStreamTransport,
    GlooTransport,
    Transport,
    reduce_scatter_mean,
)
from cs336_systems.parallel.fsdp.units import ROOT_KEY, Unit, default_units
from cs336_systems.parallel.fsdp.wrapper import FSDP, GATHER_RANGE, REDUCE_RANGE, USE_RANGE

__all__ = [
    "FSDP",
    "GATHER_RANGE",
    "NATIVE_MEAN_REDUCE_SCATTER",
    "REDUCE_RANGE",
    "ROOT_KEY",
    "USE_RANGE",
    "CudaStreamTransport",
    "GlooTransport",
    "Grads",
    "IllegalTransition",
    "Phase",
    "Transport",
    "Unit",
    "Weights",
    "default_units",
    "reduce_scatter_mean",
]
