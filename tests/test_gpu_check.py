"""benchmarks/gpu_check.py: every verdict it can reach, on the CPU, and its run without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_check
from benchmarks import gpu_verdicts as v


def test_noise_floor_is_the_largest_measured_difference_per_parameter():
    f64 = {"dtype": torch.float64}
    ref = {"w": torch.tensor([1.0, 2.0], **f64), "b": torch.tensor([0.5], **f64)}
    again = {"w": torch.tensor([1.0, 2.0 + 1e-6], **f64), "b": torch.tensor([0.5], **f64)}
    compiled = {"w": torch.tensor([1.0 + 3e-6, 2.0], **f64), "b": torch.tensor([0.5 + 1e-7], **f64)}
    floor = v.noise_floor(v.grad_diffs(ref, again), v.grad_diffs(ref, compiled))
    assert floor["w"] == pytest.approx(3e-6, rel=1e-3)
    assert floor["b"] == pytest.approx(1e-7, rel=1e-2)


def test_a_gradient_is_judged_against_the_floor_and_a_race_is_not_within_it():
    ref = {"w": torch.ones(100)}
    floor, scale = {"w": 1e-6}, v.grad_scale(ref)
    close = {"w": torch.ones(100) + 3e-6}
    raced = {"w": torch.ones(100)}
    raced["w"][7] = 0.0  # a restore that read a buffer before its copy landed
    ok, _ = v.within_floor(v.grad_diffs(ref, close), floor, scale)
    assert ok
    ok, note = v.within_floor(v.grad_diffs(ref, raced), floor, scale)
    assert not ok and "w" in note
    poisoned = {"w": torch.full((100,), float("nan"))}
    assert not v.within_floor(v.grad_diffs(ref, poisoned), floor, scale)[0]
    assert not v.within_floor(v.grad_diffs(ref, {}), floor, scale)[0]


def test_memory_verdict_allows_five_percent_of_the_reference():
    assert v.memory_verdict(104, 100, reference=100, floor=0)["ok"]
    assert not v.memory_verdict(106, 100, reference=100, floor=0)["ok"]
    assert v.memory_verdict(0, 0, reference=0)["ok"]
    assert not v.memory_verdict(50, 0, reference=0, floor=0)["ok"]  # an unplanned fallback


def test_copy_overlap_needs_copies_on_a_side_stream_running_under_kernels():
    k = [v.TraceEvent("gemm", 7, 0, 100), v.TraceEvent("gemm", 7, 100, 200)]
    hidden = v.copy_overlap(k + [v.TraceEvent("Memcpy DtoH (Device -> Pinned)", 20, 50, 150)])
    assert hidden["ok"] and hidden["overlap_share"] == 1.0
    half = v.copy_overlap(k + [v.TraceEvent("Memcpy HtoD", 20, 150, 250)])
    assert half["overlap_share"] == pytest.approx(0.5)
    serial = v.copy_overlap(k + [v.TraceEvent("Memcpy DtoH", 20, 300, 400)])
    assert not serial["ok"]
    on_compute = v.copy_overlap(k + [v.TraceEvent("Memcpy DtoH", 7, 50, 60)])
    assert not on_compute["ok"] and on_compute["side_stream_copies"] == 0


def test_summary_puts_fxckpt_against_each_baseline_of_the_same_length():
    rows = [
        {"seq": 8, "method": "full_checkpoint", "peak_bytes": 200, "step_ms": 10.0},
        {"seq": 8, "method": "save_on_cpu", "peak_bytes": 100, "step_ms": 20.0},
        {"seq": 8, "method": "fxckpt_offload_all", "peak_bytes": 100, "step_ms": 12.0,
         "stall_s_per_step": 0.002},
        {"seq": 16, "method": "full_checkpoint", "unavailable": "OOM"},
    ]
    got = v.summarize(rows, ("full_checkpoint", "save_on_cpu"))
    assert [(r["baseline"], r["peak_ratio"], r["step_time_ratio"]) for r in got] == [
        ("full_checkpoint", 0.5, 1.2), ("save_on_cpu", 1.0, 0.6)]
    assert got[0]["exposed_copy_ms"] == pytest.approx(2.0)
    assert v.hidden_share(0.002, 0.010) == pytest.approx(0.8)
    assert v.hidden_share(0.0, 0.0) is None


def test_deadline_skips_what_does_not_fit():
    d = v.Deadline(10.0)
    assert d.allows(5.0) and not d.allows(60.0)


@pytest.mark.heavy
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs every check")
def test_without_cuda_it_runs_the_cpu_checks_skips_the_rest_and_writes_one_json(tmp_path, capsys):
    from benchmarks.goals import GOAL_KEYS

    code = gpu_check.main(["--out", str(tmp_path / "out"), "--compiler", "eager"])
    assert "CUDA is not available" in capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    status = {c["check"]: c["status"] for c in doc["checks"]}
    assert status["preflight"] == "passed", doc["failures"]
    assert status["gradients"] == status["race_detector"] == "passed", doc["failures"]
    assert status["bucket_overhead"] == status["disk_tier"] == "passed", doc["failures"]
    buckets = next(c for c in doc["checks"] if c["check"] == "bucket_overhead")
    assert 0 < buckets["bucketed"]["handoffs_per_step"] < buckets["alone"]["handoffs_per_step"]
    assert code == 0
    needs_cuda = [k.name for k in gpu_check.CHECKS if k.needs_cuda]
    assert all(status[n] == "skipped" for n in needs_cuda)
    race = next(c for c in doc["checks"] if c["check"] == "race_detector")
    assert race["mutant_caught"] is True
    assert doc["running"] is None and (tmp_path / "out" / "faulthandler.log").exists()
    # The five goals, each with a threshold and a verdict that says why it was not measured.
    assert list(doc["goals"]) == list(GOAL_KEYS)
    for g in doc["goals"].values():
        assert isinstance(g["threshold"], float)
        assert g["verdict"].startswith("skipped: needs CUDA")
    ran = [c for c in doc["checks"] if c["status"] != "skipped"]
    assert all(isinstance(c["wall_s"], float) and c["estimate_s"] > 0 for c in ran)


def _ctx(tmp_path, deadline_s=60.0):
    import argparse

    from benchmarks.gpu_harness import Ctx

    return Ctx(torch.device("cpu"), "eager", argparse.Namespace(), v.Report(),
               v.Deadline(deadline_s), tmp_path)


def test_the_deadline_stops_a_running_check_keeps_its_figures_and_writes_the_file(tmp_path):
    import time

    from benchmarks.gpu_harness import Check, run_all

    seen = []

    def first(ctx):
        seen.append(json.loads((tmp_path / "gpu_check.json").read_text())["running"])
        ctx.report.add("first", "passed")

    def endless(ctx):
        for i in range(10_000):
            ctx.partial["steps"] = i  # what it measured so far
            time.sleep(0.01)
        ctx.report.add("endless", "passed")

    def never(ctx):
        raise AssertionError("started after the deadline")

    ctx = _ctx(tmp_path, deadline_s=1.5)
    start = time.perf_counter()
    run_all(ctx, [Check("first", False, 0, first), Check("endless", False, 0, endless),
                  Check("never", False, 0, never)], [])
    assert time.perf_counter() - start < 10
    assert seen == ["first"]  # the file names the running check before it runs
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    by = {c["check"]: c for c in doc["checks"]}
    assert by["first"]["status"] == "passed"
    assert by["endless"]["status"] == "skipped" and "stopped while running" in by["endless"]["why"]
    assert by["endless"]["partial"]["steps"] > 10
    assert by["never"]["why"] == "deadline: not started"
    assert doc["running"] is None


def test_a_crash_fails_its_check_with_the_traceback_and_the_rest_still_run(tmp_path):
    from benchmarks.gpu_harness import Check, run_all

    def crash(ctx):
        ctx.partial["got"] = 1
        raise RuntimeError("CUDA error: an illegal memory access")

    ctx = _ctx(tmp_path)
    run_all(ctx, [Check("crash", False, 0, crash),
                  Check("after", False, 0, lambda ctx: ctx.report.add("after", "passed"))], [])
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    crash_rec, after = doc["checks"]
    assert crash_rec["status"] == "failed" and "illegal memory access" in crash_rec["why"]
    assert "RuntimeError" in crash_rec["traceback"] and crash_rec["partial"] == {"got": 1}
    assert after["status"] == "passed"


def test_estimates_come_from_an_earlier_run_or_the_measured_compile_scaled_by_the_run(tmp_path):
    from benchmarks.gpu_harness import Check, load_estimates

    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"checks": [
        {"check": "gradients", "status": "passed", "wall_s": 73.0},
        {"check": "table", "status": "skipped", "why": "deadline"}]}))
    ctx = _ctx(tmp_path)
    ctx.previous = load_estimates(str(earlier))
    noop = lambda ctx: None  # noqa: E731
    assert ctx.estimate(Check("gradients", False, 4, noop)) == 73.0
    ctx.compile_s = 5.0
    assert ctx.estimate(Check("table", False, 12, noop)) == 60.0
    ctx.ratios += [2.0, 2.0, 1.0]  # the checks so far took twice their estimates
    assert ctx.estimate(Check("table", False, 12, noop)) == 120.0


def test_memory_verdict_has_an_absolute_floor_for_plans_that_keep_almost_nothing():
    # offload="all" keeps ~0 bytes; the allocator's rounding alone is thousands of bytes.
    assert v.memory_verdict(8_192, 0, reference=0)["ok"]
    assert not v.memory_verdict(v.MEMORY_FLOOR_BYTES + 1, 0, reference=0)["ok"]
    assert not v.memory_verdict(200 * 2**20, 100 * 2**20, reference=100 * 2**20)["ok"]


def test_bf16_gradients_are_judged_relative_to_their_own_magnitude():
    from benchmarks.methods import grads_match

    ref = {"w": torch.full((64,), 1e-3)}
    close = {"w": ref["w"] * 1.01}
    raced = {"w": ref["w"].clone()}
    raced["w"][3] = 0.0  # a restore that read a stale buffer: off by the gradient itself
    assert grads_match(ref, close, scale_rtol=5e-2)[0]
    assert not grads_match(ref, raced, scale_rtol=5e-2)[0]
    assert grads_match(ref, raced, rtol=5e-2, atol=1e-2)[0]  # the old tolerance was blind


def test_plot_writes_each_verdict_and_the_comparison_into_the_docs_block():
    from benchmarks.plot import DOC, docs_block

    doc = {"command": "gpu_check", "gpu": "H200", "torch": "2.11", "wall_s": 400.0, "checks": [
        {"check": "sync_debug", "status": "failed", "why": "synchronizing call"},
        {"check": "table", "status": "passed", "why": "", "rows": [], "versus": [
            {"seq": 8192, "method": "fxckpt_offload_all", "baseline": "full_checkpoint",
             "peak_ratio": 0.8, "step_time_ratio": 0.9, "exposed_copy_ms": 1.5}]}]}
    block = docs_block(doc, DOC.parent / "benchmarks" / "gpu_check.png")  # not written
    assert "| sync_debug | failed | synchronizing call |" in block
    assert "| 8192 | fxckpt_offload_all | full_checkpoint | 0.80 | 0.90 | 1.5 |" in block
    assert "H200" in block


def test_the_goals_start_whatever_their_estimate_and_a_check_without_work_calibrates_nothing(
        tmp_path):
    from benchmarks.gpu_harness import Check, run_all

    ran = []
    ctx = _ctx(tmp_path, deadline_s=30.0)
    ctx.compile_s = 100.0  # every estimate is far past the deadline
    run_all(ctx, [Check("goals", False, 16, lambda ctx: ran.append("goals"), cpu_compiles=0,
                        always_start=True),
                  Check("late", False, 1, lambda ctx: ran.append("late"))], [])
    assert ran == ["goals"] and ctx.ratios == []  # no CPU work: no measured ratio
    late = next(c for c in ctx.report.checks if c["check"] == "late")
    assert late["status"] == "skipped" and late["why"].startswith("deadline")
