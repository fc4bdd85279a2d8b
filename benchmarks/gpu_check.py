"""The GPU checks and the five GPU goals, as one prepared script for one lent GPU.

    PYTHONPATH=. python benchmarks/gpu_check.py --out gpu_check

Run from the source tree (no ``pip install``); it writes ``DIR/gpu_check.json`` (default
``./gpu_check/``) before and after every check, and ``DIR/faulthandler.log``. A hard deadline
(``--deadline-s``, default 540) stops whatever runs then and keeps what it measured
(``benchmarks/gpu_harness.py``). It exits 1 if any check failed. In order:

1. ``preflight``: Python, torch, the GPU, a C compiler, ``Python.h``, Triton, the backend name
   ``"fxckpt"`` resolving, then one tiny compile and step with fxckpt on the device, timed: the
   unit every later estimate is measured in. If Inductor cannot build there, the rest runs with
   ``compiler="eager"`` and the record says so.
2. ``goals``: the five GPU goals (``benchmarks/gpu_goals.py``), into the JSON's ``goals``
   object with the keys of ``benchmarks/goals.py``; without CUDA each says "skipped: needs
   CUDA".
3. The checks of ``benchmarks/gpu_checks.py``: ``copy_streams``, ``bandwidth``,
   ``gradients`` (the noise floor, then fxckpt within it), ``race_detector``,
   ``pinned_slabs``, ``sync_debug``, ``profiler_overlap``, ``stall_figures``, ``disk_tier``,
   ``memory_vs_simulator``, ``conv_memory`` (``benchmarks/conv_case.py``: a ResNet-18 shape in
   bf16, where Inductor lays convolutions out channels-last, at budgets 0.5 and 0.3),
   ``cudagraphs``, ``bucket_overhead``, ``table``.

Without CUDA, ``preflight``, ``gradients``, ``race_detector``, ``disk_tier`` and
``bucket_overhead`` run on the CPU with tiny models; the rest are skipped, each with why.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Before CUDA initialises: many model copies and two sequence lengths in one process.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from benchmarks import gpu_checks as c  # noqa: E402
from benchmarks import gpu_verdicts as v  # noqa: E402
from benchmarks.gpu_harness import Check, Ctx, load_estimates, run_all  # noqa: E402


def check_preflight(ctx: Ctx) -> None:
    """What the run needs, then one tiny compile and step on the device, timed."""
    from torch._dynamo.backends.registry import list_backends

    import fxckpt
    from benchmarks.methods import QWEN3_1_7B, Decoder, grads_match, make_batch

    include = Path(sysconfig.get_paths()["include"]) / "Python.h"
    env: dict[str, object] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "fxckpt": fxckpt.__version__,
        "gpu": torch.cuda.get_device_name(ctx.device) if ctx.cuda else None,
        "c_compiler": shutil.which("gcc") or shutil.which("cc"),
        "python_h": include.exists(), "backend_registered": "fxckpt" in list_backends(),
    }  # fmt: skip
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    ctx.partial["env"] = env
    problems = [f"{k} missing" for k in ("c_compiler", "python_h", "backend_registered")
                if not env[k]]  # fmt: skip
    if ctx.cuda and not env["triton"]:
        problems.append("triton missing")
    tiny = replace(QWEN3_1_7B, name="qwen3-preflight", vocab=512, d=128, heads=4, kv_heads=2,
                   head_dim=32, ffn=256, layers=2)
    idx, tgt = make_batch(tiny, 2, 128, ctx.device)

    def step(compiler: str | None, options: dict[str, object] | None = None
             ) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = Decoder(tiny).to(ctx.device)
        opts = options or {"offload": "all", "min_offload_bytes": 0}
        call = model if compiler is None else torch.compile(
            model, backend="fxckpt", options={**opts, "compiler": compiler})
        call(idx, tgt).backward()
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ref = step(None)
    start = time.perf_counter()
    try:
        got = step(ctx.compiler)
    except Exception as e:
        if ctx.compiler != "inductor":
            raise
        problems.append(f"inductor: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        ctx.compiler = "eager"  # the rest still gives numbers, without code generation
        env["compiler_fallback"] = "eager"
        start = time.perf_counter()
        got = step("eager")
    cold_s = time.perf_counter() - start  # the process's first compile: toolchains start
    ctx.partial["cold_compile_s"] = cold_s
    ok, note = grads_match(ref, got, scale_rtol=1e-3)
    if not ok:
        problems.append(f"gradients: {note}")
    # The unit of every estimate: a compile once the one-time costs are paid, as later
    # checks' compiles are (another plan, so another graph: no cache hit).
    torch._dynamo.reset()
    start = time.perf_counter()
    step_options = {"memory_budget": 0.5}
    step(ctx.compiler, step_options)
    ctx.compile_s = time.perf_counter() - start
    ctx.doc["compiler"] = ctx.compiler
    ctx.report.add("preflight", "failed" if problems else "passed", "; ".join(problems),
                   cold_compile_s=round(cold_s, 2), compile_s=round(ctx.compile_s, 2), **env)


def check_goals(ctx: Ctx) -> None:
    from benchmarks import gpu_goals

    if not ctx.cuda:
        ctx.doc["goals"] = gpu_goals.skipped(f"needs CUDA (torch {torch.__version__} sees none)")
        ctx.report.add("goals", "skipped", "needs CUDA")
        return
    rows = gpu_goals.measure(ctx.device, ctx.compiler, repeats=ctx.args.repeats,
                             seq=ctx.args.goal_seq, partial=ctx.partial)
    ctx.doc["goals"] = gpu_goals.judge(rows)
    broken = [f"{r['method']}: {r.get('unavailable') or r.get('grads_note')}" for r in rows
              if str(r["method"]).startswith("fxckpt")
              and (r.get("unavailable") or not r.get("grads_match", True))]  # fmt: skip
    ctx.report.add("goals", "failed" if broken else "passed", "; ".join(broken),
                   verdicts={k: g["verdict"] for k, g in ctx.doc["goals"].items()}, rows=rows)


def check_conv_memory(ctx: Ctx) -> None:
    from benchmarks.conv_case import run as conv_case

    record = conv_case(ctx.device, ctx.compiler)
    ctx.report.add("conv_memory", record.pop("status"), record.pop("why"), **record)


# Compiles are counted in the pre-flight's units (one tiny compile and step), so that what the
# pre-flight measured on this machine prices each check; larger models count more than one.
CHECKS: list[Check] = [
    Check("preflight", False, 0, check_preflight),
    Check("goals", False, 16, check_goals, cpu_compiles=0, always_start=True),
    Check("copy_streams", True, 0, c.check_copy_streams),
    Check("bandwidth", True, 0, c.check_bandwidth),
    Check("gradients", False, 4, c.check_gradients),
    Check("race_detector", False, 0.5, c.check_race_detector, needs_state=True),
    Check("pinned_slabs", True, 0.2, c.check_pinned_slabs, needs_state=True),
    Check("sync_debug", True, 0.2, c.check_sync_debug, needs_state=True),
    Check("profiler_overlap", True, 0.3, c.check_profiler_overlap, needs_state=True),
    Check("stall_figures", True, 0.2, c.check_stall_figures, needs_state=True),
    Check("disk_tier", False, 1.5, c.check_disk_tier, needs_state=True),
    Check("memory_vs_simulator", True, 8, c.check_memory_vs_simulator),
    Check("conv_memory", True, 6, check_conv_memory),
    Check("cudagraphs", True, 3, c.check_cudagraphs),
    Check("bucket_overhead", False, 3, c.check_bucket_overhead),
    Check("table", True, 12, c.check_table, always_start=True),  # skips lengths itself
]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py",
                                description="GPU checks and goals of fxckpt (see "
                                "docs/benchmarks.md); exits 1 if any check fails.")
    p.add_argument("--out", metavar="DIR", default="gpu_check",
                   help="folder for gpu_check.json and faulthandler.log")
    p.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--layers", type=int, default=8, help="layers of Qwen3-1.7B's 28 in the table")
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--goal-seq", type=int, default=8192, help="the goals' sequence length")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--deadline-s", type=float, default=540.0,
                   help="stop whatever runs after this many seconds, keep what it measured")
    p.add_argument("--estimates", metavar="JSON",
                   help="an earlier run's gpu_check.json: its measured seconds per check")
    p.add_argument("--only", nargs="*", default=[], choices=[k.name for k in CHECKS],
                   help="run these checks only")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print(f"gpu_check: CUDA is not available (torch {torch.__version__}); running the "
              "checks that need no GPU on the CPU, skipping the rest")
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 1 << 16
    from benchmarks import gpu_goals

    ctx = Ctx(device, args.compiler, args, v.Report(), v.Deadline(args.deadline_s),
              Path(args.out), previous=load_estimates(args.estimates))
    ctx.doc = {
        "command": "PYTHONPATH=. python benchmarks/gpu_check.py "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__, "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "compiler": args.compiler,
        "deadline_s": args.deadline_s, "goals": gpu_goals.skipped("not run yet"),
    }  # fmt: skip
    run_all(ctx, CHECKS, args.only)
    record = next((r for r in ctx.report.checks if r["check"] == "goals"), None)
    untouched = all(g["verdict"] == "skipped: not run yet" for g in ctx.doc["goals"].values())
    if record is not None and record["status"] == "skipped" and untouched:
        ctx.doc["goals"] = gpu_goals.skipped(record["why"])  # the deadline's, say
        ctx.write()
    failures = ctx.report.failures()
    out = ctx.out / "gpu_check.json"
    print(f"\nwrote {out}; {ctx.doc.get('compiler')}; "
          f"{args.deadline_s - ctx.deadline.left():.0f} s; {len(ctx.report.checks)} checks, "
          f"{len(failures)} failed, {len(ctx.report.skipped())} skipped"
          + ("" if not failures else "\nFAILED: " + "; ".join(failures)))
    for key, g in ctx.doc["goals"].items():
        print(f"goal {key}: {g['verdict']} (figure {g['figure']}, threshold {g['threshold']})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
