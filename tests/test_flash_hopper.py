"""The Hopper backend: Gluon kernels (``cs336_systems/attention/backends/hopper_kernels.py``) and their host side
(``backends/hopper.py``).

On a machine without a GPU: the kernels compile for sm_90 down to a cubin (Triton's own ptxas) at the
supported head dims with no register spills and within the shared memory of a block, the forward's and the
backward's wgmma kept asynchronous by ptxas (no C7514 serialisation); the TMA views of
Q/K/V/dO address the right elements without copying where they can; the choice between this backward and the
Triton one follows the explicit ``FlashConfig`` and refuses to force an impossible one. Its numerics are checked on
a Hopper GPU (H100 or H200) by the GPU grid of ``test_flash_attention_triton.py``, which runs it by default on
Hopper, and by ``test_hopper_and_triton_kernels_agree_gpu`` below.
"""

from __future__ import annotations

import collections
import functools
import math
import re
from pathlib import Path

import pytest
import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cs336_systems.attention import op
from cs336_systems.attention.backends import hopper
from cs336_systems.attention.backends import triton as triton_backend
from cs336_systems.attention.config import FLASH_CONFIG, FlashConfig
from cs336_systems.attention.backends.common import Backend, head_dim_parts
from cs336_systems.kernels.launch import interpreting, poisoned_outputs
from tests._flash_aot import (
    compiled_and_short_launches,
    compile_for_gpu,
    hopper_launches,
    nvidia_toolchain_available,
    resource_usage,
    serialized_wgmma,
)
from tests._flash_checks import hopper_gpu, relative_error

HOPPER_SHARED_MEMORY = 227 * 1024  # bytes a block may use on an H100/H200


def _wgmma_a_operands(ptx: str, shape: str) -> list[str]:
    """Where each ``wgmma`` of ``shape`` (e.g. "m64n64k16") in ``ptx`` takes its A operand: "registers" (a register
    list after the accumulators) or "descriptor" (a shared-memory descriptor)."""
    operands = []
    for line in ptx.splitlines():
        if "wgmma.mma_async" in line and f".{shape}." in line:
            after_accumulators = line.split("}", 1)[1].lstrip(", \t")
            operands.append("registers" if after_accumulators.startswith("{") else "descriptor")
    return operands


# A few configurations (a few seconds of ptxas apiece): the largest head dim, causal, the smallest, not causal, and
# two head dims of two column parts (two descriptors per tensor); every head dim runs on the GPU. The launches are
# the backend's own, recorded on CPU tensors (tests/_flash_aot.py).
def _run_backward_programs_of(monkeypatch, keys: int) -> None:
    """Every Hopper backward in the test takes programs of ``keys`` keys (64: one warpgroup; 128: two), whatever the
    call's size would choose."""
    config = hopper.SMALL_BACKWARD_CONFIG if keys == hopper.SMALL_BACKWARD_KEYS else hopper.BACKWARD_CONFIG
    monkeypatch.setattr(hopper, "backward_tiles", lambda *shape: (keys, config))


@pytest.mark.slow
@pytest.mark.compiled_kernels
@pytest.mark.parametrize("d, dtype, is_causal, keys", [
    (128, torch.bfloat16, True, 128), (16, torch.float16, False, 64), (64, torch.bfloat16, True, 64),
    (64, torch.float16, True, 128), (80, torch.bfloat16, True, 128), (96, torch.float16, False, 128)])
def test_backward_compiles_for_sm90_without_spills_or_serialized_wgmma(monkeypatch, d, dtype, is_causal, keys):
    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    _run_backward_programs_of(monkeypatch, keys)
    launch = hopper_launches(dtype, d, is_causal, forward=False)["bwd"]
    tiles = math.ceil(777 / keys)  # small: causal, heads first
    assert launch.grid == ((6, tiles) if is_causal else (tiles, 6)) and launch.kwargs["HEADS_FIRST"] == is_causal
    assert (launch.kwargs["BLOCK_N"], launch.kwargs["num_warps"]) == (keys, keys // 16)
    parts = [part for part in head_dim_parts(d) if part]
    assert launch.kwargs["HEAD_DIM_B"] == (parts[1] if len(parts) == 2 else 0)
    widths = [arg.block_shape[-1] for arg in launch.args if isinstance(arg, TensorDescriptor)]
    assert widths == [width for width in parts for _ in range(7)]  # one descriptor per tensor and column part
    compiled = compile_for_gpu(launch.kernel, launch.args, launch.kwargs)
    usage = resource_usage(compiled)
    assert usage.spill_bytes == 0, usage
    assert usage.shared_bytes <= HOPPER_SHARED_MEMORY, usage
    ptx = compiled.asm["ptx"]
    # The point of this kernel: Hopper's asynchronous matmuls, copy engine and register reallocation.
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "cp.reduce.async.bulk.tensor", "setmaxnreg"):
        assert instruction in ptx, instruction
    assert serialized_wgmma(compiled) is None
    # S^T = K Q^T and dP^T = V dO^T are the 64-query-wide matmuls (m64n64 at d 16; at d 64 dV, dK and dQ are too):
    # up to d 32 K and V come from registers, else from shared memory.
    score_operands = _wgmma_a_operands(ptx, "m64n64k16")
    if d <= 32:
        assert score_operands and set(score_operands) == {"registers"}, score_operands
    else:
        assert "descriptor" in score_operands, score_operands
    if keys == hopper.SMALL_BACKWARD_KEYS:
        # One consumer warpgroup a program: two programs must share a multiprocessor (64K registers, 228 KB of
        # shared memory, 1 KB of it reserved per block), or the tensor cores get half the warps they have at 128 keys.
        threads = int(re.search(r"\.reqntid (\d+)", ptx).group(1))
        assert 2 * threads * usage.registers <= 65536, (threads, usage)
        assert 2 * (usage.shared_bytes + 1024) <= 228 * 1024, usage


def _staging_offsets(layout, rows: int, columns: int) -> dict[tuple[int, int], int]:
    """Where a shared linear layout puts each (row, column) of a (rows, columns) tile: offset k holds the XOR of the
    bases of k's set bits."""
    where = {}
    for offset in range(rows * columns):
        row = column = 0
        for bit, (basis_row, basis_column) in enumerate(layout.offset_bases):
            if offset >> bit & 1:
                row, column = row ^ basis_row, column ^ basis_column
        where[row, column] = offset
    return where


def _swizzled_128(row: int, column: int, rows: int) -> int:
    """The float32 offset of (row, column) in a tile swizzled over 128 bytes (what the copy engine reads): 32-column
    blocks one after the other, rows of 128 bytes, a row's 16-byte chunks permuted by the row's index mod 8."""
    chunk = (column % 32 // 4) ^ (row % 8)
    return column // 32 * rows * 32 + row * 32 + chunk * 4 + column % 4


def _wavefronts(addresses: list[int]) -> int:
    """Shared-memory wavefronts of one store: the most 4-byte words that fall in any one of 32 banks (distinct words;
    8-byte stores are taken a half-warp at a time, so pass one half-warp's words)."""
    banks = collections.defaultdict(set)
    for address in addresses:
        banks[address % 32].add(address)
    return max(len(words) for words in banks.values())


@pytest.mark.parametrize("columns", [32, 64, 128])
def test_dq_staging_tile_keeps_the_copy_engines_layout_and_stores_without_bank_conflicts(columns):
    """The backward stages dQ through a linear layout of the 128-byte swizzle: unmoved it is that swizzle; moved,
    every value still lands where the swizzle has it (odd rows' columns c and c xor 16 exchanged in the registers
    and in the layout), and a half-warp's 8-byte stores of the wgmma accumulator (four rows, 32 bytes each) take one
    wavefront where the plain store takes two."""
    from cs336_systems.attention.backends.hopper_kernels import _dq_staging_layout

    rows = 64
    plain = _staging_offsets(_dq_staging_layout(rows, columns, False), rows, columns)
    moved = _staging_offsets(_dq_staging_layout(rows, columns, True), rows, columns)
    assert len(plain) == len(moved) == rows * columns
    assert all(plain[r, c] == _swizzled_128(r, c, rows) for r, c in plain)
    assert all(moved[r, c] == plain[r, c ^ (16 if r % 2 else 0)] for r, c in moved)

    # The accumulator's layout: lane l of a warp holds rows l // 4 (+ 8), columns 2 (l % 4) + 8 i (+ 1), i the
    # register group; one 8-byte store per group (a warpgroup's first 32 columns; the others repeat the pattern).
    for layout, wavefronts in ((plain, 2), (moved, 1)):
        for group in range(4):
            for half in range(2):
                words = []
                for lane in range(16 * half, 16 * half + 16):
                    row, column = lane // 4, 2 * (lane % 4) + 8 * group
                    words += [layout[row, column], layout[row, column + 1]]
                assert _wavefronts(words) == wavefronts, (group, half)


def test_backward_runs_one_warpgroup_a_program_where_the_gpu_would_not_fill():
    """64-key programs of one warpgroup at head dims up to 32; up to 64 where 128-key programs would not fill one
    wave, or at short contexts where they fill at most a few; 128-key programs of two warpgroups otherwise."""
    small = (hopper.SMALL_BACKWARD_KEYS, hopper.SMALL_BACKWARD_CONFIG)
    large = (hopper.BLOCK_N, hopper.BACKWARD_CONFIG)
    waves, context = hopper.SMALL_BACKWARD_WAVES, hopper.SMALL_BACKWARD_CONTEXT
    assert hopper.backward_tiles(16, 65536, 10**6, 132) == hopper.backward_tiles(32, 65536, 10**6, 132) == small
    assert hopper.backward_tiles(64, 65536, 132, 132) == hopper.backward_tiles(48, 16384, 1, 132) == small
    assert hopper.backward_tiles(64, context, waves * 132, 132) == small
    assert hopper.backward_tiles(64, context, waves * 132 + 1, 132) == large
    assert hopper.backward_tiles(64, context + 1, 133, 132) == hopper.backward_tiles(48, 65536, 512, 132) == large
    assert hopper.backward_tiles(80, 512, 1, 132) == hopper.backward_tiles(128, 512, 1, 132) == large
    assert small[1].num_warps == 4 and large[1].num_warps == 8  # a warp holds 16 keys


def test_forward_takes_64_keys_a_step_at_short_contexts():
    """64 keys a step through 4 stages up to SHORT_FORWARD_KEYS keys, 128 through 2 above; the schedule counts a
    tile's key blocks at the step's width."""
    assert hopper.forward_tiles(1) == hopper.forward_tiles(hopper.SHORT_FORWARD_KEYS) == (64, 4)
    assert hopper.forward_tiles(hopper.SHORT_FORWARD_KEYS + 1) == (hopper.BLOCK_N, hopper.STAGES) == (128, 2)
    # One head of 512 queries, causal, on 4 programs: tiles of 8, 6, 4, 2 blocks of 64 keys (4, 3, 2, 1 of 128),
    # each plus a tile's fixed cost.
    for block_n, costs in ((64, [9, 7, 5, 3]), (128, [5, 4, 3, 2])):
        schedule = hopper.forward_schedule(1, 512, 512, True, 4, 1, block_n)
        assert _program_loads(schedule, 512, 512, True, block_n) == costs


def test_backward_grid_runs_over_the_heads_first_where_their_q_and_do_fit_in_l2():
    """Causal, heads first where Q and dO of all batch-heads fit in HEADS_FIRST_BYTES (and the key tiles in the
    grid's second dimension), key tiles first otherwise; full attention always key tiles first."""
    rows = hopper.HEADS_FIRST_BYTES // (2 * 64 * 2)  # batch-heads times queries at the budget, d 64, 2-byte elements
    assert hopper.backward_heads_first(128, rows // 128, 64, 2, 8, True)
    assert hopper.backward_heads_first(1, rows, 64, 2, 8, True)
    assert not hopper.backward_heads_first(1, rows, 64, 2, 8, False)
    assert not hopper.backward_heads_first(1, rows + 1, 64, 2, 8, True)
    assert not hopper.backward_heads_first(1, rows // 2 + 1, 64, 4, 8, True)
    assert not hopper.backward_heads_first(1, 64, 64, 2, 65536, True)
    # The 2026 models at batch 4, context 512: small to xl heads first, 10B (36 heads of d 128) not.
    assert hopper.backward_heads_first(4 * 12, 512, 64, 2, 8, True)
    assert hopper.backward_heads_first(4 * 32, 512, 80, 2, 4, True)
    assert not hopper.backward_heads_first(4 * 36, 512, 128, 2, 4, True)
    assert not hopper.backward_heads_first(16, 16384, 64, 2, 128, True)  # the leaderboard


@pytest.mark.compiled_kernels
@pytest.mark.parametrize("d, dtype, is_causal, short", [
    pytest.param(128, torch.bfloat16, True, False, marks=pytest.mark.slow), (64, torch.float16, False, False),
    (80, torch.bfloat16, True, False), (128, torch.bfloat16, True, True)])
def test_forward_compiles_for_sm90_without_spills(monkeypatch, d, dtype, is_causal, short):
    """``short``: the tiles of short contexts (64 keys a step through 4 stages: the most shared memory at d 128)."""
    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    tiles = hopper.forward_tiles(hopper.SHORT_FORWARD_KEYS if short else hopper.SHORT_FORWARD_KEYS + 1)
    monkeypatch.setattr(hopper, "forward_tiles", lambda n_keys: tiles)
    launch = hopper_launches(dtype, d, is_causal)["fwd"]
    assert (launch.kwargs["BLOCK_N"], launch.kwargs["STAGES"]) == tiles
    # one persistent program per multiprocessor, at most (2 where kernels are compiled on the CPU), each tile once
    assert launch.grid == (2, 1) and sorted(launch.kwargs["schedule"][3:].tolist()) == list(range(6 * 8))
    parts = [part for part in head_dim_parts(d) if part]
    assert launch.kwargs["HEAD_DIM_B"] == (parts[1] if len(parts) == 2 else 0)
    widths = [arg.block_shape[-1] for arg in launch.args if isinstance(arg, TensorDescriptor)]
    assert widths == [width for width in parts for _ in range(4)]  # one descriptor per tensor and column part
    compiled = compile_for_gpu(launch.kernel, launch.args, launch.kwargs)
    usage = resource_usage(compiled)
    assert usage.spill_bytes == 0, usage
    assert usage.shared_bytes <= HOPPER_SHARED_MEMORY, usage
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg"):
        assert instruction in compiled.asm["ptx"], instruction
    assert serialized_wgmma(compiled) is None  # S_(j+1) is waited for in the next step, yet nothing reads it early


@pytest.mark.compiled_kernels
@pytest.mark.slow
def test_sass_fingerprint_script_compiles_one_configuration():
    """``scripts/flash_hopper_sass.py`` (run before and after a refactor that must not change the kernels) prints a
    line per kernel the backend launches."""
    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    import runpy

    script = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "flash_hopper_sass.py"))
    lines = script["fingerprint_lines"](64, "bf16", True)
    assert [line.split()[0] for line in lines] == [f"{name}_d64_bf16_causal" for name in
                                                   ("fwd", "delta", "bwd", "dq_convert")]
    assert all(" spill 0 " in line for line in lines), lines


def _heads(view: torch.Tensor, heads_in_columns: bool, batch: int, heads: int, d: int) -> torch.Tensor:
    """Read the view back as (batch, heads, seq, d) the way the kernel addresses it."""
    if heads_in_columns:
        return view.unflatten(2, (heads, d)).transpose(1, 2)
    return view.unflatten(0, (batch, heads))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "three_d", "one_head", "strided_d", "odd_stride",
                                    "misaligned"])
def test_tma_view_addresses_every_head(layout):
    batch, heads, seq, d = 2, 3, 5, 16
    base = torch.randn(batch, seq, heads, 2 * d)
    if layout == "contiguous":
        x = torch.randn(batch, heads, seq, d)
    elif layout == "transposed":  # what attention layers make: (batch, seq, heads, d) -> (batch, heads, seq, d)
        x = base[..., :d].contiguous().transpose(1, 2)
    elif layout == "three_d":
        x = torch.randn(batch * heads, seq, d)
    elif layout == "one_head":
        x = torch.randn(batch, 1, seq, d)[:, :, 1:]
    elif layout == "strided_d":  # the head dim is not unit-stride: needs a copy
        x = torch.randn(batch, heads, seq, 2 * d)[..., ::2]
    elif layout == "odd_stride":  # rows 9 elements apart: not 16-byte aligned, needs a copy
        x = torch.randn(batch, heads, seq, 9)[..., :8]
    else:  # contiguous, but starting 4 bytes into its allocation: needs a copy
        x = torch.randn(batch * heads * seq * d + 1)[1:].view(batch, heads, seq, d)
        assert x.is_contiguous() and x.data_ptr() % 16 != 0
    view, heads_in_columns = hopper.tma_view(x)
    x4 = x if x.dim() == 4 else x.unsqueeze(1)
    b, h, s, dd = x4.shape
    assert view.dim() == 3 and view.stride(-1) == 1
    assert view.data_ptr() % 16 == 0 and all(st * view.element_size() % 16 == 0 for st in view.stride()[:-1])
    torch.testing.assert_close(_heads(view, heads_in_columns, b, h, dd), x4, rtol=0, atol=0)
    shares_storage = view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert shares_storage == (layout in ("contiguous", "transposed", "three_d", "one_head"))
    assert heads_in_columns == (layout == "transposed")


def test_kernel_choice_follows_the_configuration():
    cpu = torch.device("cpu")
    if interpreting():
        pytest.skip("under the interpreter CPU tensors run the Triton backend for another reason")
    for kernels in ("auto", "triton"):
        for part in ("forward", "backward"):  # CPU tensors: not the Hopper backend, and no backend at all
            with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
                op.choose_backend(FlashConfig(kernels=kernels), cpu, torch.bfloat16, 64, part, True)
    with pytest.raises(ValueError, match="backward cannot run: tensors on cpu"):
        op.choose_backend(FlashConfig(kernels="hopper"), cpu, torch.bfloat16, 64, "backward", True)
    assert hopper.supports(cpu, torch.bfloat16, 64) == "tensors on cpu"
    assert triton_backend.supports(cpu, torch.float64, 64).startswith("unsupported dtype")
    assert triton_backend.supports(cpu, torch.float32, 72) == "head dim 72 (needs one of (16, 32, 48, 64, 80, 96, 128))"


def test_two_part_head_dims_run_unpadded_on_either_backend(monkeypatch):
    """At 48, 80 and 96 both backends hold the head dim in two column parts: the route gives the Hopper kernels the
    head dim as it is, and leaves them to the programs rule in both directions, as other head dims; a head dim no
    kernel holds (72) goes to the next one that does."""
    fresh_route(monkeypatch)
    monkeypatch.setattr(hopper, "supports", lambda device, dtype, head_dim: None)
    hopper_config, cpu = FlashConfig(kernels="hopper"), torch.device("cpu")
    for part in ("forward", "backward"):
        for d in (48, 80, 96):
            assert op.route(hopper_config, cpu, torch.bfloat16, d, part, True) == (hopper, d)
        assert op.route(hopper_config, cpu, torch.bfloat16, 72, part, True) == (hopper, 80)
    seen = []
    monkeypatch.setattr(op, "route", op.route.__wrapped__)  # every call chooses
    monkeypatch.setattr(op, "choose_backend", lambda *args: seen.append(args[-1]) or triton_backend)
    for d, n in [(80, 2048), (80, 64), (64, 2048)]:
        Q = torch.empty(2, 8, n, d)
        op._route("forward", Q, Q), op._route("backward", Q, Q)
    assert seen == [True, True, False, False, True, True]  # 2 x 8 heads x 16 tiles of 128: 256 programs; 16


def fresh_route(monkeypatch) -> None:
    """The operator's choices made with a cache of their own, dropped after the test."""
    monkeypatch.setattr(op, "route", functools.lru_cache(maxsize=8)(op.route.__wrapped__))


def test_chosen_backends_name_each_part_and_its_head_dim():
    if not interpreting():
        pytest.skip("CPU tensors run the portable kernels only under the interpreter")
    Q = torch.empty(1, 2, 16, 80)
    assert op.chosen_backends(Q, Q) == {"forward": "triton, d 80", "backward": "triton, d 80"}
    Q = torch.empty(1, 2, 16, 72)  # a head dim the portable kernels pad
    assert op.chosen_backends(Q, Q)["forward"] == "triton, d 80"


def test_backends_are_backends():
    """Each backend module answers for itself through the one interface, and no backend imports another."""
    import ast

    for backend in (hopper, triton_backend):
        assert isinstance(backend, Backend), backend.__name__
        tree = ast.parse(Path(backend.__file__).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
        assert not {"cs336_systems.attention.backends.triton", "cs336_systems.attention.backends.hopper"} & imported
        assert not {"triton", "hopper"} & names, backend.__name__


def _program_loads(schedule: list[int], n_queries: int, n_keys: int, is_causal: bool,
                   block_n: int = hopper.BLOCK_N) -> list[int]:
    """Each program's work under the schedule's cost model (a tile's fixed cost plus its key blocks)."""
    query_tiles = math.ceil(n_queries / hopper.ROWS_PER_PROGRAM)
    key_blocks = math.ceil(n_keys / block_n)
    programs = schedule[0] - 1

    def cost(tile: int) -> int:
        i = tile % query_tiles
        return hopper.TILE_COST + (min(key_blocks, math.ceil((i + 1) * hopper.ROWS_PER_PROGRAM / block_n))
                                   if is_causal else key_blocks)

    return [sum(cost(tile) for tile in schedule[schedule[p]:schedule[p + 1]]) for p in range(programs)]


@pytest.mark.parametrize("batch_heads, n_queries, n_keys, is_causal, programs, d", [
    (100, 2048, 2048, True, 132, 64),  # uneven head-major: the balanced schedule
    (128, 2048, 2048, True, 132, 128),  # the balanced one would hold too much K and V in L2: head-major
    (6, 1000, 777, True, 132, 64),  # fewer tiles than programs
    (7, 300, 5000, False, 4, 64),  # not causal: equal tiles, dealt in turn
    (3, 1, 1, True, 132, 16),
    (0, 100, 100, True, 132, 64),  # an empty batch: no programs
])
def test_forward_schedule_deals_every_tile_once(batch_heads, n_queries, n_keys, is_causal, programs, d):
    schedule = hopper.forward_schedule(batch_heads, n_queries, n_keys, is_causal, programs, 4 * n_keys * d)
    tiles = batch_heads * math.ceil(n_queries / hopper.ROWS_PER_PROGRAM)
    used = min(programs, tiles)
    offsets = schedule[:used + 1]
    assert offsets[0] == used + 1 and offsets[-1] == len(schedule)
    assert all(first < last for first, last in zip(offsets, offsets[1:]))  # every program has a tile
    assert sorted(schedule[used + 1:]) == list(range(tiles))
    loads = _program_loads(schedule, n_queries, n_keys, is_causal)
    if not is_causal:
        assert max(loads) - min(loads) <= loads[0] // len(schedule[offsets[0]:offsets[1]])  # at most a tile apart


def test_forward_schedule_balances_only_within_the_l2_budget(monkeypatch):
    """At (4, 25, 2048, 64) the head-major schedule's busiest program has about 7 % more work than the balanced
    schedule's, whose programs meet on 48 heads (24 MB of K and V, within the budget); each program's tiles run in
    head order. With no L2 budget the head-major schedule stays, heads in order across programs."""
    shape = (100, 2048, 2048, True, 132, 2 * 2048 * 64 * 2)
    balanced = hopper.forward_schedule(*shape)
    monkeypatch.setattr(hopper, "L2_BUDGET", 0)
    head_major = hopper.forward_schedule(*shape)
    busiest = [max(_program_loads(s, 2048, 2048, True)) for s in (balanced, head_major)]
    assert busiest[0] * hopper.BALANCE_TOLERANCE < busiest[1]
    heads = [tile // 16 for tile in balanced[balanced[0]:balanced[1]]]
    assert heads == sorted(heads)
    assert [head_major[head_major[0]], head_major[head_major[1]]] == [15, 14]  # head 0's heaviest: programs 0, 1


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_gpu(), reason="needs a Hopper GPU")
def test_kernel_choice_on_hopper_gpu():
    gpu = torch.device("cuda", torch.cuda.current_device())
    auto, forced = FlashConfig(), FlashConfig(kernels="hopper")
    for part in ("forward", "backward"):
        assert op.choose_backend(auto, gpu, torch.bfloat16, 64, part, True) is hopper
        assert op.choose_backend(auto, gpu, torch.bfloat16, 64, part, False) is triton_backend  # too few programs
        assert op.choose_backend(auto, gpu, torch.float32, 64, part, True) is triton_backend
    assert op.choose_backend(forced, gpu, torch.bfloat16, 64, "forward", False) is hopper
    with pytest.raises(ValueError, match="float32"):
        op.choose_backend(forced, gpu, torch.float32, 64, "backward", True)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_gpu(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("is_causal, l2_budget", [(True, 0), (True, hopper.L2_BUDGET), (False, hopper.L2_BUDGET)])
def test_persistent_forward_runs_many_tiles_per_program_gpu(monkeypatch, is_causal, l2_budget):
    """The Gluon forward at 640 tiles (about 5 a program) against float64 with poisoned outputs; n_keys != n_queries,
    a ragged end; causal under the head-major schedule (no L2 budget) and the balanced one (not causal: tiles of
    equal work, one schedule)."""
    monkeypatch.setattr(hopper, "L2_BUDGET", l2_budget)
    monkeypatch.setattr(hopper.FORWARD, "entries", collections.OrderedDict())
    torch.manual_seed(1)
    Q = torch.randn(2, 40, 1000, 64, device="cuda", dtype=torch.bfloat16)
    K, V = (torch.randn(2, 40, 1100, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(1000, 1100, device="cuda", dtype=torch.bool).tril() if is_causal else None
    expected = torch.nn.functional.scaled_dot_product_attention(Q.double(), K.double(), V.double(), attn_mask=mask)
    with poisoned_outputs():
        output, _ = hopper.forward(Q, K, V, is_causal, 1 / 8)
    assert relative_error(output, expected) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_gpu(), reason="needs a Hopper GPU")
def test_forward_first_planned_in_a_cuda_graph_capture_replays_gpu(monkeypatch):
    """A forward whose plan is first made while a CUDA graph is captured: its schedule is copied by the graph from
    page-locked memory at each replay, and its entry is not kept (its schedule lives in the graph's memory).
    Replays on new inputs (written into the captured ones) match float64, outputs NaN-poisoned at each replay."""
    torch.manual_seed(2)
    Q, K, V = (torch.randn(2, 40, 1000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    hopper.forward(Q, K, V, True, 1 / 8)  # compiled before the capture: the test is of the plan made in it
    monkeypatch.setattr(hopper.FORWARD, "entries", collections.OrderedDict())
    monkeypatch.setattr(hopper, "_device_schedules", {})
    monkeypatch.setattr(hopper, "_captured_sources", [])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), poisoned_outputs():
        output, _ = hopper.forward(Q, K, V, True, 1 / 8)
    assert not hopper.FORWARD.entries
    assert len(hopper._captured_sources) == 1 and hopper._captured_sources[0].is_pinned()
    for seed in (3, 4):
        torch.manual_seed(seed)
        for x in (Q, K, V):
            x.copy_(torch.randn_like(x))
        graph.replay()
        expected = torch.nn.functional.scaled_dot_product_attention(Q.double(), K.double(), V.double(),
                                                                    is_causal=True)
        assert relative_error(output, expected) < 1e-2
    del graph  # before the page-locked schedule it copies from


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_gpu(), reason="needs a Hopper GPU")
def test_forward_captured_after_its_plan_replays_once_the_entry_is_gone_gpu(monkeypatch):
    """The usual warm-up: a forward planned before a CUDA graph captures it. The graph reads the plan's schedule at
    every replay, long after the launch entry that made it may have left its bounded cache: here every entry is
    dropped and blocks of the schedule's size are allocated and zeroed (a zero schedule gives every program no tile)
    before the replay, whose output, NaN-poisoned, must match float64."""
    torch.manual_seed(5)
    Q, K, V = (torch.randn(2, 40, 1000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    monkeypatch.setattr(hopper.FORWARD, "entries", collections.OrderedDict())
    with poisoned_outputs():
        hopper.forward(Q, K, V, True, 1 / 8)
        (entry,) = hopper.FORWARD.entries.values()
        schedule_size = entry.kwargs["schedule"].numel()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output, _ = hopper.forward(Q, K, V, True, 1 / 8)
    del entry
    hopper.FORWARD.entries.clear()
    refill = [torch.zeros(schedule_size, dtype=torch.int32, device="cuda") for _ in range(256)]
    graph.replay()
    expected = torch.nn.functional.scaled_dot_product_attention(Q.double(), K.double(), V.double(), is_causal=True)
    assert relative_error(output, expected) < 1e-2
    del graph, refill


def test_forward_schedules_are_copied_once_per_schedule_and_device():
    """Plans that deal the same tiles share one schedule on the device, kept for the process."""
    cpu = torch.device("cpu")
    schedule = hopper._schedule_tensor([3, 3, 5, 0, 1], cpu)
    assert schedule.dtype == torch.int32 and schedule.tolist() == [3, 3, 5, 0, 1]
    assert hopper._schedule_tensor([3, 3, 5, 0, 1], cpu) is schedule
    assert hopper._schedule_tensor([3, 3, 5, 1, 0], cpu) is not schedule


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_gpu(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize("keys", [64, 128])
@pytest.mark.parametrize("d, is_causal", [(64, True), (48, False), (32, True)])
def test_backward_of_either_program_shape_matches_float64_gpu(monkeypatch, keys, d, is_causal, heads_first):
    """The Hopper backward with 64-key programs of one warpgroup and 128-key programs of two, its grid over the
    heads first or the key tiles first, whatever the call's size would choose, against float64: n_keys !=
    n_queries, ragged ends, the heads in the columns of Q's view, gradients NaN-poisoned."""
    _run_backward_programs_of(monkeypatch, keys)
    monkeypatch.setattr(hopper, "backward_heads_first", lambda *sizes: heads_first)
    monkeypatch.setattr(hopper.BACKWARD, "entries", collections.OrderedDict())
    torch.manual_seed(keys + d)
    Q = torch.randn(2, 1000, 6, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    K, V = (torch.randn(2, 6, 1100, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dO = torch.randn(2, 6, 1000, d, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(1000, 1100, device="cuda", dtype=torch.bool).tril() if is_causal else None
    leaves = [x.double().requires_grad_() for x in (Q, K, V)]
    torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask).backward(dO.double())
    O, L = hopper.forward(Q, K, V, is_causal, d ** -0.5) if d != 48 else triton_backend.forward(
        Q, K, V, is_causal, d ** -0.5)
    with poisoned_outputs():
        grads = hopper.backward(Q, K, V, O, L, dO, is_causal, d ** -0.5)
    entries = hopper.BACKWARD.entries.values()
    assert entries and all(entry.kwargs["BLOCK_N"] == keys and entry.kwargs["HEADS_FIRST"] == heads_first
                           for entry in entries)
    for name, grad, leaf in zip("QKV", grads, leaves):
        assert relative_error(grad, leaf.grad) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_gpu(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("d", [16, 32, 64, 80, 128])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_hopper_and_triton_kernels_agree_gpu(d, layout):
    """Forced Gluon and forced Triton forwards and backwards against float64, at a length with many key tiles and
    a ragged end, for the two TMA views (at d = 80 the Gluon kernels' two column blocks of each head); gradients
    NaN-poisoned so that unwritten rows show."""
    torch.manual_seed(d)
    batch, heads, seq = 2, 4, 1000 + d
    if layout == "contiguous":
        Q, K, V = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    else:
        Q, K, V = (torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))
    dO = torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16)
    leaves = [x.detach().double().requires_grad_() for x in (Q, K, V)]
    reference_output = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    reference_output.backward(dO.double())
    reference = [x.grad for x in leaves]
    expected_output = reference_output.detach()
    for kernels in ("hopper", "triton"):
        inputs = [x.detach().requires_grad_() for x in (Q, K, V)]
        with FLASH_CONFIG.use(kernels=kernels), poisoned_outputs():
            output = op.flash_attention(*inputs, True)
            output.backward(dO)
        results = [("O", output.detach(), expected_output)] + [
            (f"d{name}", x.grad, expected) for name, x, expected in zip("QKV", inputs, reference)]
        for name, value, expected in results:
            error = relative_error(value, expected)
            assert error < 1e-2, f"{kernels}: {name} relative error {error:.2e}"


def _inputs(layout: str, batch: int, heads: int, seq: int, d: int) -> torch.Tensor:
    if layout == "transposed":
        return torch.randn(batch, seq, heads, d, dtype=torch.bfloat16).transpose(1, 2)
    if layout == "misaligned":
        return torch.randn(batch * heads * seq * d + 1, dtype=torch.bfloat16)[1:].view(batch, heads, seq, d)
    return torch.randn(batch, heads, seq, d, dtype=torch.bfloat16)


@pytest.mark.parametrize("part, d", [("forward", 64), ("forward", 80), ("backward", 64), ("backward", 80)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "misaligned"])
def test_short_path_launches_what_the_first_launch_compiled(monkeypatch, part, d, layout):
    """The second call of a key (descriptors rebuilt from the cached entry) passes the kernel the same views, sizes
    and scales as the first (full descriptors, from which the kernel is compiled); at d = 80 two descriptors per
    tensor, one per column part."""
    kernel = hopper.FORWARD if part == "forward" else hopper.BACKWARD
    monkeypatch.setattr(kernel, "entries", collections.OrderedDict())
    batch, heads, seq = 2, 3, 200
    Q, K, V, dO = (_inputs(layout, batch, heads, seq, d) for _ in range(4))
    O, L = torch.randn(batch, heads, seq, d, dtype=torch.bfloat16), torch.randn(batch, heads, seq)
    with compiled_and_short_launches() as (compiled, short):
        for _ in range(2):
            if part == "forward":
                hopper.forward(Q, K, V, True, 0.125)
            else:
                hopper.backward(Q, K, V, O, L, dO, True, 0.125)
    ((_, grid, first, entry),) = [launch for launch in compiled if launch[0] is kernel.fn]
    ((_, grid_again, second, tail),) = [launch for launch in short if launch[0] is kernel.fn]
    keys = hopper.backward_tiles(d, seq, hopper.programs("backward", Q, K), 2)[0]  # 2 multiprocessors on the CPU
    # The forward: one program per SM; the backward: one per batch-head and tile of keys (heads first, this small).
    assert grid == grid_again == ((2, 1) if part == "forward" else (6, math.ceil(seq / keys)))
    assert entry.config.num_warps == (4 if part == "forward" else keys // 16) and tail == entry.tail
    assert entry.kwargs["Q_COLUMNS"] == (layout == "transposed") and entry.kwargs["HEAD_DIM"] == d
    columns = {64: [64], 80: [64, 16]}[d]
    assert [full.block_shape[-1] for full in first if isinstance(full, TensorDescriptor)] == [
        width for width in columns for _ in range(7 if part == "backward" else 4)]
    inputs = {0, 1, 2, 4, 5, 6} if part == "forward" else {0, 1, 2, 3, 14, 15, 16, 17}  # Q, K, V (dO) of each part
    assert len(first) == len(second)
    for position, (full, again) in enumerate(zip(first, second)):
        if not isinstance(full, TensorDescriptor):  # no second column part at d = 64: None both times
            assert type(full) is type(again) and (isinstance(full, torch.Tensor) or full == again), position
            continue
        # The short path passes the tensor the descriptor addresses: the compiled kernel's launcher keeps the
        # shapes and strides of the descriptors it was compiled from.
        assert isinstance(again, torch.Tensor) and again.data_ptr() % 16 == 0, position
        assert (again.shape, again.dtype) == (full.base.shape, full.base.dtype), position
        if position in inputs and layout == "misaligned":  # a new copy: the same values
            assert torch.equal(full.base.flatten(), again.flatten()), position
        elif position in inputs:
            assert again is full.base, position
    qk_scale = entry.kwargs["qk_scale"] if part == "forward" else first[13]
    assert qk_scale == pytest.approx(0.125 * math.log2(math.e))


def test_backend_choice_weighs_the_hopper_programs(monkeypatch):
    """Where both backends can run, "auto" takes the Hopper kernels from ``hopper_min_programs`` programs of 128
    queries (forward) or keys (backward) up; "hopper" and "triton" take theirs whatever the size."""
    monkeypatch.setattr(hopper, "supports", lambda device, dtype, head_dim: None)
    monkeypatch.setattr(triton_backend, "supports", lambda device, dtype, head_dim: None)
    fresh_route(monkeypatch)

    def chosen(part, n_queries, n_keys, heads=1, **config):
        Q = torch.empty(2, heads, n_queries, 64, dtype=torch.bfloat16)
        K = torch.empty(2, heads, n_keys, 64, dtype=torch.bfloat16)
        with FLASH_CONFIG.use(FlashConfig(**config)):
            return op._route(part, Q, K)[0]

    assert chosen("forward", 16 * 128, 64) is hopper  # 2 x 16 tiles of queries: 32 programs
    assert chosen("forward", 16 * 128 - 128, 64) is triton_backend  # 30
    assert chosen("forward", 15 * 128 + 1, 64) is hopper  # a ragged last tile counts
    assert chosen("backward", 64, 16 * 128) is hopper  # tiles of keys
    assert chosen("backward", 16 * 128, 64) is triton_backend
    assert chosen("forward", 128, 128, heads=16) is hopper  # 2 x 16 heads x 1 tile
    assert chosen("forward", 128, 128, kernels="hopper") is hopper
    assert chosen("forward", 16 * 128, 64, kernels="triton") is triton_backend
    assert chosen("forward", 16 * 128, 64, hopper_min_programs=33) is triton_backend


def test_kernel_times_split_the_backward_from_the_forward_for_ours_and_cudnn():
    """``scripts/hopper_backward_tiles.py --kernel-times``: the main backward kernel by name, the backward's kernels
    as every kernel but the forward's, and a refusal where no main kernel (or two) shows."""
    import runpy

    script = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "hopper_backward_tiles.py"))
    split = script["backward_split"]
    ours = {"attn_fwd_hopper_kernel": 1.0, "attn_bwd_delta_kernel": 0.03, "attn_bwd_hopper_kernel": 2.5,
            "attn_bwd_dq_convert_kernel": 0.02}
    cudnn = {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": 1.2,
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": 3.0,
             "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>": 0.04,
             "void cudnn::fusion::convert_dq_to_16bits<true>": 0.03, "Memset (Device)": 0.002}
    assert split(ours) == pytest.approx((2.5, 2.55))
    assert split(cudnn) == pytest.approx((3.0, 3.072))
    for kernels in ({"attn_fwd_hopper_kernel": 1.0}, {**ours, "flash_bprop_other": 1.0}):
        with pytest.raises(SystemExit, match="one main backward kernel"):
            split(kernels)
