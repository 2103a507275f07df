"""The fused Triton RMSNorm against PyTorch eager, ``torch.compile``, Liger-Kernel and QuACK (problem ``rmsnorm``).

Two parts, measured in one run:

* ``kernel``: RMSNorm on ``(M, N)`` inputs, rows M in 4096, 16384, 32768, 65536 and hidden sizes N of the five
  models (768 ... 2560) and 4096 and 8192, bf16 and fp32 (the gain in the input's dtype), forward (``fwd``) and
  forward plus backward (``fwd_bwd``: ``torch.autograd.grad`` of y for x and the gain). Providers:
  ``ours`` (``cs336_systems.kernels.rmsnorm``), ``eager`` (``cs336_basics.model.RMSNorm``), ``compile``
  (``torch.compile`` of eager, specialised to each shape), ``liger`` (Liger-Kernel's ``LigerRMSNorm`` with
  ``casting_mode="gemma"``, i.e. our rounding: everything in float32, one cast at the end), ``quack``
  (QuACK's ``QuackRMSNorm``, CuTe DSL kernels: x and the gain read in float32, one cast at the end, our rounding
  too), and ``copy`` (``x.clone()``: the device's copy bandwidth on the same tensor, the reference). ``liger``
  and ``quack`` come from the optional ``bench`` group (``uv sync --extra bench``); each is skipped, saying why
  in one line, where its package is missing or there is no GPU. QuACK needs NVIDIA's CuTe DSL compiler
  (``nvidia-cutlass-dsl``), whose library wheel alone is about 88 MiB: it installs beside torch 2.11 where a
  package index is reachable, but does not fit the 64 MiB that can be carried to a GPU machine without network
  (``scripts/bench_wheels.sh``), where ``quack`` is then skipped.
  Timed with ``triton.testing.do_bench`` (median, with the L2 cache flushed before every call), or, with
  ``--timer graph``, from CUDA graph replays (``timing.graph_replay_ms``): R rounds over K independent input sets
  (together twice the L2 cache, so no call finds its inputs there) captured in one graph, median replay time over
  R·K. At small shapes (kernels of a few µs) do_bench's interval may hold the host's launch of each call (Python,
  autograd) after the cache flush, not only the kernel; the graph has no host between calls. Graph rows carry
  ``timer: graph`` in their case (rows of both timers may share a run; readers take one timer's rows), and a
  case whose graph cannot be captured is timed with do_bench instead (``timed_with``, ``timer_note``).
  GB/s counts the bytes no implementation can avoid, ``e`` bytes an element of x, ``e_g`` of the gain:
  ``fwd`` reads x and g and writes y, ``2·M·N·e + N·e_g``; ``fwd_bwd`` adds reading x, dy and
  g and writing dx and dg, ``5·M·N·e + 3·N·e_g`` in all. Per-row statistics (4 bytes a row)
  and the partial weight gradients are not counted. ``copy`` moves ``2·M·N·e``. Every row records
  ``copy_share``: its GB/s over the copy GB/s of the same (M, N, dtype) in the same run.
  The kernel part is one run (one ``run`` id): it measures every case each time it is started, since its rows
  are read together; ``--run-id`` continues an earlier run instead (a grid split over several commands),
  measuring only the cases that run lacks.
* ``model``: a full bf16-autocast training step (forward, loss, backward, AdamW) of every model size,
  batch 4, context 512 (5 warm-up and 10 timed steps; the median is reported), with the plain RMSNorm,
  the fused one, and the fused one writing its output in bf16 under autocast (``norm``: ``plain``,
  ``fused``, ``fused_autocast``; see ``FusedRMSNorm.autocast_output``), each eager and
  ``torch.compile``-d, naive attention; and for xl: each fused RMSNorm + our Triton attention + compile
  against plain RMSNorm + PyTorch SDPA + compile. Re-running skips the model cases measured on this device.

On a CPU (no GPU) the tool runs a tiny configuration with ``timing.time_calls`` and skips ``ours``, ``liger``
and ``quack`` (their kernels need a GPU), except that ``ours`` runs through the Triton interpreter when
``TRITON_INTERPRET=1`` is set (slow; the numbers then mean nothing).

Examples::

    python -m cs336_systems.bench.rmsnorm                                  # both parts
    python -m cs336_systems.bench.rmsnorm --part kernel --dtypes bf16 --cols 1600 --rows 16384
    python -m cs336_systems.bench.rmsnorm --part kernel --dtypes fp32 --run-id 20261126T160000Z-a1b2c3
    python -m cs336_systems.bench.rmsnorm --part model --sizes xl
    python -m cs336_systems.bench.rmsnorm --part kernel --timer graph --rows 4096 --dtypes bf16
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cs336_basics.model import RMSNorm
from cs336_systems.bench.common import cli, model_sizes, result_store, timing
from cs336_systems.bench.common.lm import LMConfig, build_model, measure_case

PROBLEM = "rmsnorm"
COLS = [768, 1024, 1280, 1600, 2560, 4096, 8192]
ROWS = [4096, 16384, 32768, 65536]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROVIDERS = ("ours", "eager", "compile", "liger", "quack")
PASSES = ("fwd", "fwd_bwd")
TIMERS = ("do_bench", "graph")
NORMS = ("plain", "fused", "fused_autocast")
EPS = 1e-5


def parser():
    p = cli.base_parser(__doc__)
    p.add_argument("--part", choices=["kernel", "model", "both"], default="both")
    p.add_argument("--cols", nargs="+", type=cli.positive_int, default=None, help=f"hidden sizes N (default {COLS})")
    p.add_argument("--rows", nargs="+", type=cli.positive_int, default=None, help=f"row counts M (default {ROWS})")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--timer", choices=TIMERS, default="do_bench",
                   help="kernel part: do_bench (each call timed alone after an L2 flush) or graph (CUDA graph replays "
                        "over rotating inputs: device time without the host's gaps between calls, which "
                        "do_bench's interval may hold at small shapes); graph rows carry `timer: graph`")
    p.add_argument("--run-id", default=None,
                   help="kernel part: continue this run (its rows' `run`), measuring only the cases it lacks")
    cli.add_model_size(p, multiple=True, default="model part: the edition's every size")
    p.add_argument("--norms", nargs="+", choices=NORMS, default=list(NORMS), help="model part: which RMSNorm")
    p.add_argument("--compile", nargs="+", choices=["off", "on"], default=["off", "on"], dest="compile_modes",
                   help="model part: eager, compiled or both")
    p.add_argument("--context-length", type=cli.positive_int, default=512)
    p.add_argument("--batch-size", type=cli.positive_int, default=4)
    p.add_argument("--warmup", type=cli.non_negative_int, default=5,
                   help="untimed training steps (model part; compilation happens there)")
    p.add_argument("--steps", type=cli.positive_int, default=10, help="timed training steps (model part)")
    return p


# ---------------------------------------------------------------------------------------------------
# Kernel part
# ---------------------------------------------------------------------------------------------------


def moved_bytes(pass_: str, rows: int, cols: int, element_size: int, gain_element_size: int) -> int:
    """Bytes an ideal implementation reads and writes (see the module docstring)."""
    activations = {"fwd": 2, "fwd_bwd": 5, "copy": 2}[pass_]
    gains = {"fwd": 1, "fwd_bwd": 3, "copy": 0}[pass_]
    return activations * rows * cols * element_size + gains * cols * gain_element_size


def optional_norm_class(provider: str) -> tuple[type | None, str]:
    """The RMSNorm module class of an optional provider (``liger``, ``quack``), or None and why it cannot be had."""
    try:
        if provider == "liger":
            from liger_kernel.transformers.rms_norm import LigerRMSNorm

            return LigerRMSNorm, ""
        from quack.rmsnorm import QuackRMSNorm

        return QuackRMSNorm, ""
    except ImportError as error:
        package = {"liger": "liger-kernel", "quack": "quack-kernels"}[provider]
        return None, (f"{package} cannot be imported ({error}); install the optional group: uv sync --extra bench, "
                      "or on a machine without network the wheels of scripts/bench_wheels.sh")


def ours_available(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    from cs336_systems.kernels.launch import interpreting

    return interpreting()


def unavailable(provider: str, device: torch.device) -> str | None:
    """Why ``provider`` cannot run here, or None where it can."""
    if provider == "ours":
        return None if ours_available(device) else "Triton kernels need a GPU, or TRITON_INTERPRET=1"
    if provider in ("liger", "quack"):
        if device.type != "cuda":
            return "no GPU"
        return optional_norm_class(provider)[1] or None
    return None


def make_norm(provider: str, cols: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The RMSNorm module of ``provider`` (gain of ones plus noise, in ``dtype``); the provider must be available."""
    if provider == "ours":
        from cs336_systems.kernels.rmsnorm import FusedRMSNorm

        module = FusedRMSNorm(cols, eps=EPS, device=device, dtype=dtype)
    elif provider in ("eager", "compile"):
        module = RMSNorm(cols, eps=EPS, device=device, dtype=dtype)
    elif provider == "liger":
        # in_place=False: Liger would otherwise overwrite dy with dx, changing the inputs between timed calls.
        module = optional_norm_class("liger")[0](cols, eps=EPS, casting_mode="gemma", in_place=False)
        module = module.to(device=device, dtype=dtype)
    elif provider == "quack":
        module = optional_norm_class("quack")[0](cols, eps=EPS, device=device, dtype=dtype)
    else:
        raise ValueError(f"unknown provider {provider!r}")
    with torch.no_grad():
        module.weight.add_(0.1 * torch.randn_like(module.weight))
    if provider == "compile":
        torch._dynamo.reset()  # a fresh, shape-specialised graph for every case
        return torch.compile(module, dynamic=False)
    return module


def time_ms(fn: Callable[[], Any], device: torch.device) -> dict[str, float]:
    """Median and 20th/80th percentile ms of ``fn`` (after two untimed calls: compilation, autotuning)."""
    fn()
    fn()
    if device.type == "cuda":
        import triton

        median, p20, p80 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
        return {"ms": median, "ms_p20": p20, "ms_p80": p80}
    seconds = timing.time_calls(fn, warmup=0, steps=3, device=device)
    return {"ms": statistics.median(seconds) * 1e3}


def gbps(moved: int, ms: float) -> float:
    return moved / (ms * 1e-3) / 1e9


def graph_time_ms(fn_of_input: Callable[[tuple], Any], inputs: list[tuple], device: torch.device) -> dict[str, Any]:
    """``time_ms``'s keys from CUDA graph replays over the rotating ``inputs`` (``timing.graph_replay_ms``), with
    the graph's calls per replay and input sets. Where the graph cannot be captured: ``do_bench`` on the first input
    set, marked ``timed_with: do_bench`` with a ``timer_note`` saying why, and ``copy_gbps``, the copy of the same x
    timed with ``do_bench`` too (the row's share must not divide by a copy another timer measured)."""
    try:
        stats = timing.graph_replay_ms(fn_of_input, inputs, device)
    except timing.GraphCaptureError as error:
        x = inputs[0][0].detach()
        copy = time_ms(lambda: x.clone(), device)
        return {**time_ms(lambda: fn_of_input(inputs[0]), device), "timed_with": "do_bench",
                "timer_note": f"{error}: timed with do_bench, its copy_share against a copy timed with do_bench",
                "copy_gbps": gbps(moved_bytes("copy", *x.shape, x.element_size(), 0), copy["ms"])}
    return {"ms": stats["median_ms"], "ms_p20": stats["p20_ms"], "ms_p80": stats["p80_ms"],
            "calls_per_replay": stats["calls_per_replay"], "input_sets": stats["input_sets"]}


def case_timer(row: dict[str, Any]) -> str:
    """The timer a case asked for (``timer``; cases without one: ``do_bench``, the default)."""
    return row.get("timer", "do_bench")


def measured_by(row: dict[str, Any]) -> str:
    """The timer that measured a row: its case's, unless the row fell back to another (``timed_with``)."""
    return row.get("timed_with") or case_timer(row)


def kernel_cases(args) -> list[dict[str, Any]]:
    """Every (shape, dtype) of the grid: its copy first (the reference of the rows after it), then each provider
    and pass. Cases of ``--timer graph`` carry ``timer: graph``; do_bench's carry no timer, as before the option."""
    timer = {"timer": args.timer} if args.timer != "do_bench" else {}
    cases = []
    for dtype in args.dtypes:
        for rows in args.rows:
            for cols in args.cols:
                shape = dict(part="kernel", rows=rows, cols=cols, dtype=dtype, **timer)
                cases.append({**shape, "provider": "copy", "pass": "copy"})
                cases += [{**shape, "provider": p, "pass": pass_} for p in args.providers for pass_ in args.passes]
    return cases


def copy_reference(rows: list[dict[str, Any]], run: str, timer: str = "do_bench") -> dict[tuple[int, int, str], float]:
    """The copy GB/s of each (M, N, dtype) measured in ``run`` by ``timer`` (the last such row where there are
    several)."""
    return {(r["rows"], r["cols"], r["dtype"]): r["gbps"] for r in rows
            if r.get("run") == run and r.get("part") == "kernel" and r.get("provider") == "copy" and r.get("gbps")
            and case_timer(r) == measured_by(r) == timer}


def with_copy_share(result: dict[str, Any], copy_gbps: float | None) -> dict[str, Any]:
    """``result`` with ``copy_gbps`` and ``copy_share`` (its GB/s over the copy's), both None without a copy."""
    share = result["gbps"] / copy_gbps if copy_gbps and result.get("gbps") else None
    return {**result, "copy_gbps": copy_gbps, "copy_share": share}


def newest_kernel_run(rows: list[dict[str, Any]], timer: str = "do_bench") -> list[dict[str, Any]]:
    """The kernel-part rows of ``timer``'s cases (``case_timer``) of the newest run that records ``copy_share``
    (rows of earlier versions of the tool have none), in file order; empty if there is none. The newest run is the
    run of the latest such row (:func:`result_store.latest`). The rows of one timer are never read with another's."""
    kernel = [r for r in rows if r.get("part") == "kernel" and "copy_share" in r and case_timer(r) == timer]
    if not kernel:
        return []
    newest = result_store.latest(kernel)[0]["run"]
    return [r for r in kernel if r["run"] == newest]


def input_set_bytes(case: dict[str, Any]) -> int:
    """Bytes of one input set of a case: x, and dy for the backward."""
    tensors = 2 if case["pass"] == "fwd_bwd" else 1
    return tensors * case["rows"] * case["cols"] * DTYPES[case["dtype"]].itemsize


def kernel_inputs(case: dict[str, Any], device: torch.device, sets: int) -> list[tuple[torch.Tensor, ...]]:
    """``sets`` independent input sets: ``(x,)``, or ``(x, dy)`` for the backward; x requires grad for a norm, whose
    timed calls run in grad mode."""
    shape, dtype = (case["rows"], case["cols"]), DTYPES[case["dtype"]]

    def one() -> tuple[torch.Tensor, ...]:
        x = torch.randn(shape, device=device, dtype=dtype, requires_grad=case["provider"] != "copy")
        return (x, torch.randn_like(x)) if case["pass"] == "fwd_bwd" else (x,)

    return [one() for _ in range(sets)]


def kernel_operation(case: dict[str, Any], device: torch.device,
                     x: torch.Tensor) -> tuple[Callable[[tuple], Any], int, float | None]:
    """The timed operation of a case on one input set, the gain's bytes an element, and the largest difference of
    the provider's output on ``x`` from eager's (None for the copy)."""
    if case["provider"] == "copy":
        return (lambda inputs: inputs[0].clone()), 0, None
    norm = make_norm(case["provider"], case["cols"], x.dtype, device)
    weight = next(norm.parameters())
    # A sanity check against eager, in grad mode like the timed calls (one compiled graph, not two).
    expected = RMSNorm(case["cols"], eps=EPS, device=device, dtype=weight.dtype)
    expected.load_state_dict({"weight": weight.detach()})
    error = (norm(x).detach().float() - expected(x).detach().float()).abs().max().item()

    def forward(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return norm(inputs[0])

    def forward_backward(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, dy = inputs
        return torch.autograd.grad(norm(x), (x, weight), dy)

    return (forward if case["pass"] == "fwd" else forward_backward), weight.element_size(), error


def measure_kernel_case(case: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """One (provider, pass, shape) case, timed by its case's timer; the provider must be available here. The graph
    timer rotates over enough input sets to span twice the L2 cache (allocated here, freed on return)."""
    graph = case_timer(case) == "graph"
    sets = 1
    if graph and device.type == "cuda":
        sets = timing.rotation_count(input_set_bytes(case), timing.l2_cache_bytes(device))
    inputs = kernel_inputs(case, device, sets)
    fn, gain_element_size, error = kernel_operation(case, device, inputs[0][0])
    result = graph_time_ms(fn, inputs, device) if graph else time_ms(lambda: fn(inputs[0]), device)
    moved = moved_bytes(case["pass"], case["rows"], case["cols"], inputs[0][0].element_size(), gain_element_size)
    return {**result, "bytes": moved, "gbps": gbps(moved, result["ms"]), "max_abs_error_vs_eager": error}


def pending_in_run(store: result_store.ResultStore, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cases that the store's run has not measured yet (all of them in a new run)."""
    measured = [{key: r.get(key) for key in r.get("config_keys", ())}
                for r in store.rows() if r.get("run") == store.run]
    return [case for case in cases if case not in measured]


def run_kernels(args, device: torch.device, store: result_store.ResultStore) -> list[dict[str, Any]]:
    if args.run_id:
        store.run = args.run_id
    cases = kernel_cases(args)
    reasons = {p: unavailable(p, device) for p in args.providers}
    for provider, why in reasons.items():
        if why:
            print(f"# skipped here: {provider} ({why})", file=sys.stderr)
    cases = [c for c in pending_in_run(store, cases) if not reasons.get(c["provider"])]
    print(f"# kernel part: run {store.run}, {len(cases)} cases to measure, timer {args.timer}", file=sys.stderr)
    copy_gbps = copy_reference(store.rows(), store.run, args.timer)
    rows = []
    for case in cli.progress(cases, f"{PROBLEM} (kernel)"):
        shape = (case["rows"], case["cols"], case["dtype"])
        result = result_store.measure_or_oom(lambda: measure_kernel_case(case, device))
        if case["provider"] == "copy" and result.get("gbps") and measured_by({**case, **result}) == args.timer:
            copy_gbps[shape] = result["gbps"]
        if not result["oom"]:
            # A row timed by the fallback carries its own copy, timed by the same fallback.
            result = with_copy_share(result, result.get("copy_gbps") or copy_gbps.get(shape))
        rows.append(store.add(case, result))
        timing.free_memory()
    return rows


def print_kernel_summary(store: result_store.ResultStore, timer: str) -> None:
    """GB/s of every provider per shape and its share of the copy bandwidth, from this run's rows of ``timer``'s
    cases."""
    import pandas as pd

    measured = [r for r in store.rows() if r.get("run") == store.run and r.get("part") == "kernel" and r.get("gbps")
                and case_timer(r) == timer]
    if not measured:
        return
    frame = pd.DataFrame(measured).drop_duplicates(["provider", "pass", "rows", "cols", "dtype"], keep="last")
    print(f"Run {store.run}, timer {timer}: GB/s (bytes an ideal implementation moves / median time), "
          "then the share of the copy "
          "bandwidth of the same shape")
    for values in ("gbps", "copy_share"):
        table = frame.pivot_table(index=["dtype", "rows", "cols"], columns=["pass", "provider"], values=values)
        print(table.round(2).to_string())


# ---------------------------------------------------------------------------------------------------
# Model part
# ---------------------------------------------------------------------------------------------------


def model_cases(args) -> list[dict[str, Any]]:
    xl = model_sizes.canonical_size("xl", args.edition)
    base = dict(part="model", context_length=args.context_length, batch_size=args.batch_size, mode="train_step",
                dtype="bf16")
    cases = [{**base, "size": size, "norm": norm, "attention": "naive", "compile": compiled == "on"}
             for size in args.sizes for compiled in args.compile_modes for norm in args.norms]
    if xl in args.sizes and "on" in args.compile_modes:
        cases += [{**base, "size": xl, "norm": norm, "attention": "sdpa" if norm == "plain" else "triton",
                   "compile": True} for norm in args.norms]
    return cases


def measure_model_case(case: dict[str, Any], device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    from cs336_systems.kernels.rmsnorm import use_fused_rmsnorm

    too_large = model_sizes.estimated_oom(case["size"], case["mode"], device)
    if too_large:
        return too_large
    config = LMConfig(case["size"], case["context_length"], case["batch_size"])
    model = build_model(config, device, case["attention"])
    if case["norm"] != "plain":
        use_fused_rmsnorm(model, autocast_output=case["norm"] == "fused_autocast")
    try:
        return measure_case(config, case["mode"], case["dtype"], warmup, steps, device, attention=case["attention"],
                            compile_model=case["compile"], model=model)
    finally:
        del model
        torch._dynamo.reset()


def run_models(args, device: torch.device, store: result_store.ResultStore) -> list[dict[str, Any]]:
    cases = model_cases(args)
    if not ours_available(device):
        print("# model part: no GPU (and no TRITON_INTERPRET=1): only the plain RMSNorm", file=sys.stderr)
        cases = [c for c in cases if c["norm"] == "plain"]
    pending = store.pending(cases)
    for case in cli.progress(pending, f"{PROBLEM} (model)"):
        result = result_store.measure_or_oom(lambda: measure_model_case(case, device, args.warmup, args.steps))
        store.add(case, result)
        timing.free_memory()
    return [row for row in store.asked_rows() if row.get("part") == "model"]


def print_model_summary(rows: list[dict[str, Any]], xl: str) -> None:
    """The model part's table and step-time ratios; ``xl``: the canonical key of the edition's xl."""
    cli.print_table(rows, ["size", "norm", "attention", "compile", "median_ms", "mean_ms", "std_ms", "oom"])
    by_key = {(r["size"], r["norm"], r["attention"], r["compile"]): r.get("median_ms") for r in rows}
    for size in dict.fromkeys(r["size"] for r in rows):
        for compiled in (False, True):
            plain = by_key.get((size, "plain", "naive", compiled))
            for norm in NORMS[1:]:
                fused = by_key.get((size, norm, "naive", compiled))
                if plain and fused:
                    mode = "compiled" if compiled else "eager"
                    print(f"# {size} {mode}: {norm} / plain step time = {fused / plain:.3f}")
    plain = by_key.get((xl, "plain", "sdpa", True))
    for norm in NORMS[1:]:
        ours = by_key.get((xl, norm, "triton", True))
        if plain and ours:
            print(f"# xl, compiled: ({norm} RMSNorm + Triton attention) / (plain RMSNorm + SDPA) step time = "
                  f"{ours / plain:.3f}")


def main(argv: list[str] | None = None) -> None:
    args, device, _ = cli.start(parser(), argv)
    tiny = device.type == "cpu"
    if tiny:
        args.cols, args.rows = args.cols or [64, 96], args.rows or [256]
        args.sizes, args.context_length = args.sizes or ["tiny"], min(args.context_length, 32)
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 2)
    elif args.quick:
        args.cols, args.rows = args.cols or [768, 2560], args.rows or [16384]
        args.sizes, args.steps = args.sizes or ["small"], min(args.steps, 3)
    args.cols, args.rows = args.cols or COLS, args.rows or ROWS
    args.sizes = args.sizes or model_sizes.edition_sizes(args.edition)
    if args.quick:
        args.dtypes = args.dtypes[:1]
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force, edition=args.edition)
    if args.part in ("kernel", "both"):
        run_kernels(args, device, store)
        print_kernel_summary(store, args.timer)
    if args.part in ("model", "both"):
        print_model_summary(run_models(args, device, store), model_sizes.canonical_size("xl", args.edition))


if __name__ == "__main__":
    main()
