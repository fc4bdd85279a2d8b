"""The benchmark scripts import and answer --help; no benchmark runs here (DESIGN.md §5)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("cpu_bench", "planner_scaling", "gpu_check", "plot", "dynamic_budget", "meter_cost")


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_and_answers_help(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    assert ("--no-doc" if name == "plot" else "--json") in out


def test_methods_share_one_row_set():
    from benchmarks import gpu_check
    from benchmarks.methods import BASELINE_SPECS, default_fxckpt_specs

    cpu_rows = {s.name for s in (*BASELINE_SPECS, *default_fxckpt_specs("64KiB"))}
    assert set(gpu_check.GPU_ROWS) <= cpu_rows
    assert [s.name for s in gpu_check.gpu_specs()] == list(gpu_check.GPU_ROWS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the checks")
def test_gpu_check_without_cuda_exits_0_with_a_message():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "CUDA is not available" in done.stdout
