"""What the Gluon kernels need that Triton 3.6 does not export: the aggregate decorator and the copy engine's bulk
reduction into global memory. Every private Triton symbol the attention kernels use is here, so that a Triton
upgrade that moves one breaks this module only.

* :func:`aggregate`: a class whose fields travel through ``@gluon.jit`` functions as one value (flattened into
  its fields where a function is called: it adds no instruction). Later Triton versions export it as
  ``gl.aggregate``.
* :func:`tma_reduce_add`: ``cp.reduce.async.bulk.tensor ... .add``, which Gluon's ``tma`` module has no wrapper
  for on Hopper.
"""

from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin
from triton.language.core import _aggregate as aggregate

__all__ = ["aggregate", "tma_reduce_add"]


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory block ``src`` into global memory at ``coord`` by the copy engine
    (``cp.reduce.async.bulk.tensor ... .add``); completion as for ``tma.async_copy_shared_to_global``."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)
