"""The kernel families our attention operator (``cs336_systems.attention.op``) runs, one module each with the same
interface: ``supports(device, dtype, head_dim)`` (why it cannot run such inputs, or None), ``forward`` and
``backward``. ``triton`` is the portable Triton backend (kernels in ``triton_kernels.py``); ``hopper`` the Gluon
backend for Hopper GPUs (kernels in ``hopper_kernels.py``, the private Triton symbols they need in
``gluon_compat.py``)."""
