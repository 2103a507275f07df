"""The kernel families our attention operator (``cs336_systems.attention.op``) runs, one module each, each a
:class:`~cs336_systems.attention.backends.common.Backend` (``supports``, ``programs``, ``forward``,
``backward``). ``triton`` is the portable Triton backend (kernels in ``triton_kernels.py``); ``hopper``
the Gluon backend for Hopper GPUs (kernels in ``hopper_kernels.py``, the private Triton symbols they need in
``gluon_compat.py``); ``common`` what both share. No backend imports another."""
