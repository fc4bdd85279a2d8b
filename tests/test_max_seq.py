"""``fxckpt inspect --max-seq``: the search for the longest sequence, and what it says checked
on the CPU's allocator, which reads no plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
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


def test_forked_strategies_find_what_one_after_the_other_finds() -> None:
    from fxckpt.seq_fit import longest_sequences, plan_lengths
    from fxckpt.workloads import load_factory

    work = load_factory("tests/models.py:gpt_seq_factory")
    said: list[str] = []
    found = {}
    with plan_lengths(work) as plan_at:
        plan_at(fxckpt.inspect.inspect_options(), 64)
        for fork in (False, True):
            fits = longest_sequences(plan_at, limit=20 << 20, seq=64, ceiling=2048, base={},
                                     say=said.append, fork=fork)  # fmt: skip
            found[fork] = [(f.name, f.max_seq, f.total_bytes, f.predicted_step_ms) for f in fits]
    assert [name for name, *_ in found[True]] == ["none", "full_checkpointing", "fxckpt"]
    assert found[True] == found[False]
    assert not any("failed" in line for line in said)


def _pid_list() -> list[int]:
    return [os.getpid()]


def test_in_two_runs_there_in_a_copy_of_the_process() -> None:
    from fxckpt.seq_fit import in_two

    said: list[str] = []
    there, here = in_two(_pid_list, _pid_list, say=said.append)
    assert here == os.getpid() != there
    assert said == []


def test_a_copy_that_fails_or_dies_is_run_again_here_and_its_error_raised() -> None:
    from fxckpt.seq_fit import in_two

    parent = os.getpid()
    said: list[str] = []

    def dies() -> list[int]:
        if os.getpid() != parent:
            os._exit(3)
        return [7]

    assert in_two(dies, lambda: [8], say=said.append) == [7, 8]
    assert said == ["the forked search failed (exit status 3); searching again here"]

    class NoFit(Exception):
        pass

    def raises() -> list[int]:
        raise NoFit("no plan fits")

    with pytest.raises(NoFit, match="no plan fits"):
        in_two(raises, lambda: [8], say=said.append)
    assert "NoFit: no plan fits" in said[-1]


def test_an_error_here_ends_the_copy_and_is_raised() -> None:
    from fxckpt.seq_fit import in_two

    def slow() -> list[int]:
        time.sleep(60)
        return [1]

    def fails() -> list[int]:
        raise ValueError("here")

    start = time.perf_counter()
    children = _children()
    with pytest.raises(ValueError, match="here"):
        in_two(slow, fails, say=lambda _m: None)
    assert time.perf_counter() - start < 30  # the copy was killed, not waited for
    assert _children() == children  # and reaped: no zombie left


def _children() -> set[int]:
    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return set(map(int, path.read_text().split())) if path.exists() else set()


def test_a_large_answer_is_read_before_the_copy_is_waited_for_and_its_output_is_kept() -> None:
    # The copy writes its answer to a pipe; larger than the pipe's buffer, it blocks until
    # the parent reads, so a parent that waited for the copy first would wait for ever.
    code = textwrap.dedent(
        """
        import sys
        from fxckpt.seq_fit import in_two

        sys.stdout.write("before\\n")  # buffered: written once, not again by the copy

        def there():
            print("from the copy")  # buffered (stdout is a pipe): the copy flushes it
            return list(range(200_000))

        out = in_two(there, lambda: [-1], say=print)
        assert out[:3] == [0, 1, 2] and out[-1] == -1 and len(out) == 200_001
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.replace("\n", " ").split() == ["before", "from", "the", "copy", "ok"]
