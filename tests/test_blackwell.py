"""Blackwell (B200, compute capability 10.0): what of our attention runs there, checked on a machine without one.

* The portable Triton kernels (forward, Delta, backward) at the configurations the backend launches compile for
  sm_100 with Triton's ``ptxas-blackwell``: their ``tl.dot`` becomes ``tcgen05.mma`` (accumulating in tensor
  memory), with no register spills, within a block's shared memory and within the SM's tensor memory. This says
  they build, not how fast they run.
* The Gluon kernels are Hopper's (``warpgroup_mma``, which does not exist on sm_100): the operator never chooses
  them where the capability is not 9.x, and asking for them there is an error, not a compilation. The capability is
  faked here by replacing ``torch.cuda.get_device_capability``; nothing touches a GPU.
"""

from __future__ import annotations

import functools

import pytest
import torch

from cs336_systems.attention import op
from cs336_systems.attention.backends import hopper
from cs336_systems.attention.backends import triton as triton_backend
from cs336_systems.attention.config import FlashConfig
from cs336_systems.kernels import launch
from tests._flash_aot import (
    SHARED_MEMORY_PER_BLOCK,
    TENSOR_MEMORY_COLUMNS,
    compile_for_gpu,
    nvidia_toolchain_available,
    portable_launches,
    resource_usage,
)

BLACKWELL = 100


@pytest.mark.compiled_kernels
@pytest.mark.parametrize(
    "dtype, head_dim",
    [(torch.bfloat16, 64), pytest.param(torch.bfloat16, 128, marks=pytest.mark.slow),
     pytest.param(torch.float16, 64, marks=pytest.mark.slow), pytest.param(torch.float16, 128, marks=pytest.mark.slow),
     pytest.param(torch.bfloat16, 80, marks=pytest.mark.slow)],
    ids=["bf16-d64", "bf16-d128", "fp16-d64", "fp16-d128", "bf16-d80"],
)
def test_triton_kernels_compile_for_sm100(monkeypatch, dtype, head_dim):
    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    monkeypatch.setattr(triton_backend, "_capability", lambda device: BLACKWELL)  # the tiles chosen for a B200
    for name, launch_ in portable_launches(dtype, head_dim, is_causal=True).items():
        compiled = compile_for_gpu(launch_.kernel, launch_.args, launch_.kwargs, capability=BLACKWELL)
        usage = resource_usage(compiled)
        where = f"{name}: {usage}"
        assert compiled.metadata.target.arch == BLACKWELL, where
        assert usage.spill_bytes == 0, where
        assert 0 < usage.shared_bytes <= SHARED_MEMORY_PER_BLOCK[BLACKWELL], where
        assert usage.tensor_memory_columns <= TENSOR_MEMORY_COLUMNS[BLACKWELL], where
        if name != "delta":  # the two with matmuls: on Blackwell's tensor cores, accumulating in tensor memory
            assert "tcgen05.mma" in compiled.asm["ptx"] and usage.tensor_memory_columns > 0, where


@pytest.mark.compiled_kernels  # the Gluon kernels are JIT functions only when compiled
def test_gluon_kernels_are_refused_for_sm100():
    """Compiling a Hopper Gluon kernel for sm_100 would abort the process (an LLVM error, not an exception): the
    compile helper refuses it before Triton sees it."""
    from cs336_systems.attention.backends import hopper_kernels

    for kernel in (hopper_kernels.attn_fwd_hopper_kernel, hopper_kernels.attn_bwd_hopper_kernel):
        with pytest.raises(ValueError, match="Gluon kernel for Hopper"):
            compile_for_gpu(kernel, (), {}, capability=BLACKWELL)


@pytest.fixture
def faked_capability(monkeypatch):
    """``set(major, minor)`` makes every CUDA device report that compute capability, with the kernels compiled (as
    on a GPU) so that only the capability decides; the operator's choices are made in a cache of their own."""
    monkeypatch.setattr(launch, "_INTERPRETING", False)
    monkeypatch.setattr(hopper, "interpreting", lambda: False)

    def set_capability(major: int, minor: int) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))

    monkeypatch.setattr(op, "route", functools.lru_cache(maxsize=8)(op.route.__wrapped__))
    yield set_capability


@pytest.mark.parametrize("capability, chosen", [((10, 0), triton_backend), ((8, 0), triton_backend),
                                                ((12, 0), triton_backend), ((9, 0), hopper)],
                         ids=["sm100-triton", "sm80-triton", "sm120-triton", "sm90-hopper"])
def test_dispatch_takes_the_gluon_kernels_on_hopper_only(faked_capability, capability, chosen):
    faked_capability(*capability)
    gpu = torch.device("cuda", 0)
    for part in ("forward", "backward"):
        for dtype in (torch.bfloat16, torch.float16):
            for head_dim in (64, 128):
                assert op.choose_backend(FlashConfig(), gpu, dtype, head_dim, part, True) is chosen, (part, dtype)
        assert op.choose_backend(FlashConfig(), gpu, torch.float32, 64, part, True) is triton_backend
        assert op.choose_backend(FlashConfig(kernels="triton"), gpu, torch.bfloat16, 64, part, True) is triton_backend


@pytest.mark.parametrize("capability", [(10, 0), (12, 0), (8, 0)], ids=["sm100", "sm120", "sm80"])
def test_forcing_the_gluon_kernels_off_hopper_is_an_error(faked_capability, capability):
    """The operator asks for its backend before it launches anything: the error comes before any compilation."""
    faked_capability(*capability)
    for part in ("forward", "backward"):
        with pytest.raises(ValueError, match=rf"Hopper {part} cannot run: compute capability \({capability[0]}, "
                                             rf"{capability[1]}\) \(needs 9.x, Hopper\)"):
            op.choose_backend(FlashConfig(kernels="hopper"), torch.device("cuda", 0), torch.bfloat16, 64, part, True)
