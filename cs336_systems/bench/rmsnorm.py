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
  Timed with ``triton.testing.do_bench`` (median, with the L2 cache flushed before every call).
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
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cs336_basics.model import RMSNorm
from cs336_systems.bench.common import cli, result_store, timing
from cs336_systems.bench.common.lm import SIZES, LMConfig, build_model, measure_case

PROBLEM = "rmsnorm"
COLS = [768, 1024, 1280, 1600, 2560, 4096, 8192]
ROWS = [4096, 16384, 32768, 65536]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROVIDERS = ("ours", "eager", "compile", "liger", "quack")
PASSES = ("fwd", "fwd_bwd")
MODEL_SIZES = ["small", "medium", "large", "xl", "2.7B"]
NORMS = ("plain", "fused", "fused_autocast")
EPS = 1e-5


def parser():
    p = cli.base_parser(__doc__)
    p.add_argument("--part", choices=["kernel", "model", "both"], default="both")
    p.add_argument("--cols", nargs="+", type=int, default=None, help=f"hidden sizes N (default {COLS})")
    p.add_argument("--rows", nargs="+", type=int, default=None, help=f"row counts M (default {ROWS})")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--run-id", default=None,
                   help="kernel part: continue this run (its rows' `run`), measuring only the cases it lacks")
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=None, help="model part (default: all five)")
    p.add_argument("--norms", nargs="+", choices=NORMS, default=list(NORMS), help="model part: which RMSNorm")
    p.add_argument("--compile", nargs="+", choices=["off", "on"], default=["off", "on"], dest="compile_modes",
                   help="model part: eager, compiled or both")
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5, help="untimed training steps (model part; compilation happens there)")
    p.add_argument("--steps", type=int, default=10, help="timed training steps (model part)")
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


def kernel_cases(args) -> list[dict[str, Any]]:
    """Every (shape, dtype) of the grid: its copy first (the reference of the rows after it), then each provider
    and pass."""
    cases = []
    for dtype in args.dtypes:
        for rows in args.rows:
            for cols in args.cols:
                shape = dict(part="kernel", rows=rows, cols=cols, dtype=dtype)
                cases.append({**shape, "provider": "copy", "pass": "copy"})
                cases += [{**shape, "provider": p, "pass": pass_} for p in args.providers for pass_ in args.passes]
    return cases


def copy_reference(rows: list[dict[str, Any]], run: str) -> dict[tuple[int, int, str], float]:
    """The copy GB/s of each (M, N, dtype) measured in ``run`` (the last such row where there are several)."""
    return {(r["rows"], r["cols"], r["dtype"]): r["gbps"] for r in rows
            if r.get("run") == run and r.get("part") == "kernel" and r.get("provider") == "copy" and r.get("gbps")}


def with_copy_share(result: dict[str, Any], copy_gbps: float | None) -> dict[str, Any]:
    """``result`` with ``copy_gbps`` and ``copy_share`` (its GB/s over the copy's), both None without a copy."""
    share = result["gbps"] / copy_gbps if copy_gbps and result.get("gbps") else None
    return {**result, "copy_gbps": copy_gbps, "copy_share": share}


def newest_kernel_run(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The kernel-part rows of the newest run that records ``copy_share`` (rows of earlier versions of the tool
    have none), in file order; empty if there is none. Runs are ordered by their first row's date, then by where
    that row stands in ``rows`` (a file is appended to, so a later run starts further down)."""
    kernel = [r for r in rows if r.get("part") == "kernel" and "copy_share" in r]
    started: dict[str, tuple[str, int]] = {}
    for index, r in enumerate(kernel):
        started.setdefault(r["run"], ((r.get("env") or {}).get("date", ""), index))
    if not started:
        return []
    newest = max(started, key=started.get)
    return [r for r in kernel if r["run"] == newest]


def measure_kernel_case(case: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """One (provider, pass, shape) case; the provider must be available here."""
    dtype = DTYPES[case["dtype"]]
    rows, cols = case["rows"], case["cols"]
    x = torch.randn(rows, cols, device=device, dtype=dtype)
    if case["provider"] == "copy":
        timing = time_ms(lambda: x.clone(), device)
        gain_element_size = 0
        error = None
    else:
        norm = make_norm(case["provider"], cols, dtype, device)
        weight = next(norm.parameters())
        x.requires_grad_()
        dy = torch.randn_like(x)
        # A sanity check against eager, in grad mode like the timed calls (one compiled graph, not two).
        expected = RMSNorm(cols, eps=EPS, device=device, dtype=weight.dtype)
        expected.load_state_dict({"weight": weight.detach()})
        error = (norm(x).detach().float() - expected(x).detach().float()).abs().max().item()
        if case["pass"] == "fwd":
            timing = time_ms(lambda: norm(x), device)
        else:
            timing = time_ms(lambda: torch.autograd.grad(norm(x), (x, weight), dy), device)
        gain_element_size = weight.element_size()
    moved = moved_bytes(case["pass"], rows, cols, x.element_size(), gain_element_size)
    return {**timing, "bytes": moved, "gbps": moved / (timing["ms"] * 1e-3) / 1e9, "max_abs_error_vs_eager": error}


def pending_in_run(store: result_store.ResultStore, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cases that the store's run has not measured yet (all of them in a new run)."""
    measured = [{key: r.get(key) for key in r.get("config_keys", ())} for r in store.rows() if r.get("run") == store.run]
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
    print(f"# kernel part: run {store.run}, {len(cases)} cases to measure", file=sys.stderr)
    copy_gbps = copy_reference(store.rows(), store.run)
    rows = []
    for case in cli.progress(cases, f"{PROBLEM} (kernel)"):
        shape = (case["rows"], case["cols"], case["dtype"])
        result = result_store.measure_or_oom(lambda: measure_kernel_case(case, device))
        if case["provider"] == "copy" and result.get("gbps"):
            copy_gbps[shape] = result["gbps"]
        if not result["oom"]:
            result = with_copy_share(result, copy_gbps.get(shape))
        rows.append(store.add(case, result))
        timing.free_memory()
    return rows


def print_kernel_summary(store: result_store.ResultStore) -> None:
    """GB/s of every provider per shape and its share of the copy bandwidth, from this run's rows."""
    import pandas as pd

    measured = [r for r in store.rows() if r.get("run") == store.run and r.get("part") == "kernel" and r.get("gbps")]
    if not measured:
        return
    frame = pd.DataFrame(measured).drop_duplicates(["provider", "pass", "rows", "cols", "dtype"], keep="last")
    print(f"Run {store.run}: GB/s (bytes an ideal implementation moves / median time), then the share of the copy "
          "bandwidth of the same shape")
    for values in ("gbps", "copy_share"):
        table = frame.pivot_table(index=["dtype", "rows", "cols"], columns=["pass", "provider"], values=values)
        print(table.round(2).to_string())


# ---------------------------------------------------------------------------------------------------
# Model part
# ---------------------------------------------------------------------------------------------------


def model_cases(args) -> list[dict[str, Any]]:
    base = dict(part="model", context_length=args.context_length, batch_size=args.batch_size, mode="train_step",
                dtype="bf16")
    cases = [{**base, "size": size, "norm": norm, "attention": "naive", "compile": compiled == "on"}
             for size in args.sizes for compiled in args.compile_modes for norm in args.norms]
    if "xl" in args.sizes and "on" in args.compile_modes:
        cases += [{**base, "size": "xl", "norm": norm, "attention": "sdpa" if norm == "plain" else "triton",
                   "compile": True} for norm in args.norms]
    return cases


def measure_model_case(case: dict[str, Any], device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    from cs336_systems.kernels.rmsnorm import use_fused_rmsnorm

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


def print_model_summary(rows: list[dict[str, Any]]) -> None:
    cli.print_table(rows, ["size", "norm", "attention", "compile", "median_ms", "mean_ms", "std_ms", "oom"])
    by_key = {(r["size"], r["norm"], r["attention"], r["compile"]): r.get("median_ms") for r in rows}
    for size in dict.fromkeys(r["size"] for r in rows):
        for compiled in (False, True):
            plain = by_key.get((size, "plain", "naive", compiled))
            for norm in NORMS[1:]:
                fused = by_key.get((size, norm, "naive", compiled))
                if plain and fused:
                    print(f"# {size} {'compiled' if compiled else 'eager'}: {norm} / plain step time = {fused / plain:.3f}")
    plain = by_key.get(("xl", "plain", "sdpa", True))
    for norm in NORMS[1:]:
        ours = by_key.get(("xl", norm, "triton", True))
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
    args.cols, args.rows, args.sizes = args.cols or COLS, args.rows or ROWS, args.sizes or MODEL_SIZES
    if args.quick:
        args.dtypes = args.dtypes[:1]
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force)
    if args.part in ("kernel", "both"):
        run_kernels(args, device, store)
        print_kernel_summary(store)
    if args.part in ("model", "both"):
        print_model_summary(run_models(args, device, store))


if __name__ == "__main__":
    main()
