"""The benchmark scripts import and answer --help; no benchmark runs here (DESIGN.md §5)."""

from __future__ import annotations

import importlib

import pytest

SCRIPTS = ("cpu_bench", "planner_scaling", "gpu_check", "plot", "host_budget")


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_and_answers_help(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    assert ("--no-doc" if name == "plot" else "--json") in out


def test_gpu_check_rows_exist_in_the_shared_row_set():
    from benchmarks import gpu_check
    from benchmarks.methods import BASELINE_SPECS

    assert set(gpu_check.TABLE_ROWS) <= {s.name for s in BASELINE_SPECS}
