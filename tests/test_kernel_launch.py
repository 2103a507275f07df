"""The launch scaffold every kernel module uses (``cs336_systems.kernels.launch``), on the CPU without a GPU: the
launch entries (a fixed configuration per key, or the autotuner's, once; bounded), the eager, planned and traced
launches of a :class:`Kernel` (with the jit function, the autotuner and the compiled kernel's launch replaced by
recorders), the device check's messages, operator registration, and the interpreter decision read in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import triton
from jaxtyping import Float

from cs336_systems.kernels import compat, launch
from cs336_systems.kernels.launch import Kernel, LaunchPlan, check_device, define_operator, unsupported_device

ROOT = Path(__file__).resolve().parents[1]


class Recorder:
    """Stands for a jit function or an autotuner: records each launch ``fn[grid](*args, **kwargs)``, returns a
    stand-in compiled kernel, keeps an autotuner's ``cache`` of picks and, as an autotuner, picks ``best_config``."""

    def __init__(self, best_config: triton.Config | None = None):
        self.launches: list[tuple] = []
        self.best_config = best_config
        self.arg_names = ["X", "n", "BLOCK", "FLAG"]
        self.__name__ = "recorder"
        self.cache: dict = {}

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            # An autotuner calls the grid with its pick's tile sizes among the keyword arguments.
            meta = {**kwargs, **self.best_config.kwargs} if self.best_config else kwargs
            self.launches.append((grid(meta) if callable(grid) else grid, args, kwargs))
            self.cache[len(self.launches)] = self.best_config
            return f"compiled {len(self.launches)}"

        return launch_


def fixed_rule(calls: list, block: int = 16):
    def rule() -> triton.Config:
        calls.append(block)
        return triton.Config({"BLOCK": block}, num_warps=2, num_stages=1)

    return rule


def recorded_kernel(monkeypatch, best: triton.Config | None = None) -> tuple[Kernel, Recorder, Recorder, list]:
    """A Kernel whose jit function and autotuner are recorders, and the list of its launches of compiled kernels
    (nothing compiles or runs)."""
    fn, autotuner, short = Recorder(), Recorder(best), []
    kernel = Kernel(fn)
    kernel.autotuner = autotuner
    monkeypatch.setattr(launch, "wrap_triton", lambda f: f)  # traced launches call the recorder itself
    monkeypatch.setattr(launch, "_INTERPRETING", False)  # as on a GPU, whatever this process runs under
    monkeypatch.setattr(compat, "current_device", lambda: 0)
    monkeypatch.setattr(compat, "CompiledLauncher", lambda compiled, compile_args: compiled)
    monkeypatch.setattr(compat, "launch_compiled",
                        lambda compiled, device, grid_, args, tail: short.append((compiled, grid_, args, tail)))
    return kernel, fn, autotuner, short


def grid(tiles) -> tuple[int]:
    return (64 // tiles["BLOCK"],)


# ---------------------------------------------------------------------------------------------------
# Kernel: one entry per launch signature; eager and traced launches
# ---------------------------------------------------------------------------------------------------


def test_autotuned_key_tunes_once_then_launches_its_pick(monkeypatch):
    best = triton.Config({"BLOCK": 8}, num_warps=4, num_stages=2)
    kernel, fn, autotuner, short = recorded_kernel(monkeypatch, best)
    calls = []
    for _ in range(3):
        kernel("k1", grid, ("x", 5), {"FLAG": True}, fixed_rule(calls), autotune=True)
    assert len(autotuner.launches) == 1 and kernel.autotuned == 1  # the first call tuned, and launched
    # The second compiled the pick, the third took the short path.
    assert fn.launches == [((8,), ("x", 5), {"FLAG": True, "BLOCK": 8, "num_warps": 4, "num_stages": 2})]
    assert short == [("compiled 1", (8,), ("x", 5), (8, True))]
    assert calls == []
    kernel("k2", grid, ("y", 6), {"FLAG": False}, fixed_rule(calls), autotune=True)
    assert len(autotuner.launches) == 2 and kernel.autotuned == 2  # a new key tunes again


def test_fixed_configuration_is_chosen_once_per_key(monkeypatch):
    kernel, fn, autotuner, short = recorded_kernel(monkeypatch)
    calls = []
    for _ in range(2):
        kernel("k1", grid, ("x", 5), {"FLAG": True}, fixed_rule(calls, 16))
    kernel("k2", grid, ("x", 5), {"FLAG": True}, fixed_rule(calls, 32))
    assert calls == [16, 32] and autotuner.launches == []
    assert [launched[0] for launched in fn.launches] == [(4,), (2,)]
    assert fn.launches[0][2] == {"FLAG": True, "BLOCK": 16, "num_warps": 2, "num_stages": 1}
    assert short == [("compiled 1", (4,), ("x", 5), (16, True))]
    assert list(kernel.entries) == [(0, False, "k1"), (0, False, "k2")]


def test_autotuning_off_and_autotuning_on_keep_separate_choices(monkeypatch):
    kernel, fn, autotuner, _ = recorded_kernel(monkeypatch, triton.Config({"BLOCK": 8}, num_warps=4))
    calls = []
    kernel("k", grid, ("x", 5), {"FLAG": True}, fixed_rule(calls, 16), autotune=False)
    kernel("k", grid, ("x", 5), {"FLAG": True}, fixed_rule(calls, 16), autotune=True)
    kernel("k", grid, ("x", 5), {"FLAG": True}, fixed_rule(calls, 16), autotune=True)
    assert calls == [16] and len(autotuner.launches) == 1
    assert [launched[0] for launched in fn.launches] == [(4,), (8,)]


def test_a_kernel_without_candidates_never_autotunes(monkeypatch):
    kernel, fn, _, _ = recorded_kernel(monkeypatch)
    kernel.autotuner = None
    calls = []
    kernel("k", grid, ("x", 5), {"FLAG": True}, fixed_rule(calls), autotune=True)
    assert calls == [16] and fn.launches[0][0] == (4,) and list(kernel.entries) == [(0, False, "k")]


def test_entries_are_bounded_least_recently_used_first(monkeypatch):
    kernel, fn, _, short = recorded_kernel(monkeypatch)
    kernel.cache_size = 2
    for key in ("a", "b", "a", "c"):  # "a" used again: "b" is the least recently used when "c" comes
        kernel(key, grid, ("x", 5), {"FLAG": True}, fixed_rule([], 16))
    assert [key for _, _, key in kernel.entries] == ["a", "c"] and len(fn.launches) == 3 and len(short) == 1


def test_autotuners_picks_are_bounded(monkeypatch):
    kernel, _, autotuner, _ = recorded_kernel(monkeypatch, triton.Config({"BLOCK": 8}, num_warps=4))
    kernel.cache_size = 2
    for key in range(4):
        kernel(key, grid, ("x", 5), {"FLAG": True}, fixed_rule([]), autotune=True)
    assert len(autotuner.launches) == 4 and list(autotuner.cache) == [3, 4]


def _plan(extra: str) -> LaunchPlan:
    return LaunchPlan(grid, {"n": 5, "FLAG": True}, triton.Config({"BLOCK": 16}, num_warps=2), extra)


def test_planned_launch_names_its_trailing_arguments_once(monkeypatch):
    """``Kernel.launch``: the plan (asked at a key's first call only) names every parameter after the call's own;
    the first launch compiles with them by name, later ones pass them in the kernel's order after what ``build``
    makes of the call's arguments and the plan's ``extra``."""
    kernel, fn, _, short = recorded_kernel(monkeypatch)
    plans, built = [], []

    def plan(extra):
        plans.append(extra)
        return _plan(extra)

    def build(extra, args, compiled):
        built.append((extra, compiled))
        return args

    for tensor in ("x", "y"):
        kernel.launch("k", (tensor,), plan, "extra", build=build)
    assert plans == ["extra"] and built == [("extra", False), ("extra", True)]
    assert fn.launches == [((4,), ("x",), {"n": 5, "FLAG": True, "BLOCK": 16, "num_warps": 2, "num_stages": 3})]
    assert short == [("compiled 1", (4,), ("y",), (5, 16, True))]


def test_planned_launch_refuses_names_that_are_not_the_trailing_parameters(monkeypatch):
    kernel, fn, _, _ = recorded_kernel(monkeypatch)
    with pytest.raises(TypeError, match=r"after the first 1: missing \['n'\], unknown \['m'\]"):
        kernel.launch("k", ("x",), lambda: LaunchPlan(grid, {"m": 5, "FLAG": True}, triton.Config({"BLOCK": 16})))
    assert fn.launches == [] and not kernel.entries


def test_traced_launch_takes_the_fixed_configuration_through_wrap_triton(monkeypatch):
    kernel, fn, autotuner, short = recorded_kernel(monkeypatch, triton.Config({"BLOCK": 8}, num_warps=4))
    wrapped = []
    monkeypatch.setattr(launch, "wrap_triton", lambda f: wrapped.append(f) or f)
    calls = []
    for _ in range(2):  # fake tensors have no data: no key, the rule each time
        kernel(None, grid, ("x", 5), {"FLAG": True}, fixed_rule(calls, 16), traced=True, autotune=True)
    assert calls == [16, 16] and wrapped == [fn, fn]
    assert fn.launches == 2 * [((4,), ("x", 5), {"FLAG": True, "BLOCK": 16, "num_warps": 2, "num_stages": 1})]
    assert autotuner.launches == [] and short == [] and not kernel.entries


def test_interpreter_takes_the_fixed_configuration_and_never_wraps(monkeypatch):
    kernel, fn, autotuner, short = recorded_kernel(monkeypatch, triton.Config({"BLOCK": 8}, num_warps=4))
    monkeypatch.setattr(launch, "_INTERPRETING", True)
    monkeypatch.setattr(launch, "wrap_triton", lambda f: pytest.fail("interpreted kernels cannot be wrapped"))
    monkeypatch.setattr(compat, "current_device", lambda: pytest.fail("the interpreter has no CUDA device"))
    calls = []
    for _ in range(2):
        kernel("k", grid, ("x", 5), {"FLAG": True}, fixed_rule(calls, 16), autotune=True)
    kernel(None, grid, ("x", 5), {"FLAG": True}, fixed_rule(calls, 16), traced=True)
    assert calls == [16, 16] and autotuner.launches == [] and short == []  # every interpreted call runs fn
    assert [launched[0] for launched in fn.launches] == [(4,)] * 3


def test_kernel_builds_an_autotuner_over_its_candidates():
    @triton.jit
    def copy_kernel(X, Y, n, BLOCK: triton.language.constexpr):
        offs = triton.language.program_id(0) * BLOCK + triton.language.arange(0, BLOCK)
        triton.language.store(Y + offs, triton.language.load(X + offs, mask=offs < n), mask=offs < n)

    candidates = [triton.Config({"BLOCK": 64}, num_warps=2), triton.Config({"BLOCK": 128}, num_warps=4)]
    tuned = Kernel(copy_kernel, candidates, ["n"])
    assert tuned.fn is copy_kernel and tuned.autotuner.configs == candidates and tuned.autotuner.keys == ["n"]
    assert Kernel(copy_kernel).autotuner is None


# ---------------------------------------------------------------------------------------------------
# CompiledLauncher: Triton's C launcher called with the descriptors expanded (and encoded once per address)
# ---------------------------------------------------------------------------------------------------


class CLauncher:
    """Stands for Triton's C launcher (a built-in: no ``__code__``): records its arguments."""

    def __init__(self, calls: list):
        self.calls = calls

    def __call__(self, *args):
        self.calls.append(args)


def _triton_launcher_call(self, grid_x, grid_y, grid_z, stream, function, *args):
    """What Triton's launcher object does when called (no scratch memory here)."""
    self.launch(grid_x, grid_y, grid_z, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None,
                *args)


class CompiledStandIn:
    """A compiled kernel as :class:`compat.CompiledLauncher` reads it, whose launcher object wraps a recording C
    launcher in Triton's own descriptor-expanding wrapper (``wrap_handle_tensordesc``), descriptors not lowered
    to tensor maps (so that their expansion needs no GPU)."""

    def __init__(self, signature: dict):
        from triton.backends.nvidia.driver import wrap_handle_tensordesc

        self.calls: list[tuple] = []
        self.function, self.packed_metadata = "function", "packed"
        raw = CLauncher(self.calls)  # like a C function: no Python code object
        self.run = type("Launcher", (), dict(launch=staticmethod(wrap_handle_tensordesc(raw, signature, None)),
                                             launch_cooperative_grid=False, launch_pdl=False, global_scratch_size=0,
                                             profile_scratch_size=0, __call__=_triton_launcher_call))()


SIGNATURE = {"a": "tensordesc<bf16[1, 64, 64]>", "x": "*fp32", "n": "i32", "b": "tensordesc<bf16[1, 64, 64]>",
             "BLOCK": "constexpr"}


def _descriptor(tensor: torch.Tensor) -> compat.DescriptorArg:
    return compat.DescriptorArg(tensor, (4, 64, 64), (4096, 64, 1))


def test_compiled_launcher_passes_what_tritons_wrapper_passes_and_encodes_once_per_address(monkeypatch):
    """Given, in each descriptor's place, the tensor it addresses, the launcher passes the C launcher what Triton's
    own wrapper passes for full descriptors (the shapes and strides of those the kernel was compiled from)."""
    encoded = []
    make = compat.make_tensordesc_arg
    monkeypatch.setattr(compat, "make_tensordesc_arg", lambda arg, meta: encoded.append(arg) or make(arg, meta))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77)
    kernel = CompiledStandIn(SIGNATURE)
    first, second, x = torch.zeros(4, 64, 64), torch.zeros(4, 64, 64), torch.zeros(3)
    launcher = compat.CompiledLauncher(kernel, (_descriptor(first), x, 9, _descriptor(second)))
    assert [index for index, _ in launcher.descriptors] == [0, 3]
    for a in (first, first, second):
        launcher.launch(0, (5, 2), (a, x, 9, second), (64,))
    kernel.run.launch(5, 2, 1, 77, "function", False, False, None, None, "packed", None,
                      triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook,
                      _descriptor(second), x, 9, _descriptor(second), 64)  # Triton's own expansion of the last call
    assert kernel.calls[2][13:] == kernel.calls[3][13:]
    assert kernel.calls[2][:11] == kernel.calls[3][:11]  # grid, stream, function, flags, metadata
    assert kernel.calls[0][13] is first and kernel.calls[2][13] is second and kernel.calls[0][-1] == 64
    # (position, address) pairs: (0, first), (3, second), (0, second); the repeated call encoded nothing
    assert len(encoded) == 3 and all(arg.base is t for arg, t in zip(encoded, (first, second, second)))
    assert all(arg.shape == (4, 64, 64) and arg.strides == (4096, 64, 1) for arg in encoded)


def test_compiled_launcher_skips_empty_hook_chains_and_defers_to_triton_for_listened_ones(monkeypatch):
    """An empty chain of launch hooks goes to the C launcher as None (nothing to call); with an enter hook set
    (a profiler's), the launch goes through Triton's launcher with full descriptors, and the hook sees it."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0)
    kernel = CompiledStandIn(SIGNATURE)
    a, x = torch.zeros(4, 64, 64), torch.zeros(3)
    launcher = compat.CompiledLauncher(kernel, (_descriptor(a), x, 9, _descriptor(a)))
    launcher.launch(0, (1,), (a, x, 9, a), (64,))
    assert kernel.calls[0][11:13] == (None, None)
    monkeypatch.setattr(kernel, "launch_metadata", lambda grid, stream, *args: ("metadata", args), raising=False)
    hook, hooks = [].append, triton.knobs.runtime.launch_enter_hook
    hooks.add(hook)
    try:
        launcher.launch(0, (1,), (a, x, 9, a), (64,))
    finally:
        hooks.remove(hook)
    # Through Triton's wrapper, which expanded the descriptors; the C launcher calls the hooks with the metadata.
    assert len(kernel.calls) == 2 and kernel.calls[1][11] is hooks and kernel.calls[1][13] is a
    _, described = kernel.calls[1][10]
    assert isinstance(described[0], compat.DescriptorArg) and described[0].shape == (4, 64, 64)


def test_compiled_launcher_forgets_encodings_beyond_its_bound(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0)
    monkeypatch.setattr(compat, "ENCODED_DESCRIPTORS", 3)
    b = torch.zeros(2)
    described = compat.DescriptorArg(b, (2,), (1,))
    launcher = compat.CompiledLauncher(CompiledStandIn(SIGNATURE), (described, b, 1, described))
    for _ in range(4):
        launcher.launch(0, (1,), (torch.zeros(2), b, 1, b), (64,))
    assert 0 < len(launcher.encoded) <= 3


def test_compiled_launcher_of_a_kernel_without_descriptors_calls_its_launcher(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0)
    kernel = CompiledStandIn({"x": "*fp32", "n": "i32"})
    launcher = compat.CompiledLauncher(kernel)
    assert launcher.descriptors == () and launcher.raw is kernel.run.launch
    launcher.launch(0, (3,), (torch.zeros(1), 4), ())
    assert kernel.calls[0][:3] == (3, 1, 1) and kernel.calls[0][-1] == 4


# ---------------------------------------------------------------------------------------------------
# Device check
# ---------------------------------------------------------------------------------------------------


def test_device_check_messages(monkeypatch):
    monkeypatch.setattr(launch, "_INTERPRETING", False)
    with pytest.raises(ValueError, match=r"the fused things need CUDA tensors, got tensors on cpu; .*set "
                                         r"TRITON_INTERPRET=1 before cs336_systems.kernels.things is imported"):
        check_device(torch.zeros(2), "the fused things", "cs336_systems.kernels.things")
    monkeypatch.setattr(launch, "_INTERPRETING", True)
    check_device(torch.zeros(2), "the fused things", "cs336_systems.kernels.things", reads_host_addresses=True)
    check_device(torch.zeros(2, device="meta"), "the fused things", "cs336_systems.kernels.things")
    with pytest.raises(ValueError, match="under TRITON_INTERPRET=1 the fused things take CPU tensors only .* got a "
                                         "tensor on meta"):
        check_device(torch.zeros(2, device="meta"), "the fused things", "cs336_systems.kernels.things",
                     reads_host_addresses=True)


def test_unsupported_device_says_why_or_none(monkeypatch):
    monkeypatch.setattr(launch, "_INTERPRETING", False)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert unsupported_device(gpu, "the things", "m", reads_host_addresses=True) is None
    assert unsupported_device(cpu, "the things", "m") == (
        "the things need CUDA tensors, got tensors on cpu; to run them on the CPU through the Triton interpreter, "
        "set TRITON_INTERPRET=1 before m is imported")
    monkeypatch.setattr(launch, "_INTERPRETING", True)
    assert unsupported_device(cpu, "the things", "m", reads_host_addresses=True) is None
    assert unsupported_device(gpu, "the things", "m") is None
    assert unsupported_device(gpu, "the things", "m", reads_host_addresses=True).startswith(
        "under TRITON_INTERPRET=1 the things take CPU tensors only")


# ---------------------------------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------------------------------


def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


def _scaled_shape(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


def test_opaque_operator_with_shapes_and_autograd():
    def setup_context(ctx, inputs, output):
        ctx.factor = inputs[1]

    def backward(ctx, grad):
        return grad * ctx.factor, None

    define_operator("cs336_systems_test::scaled", _scaled, traceable=False, fake=_scaled_shape, backward=backward,
                    setup_context=setup_context)
    x = torch.randn(5, requires_grad=True)
    torch.library.opcheck(torch.ops.cs336_systems_test.scaled.default, (x, 3.0))
    torch.ops.cs336_systems_test.scaled(x, 3.0).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((5,), 3.0))
    with pytest.raises(TypeError, match="needs a fake"):
        define_operator("cs336_systems_test::shapeless", _scaled, traceable=False)


def _halved_pair(x: Float[torch.Tensor, "n"], flag: bool) -> tuple[Float[torch.Tensor, "n"], ...]:
    return x / 2, (x / 2 if flag else x).clone()


def _halved_pair_shapes(x: torch.Tensor, flag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def test_operator_from_a_schema_is_registered_with_the_dispatcher():
    """An opaque operator whose body's annotations the schema inference does not read; its CPU kernel is the body
    itself, no custom_op wrapper in between."""
    op = define_operator("cs336_systems_test::halved_pair", _halved_pair, traceable=False, fake=_halved_pair_shapes,
                         schema="(Tensor x, bool flag) -> (Tensor, Tensor)")
    assert op is torch.ops.cs336_systems_test.halved_pair
    x = torch.arange(4.0)
    torch.library.opcheck(op.default, (x, True))
    half, same = op(x, False)
    torch.testing.assert_close(half, x / 2)
    torch.testing.assert_close(same, x)
    assert torch.compile(lambda t: op(t, True)[0] + 1, backend="eager", fullgraph=True)(x).tolist() == [1, 1.5, 2, 2.5]
    with pytest.raises(TypeError, match="opaque"):
        define_operator("cs336_systems_test::traced_schema", _halved_pair, traceable=True, fake=_halved_pair_shapes,
                        schema="(Tensor x, bool flag) -> (Tensor, Tensor)")


def test_attention_operators_are_dispatcher_operators():
    from cs336_systems.attention import op  # noqa: F401 (registers the operators)

    for name in ("flash_attention_forward", "flash_attention_backward"):
        assert torch._library.custom_ops._maybe_get_opdef(f"cs336_systems::{name}") is None  # no custom_op wrapper
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"cs336_systems::{name}", "CUDA")


def test_rmsnorm_operators_are_triton_ops_outside_the_interpreter():
    from torch._library.triton import triton_ops_to_kernels

    from cs336_systems.kernels import rmsnorm  # noqa: F401 (registers the operators)

    if launch.interpreting():
        pytest.skip("the interpreter's operators are opaque custom ops")
    for name in ("rmsnorm_forward", "rmsnorm_backward"):
        assert f"cs336_systems::{name}" in triton_ops_to_kernels


# ---------------------------------------------------------------------------------------------------
# The interpreter decision, read in one place
# ---------------------------------------------------------------------------------------------------

ALLOWED_READERS = {
    # A command-line tool that hands TRITON_INTERPRET=1 to the CPU ranks it spawns when its own process lacks it.
    "cs336_systems/bench/leaderboard_2026.py",
    # A command-line tool that, without a GPU, sets TRITON_INTERPRET=1 before our kernels are first imported.
    "cs336_systems/bench/demo.py",
}


def interpreter_reads(path: Path) -> list[str]:
    """Where ``path`` reads the interpreter setting itself: the variable's name as a string (an environment
    look-up), Triton's knob, or a module constant of it (``RUNNING_IN_INTERPRETER``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value == "TRITON_INTERPRET":
            found.append(f"line {node.lineno}: the environment variable")
        elif isinstance(node, ast.Attribute) and (node.attr, getattr(node.value, "attr", "")) == ("interpret", "runtime"):
            found.append(f"line {node.lineno}: triton.knobs.runtime.interpret")
        elif isinstance(node, (ast.Name, ast.Attribute)) and "RUNNING_IN_INTERPRETER" in (
                getattr(node, "id", None), getattr(node, "attr", None)):
            found.append(f"line {node.lineno}: RUNNING_IN_INTERPRETER")
        elif isinstance(node, ast.ImportFrom) and any(a.name == "RUNNING_IN_INTERPRETER" for a in node.names):
            found.append(f"line {node.lineno}: imports RUNNING_IN_INTERPRETER")
    return found


def test_the_interpreter_decision_is_read_in_launch_only():
    readers = {}
    for path in sorted((ROOT / "cs336_systems").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative != "cs336_systems/kernels/launch.py" and (found := interpreter_reads(path)):
            readers[relative] = found
    assert set(readers) <= ALLOWED_READERS, {k: v for k, v in readers.items() if k not in ALLOWED_READERS}
    assert interpreter_reads(ROOT / "cs336_systems" / "kernels" / "launch.py")  # the one reading


def test_interpreting_is_the_setting_the_kernels_were_defined_under():
    from triton.runtime.interpreter import InterpretedFunction

    from cs336_systems.kernels import adamw, cross_entropy, rmsnorm, weighted_sum

    for kernel in (adamw.fused_adamw_kernel, cross_entropy.cross_entropy_rows_kernel, rmsnorm.rmsnorm_fwd_kernel,
                   weighted_sum.weighted_sum_fwd_kernel):
        assert isinstance(kernel, InterpretedFunction) == launch.interpreting()
    from cs336_systems.attention.backends import triton_kernels

    assert isinstance(triton_kernels.attn_fwd_kernel, InterpretedFunction) == launch.interpreting()
