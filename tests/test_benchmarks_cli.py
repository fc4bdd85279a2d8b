"""The benchmark scripts run end to end at their smallest size (``--smoke``, or the smallest
values of their own flags), and what they print and write has the shape a reader expects: the
method rows and columns, the JSON keys, ratios that are finite and positive, byte counts that
are non-negative integers, clear errors for names they do not know. Never a timing: speed and
memory are measured in benchmarks/, never asserted in tests. The GPU-only scripts answer
``--help`` here (``tests/test_gpu_check.py`` runs gpu_check's CPU checks)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


@contextlib.contextmanager
def _process_settings_kept() -> Iterator[None]:
    """The scripts set process-wide knobs, as a benchmark process should (torch's threads,
    dynamo's recompile limits, Inductor's caches); put them back for the tests after them."""
    from torch._dynamo import config as dynamo
    from torch._functorch import config as functorch
    from torch._inductor import config as inductor

    threads = torch.get_num_threads()
    limits = dynamo.recompile_limit, dynamo.accumulated_recompile_limit
    caches = inductor.fx_graph_cache, functorch.enable_autograd_cache
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        dynamo.recompile_limit, dynamo.accumulated_recompile_limit = limits
        inductor.fx_graph_cache, functorch.enable_autograd_cache = caches


@pytest.fixture(autouse=True)
def _kept_settings() -> Iterator[None]:
    with _process_settings_kept():
        yield


def _main(name: str, *argv: str) -> int:
    return importlib.import_module(f"benchmarks.{name}").main(list(argv))


def _table(out: str, head: str) -> list[list[str]]:
    """The rows of the markdown table whose header starts with ``head``, as cells."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(head))
    assert set(lines[start + 1]) <= {"|", "-"}, "a header without its separator line"
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _bytes(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


# --------------------------------------------------------------------------------------------
# GPU-only scripts: --help, and what they say without CUDA
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpu_check", "gpu_cudagraphs"])
def test_gpu_script_imports_and_answers_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _main(name, "--help")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    assert {"gpu_check": "--out", "gpu_cudagraphs": "--json"}[name] in out


def test_the_cuda_graph_script_without_cuda_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _main("gpu_cudagraphs") == 2
    assert "gpu_cudagraphs: no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["cpu_bench", "planner_scaling", "dynamic_budget", "cpu_goal",
                                  "gpu_shaped"])
def test_a_smoke_run_never_rewrites_the_docs(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _main(name, "--smoke", "--docs")
    assert exit_info.value.code == 2
    assert "--smoke's figures mean nothing: not for --docs" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# cpu_bench and plot
# --------------------------------------------------------------------------------------------

CPU_BENCH_ROWS = ["eager", "full_checkpoint", "fxckpt_at_full_ckpt", "fxckpt_offload_all"]


@pytest.fixture(scope="module")
def cpu_bench_run(tmp_path_factory) -> tuple[str, dict[str, Any], Path]:
    """One --smoke run of cpu_bench (two fxckpt rows; eager and full_checkpoint come with
    them), shared by its test and plot's: what it printed, the JSON it wrote, the JSON's path."""
    path = tmp_path_factory.mktemp("cpu_bench") / "cpu_smoke.json"
    out = io.StringIO()
    with _process_settings_kept(), contextlib.redirect_stdout(out):
        code = _main("cpu_bench", "--smoke", "--min-offload-bytes", "0", "--methods",
                     "fxckpt_at_full_ckpt", "fxckpt_offload_all", "--json", str(path))
    assert code == 0
    return out.getvalue(), json.loads(path.read_text()), path


def test_cpu_bench_smoke_prints_every_row_and_writes_the_json(cpu_bench_run):
    out, doc, path = cpu_bench_run
    assert {"command", "machine", "model", "batch", "seqs", "repeats", "warmup", "compiler",
            "rows"} <= set(doc)
    assert doc["model"]["name"] == "gpt-smoke" and doc["seqs"] == [32] and doc["repeats"] == 2
    assert "torch" in doc["machine"] and "cores" in doc["machine"]
    # --methods keeps eager (every ratio's baseline) and full_checkpoint (the budget's source).
    rows = doc["rows"]
    assert [r["method"] for r in rows] == CPU_BENCH_ROWS
    table = _table(out, "| seq | method | compiler | resident after fwd MiB |")
    assert [(cells[0], cells[1]) for cells in table] == [("32", m) for m in CPU_BENCH_ROWS]
    assert all(len(cells) == 11 for cells in table)
    assert f"wrote {path}" in out
    by = {r["method"]: r for r in rows}
    for r in rows:
        assert r["unavailable"] is None, r["unavailable"]
        assert r["grads_match"] is True, r["grads_note"]
        for key in ("measured_resident_bytes", "forward_peak_bytes", "peak_bytes",
                    "host_saved_bytes", "start_bytes", "absolute_peak_bytes"):
            assert _bytes(r[key]), (r["method"], key, r[key])
        # The absolute step peak counts what the device held at the step's start: the model
        # and the batch.
        assert r["start_bytes"] > 0
        assert r["absolute_peak_bytes"] == r["start_bytes"] + r["peak_bytes"]
        assert len(r["step_s"]) == len(r["cpu_s"]) == len(r["step_ratios"]) == 2
        for key in ("step_ms", "step_time_ratio", "cpu_time_ratio", "step_ratio_min",
                    "step_ratio_max"):
            assert _positive(r[key]), (r["method"], key, r[key])
        assert r["step_ratio_min"] <= r["step_ratio_max"]
        # No plain torch.compile row ran: there is no compile time to compare with.
        assert r["compile_time_ratio"] is None
    assert by["eager"]["step_time_ratio"] == 1.0 and by["eager"]["step_ratios"] == [1.0, 1.0]
    # full_checkpoint's measured absolute step peak became fxckpt_at_full_ckpt's budget: above
    # what its step started with (the model and the batch).
    budget = by["full_checkpoint"]["budget_source_bytes"]
    assert _positive(budget) and by["fxckpt_at_full_ckpt"]["options"]["memory_budget"] == budget
    assert by["full_checkpoint"]["start_bytes"] < budget
    assert by["fxckpt_at_full_ckpt"]["plan_budget_bytes"] == [budget]
    offload_all = by["fxckpt_offload_all"]
    assert offload_all["plan_decisions"].get("offload", 0) > 0
    assert offload_all["host_saved_bytes"] > 0


def test_cpu_bench_names_an_unknown_method_before_running_anything():
    with pytest.raises(SystemExit, match=r"--methods fxckpt_nope: not a method here; choose "
                                         r"from .*fxckpt_offload_all"):
        _main("cpu_bench", "--smoke", "--methods", "fxckpt_nope", "compiled")


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_plot_draws_cpu_bench_json(cpu_bench_run, tmp_path, capsys):
    png = tmp_path / "smoke.png"
    assert _main("plot", str(cpu_bench_run[2]), "--out", str(png), "--no-doc") == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in capsys.readouterr().out


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    assert _main("plot", str(tmp_path / "never_read.json"), "--no-doc") == 1
    assert "needs matplotlib: pip install matplotlib" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# cpu_goal
# --------------------------------------------------------------------------------------------


def test_cpu_goal_names_an_unknown_method_before_running_anything():
    from benchmarks import cpu_goal

    with pytest.raises(SystemExit, match=r"--only fxckpt_nope: not a method here; choose from .*fxckpt_plan"):
        cpu_goal.main(["--only", "fxckpt_nope", "fxckpt_plan", "--strides"])


def test_cpu_goal_smoke_judges_the_plan_at_full_checkpointing_bytes(tmp_path, capsys):
    path = tmp_path / "cpu_goal.json"
    assert _main("cpu_goal", "--smoke", "--only", "fxckpt_plan", "fxckpt_offload_all",
                 "--json", str(path)) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert {"command", "machine", "model", "batch", "seq", "repeats", "strides", "summary",
            "rows"} <= set(doc)
    assert doc["model"]["name"] == "gpt-smoke" and doc["repeats"] == 2
    names = ["eager", "full_checkpoint", "fxckpt_plan", "fxckpt_offload_all"]
    assert [r["method"] for r in doc["rows"]] == names
    table = _table(out, "| method | step peak MiB | meets budget |")
    assert [cells[0] for cells in table] == names and all(len(c) == 10 for c in table)
    by = {r["method"]: r for r in doc["rows"]}
    s = doc["summary"]
    # The budget: full_checkpoint's absolute step peak, above what its step started with.
    assert s["budget_bytes"] == by["full_checkpoint"]["budget_source_bytes"]
    assert 0 < by["full_checkpoint"]["start_bytes"] < s["budget_bytes"]
    assert by["fxckpt_plan"]["options"]["memory_budget"] == s["budget_bytes"]
    for r in doc["rows"]:
        assert r["grads_match"] is True, r["grads_note"]
        assert _bytes(r["measured_resident_bytes"]) and _positive(r["step_time_ratio"])
        assert _bytes(r["absolute_peak_bytes"])
        assert r["meets_budget"] == (r["absolute_peak_bytes"] <= s["budget_bytes"])
        assert [c[2] for c in table if c[0] == r["method"]] == ["yes" if r["meets_budget"] else "no"]
    assert _positive(s["plan_vs_eager"]) and _positive(s["plan_vs_offload_all"])
    lo, hi = s["plan_vs_offload_all_min_max"]
    assert 0 < lo <= s["plan_vs_offload_all"] <= hi
    assert s["plan_meets_budget"] == by["fxckpt_plan"]["meets_budget"]
    assert s["goal_vs_eager_met"] == (s["plan_vs_eager"] <= 1.05)
    assert s["goal_vs_offload_all_met"] == (s["plan_vs_offload_all"] <= 1.0)
    if "fastest_meeting" in s:
        assert by[s["fastest_meeting"]]["meets_budget"]
    assert "Goal: `fxckpt_plan`" in out


# --------------------------------------------------------------------------------------------
# gpu_shaped
# --------------------------------------------------------------------------------------------


def test_gpu_shaped_names_an_unknown_row_before_running_anything():
    with pytest.raises(SystemExit, match=r"--only fxckpt_nope: not a row here; choose from "
                                         r".*fxckpt_fits"):
        _main("gpu_shaped", "--smoke", "--only", "fxckpt_nope")


@pytest.mark.heavy
def test_gpu_shaped_smoke_writes_rows_link_and_the_five_goals(tmp_path, capsys):
    from benchmarks.goals import GOAL_KEYS, MET, NOT_MET

    path = tmp_path / "gpu_shaped.json"
    assert _main("gpu_shaped", "--smoke", "--only", "fxckpt_fits", "--json", str(path)) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert {"command", "machine", "model", "batch", "seq", "repeats", "pairs", "link", "goals",
            "extras", "rows"} <= set(doc)
    assert doc["model"]["name"] == "qwen3-shaped-smoke" and doc["pairs"] == 1
    # --only keeps the baseline, the budgets' sources and the goals' references.
    names = ["eager", "full_checkpoint", "save_on_cpu", "compiled", "fxckpt_fits"]
    assert [r["method"] for r in doc["rows"]] == names
    table = _table(out, "| method | held after fwd MiB | step peak MiB (predicted) |")
    assert [cells[0] for cells in table] == names and all(len(c) == 9 for c in table)
    for r in doc["rows"]:
        assert r["unavailable"] is None, r["unavailable"]
        assert r["grads_match"] is True, r["grads_note"]
        assert _bytes(r["measured_resident_bytes"]) and _bytes(r["peak_bytes"])
        assert _positive(r["step_time_ratio"])
        assert all(_positive(x) for x in r["link_scales"])
    link = doc["link"]
    assert link["target"] == "h200-pcie5"
    for key in ("bandwidth", "target_ratio", "forward_ms", "compute_scale"):
        assert _positive(link[key]), (key, link[key])
    assert 0 < link["scales"]["min"] <= link["scales"]["median"] <= link["scales"]["max"]
    fits = doc["rows"][-1]
    assert fits["plan"]["graphs"] >= 1 and _bytes(fits["plan"]["resident_peak_bytes"])
    assert len(fits["pairs"]["compiled"]) == 1  # its goal's pair, run back to back once
    assert set(doc["goals"]) == set(GOAL_KEYS)
    goal_table = _table(out, "| goal | figure | threshold | verdict | from |")
    assert [cells[0] for cells in goal_table] == [f"`{k}`" for k in doc["goals"]]
    for key, g in doc["goals"].items():
        assert g["label"] == "emulated"
        assert g["verdict"] in (MET, NOT_MET) or g["verdict"].startswith("skipped: "), g
        if g["verdict"] == MET:  # a goal is met only by a figure on the right side
            assert (g["figure"] <= g["threshold"]) if g["better"] == "lower" else (
                g["figure"] >= g["threshold"]), (key, g)


# --------------------------------------------------------------------------------------------
# planner_scaling
# --------------------------------------------------------------------------------------------


def test_planner_scaling_smoke_plans_a_real_graph_and_compares_the_solvers(tmp_path, capsys):
    path = tmp_path / "planner.json"
    assert _main("planner_scaling", "--smoke", "--json", str(path)) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    # --smoke leaves out the compile-time share (part 3).
    assert set(doc) == {"command", "machine", "real_graphs", "greedy_vs_milp", "greedy_big"}
    assert "3. Compile time" not in out
    (real,) = doc["real_graphs"]
    assert real["layers"] == 2 and real["candidates"] > 0 and real["positions"] > 0
    assert real["solver_calls"] >= 1 and _bytes(real["plan_resident_peak_bytes"])
    assert _table(out, "| layers | candidates |")[0][:3] == [
        "2", str(real["candidates"]), str(real["positions"])]
    labels = ["2-layer decoder", "2-layer decoder, link 50x slower", "synthetic n=50",
              "synthetic n=50, copies never queue"]
    rows = doc["greedy_vs_milp"]
    assert [r["problem"] for r in rows] == labels
    assert [cells[0] for cells in _table(out, "| problem | candidates | budget |")] == labels
    for r in rows:
        assert r["budget_fraction"] == 0.5 and _bytes(r["budget_bytes"])
        assert r["greedy_feasible"] == (r["greedy_peak"] <= r["budget_bytes"])
        if r["milp_finished"]:
            assert r["milp_feasible"] == (r["milp_peak"] <= r["budget_bytes"])
        assert r["gap"] is None or math.isfinite(r["gap"])
    # Where copies never queue the MILP is exact: the greedy never beats it.
    exact = rows[-1]
    if exact["milp_finished"] and exact["milp_feasible"]:
        assert exact["greedy_cost_ms"] >= exact["milp_cost_ms"] * (1 - 1e-3) - 1e-9
    big = doc["greedy_big"]
    assert big["candidates"] == 200 and big["positions"] == 400
    assert isinstance(big["feasible"], bool)
    assert "4. Greedy, synthetic 200 candidates x 400 positions" in out


# --------------------------------------------------------------------------------------------
# dynamic_budget, meter_cost, host_budget, bucket_overhead
# --------------------------------------------------------------------------------------------


@pytest.mark.slow  # 14-19 s on 2 cores: five compiles under dynamic shapes
def test_dynamic_budget_smoke_reuses_the_plan_made_for_the_max(tmp_path, capsys):
    path = tmp_path / "dynamic.json"
    assert _main("dynamic_budget", "--smoke", "--json", str(path)) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert set(doc) == {"command", "facts", "rows"}
    budget = doc["facts"]["budget_bytes"]
    assert budget == 1792 * 1024  # the smoke's memory_budget: an absolute step peak
    rows = doc["rows"]
    assert [r["seq"] for r in rows] == [32, 64]
    table = _table(out, "| tokens | plain compile MiB |")
    assert [cells[0] for cells in table] == ["32", "64"] and all(len(c) == 8 for c in table)
    for r, cells in zip(rows, table, strict=True):
        assert _bytes(r["plain_bytes"])
        ran = []
        for key in ("fxckpt_bytes", "marked_bytes"):
            v = r[key]
            assert _bytes(v) or (isinstance(v, str) and v.startswith("BudgetError")), (key, v)
            if isinstance(v, int):
                ran.append(v)
        if len(ran) == 2:  # the last column says whether what ran held the budget
            assert cells[-1] == ("yes" if all(v <= budget for v in ran) else "no")
    # dynamic=True planned each length as it came; mark_dynamic once, for the max.
    assert "new, planned at 32 tokens" in rows[0]["fxckpt_plan"]
    assert rows[0]["marked_plan"].endswith("new, planned at 64 tokens, the max")
    assert rows[1]["marked_plan"].endswith("reused, planned at 64 tokens, the max")


def test_meter_cost_smallest_run_has_three_rows_per_length(tmp_path, capsys):
    path = tmp_path / "meter.json"
    assert _main("meter_cost", "--seqs", "16", "--batch", "1", "--rounds", "3",
                 "--json", str(path)) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert set(doc) == {"command", "date", "results"}
    (res,) = doc["results"]
    assert res["seq"] == 16 and res["rounds"] == 3
    assert _bytes(res["meter_resident"]) and res["meter_resident"] > 0
    assert _bytes(res["profiler_net"]) and res["profiler_net"] > 0
    kinds = ["unmeasured", "fxckpt.measure", "torch.profiler"]
    for kind in kinds:
        ms, ratio, lo, hi = res[kind]
        assert _positive(ms) and _positive(lo) and lo <= ratio <= hi
    assert res["unmeasured"][1:] == [1.0, 1.0, 1.0]  # the baseline against itself
    table = _table(out, "| seq | step (forward measured by) |")
    assert [(c[0], c[1]) for c in table] == [("16", k) for k in kinds]
    assert [c[-1] for c in table] == ["-", str(res["meter_resident"]), str(res["profiler_net"])]


def test_host_budget_smoke_spills_to_disk_within_each_budget(tmp_path, capsys):
    path = tmp_path / "host.json"
    # Exit 0: every row's losses equal the baseline's bit for bit.
    assert _main("host_budget", "--smoke", "--dir", str(tmp_path), "--json",
                 str(path)) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert {"model", "batch", "seq", "min_offload_bytes", "need_bytes", "rows", "block",
            "rounds", "command"} <= set(doc)
    assert doc["block"] == 2 and doc["rounds"] == 1
    labels = ["baseline (no host budget)", "host_budget 100%", "host_budget 50%",
              "host_budget 25%"]
    rows = doc["rows"]
    assert [r["row"] for r in rows] == labels
    assert [line.split(" | ")[0] for line in out.splitlines() if " | " in line][1:] == labels
    base, *budgeted = rows
    assert base["host_budget"] is None and base["disk_bytes_per_step"] == 0
    need = doc["need_bytes"]
    assert need == base["host_high_water_bytes"] > 0
    for r, share in zip(budgeted, (1.0, 0.5, 0.25), strict=True):
        assert r["host_budget"] == int(need * share)
        assert _bytes(r["host_high_water_bytes"]) and r["host_high_water_bytes"] <= r["host_budget"]
    for r in rows:
        assert r["loss_equal"] is True and len(r["losses"]) == 2
        assert _positive(r["step_ms"]) and isinstance(r["fallbacks"], int)
        for key in ("disk_bytes_per_step", "disk_write_s_per_step", "disk_read_s_per_step",
                    "stall_s_per_step"):
            assert math.isfinite(r[key]) and r[key] >= 0, (r["row"], key)
    assert budgeted[-1]["disk_bytes_per_step"] > 0  # a quarter of the need: the rest on disk


def test_bucket_overhead_smoke_buckets_take_fewer_calls(tmp_path, capsys):
    path = tmp_path / "buckets.json"
    assert _main("bucket_overhead", "--smoke", "--json", str(path)) == 0
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())
    assert list(rows) == ["keep", "alone", "bucketed"]
    table = _table(out, "| method | fxckpt ops / step |")
    assert [c[0] for c in table] == list(rows) and all(len(c) == 8 for c in table)
    for name, r in rows.items():
        assert r["ops_per_step"] == sum(r["ops"].values())
        assert all(op.startswith("fxckpt::") for op in r["ops"])
        assert len(r["wall_ms"]) == len(r["thread_ms"]) == 1 and _positive(r["wall_ms_median"])
        assert [c[1:4] for c in table if c[0] == name] == [
            [str(r["ops_per_step"]), str(r["offload_calls_per_step"]), str(r["handoffs_per_step"])]]
    keep, alone, bucketed = rows["keep"], rows["alone"], rows["bucketed"]
    assert keep["offload_calls_per_step"] == keep["handoffs_per_step"] == 0
    assert keep["wall_ms_over_keep"] == keep["thread_ms_over_keep"] == 0.0
    assert 0 < bucketed["offload_calls_per_step"] < alone["offload_calls_per_step"]
    assert 0 < bucketed["handoffs_per_step"] < alone["handoffs_per_step"]


# --------------------------------------------------------------------------------------------
# Inductor: positions, conv_layout
# --------------------------------------------------------------------------------------------


@pytest.mark.slow  # Inductor C++ compiles: 4 s with a warm kernel cache, 13 s without
@pytest.mark.inductor
def test_positions_smoke_places_every_op_of_the_chain(tmp_path, capsys):
    path = tmp_path / "positions.json"
    assert _main("positions", "--smoke", "--json", str(path)) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert set(doc) == {"torch", "chain"}  # --smoke: the chain case alone
    chain = doc["chain"]
    assert set(chain) == {"options", "joins", "summary", "compute_kernels"}
    assert chain["options"]["offload"] == "all"
    kernels = chain["compute_kernels"]
    assert set(kernels) == {"forward", "backward"} and all(_positive(k) for k in kernels.values())
    assert f"== chain: compute kernels {kernels}" in out
    # offload="all": one join per layer's saved tensor, each a row of the table.
    assert len(chain["joins"]) == 8
    for j in chain["joins"]:
        for key in ("planned_kernel", "generated_kernel", "early", "late"):
            assert _bytes(j[key]), (j, key)
    assert {"forward.offload", "forward.offload_done", "backward.prefetch",
            "backward.wait"} <= set(chain["summary"])
    for figures in chain["summary"].values():
        assert 0 <= figures["exact"] <= figures["ops"]


@pytest.mark.slow  # five Inductor compiles, caches off: 30 s (warm kernel cache) to 110 s
@pytest.mark.inductor
@pytest.mark.heavy
def test_conv_layout_smallest_run_has_every_method(tmp_path, capsys):
    from benchmarks.conv_layout import METHODS

    path = tmp_path / "conv_layout.json"
    # Widths of 8 and more: at 4 channels plain Inductor's mkldnn path corrupts the heap on
    # some x86 CPUs (glibc aborts in the backward's convolution_backward; pytorch/pytorch#181618).
    assert _main("conv_layout", "--rounds", "1", "--steps", "1", "--widths", "8", "16",
                 "--batch", "2", "--side", "8", "--json", str(path)) == 0
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())
    assert tuple(rows) == METHODS
    table = _table(out, "| method | held after forward |")
    assert [c[0] for c in table] == list(METHODS)
    for r in rows.values():
        assert _bytes(r["held_bytes"]) and r["held_bytes"] > 0
        assert len(r["step_ms"]) == 1 and _positive(r["step_ms_median"])
        assert 0 < r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"]
    assert rows["inductor"]["ratio_median"] == 1.0  # the baseline against itself
    for name in ("fxckpt_copies", "fxckpt_nchw"):
        assert f"fxckpt / {name}, paired per round: median " in out


# --------------------------------------------------------------------------------------------
# gpu_check's parts that run here
# --------------------------------------------------------------------------------------------


def test_gpu_check_rows_exist_in_the_shared_row_set():
    from benchmarks import gpu_checks
    from benchmarks.methods import BASELINE_SPECS

    assert set(gpu_checks.TABLE_ROWS) <= {s.name for s in BASELINE_SPECS}


def test_the_cuda_graph_check_finds_an_op_inside_a_partition():
    from benchmarks.gpu_cudagraphs import ops_inside_partitions, partition_count

    code = """
def partition_0(args):
    buf0 = empty_strided_cuda((4,), (1,), torch.float32)
    return (buf0,)

def partition_1(args):
    buf1 = torch.ops.fxckpt.offload.default(buf0)
    return (buf1,)

class Runner:
    def call(self, args):
        (buf0,) = self.partitions[0](partition0_args)
        buf2 = torch.ops.fxckpt.offload_done.default(buf1, buf0)
"""
    assert partition_count(code) == 2
    assert ops_inside_partitions(code) == {"partition_1": ["offload"]}


def test_the_cuda_graph_check_is_wired_into_gpu_check_and_skips_the_eager_compiler():
    from benchmarks import gpu_check, gpu_cudagraphs

    assert any(check.name == "cudagraphs" for check in gpu_check.CHECKS)
    # CUDA graphs exist only under Inductor: nothing to run, nothing failed.
    failures, figures = gpu_cudagraphs.run_cudagraph_checks("cpu", compiler="eager")
    assert failures == [] and "skipped" in figures


@pytest.mark.heavy
def test_the_conv_case_passes_on_the_cpu_and_gives_gpu_check_one_record(tmp_path, capsys):
    # compiler="eager" here (the Inductor case runs under tests/test_conv_inductor.py and on
    # a GPU through gpu_check): the verdicts and the record's shape, not Inductor's layouts.
    # Through main(), which writes the record gpu_check takes from run().
    from benchmarks import conv_case, gpu_check

    assert any(check.name == "conv_memory" for check in gpu_check.CHECKS)
    path = tmp_path / "conv_case.json"
    code = conv_case.main(["--compiler", "eager", "--device", "cpu", "--json", str(path)])
    record = json.loads(path.read_text())
    assert code == 0 and record["status"] == "passed", record["why"]
    assert f'{{"status": "passed", "why": ""}} -> {path}' in capsys.readouterr().out
    for budget in conv_case.BUDGETS:
        row = record[f"budget{budget}"]
        # A fraction brings the step's absolute peak down from plain compile's.
        assert row["step_start_bytes"] < row["step_peak_bytes"]
        assert row["step_peak_bytes"] <= record["plain_compile_step_peak_bytes"]
        assert _bytes(row["plan_budget_bytes"]) and _bytes(row["plan_step_peak_bytes"])
        assert row["resident"]["ok"] and row["gradients_ok"]
        assert row["first_step_held_bytes"] == [row["held_bytes"]]


@pytest.mark.heavy
def test_the_weights_benchmark_runs_its_methods_with_equal_gradients(tmp_path, capsys):
    path = tmp_path / "weights.json"
    # --os-heap: the C library's default heap, which the benchmark would change for the whole
    # process (every test after this one in its worker).
    assert _main("weights", "--smoke", "--os-heap", "--models", "stack", "--json", str(path)) == 0
    doc = json.loads(path.read_text())["models"]["stack"]
    assert [r["method"] for r in doc["rows"]] == [
        "resident", "fxckpt stream", "fxckpt 50% off", "fxckpt 90% off", "eager swap", "fxckpt low peak"]
    assert all(r["grads_equal"] and _positive(r["step_ms"]) for r in doc["rows"])
    by = {r["method"]: r for r in doc["rows"]}
    # The budgets leave room beside the all-streamed step for half, then a tenth, of the
    # streamed bytes: at least that share stays off the device, measured (the tiny model's 8
    # weights: some kept, at most half, then none), and the plan says so too.
    assert 0.5 <= by["fxckpt 50% off"]["weights_off_device"] < 1.0
    assert by["fxckpt 90% off"]["weights_off_device"] == 1.0
    for row in [*doc["rows"][1:4], doc["rows"][5]]:
        assert row["measured_resident_weight_bytes"] == row["planned_resident_weight_bytes"]
    # Streamed, the frozen weights are host memory: the absolute device peak drops by at least
    # half their bytes against all-resident.
    resident, stream = (r["absolute_peak_bytes"] for r in doc["rows"][:2])
    assert resident - stream >= by["fxckpt stream"]["streamed_bytes"] // 2
    assert "emulated link" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.heavy
def test_the_weights_benchmark_trains_diffusers_and_transformers_models_like_resident(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    path = tmp_path / "weights.json"
    assert _main("weights", "--smoke", "--os-heap", "--models", "flux-lora,flux-full,llama-lora", "--json", str(path)) == 0
    models = json.loads(path.read_text())["models"]
    for name, doc in models.items():
        methods = [r["method"] for r in doc["rows"]]
        assert methods[:4] == ["resident", "fxckpt stream", "fxckpt 50% off", "fxckpt 90% off"], name
        # The swap moves frozen weights only: no swap row under full fine-tuning.
        assert ("eager swap" in methods) == (name != "flux-full"), name
        assert all(r["grads_equal"] for r in doc["rows"]), name
        assert all(r["graphs"] == 1 for r in doc["rows"] if "graphs" in r), name


@pytest.mark.parametrize("weights", [False, True])
def test_copy_overhead_times_the_round_trip_it_names(weights: bool) -> None:
    import fxckpt
    from benchmarks.copy_overhead import round_trip_ms

    fxckpt.reset_stats()
    times = round_trip_ms("cpu", 4, rounds=2, per_round=3, weights=weights)
    assert len(times) == 2 and all(math.isfinite(t) and t > 0 for t in times)
    # 50 warm-up trips and 2 x 3 timed ones, 4 KiB each: a streamed weight's copies, or an
    # offload's, and not the other.
    moved = 56 * 4 * 2**10
    stats = fxckpt.stats()
    assert (stats["weight_h2d_bytes"], stats["offloaded_bytes"]) == ((moved, 0) if weights else (0, moved))


def test_the_weights_benchmark_redraws_its_plots_from_a_report(tmp_path, capsys):
    rows = [{"method": m, "step_ms": ms, "absolute_peak_bytes": mib * 2**20}
            for m, ms, mib in (("resident", 100.0, 50.0), ("fxckpt stream", 150.0, 20.0),
                               ("eager swap", 300.0, 10.0))]  # fmt: skip
    report = tmp_path / "weights.json"
    report.write_text(json.dumps({"models": {"tiny": {"link_MBps": 12.5, "rows": rows}}}))
    assert _main("weights", "--from", str(report), "--plot", str(tmp_path / "plots")) == 0
    page = (tmp_path / "plots" / "weights_tiny.svg").read_text()
    # Each method at its step time over the resident one's and its peak in MiB.
    for key in ("1: resident (1.00x, 50.0)", "2: fxckpt stream (1.50x, 20.0)", "3: eager swap (3.00x, 10.0)"):
        assert key in page
    assert "weights_tiny.svg" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # --from draws only: without --plot there is nothing to do
        _main("weights", "--from", str(report))
    assert "give --plot DIR too" in capsys.readouterr().err
