"""``fxckpt inspect --max-seq``: the search for the longest sequence, and what it says checked
on the CPU's allocator, which reads no plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from measured import measure_absolute_step
from models import gpt_seq_factory

import fxckpt
from fxckpt import cli
from fxckpt.sizing import MAX_PROBES, Probe, longest_fit, seq_quantum


def _curve(start: int, linear: float, square: float, limit: int) -> tuple[list[int], object]:
    probed: list[int] = []

    def probe(n: int) -> Probe:
        probed.append(n)
        total = int(start + linear * n + square * n * n)
        return Probe(n, total, start, float(n), total <= limit)

    return probed, probe


@pytest.mark.parametrize("square", [0.0, 0.05])
def test_the_search_ends_between_a_length_that_fits_and_one_a_step_longer(square: float) -> None:
    limit = 10_000_000
    probed, probe = _curve(1_000_000, 900.0, square, limit)
    best, probes, capped = longest_fit(probe, limit=limit, start=1024, quantum=32, ceiling=1 << 20)
    assert best is not None and best.fits and not capped
    assert best.length % 32 == 0
    assert not probe(best.length + 32).fits  # the next length up does not fit
    assert len(probes) <= MAX_PROBES


def test_the_search_says_where_nothing_fits_and_where_the_ceiling_stops_it() -> None:
    _, never = _curve(20_000_000, 1.0, 0.0, 10_000_000)
    best, _, capped = longest_fit(never, limit=10_000_000, start=256, quantum=8, ceiling=4096)
    assert best is None and not capped
    _, always = _curve(0, 1.0, 0.0, 10_000_000)
    best, _, capped = longest_fit(always, limit=10_000_000, start=256, quantum=8, ceiling=4096)
    assert best is not None and best.length == 4096 and capped


def test_the_quantum_is_a_power_of_two_near_a_thirty_second_of_the_start() -> None:
    assert [seq_quantum(n) for n in (8, 64, 256, 8192, 10_000)] == [1, 2, 8, 256, 256]


def test_max_seq_needs_a_card(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", "tests/models.py:gpt_seq_factory", "--max-seq"]) == 2
    assert "--device-memory" in capsys.readouterr().err


def _measured_peak(length: int, **options: object) -> int:
    torch.manual_seed(0)
    model, inputs = gpt_seq_factory(seq=length)
    compiled = torch.compile(model, backend=fxckpt.backend(compiler="eager", **options))
    return measure_absolute_step(compiled, model, inputs).absolute_peak_bytes


@pytest.mark.heavy
def test_the_length_said_to_fit_fits_and_a_quarter_more_does_not(tmp_path: Path) -> None:
    out = tmp_path / "fit.json"
    code = cli.main(["inspect", "tests/models.py:gpt_seq_factory", "--device-memory", "24MiB",
                     "--max-seq", "--format", "json", "-o", str(out), "-q",
                     "--html", str(tmp_path / "plan.html")])  # fmt: skip
    assert code == 0
    page = (tmp_path / "plan.html").read_text()
    assert "longest sequence whose step fits" in page and "full_checkpointing" in page
    doc = json.loads(out.read_text())
    fit = doc["fit"]
    limit = fit["limit_bytes"]
    found = {s["name"]: s for s in fit["strategies"]}
    assert set(found) == {"none", "full_checkpointing", "fxckpt"}
    assert found["fxckpt"]["max_seq"] >= found["full_checkpointing"]["max_seq"] >= found["none"]["max_seq"]
    # Plain torch.compile's partition (fxckpt with no budget is min-cut alone), measured.
    plain = found["none"]["max_seq"]
    assert _measured_peak(plain) <= limit
    assert _measured_peak(int(plain * 1.25)) > limit
    # fxckpt at the card's budget: the length it names holds; a quarter more cannot.
    longest = found["fxckpt"]["max_seq"]
    assert _measured_peak(longest, memory_budget=limit) <= limit
    with pytest.raises(fxckpt.BudgetError):
        _measured_peak(int(longest * 1.25), memory_budget=limit)


def _figures(plans: list[fxckpt.Plan]) -> tuple[object, ...]:
    rows = sorted((a.bytes, a.decision.kind, tuple(a.shape)) for p in plans for a in p.activations)
    return (rows, [p.step["total_bytes"] for p in plans if p.step])


def test_a_length_set_in_the_traced_joint_plans_as_a_trace_at_that_length() -> None:
    from fxckpt.inspect import inspect_options, plan_workload
    from fxckpt.seq_fit import UNBOUNDED, plan_lengths
    from fxckpt.workloads import load_factory

    work = load_factory("tests/models.py:gpt_seq_factory")
    plain = inspect_options(memory_budget=UNBOUNDED)
    with plan_lengths(work) as plan_at:
        plan_at(plain, 64)  # traced here, at 64 tokens with the length a symbol
        set_plain = plan_at(plain, 160)
        total = set_plain[0].step["total_bytes"]
        binding = inspect_options(memory_budget=int(total * 0.8))
        set_binding = plan_at(binding, 160)
    model, inputs = gpt_seq_factory(seq=160)
    at_160 = fxckpt.inspect.Workload(model, inputs)
    assert _figures(set_plain) == _figures(plan_workload(at_160, plain))
    assert _figures(set_binding) == _figures(plan_workload(at_160, binding))
    assert any(a.decision.kind != "keep" for p in set_binding for a in p.activations)
