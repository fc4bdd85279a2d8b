"""The checks ``gpu_check.py`` runs after the pre-flight and the goals, one function each.

Each takes the run's :class:`benchmarks.gpu_harness.Ctx`, records its verdict with
``ctx.report.add`` and puts what it measured so far in ``ctx.partial``, which the record keeps
when the deadline stops the check. The judgements are :mod:`benchmarks.gpu_verdicts`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from benchmarks import gpu_verdicts as v
from benchmarks.gpu_harness import Ctx
from benchmarks.methods import (
    BASELINE_SPECS,
    QWEN3_1_7B,
    Decoder,
    MethodSpec,
    build_runner,
    fxckpt_spec,
    grads_of,
    make_batch,
)

TABLE_ROWS = ("eager", "full_checkpoint", "save_on_cpu")
GRAD_SCALE_RTOL = 5e-2  # bf16 rows: each gradient within 5 % of its own largest magnitude


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
    pinned = sum(p.bytes for p in pool.pools() if p.pinned)
    ok = st["pinned_bytes"] > 0 and st["pinned_bytes"] == pinned and host_after <= host_before
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
    from fxckpt.backend import runtime_profile
    from fxckpt.runtime import disk, disk_dir, pool

    cfg, batch = ctx.state["cfg"], ctx.state["batch"]
    ref, floor, scale = ctx.state["ref"], ctx.state["floor"], ctx.state["scale"]
    pool.trim_all()  # empty the pools: the next high-water mark is one step's need
    fxckpt.reset_stats()
    _grads(ctx.state["fxckpt"], batch)
    need = int(fxckpt.stats()["host_high_water_bytes"])
    # A quarter of it, but never below what the disk tier's staging alone takes: staging
    # slots of the largest offloaded tensor (the planner and the pool count the same).
    from fxckpt.runtime.pool import size_class
    from fxckpt.runtime.staging import STAGING_SLOTS, staged_bytes

    largest = max((a.bytes for p in fxckpt.last_plans() for a in p.activations
                   if a.decision.kind == "offload"), default=0)  # fmt: skip
    staging = STAGING_SLOTS * size_class(staged_bytes(largest)) if largest else 0
    budget = max(need // 4, staging + size_class(largest))
    ctx.partial.update(need_bytes=need, budget_bytes=budget, staging_bytes=staging)
    where = tempfile.mkdtemp(prefix="fxckpt-gpu-check-")
    try:
        spec = fxckpt_spec("fxckpt_disk", "host_budget=need/4, offload_dir", offload="all",
                           min_offload_bytes=0, host_budget=budget, offload_dir=where)  # fmt: skip
        runner = _runner(ctx, spec, cfg, torch.float32)
        pool.trim_all()  # its compile capped its own pool at the budget
        fxckpt.reset_stats()
        ok, note = v.within_floor(v.grad_diffs(ref, _grads(runner, batch)), floor, scale)
        disk.wait_for_staging()
        st = fxckpt.stats()
        profile = runtime_profile(fxckpt.Options(host_budget=budget, offload_dir=where))
        left = profile.disk.files() if profile is not None and profile.disk is not None else []
    finally:
        disk.shutdown()
        disk_dir.close_all()
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
                   budget_bytes=budget, staging_bytes=staging,
                   host_high_water_bytes=st["host_high_water_bytes"],
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
        runner.step(idx, tgt)  # compile and warm; leaves the gradients allocated
        fxckpt.reset_stats()
        # fxckpt's meter: CUDA's memory_allocated / max_memory_allocated, peak reset at the
        # start; it never reads a plan. Once around the forward, once around a whole step
        # whose gradients are already allocated.
        with fxckpt.Meter(ctx.device) as meter:
            loss = runner.call(idx, tgt)
            meter.set_output(loss)
        loss.backward()
        with fxckpt.Meter(ctx.device) as step_meter:
            runner.call(idx, tgt).backward()
        assert meter.result is not None and step_meter.result is not None
        measured[spec.name] = {
            "after_forward": meter.result.held_bytes,
            "forward_peak": meter.result.peak_bytes,
            "step_peak": step_meter.result.peak_bytes,
        }
        plans[spec.name] = fxckpt.last_plans()
        ctx.partial[spec.name] = measured[spec.name]
        del runner, loss
    figures, failed = {}, []
    ref = measured["compiled"]
    for name, got in measured.items():
        if name == "compiled":
            continue
        kept = sum(p.kept_bytes for p in plans[name])
        resident = v.memory_verdict(got["after_forward"], kept, reference=0)
        # Same graph, same kernels: a peak moves by what the plan moved.
        predicted = sum(p.resident_peak_bytes - p.baseline_saved_bytes for p in plans[name])
        peak = v.memory_verdict(got["forward_peak"] - ref["forward_peak"], predicted,
                                reference=ref["forward_peak"])
        step = v.memory_verdict(got["step_peak"] - ref["step_peak"], predicted,
                                reference=ref["step_peak"])
        figures[name] = {"resident": resident, "forward_peak_change": peak,
                         "step_peak_change": step}
        failed += [f"{name} {k}: {x['relative_error']:.1%} off" for k, x in figures[name].items()
                   if not x["ok"]]  # fmt: skip
    ctx.report.add("memory_vs_simulator", "failed" if failed else "passed", "; ".join(failed),
                   **figures)


def check_cudagraphs(ctx: Ctx) -> None:
    from benchmarks.gpu_cudagraphs import run_cudagraph_checks

    failures, figures = run_cudagraph_checks(ctx.device, ctx.compiler)
    ctx.report.add("cudagraphs", "failed" if failures else "passed", "; ".join(failures),
                   **figures)


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
    ctx.partial["rows"] = rows
    failed, last_s = [], 0.0
    for seq in ctx.args.seqs:
        if not ctx.deadline.allows(1.5 * last_s):
            failed_or_skipped = f"{ctx.deadline.left():.0f} s left, the last length took {last_s:.0f} s"
            ctx.report.add(f"table_seq{seq}", "skipped", failed_or_skipped)
            continue
        left = ctx.deadline.left()
        try:
            got = run_suite(big, batch=1, seq=seq, specs=specs, device=ctx.device,
                            dtype=torch.bfloat16, compiler=ctx.compiler, warmup=1,
                            repeats=ctx.args.repeats, tolerances={"scale_rtol": GRAD_SCALE_RTOL})
        except torch.OutOfMemoryError as e:
            failed.append(f"seq {seq}: out of memory: {str(e).splitlines()[0][:200]}")
            torch.cuda.empty_cache()
            continue
        last_s = left - ctx.deadline.left()
        rows += got
        for r in got:
            if r.get("unavailable"):
                if r["method"].startswith("fxckpt"):  # fxckpt itself broke: that fails
                    failed.append(f"seq {seq} {r['method']}: unavailable: {r['unavailable']}")
            elif not r.get("grads_match"):
                failed.append(f"seq {seq} {r['method']}: gradients {r['grads_note']}")
    ctx.report.add("table", "failed" if failed else "passed", "; ".join(failed),
                   rows=rows, versus=v.summarize(rows, ("full_checkpoint", "save_on_cpu")))
