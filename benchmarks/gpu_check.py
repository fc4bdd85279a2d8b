"""The GPU checks, as one prepared script: at most 8 minutes on one H200, one JSON file.

    PYTHONPATH=. python benchmarks/gpu_check.py --json gpu_check.json

It exits 1 if any check failed, 0 otherwise, and writes every check's status, reason and
figures to the JSON file. Inductor is the compiler unless ``--compiler eager``. In order:

1. ``copy_streams``: fxckpt's copy streams are its own (driver streams), not torch's pool.
2. ``bandwidth``: the probe on every visible GPU gives a plausible rate (timing the wrong
   device's stream reads as ~0 s, i.e. an absurd rate).
3. ``gradients``: eager against eager and plain ``torch.compile`` against eager first (the
   noise floor), then fxckpt (``offload="all"``, ``memory_budget=0.5``) within that floor.
4. ``race_detector``: copy delays, poisoned prefetch buffers and allocator churn between
   forward and backward still give gradients within the floor; the skip-the-waits mutant
   must not.
5. ``pinned_slabs``: the pool's bytes are page-locked slabs, and torch's pinned allocator
   did not grow.
6. ``sync_debug``: a warm fxckpt step under ``torch.cuda.set_sync_debug_mode("error")``.
7. ``profiler_overlap``: a profiled step shows copies on a side stream overlapping kernels.
8. ``stall_figures``: with slow copies, ``stall_seconds`` is positive and below the step.
9. ``disk_tier``: ``offload="all"`` with ``host_budget`` at a quarter of what it takes and an
   ``offload_dir`` in a temporary folder: gradients within the floor, the host high-water
   mark within the budget, bytes written to disk, no fallback, no file left.
10. ``memory_vs_simulator``: bytes left after the forward against the plan's kept bytes,
   and the forward peak's change against the simulator's, within 5 %.
10b. ``conv_memory``: ``benchmarks/conv_case.py``: a ResNet-18-shaped net in bf16, where
   Inductor lays convolutions out channels-last: held bytes after a forward at budgets 0.5
   and 0.3 against plain ``aot_eager``'s and the plan's, gradients within the floor.
11. ``cudagraphs``: ``benchmarks/gpu_cudagraphs.py`` trains under ``mode="reduce-overhead"``
    against eager and finds any fxckpt op inside a captured partition.
12. ``bucket_overhead``: ``benchmarks/bucket_overhead.py``: fxckpt ops, hand-offs to the copy
    engine and host time per step of a tiny decoder with everything offloaded, with copy
    buckets and without (``coalesce="never"``) against keeping everything; fails if buckets
    do not cut the ops and hand-offs.
13. ``table``: peak, step time and exposed copy time of fxckpt against full checkpointing and
    ``save_on_cpu`` (Qwen3-1.7B shape, ``--layers`` of 28, bf16, 8k and 32k tokens), within
    what is left of the deadline.

Without CUDA, checks 3, 4, 9 and 12 run on the CPU with a tiny model and the rest are reported
as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Before CUDA initialises: many model copies and two sequence lengths in one process.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from benchmarks import gpu_verdicts as v  # noqa: E402
from benchmarks.methods import (  # noqa: E402
    BASELINE_SPECS,
    QWEN3_1_7B,
    Decoder,
    MethodSpec,
    build_runner,
    fxckpt_spec,
    grads_of,
    make_batch,
)

GiB = 2**30
TABLE_ROWS = ("eager", "full_checkpoint", "save_on_cpu")


@dataclass
class Ctx:
    device: torch.device
    compiler: str
    args: argparse.Namespace
    report: v.Report
    deadline: v.Deadline
    state: dict[str, Any]

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def small_config(cuda: bool) -> tuple[Any, int]:
    """The gradient checks' model and sequence length."""
    if cuda:
        return replace(QWEN3_1_7B, name="qwen3-grads", layers=2, vocab=32000), 1024
    return replace(QWEN3_1_7B, name="qwen3-tiny", vocab=256, d=64, heads=4, kv_heads=2,
                   head_dim=16, ffn=128, layers=2), 64  # fmt: skip


def _runner(ctx: Ctx, spec: MethodSpec, cfg: Any, dtype: torch.dtype) -> Any:
    torch.manual_seed(0)
    model = Decoder(cfg).to(device=ctx.device, dtype=dtype)
    return build_runner(spec, model, ctx.device, ctx.compiler)


def _grads(runner: Any, batch: tuple[torch.Tensor, torch.Tensor],
           on_forward: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
    runner.step(*batch, on_forward=on_forward)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return grads_of(runner.model)


def check_copy_streams(ctx: Ctx) -> None:
    from fxckpt import _cuda

    ours = [_cuda.CUDA.copy_stream(ctx.device, slot) for slot in range(2)]
    pool = {torch.cuda.Stream(ctx.device).cuda_stream for _ in range(64)}  # every pool stream
    external = all(isinstance(s, torch.cuda.ExternalStream) for s in ours)
    shared = [s.cuda_stream for s in ours if s.cuda_stream in pool]
    ok = external and not shared
    ctx.report.add("copy_streams", "passed" if ok else "failed",
                   "" if ok else f"external={external}, shared with torch's pool: {shared}")


def check_bandwidth(ctx: Ctx) -> None:
    from fxckpt.graph.costs import measure_bandwidth

    rates = {f"cuda:{i}": measure_bandwidth(f"cuda:{i}") * 1e3 / 1e9
             for i in range(torch.cuda.device_count())}  # GB/s
    bad = {d: r for d, r in rates.items() if not 1.0 <= r <= 500.0}
    ctx.report.add("bandwidth", "failed" if bad else "passed",
                   f"implausible rates (GB/s): {bad}" if bad else "", gb_per_s=rates)


def check_gradients(ctx: Ctx) -> None:
    cfg, seq = small_config(ctx.cuda)
    batch = make_batch(cfg, 1, seq, ctx.device)
    specs = {s.name: s for s in BASELINE_SPECS}
    eager = _runner(ctx, specs["eager"], cfg, torch.float32)
    ref = _grads(eager, batch)
    again = _grads(eager, batch)
    compiled = _grads(_runner(ctx, specs["compiled"], cfg, torch.float32), batch)
    floor = v.noise_floor(v.grad_diffs(ref, again), v.grad_diffs(ref, compiled))
    scale = v.grad_scale(ref)
    ctx.state.update(cfg=cfg, batch=batch, ref=ref, floor=floor, scale=scale)
    failed = []
    for spec in (fxckpt_spec("fxckpt_offload_all", 'offload="all"', offload="all",
                             min_offload_bytes=0),
                 fxckpt_spec("fxckpt_budget0.5", "memory_budget=0.5", memory_budget=0.5,
                             min_offload_bytes=0)):  # fmt: skip
        runner = _runner(ctx, spec, cfg, torch.float32)
        ok, note = v.within_floor(v.grad_diffs(ref, _grads(runner, batch)), floor, scale)
        if not ok:
            failed.append(f"{spec.name}: {note}")
        if spec.options.get("offload") == "all":
            ctx.state["fxckpt"] = runner
    ctx.report.add("gradients", "failed" if failed else "passed", "; ".join(failed),
                   noise_floor_max=max(floor.values(), default=0.0))


def check_race_detector(ctx: Ctx) -> None:
    from fxckpt.runtime import engine

    runner, batch = ctx.state["fxckpt"], ctx.state["batch"]
    ref, floor, scale = ctx.state["ref"], ctx.state["floor"], ctx.state["scale"]
    gen = torch.Generator().manual_seed(0)

    def churn() -> None:
        # Between forward and backward: grab and poison freed blocks of many sizes, so a
        # restore or a kernel reading reused memory too early reads NaN.
        for _ in range(32):
            n = int(torch.randint(1 << 10, 1 << 22, (1,), generator=gen))
            torch.empty(n, device=ctx.device).fill_(float("nan"))

    delay = 0.02 if ctx.cuda else 0.005
    try:
        engine.configure(copy_delay_s=delay, poison_fresh=True)
        ok, note = v.within_floor(v.grad_diffs(ref, _grads(runner, batch, churn)), floor, scale)
        engine.configure(copy_delay_s=delay, poison_fresh=True, unsafe_skip_waits=True)
        caught, _ = v.within_floor(v.grad_diffs(ref, _grads(runner, batch, churn)), floor, scale)
        caught = not caught
    finally:
        engine.configure()
    why = [] if ok else [f"delays/poison/churn changed gradients: {note}"]
    if not caught:
        why.append("the skip-the-waits mutant gave gradients within the floor: blind detector")
    ctx.report.add("race_detector", "failed" if why else "passed", "; ".join(why),
                   mutant_caught=caught)


def check_pinned_slabs(ctx: Ctx) -> None:
    import fxckpt
    from fxckpt.runtime import pool

    host_before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    _grads(ctx.state["fxckpt"], ctx.state["batch"])
    st = fxckpt.stats()
    host_after = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    p = pool.get_pool("cuda")
    ok = st["pinned_bytes"] > 0 and st["pinned_bytes"] == p.bytes and host_after <= host_before
    ctx.report.add("pinned_slabs", "passed" if ok else "failed",
                   "" if ok else "slab bytes do not match, or torch's pinned allocator grew",
                   pinned_bytes=st["pinned_bytes"], torch_host_bytes=host_after)


def check_sync_debug(ctx: Ctx) -> None:
    runner, (idx, tgt) = ctx.state["fxckpt"], ctx.state["batch"]
    runner.step(idx, tgt)  # warm
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        runner.call(idx, tgt).backward()
        why = ""
    except RuntimeError as e:
        why = str(e).splitlines()[0][:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ctx.report.add("sync_debug", "failed" if why else "passed", why)


def check_profiler_overlap(ctx: Ctx) -> None:
    from torch.profiler import ProfilerActivity, profile

    from fxckpt.runtime import engine

    runner, batch = ctx.state["fxckpt"], ctx.state["batch"]
    runner.step(*batch)
    torch.cuda.synchronize()
    engine.configure(copy_delay_s=0.0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.step(*batch)
        torch.cuda.synchronize()
    verdict = v.copy_overlap(v.trace_events(prof))
    ctx.report.add("profiler_overlap", "passed" if verdict["ok"] else "failed",
                   "" if verdict["ok"] else "no side-stream copy overlapped a kernel", **verdict)


def check_stall_figures(ctx: Ctx) -> None:
    import time

    import fxckpt
    from fxckpt.runtime import engine

    runner, batch = ctx.state["fxckpt"], ctx.state["batch"]
    try:
        engine.configure(copy_delay_s=0.01)
        fxckpt.reset_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.step(*batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    finally:
        engine.configure()
    st = fxckpt.stats()
    stall, copy = float(st["stall_seconds"]), float(st["copy_seconds"])
    ok = 0 < stall <= wall and copy > 0
    ctx.report.add("stall_figures", "passed" if ok else "failed",
                   "" if ok else "stall_seconds is not a positive share of the step",
                   stall_s=stall, copy_s=copy, step_s=wall,
                   hidden_share=v.hidden_share(stall, copy))


def check_disk_tier(ctx: Ctx) -> None:
    import tempfile

    import fxckpt
    from fxckpt.runtime import disk, disk_dir, pool

    cfg, batch = ctx.state["cfg"], ctx.state["batch"]
    ref, floor, scale = ctx.state["ref"], ctx.state["floor"], ctx.state["scale"]
    pool.set_pool_cap(0)  # empty the pool: the next high-water mark is one step's need
    pool.set_pool_cap(None)
    fxckpt.reset_stats()
    _grads(ctx.state["fxckpt"], batch)
    need = int(fxckpt.stats()["host_high_water_bytes"])
    budget = need // 4
    where = tempfile.mkdtemp(prefix="fxckpt-gpu-check-")
    try:
        spec = fxckpt_spec("fxckpt_disk", "host_budget=need/4, offload_dir", offload="all",
                           min_offload_bytes=0, host_budget=budget, offload_dir=where)  # fmt: skip
        runner = _runner(ctx, spec, cfg, torch.float32)
        pool.set_pool_cap(0)
        pool.set_pool_cap(budget)
        fxckpt.reset_stats()
        ok, note = v.within_floor(v.grad_diffs(ref, _grads(runner, batch)), floor, scale)
        disk.wait_for_staging()
        st = fxckpt.stats()
        left = disk.current().files() if disk.current() is not None else []
    finally:
        disk.shutdown()
        disk_dir.close_all()
        pool.set_pool_cap(None)  # later checks' models were compiled without a host budget
    why = [] if ok else [f"gradients: {note}"]
    if st["host_high_water_bytes"] > budget:
        why.append(f"host high water {st['host_high_water_bytes']} > budget {budget}")
    if st["disk_bytes"] <= 0:
        why.append("nothing went to disk")
    if st["fallbacks"] or st["disk_fallbacks"]:
        why.append(f"fallbacks: {st['fallbacks']} host, {st['disk_fallbacks']} disk")
    if left:
        why.append(f"{len(left)} files left after the step")
    ctx.report.add("disk_tier", "failed" if why else "passed", "; ".join(why), need_bytes=need,
                   budget_bytes=budget, host_high_water_bytes=st["host_high_water_bytes"],
                   disk_bytes=st["disk_bytes"], disk_write_seconds=st["disk_write_seconds"],
                   disk_read_seconds=st["disk_read_seconds"], stall_seconds=st["stall_seconds"])


def check_memory_vs_simulator(ctx: Ctx) -> None:
    import fxckpt

    cfg = replace(QWEN3_1_7B, name="qwen3-memory", layers=4, vocab=32000)
    idx, tgt = make_batch(cfg, 1, 4096, ctx.device)
    measured: dict[str, dict[str, int]] = {}
    plans: dict[str, Any] = {}
    specs = [s for s in BASELINE_SPECS if s.name == "compiled"] + [
        fxckpt_spec("fxckpt_budget0.5", "memory_budget=0.5", memory_budget=0.5),
        fxckpt_spec("fxckpt_offload_all", 'offload="all"', offload="all")]
    for spec in specs:
        runner = _runner(ctx, spec, cfg, torch.bfloat16)
        runner.step(idx, tgt)  # compile and warm
        fxckpt.reset_stats()
        # fxckpt's meter: CUDA's memory_allocated / max_memory_allocated, peak reset at the
        # start; it never reads a plan.
        with fxckpt.Meter(ctx.device) as meter:
            loss = runner.call(idx, tgt)
            meter.set_output(loss)
        assert meter.result is not None
        measured[spec.name] = {
            "after_forward": meter.result.held_bytes,
            "forward_peak": meter.result.peak_bytes,
        }
        loss.backward()
        plans[spec.name] = fxckpt.last_plans()
        del runner, loss
    figures, failed = {}, []
    ref_peak = measured["compiled"]["forward_peak"]
    for name, got in measured.items():
        if name == "compiled":
            continue
        kept = sum(p.kept_bytes for p in plans[name])
        resident = v.memory_verdict(got["after_forward"], kept, reference=0)
        # Same graph, same kernels: the forward peak moves by what the plan moved.
        predicted = sum(p.resident_peak_bytes - p.baseline_saved_bytes for p in plans[name])
        peak = v.memory_verdict(got["forward_peak"] - ref_peak, predicted, reference=ref_peak)
        figures[name] = {"resident": resident, "peak_change": peak}
        failed += [f"{name} {k}: {x['relative_error']:.1%} off" for k, x in
                   (("resident", resident), ("peak", peak)) if not x["ok"]]  # fmt: skip
    ctx.report.add("memory_vs_simulator", "failed" if failed else "passed", "; ".join(failed),
                   **figures)


def check_cudagraphs(ctx: Ctx) -> None:
    from benchmarks.gpu_cudagraphs import run_cudagraph_checks

    failures = run_cudagraph_checks(ctx.device, ctx.compiler)
    ctx.report.add("cudagraphs", "failed" if failures else "passed", "; ".join(failures))


def check_bucket_overhead(ctx: Ctx) -> None:
    from benchmarks.bucket_overhead import measure

    rows = measure(ctx.device, ctx.compiler, rounds=3, steps=10)
    alone, bucketed = rows["alone"], rows["bucketed"]
    failed = [f"{key}: {bucketed[key]} with buckets, {alone[key]} without"
              for key in ("ops_per_step", "handoffs_per_step") if not bucketed[key] < alone[key]]
    figures = {name: {k: v for k, v in r.items() if not isinstance(v, list)}
               for name, r in rows.items()}  # fmt: skip
    ctx.report.add("bucket_overhead", "failed" if failed else "passed", "; ".join(failed),
                   **figures)


def check_table(ctx: Ctx) -> None:
    from benchmarks.cpu_bench import run_suite

    specs = [s for s in BASELINE_SPECS if s.name in TABLE_ROWS] + [
        fxckpt_spec("fxckpt_offload_all", 'offload="all"', offload="all")]
    big = replace(QWEN3_1_7B, layers=ctx.args.layers)
    rows: list[dict[str, Any]] = []
    failed, last_s = [], 0.0
    for seq in ctx.args.seqs:
        if not ctx.deadline.allows(1.5 * last_s):
            ctx.report.add(f"table_seq{seq}", "skipped",
                           f"{ctx.deadline.left():.0f} s left, the last length took {last_s:.0f} s")
            continue
        left = ctx.deadline.left()
        try:
            got = run_suite(big, batch=1, seq=seq, specs=specs, device=ctx.device,
                            dtype=torch.bfloat16, compiler=ctx.compiler, warmup=1,
                            repeats=ctx.args.repeats, tolerances={"rtol": 5e-2, "atol": 1e-2})
        except torch.OutOfMemoryError as e:
            failed.append(f"seq {seq}: out of memory: {str(e).splitlines()[0][:200]}")
            torch.cuda.empty_cache()
            continue
        last_s = left - ctx.deadline.left()
        rows += got
        failed += [f"seq {seq} {r['method']}: gradients {r['grads_note']}" for r in got
                   if not r.get("unavailable") and not r.get("grads_match")]
    ctx.report.add("table", "failed" if failed else "passed", "; ".join(failed),
                   rows=rows, versus=v.summarize(rows, ("full_checkpoint", "save_on_cpu")))

def check_conv_memory(ctx: Ctx) -> None:
    from benchmarks.conv_case import run as conv_case

    record = conv_case(ctx.device, ctx.compiler)
    ctx.report.add("conv_memory", record.pop("status"), record.pop("why"), **record)


# (name, needs CUDA, rough seconds on an H200, function)
CHECKS: tuple[tuple[str, bool, float, Callable[[Ctx], None]], ...] = (
    ("copy_streams", True, 2, check_copy_streams),
    ("bandwidth", True, 5, check_bandwidth),
    ("gradients", False, 60, check_gradients),
    ("race_detector", False, 20, check_race_detector),
    ("pinned_slabs", True, 5, check_pinned_slabs),
    ("sync_debug", True, 5, check_sync_debug),
    ("profiler_overlap", True, 10, check_profiler_overlap),
    ("stall_figures", True, 5, check_stall_figures),
    ("disk_tier", False, 30, check_disk_tier),
    ("memory_vs_simulator", True, 90, check_memory_vs_simulator),
    ("conv_memory", True, 60, check_conv_memory),
    ("cudagraphs", True, 60, check_cudagraphs),
    ("bucket_overhead", False, 30, check_bucket_overhead),
    ("table", True, 120, check_table),
)
NEEDS_STATE = {"race_detector", "pinned_slabs", "sync_debug", "profiler_overlap",
               "stall_figures", "disk_tier"}


def run_checks(ctx: Ctx, only: Sequence[str] = ()) -> None:
    for name, needs_cuda, estimate, fn in CHECKS:
        if only and name not in only:
            continue
        if needs_cuda and not ctx.cuda:
            ctx.report.add(name, "skipped", "needs CUDA")
        elif name in NEEDS_STATE and "fxckpt" not in ctx.state:
            ctx.report.add(name, "skipped", "needs the gradients check's compiled model")
        elif not ctx.deadline.allows(estimate):
            ctx.report.add(name, "skipped", f"deadline: {ctx.deadline.left():.0f} s left, "
                           f"about {estimate:.0f} s needed")
        else:
            try:
                fn(ctx)
            except Exception as e:  # a crash is a failed check, and the others still run
                ctx.report.add(name, "failed", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py",
                                description="GPU checks of fxckpt (see docs/benchmarks.md); "
                                "exits 1 if any check fails.")
    p.add_argument("--json", metavar="PATH", default="gpu_check.json")
    p.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--layers", type=int, default=8, help="layers of Qwen3-1.7B's 28 in the table")
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--deadline-s", type=float, default=450.0,
                   help="start no check whose rough cost would end past this many seconds")
    p.add_argument("--only", nargs="*", default=[], choices=[c[0] for c in CHECKS],
                   help="run these checks only")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print(f"gpu_check: CUDA is not available (torch {torch.__version__}); running the "
              "checks that need no GPU on the CPU, skipping the rest")
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 1 << 16
    command = "PYTHONPATH=. python benchmarks/gpu_check.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    ctx = Ctx(device, args.compiler, args, v.Report(), v.Deadline(args.deadline_s), {})
    run_checks(ctx, args.only)
    doc = {
        "command": command,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "compiler": args.compiler,
        "wall_s": round(args.deadline_s - ctx.deadline.left(), 1),
        "checks": ctx.report.checks,
        "failures": ctx.report.failures(),
        "skipped": ctx.report.skipped(),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    failures = ctx.report.failures()
    print(f"\nwrote {args.json}; {doc['wall_s']} s; {len(ctx.report.checks)} checks, "
          f"{len(failures)} failed, {len(ctx.report.skipped())} skipped"
          + ("" if not failures else "\nFAILED: " + "; ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
