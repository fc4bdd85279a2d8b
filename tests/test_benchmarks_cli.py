"""The benchmark scripts import and answer --help; no benchmark runs here (speed and memory are measured in benchmarks/, never asserted in tests)."""

from __future__ import annotations

import importlib

import pytest

SCRIPTS = (
    "cpu_bench", "planner_scaling", "gpu_check", "plot", "positions", "gpu_cudagraphs",
    "dynamic_budget", "meter_cost", "host_budget", "cpu_goal", "bucket_overhead",
    "conv_case", "conv_layout",
)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_and_answers_help(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    assert {"plot": "--no-doc", "gpu_check": "--out"}.get(name, "--json") in out


def test_cpu_goal_names_an_unknown_method_before_running_anything():
    from benchmarks import cpu_goal

    with pytest.raises(SystemExit, match=r"--only fxckpt_nope: not a method here; choose from .*fxckpt_plan"):
        cpu_goal.main(["--only", "fxckpt_nope", "fxckpt_plan", "--strides"])


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


def test_the_conv_case_passes_on_the_cpu_and_gives_gpu_check_one_record():
    # compiler="eager" here (the Inductor case runs under tests/test_conv_inductor.py and on
    # a GPU through gpu_check): the verdicts and the record's shape, not Inductor's layouts.
    from benchmarks import conv_case, gpu_check

    assert any(check.name == "conv_memory" for check in gpu_check.CHECKS)
    record = conv_case.run("cpu", compiler="eager")
    assert record["status"] == "passed", record["why"]
    for budget in conv_case.BUDGETS:
        row = record[f"budget{budget}"]
        assert row["held_bytes"] <= budget * record["aot_eager_held_bytes"]
        assert row["resident"]["ok"] and row["gradients_ok"]
        assert row["first_step_held_bytes"] == [row["held_bytes"]]
