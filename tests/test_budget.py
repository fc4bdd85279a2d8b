"""The memory budget: the step's absolute device peak, met by what the meter measures,
monotone, with reasons.

``memory_budget`` in bytes (an int or a string such as ``"3MiB"``) bounds what the device holds
when the step starts plus the most the step allocates; a fraction ``f`` puts each graph's own
step peak at ``floor + f * (plain - floor)``, between its lowest plan and plain min-cut's;
``"auto"`` is the device's capacity less a margin (stated on the CPU with
``fxckpt.emulate_device_memory``). Every figure checked here is the meter's: the absolute
peak of a warm training step (tests/measured.py ``measure_absolute_step``).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from equality import assert_step_matches
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from measured import measure_absolute_step, measure_forward
from models import GPT, gpt_inputs

import fxckpt
from fxckpt.options import auto_budget

GPT_KW = {"n_layers": 4, "d": 64}
INPUTS = {"seq": 64}
# What the meter may read over a plan's own figure: the few bytes of eager code's tensors
# (the loss's seed gradient) that no graph's liveness sees.
SLACK = 4096
# The lowest plan, as a fraction: its own step peak is the floor, to the byte.
LOWEST = 1e-9


def run(budget, **options) -> tuple[fxckpt.Plan, fxckpt.Measurement]:
    """Train two steps against eager, then measure one more whole step with the meter."""
    plan, measured, _ = run_compiled(budget, **options)
    return plan, measured


def run_compiled(budget, **options) -> tuple[fxckpt.Plan, fxckpt.Measurement, torch.nn.Module]:
    """:func:`run`, and the compiled model, warm."""
    torch._dynamo.reset()
    fxckpt.reset_stats()
    torch.manual_seed(0)
    model, inputs = GPT(**GPT_KW), gpt_inputs(**INPUTS)
    backend = fxckpt.backend(
        compiler="eager", memory_budget=budget, min_offload_bytes=0, cost_model="unit", **options
    )
    compiled = assert_step_matches(model, inputs, backend, steps=2)
    measured = measure_absolute_step(compiled, model, inputs, warm=1)
    (plan,) = fxckpt.last_plans()
    return plan, measured, compiled


@functools.cache
def measured_peak(budget: float | None, **options) -> int:
    """The measured absolute step peak under ``budget``: ``None`` for plain min-cut,
    :data:`LOWEST` for the lowest plan."""
    return run(budget, **options)[1].absolute_peak_bytes


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fraction=st.floats(min_value=0.1, max_value=1.0))
def test_a_fraction_is_met_and_gradients_stay_exact(fraction: float) -> None:
    # on_infeasible stays "raise": every fraction has a plan.
    plain, floor = measured_peak(None), measured_peak(LOWEST)
    plan, measured = run(fraction)
    assert plan.step is not None and plan.target is not None
    # The budget the plan was made for: the start level and the graph's own target.
    assert plan.budget_bytes == plan.step["start_bytes"] + max(plan.target.values())
    assert measured.absolute_peak_bytes <= plan.budget_bytes + SLACK
    # What the fraction means, by the meter: that far from the lowest plan's step to plain's.
    assert floor - SLACK <= measured.absolute_peak_bytes <= floor + fraction * (plain - floor) + SLACK


@pytest.mark.parametrize("share", [0.75, 0.5, 0.1])
def test_byte_budgets_between_the_lowest_plan_and_plain_hold(share: float) -> None:
    plain, floor = measured_peak(None), measured_peak(LOWEST)
    budget = int(floor + share * (plain - floor))
    plan, measured, compiled = run_compiled(budget)
    assert plan.budget_bytes == budget
    assert floor - SLACK <= measured.absolute_peak_bytes <= budget
    # The plan's predicted step (start level and its own peak) is what the meter finds.
    assert plan.step is not None
    assert plan.step["total_bytes"] == pytest.approx(measured.absolute_peak_bytes, abs=SLACK)
    # The runtime's own count of the kept tensors is planned, and the meter sees at least it
    # left for the backward by a forward.
    compiled.zero_grad(set_to_none=True)  # a kept gradient would count in the next step's start
    held = measure_forward(compiled, gpt_inputs(**INPUTS), warm=False).held_bytes
    assert 0 < fxckpt.stats()["planned_kept_bytes"] <= held


@pytest.mark.heavy
def test_budget_is_monotone() -> None:
    measured, predicted, cost = [], [], []
    for fraction in (1.0, 0.5, 0.25, 0.1):
        plan, m = run(fraction)
        measured.append(m.absolute_peak_bytes)
        predicted.append(plan.predicted_step_peak_bytes)
        cost.append(plan.est_overhead_ms)
    assert measured == sorted(measured, reverse=True) and measured[0] > measured[-1]
    assert measured[0] <= measured_peak(None) + SLACK  # 1.0 is plain
    assert predicted == sorted(predicted, reverse=True)
    assert cost == sorted(cost)


def test_a_tight_plan_shows_every_decision_with_numbers() -> None:
    # One-block segments (segment_stride=1) under the lowest plan's figure without them: the
    # interiors are recomputed, and the budget keeps or offloads the rest; it is missed (the
    # stride holds more), so the smallest plan runs with a warning.
    floor = measured_peak(LOWEST)
    with pytest.warns(UserWarning, match="cannot meet memory_budget"):
        plan, measured = run(floor, segment_stride=1, on_infeasible="warn")
    kinds = {r.decision.kind for r in plan.activations}
    assert kinds == {"keep", "recompute", "offload"}
    for row in plan.activations:
        reason = row.decision.reason
        assert reason.startswith(row.decision.kind + ":")
        if row.decision.kind == "offload":
            assert re.search(r"copies [\d.]+ ms against [\d.]+ ms of compute", reason)
    assert any("budget" in r.decision.reason for r in plan.activations if r.decision.kind == "keep")
    assert measured.absolute_peak_bytes > floor


def test_byte_budgets_are_bytes() -> None:
    plan, measured = run("3MiB")
    assert plan.budget_bytes == 3 * 2**20
    assert plan.recomputed_bytes + plan.offloaded_bytes > 0  # plain's step is over 3 MiB here
    assert measured.absolute_peak_bytes <= 3 * 2**20 < measured_peak(None)


def _budget_error(err: BaseException | None) -> fxckpt.BudgetError:
    while err is not None and not isinstance(err, fxckpt.BudgetError):
        # dynamo wraps backend errors in BackendCompilerFailed, keeping them as inner_exception
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
    assert isinstance(err, fxckpt.BudgetError), err
    return err


def first_error(budget: int, steps: int = 5, **options) -> fxckpt.BudgetError:
    """The BudgetError that training under ``budget`` raises. The verdict waits for what eager
    code holds to be measured (the third step, usually); the steps before it run the lowest
    plans."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(**GPT_KW)
    backend = fxckpt.backend(compiler="eager", memory_budget=budget, cost_model="unit", **options)
    compiled = torch.compile(model, backend=backend)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        try:
            compiled(*gpt_inputs(**INPUTS)).backward()
        except Exception as e:  # noqa: BLE001 (unwrapped and checked)
            return _budget_error(e)
    raise AssertionError(f"no BudgetError in {steps} steps under memory_budget={budget}")


def test_auto_budget_resolves_on_cpu() -> None:
    # A roomy card: plain min-cut's plan fits, and everything is kept.
    with fxckpt.emulate_device_memory("64MiB"):
        plan, measured = run("auto")
    assert plan.budget_bytes == auto_budget(64 * 2**20)
    assert plan.resident_peak_bytes == plan.baseline_saved_bytes  # kept all
    assert measured.absolute_peak_bytes <= plan.budget_bytes
    # A card whose "auto" budget is below plain's step: the plan holds it.
    plain, floor = measured_peak(None), measured_peak(LOWEST)
    want = (plain + floor) // 2
    capacity = int(want / (1 - 2 * 0.05))  # auto leaves 5 % and 5 % more under 20 GiB
    with fxckpt.emulate_device_memory(capacity):
        plan, measured = run("auto")
    assert plan.budget_bytes == auto_budget(capacity) and floor < plan.budget_bytes < plain
    assert measured.absolute_peak_bytes <= plan.budget_bytes
    # The CPU has no capacity of its own: without one stated, "auto" says how to state it.
    with fxckpt.emulate_device_memory(None), pytest.raises(Exception) as info:
        run("auto")
    err = info.value
    while err is not None and not isinstance(err, fxckpt.OptionsError):
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
    assert isinstance(err, fxckpt.OptionsError) and "emulate_device_memory" in str(err)


def test_infeasible_budget_raises_with_the_smallest_figure() -> None:
    err = first_error(1000, offload="never")
    assert err.budget_bytes == 1000 and err.smallest_bytes > 1000
    assert err.scope == "step" and err.parts["start_bytes"] > 1000  # the weights alone are more
    assert "offload='auto'" in str(err)
    # Written back, the figure runs, and the measured step stays within it.
    plan, measured = run(err.smallest_bytes, offload="never")
    assert measured.absolute_peak_bytes <= err.smallest_bytes + SLACK


def test_infeasible_budget_warns_and_runs_the_smallest_plan() -> None:
    with pytest.warns(UserWarning, match="cannot meet memory_budget") as record:
        plan, measured = run(1000, offload="never", on_infeasible="warn")
    assert plan.offloaded_bytes == 0 and plan.recomputed_bytes > 0
    # The warning names the smallest budget; the step the smallest plan runs is within it.
    named = [int(m) for w in record for m in re.findall(r"memory_budget=(\d+) \(", str(w.message))]
    assert named, [str(w.message) for w in record]
    assert 1000 < measured.absolute_peak_bytes <= max(named) + SLACK
    assert measured.absolute_peak_bytes <= measured_peak(LOWEST, offload="never") + SLACK


def test_stride_fixes_interiors_and_budget_decides_segment_inputs() -> None:
    plan, measured = run(0.01, segment_stride=2)
    in_blocks = [r for r in plan.activations if r.block is not None]
    assert any("interior of segment" in r.decision.reason for r in in_blocks)
    segment_inputs = [r for r in in_blocks if r.decision.kind != "recompute"]
    assert segment_inputs
    # The stride never recomputes a segment input; the budget keeps or offloads each one.
    assert all(r.decision.reason.startswith(("keep: fits", "offload: ")) for r in segment_inputs)
    assert measured.absolute_peak_bytes <= plan.budget_bytes + SLACK
    # Two-block segments hold a block more than the lowest plan without them.
    assert measured.absolute_peak_bytes > measured_peak(LOWEST)


def test_a_round_that_falls_short_recomputes_more_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first round's block search is made to under-predict (it plans for three times the
    # budget, as if min-cut had freed less than it said); a later round must add blocks.
    import fxckpt.planning.plan_round as plan_round

    budget = (measured_peak(None, offload="never") + measured_peak(LOWEST, offload="never")) // 2
    real, searched = plan_round.choose, []

    def short(problem, blocks, target, prefetch, low=None):  # type: ignore[no-untyped-def]
        if blocks is not None:
            searched.append(target)
            if len(searched) == 1:
                return real(problem, blocks, 3 * target, prefetch, low)
        return real(problem, blocks, target, prefetch, low)

    monkeypatch.setattr(plan_round, "choose", short)
    plan, measured = run(budget, offload="never")
    assert len(searched) >= 2  # the block search ran again after the first partition
    assert 0 < measured.absolute_peak_bytes <= budget
    assert any("recomputes blocks" in n for n in plan.notes), plan.notes


@pytest.mark.heavy
def test_budgets_between_rungs_get_plans_between_rungs() -> None:
    # Offload cannot help: the budget gets the least recompute that meets it, k of N blocks
    # plus single ops, not the next rung of a fixed ladder (every other block, every block).
    def one(budget: float | None) -> tuple[fxckpt.Plan, int]:
        torch._dynamo.reset()
        fxckpt.reset_stats()
        torch.manual_seed(0)
        model, inputs = GPT(n_layers=8, d=32), gpt_inputs(seq=32)
        backend = fxckpt.backend(compiler="eager", memory_budget=budget, offload="never",
                                 cost_model="unit")
        compiled = assert_step_matches(model, inputs, backend)
        (plan,) = fxckpt.last_plans()
        return plan, measure_absolute_step(compiled, model, inputs, warm=1).absolute_peak_bytes

    plain, floor = one(None)[1], one(LOWEST)[1]
    peaks, measured, recomputed = [], [], []
    for share in (0.9, 0.7, 0.5, 0.3):
        budget = int(floor + share * (plain - floor))
        plan, peak = one(budget)
        assert peak <= budget
        peaks.append(plan.predicted_step_peak_bytes)
        measured.append(peak)
        recomputed.append(plan.recomputed_bytes)
    assert len(set(peaks)) == 4 and peaks == sorted(peaks, reverse=True)
    assert measured == sorted(measured, reverse=True)
    assert recomputed == sorted(recomputed) and recomputed[0] < recomputed[-1]


def test_an_unset_stride_is_relaxed_and_a_set_one_is_kept() -> None:
    # Only blocks can meet this budget (nothing may be offloaded, and single ops free too
    # little). With segment_stride unset the planner recomputes blocks and says so; set to 0
    # by the user, it stays 0 and the error names it.
    plain = measured_peak(None, offload="never")
    floor = measured_peak(LOWEST, offload="never")
    budget = (plain + floor) // 2
    plan, measured = run(budget, offload="never")
    assert measured.absolute_peak_bytes <= budget
    assert any(n.startswith("segment_stride is unset: recomputes blocks") for n in plan.notes)
    err = first_error(budget, offload="never", segment_stride=0)
    assert err.budget_bytes == budget < err.smallest_bytes
    assert any("segment_stride unset" in s for s in err.suggestions), err.suggestions
    assert "offload='auto'" in err.suggestions
    # Written back, the smallest figure runs with the stride kept at 0.
    plan, measured = run(err.smallest_bytes, offload="never", segment_stride=0)
    assert not any(n.startswith("segment_stride is unset") for n in plan.notes)
    assert measured.absolute_peak_bytes <= err.smallest_bytes + SLACK


def test_each_layout_is_simulated_once_per_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fraction's plan range and the first round plan the same partition: they share its
    # problem and each layout at its lowest, and a round's search reuses what within_reach
    # simulated. Counted by content, so a problem built twice would count twice.
    import fxckpt.planning.layouts as layouts

    real, seen = layouts.apply, []

    def counted(problem, blocks, layout, **kw):  # type: ignore[no-untyped-def]
        fixed = problem.timeline.fixed_resident
        seen.append((layout, len(problem), None if fixed is None else tuple(fixed)))
        return real(problem, blocks, layout, **kw)

    monkeypatch.setattr(layouts, "apply", counted)
    run(0.5)
    assert sum(1 for layout, *_ in seen if layout.blocks) > 1  # block layouts were searched
    assert len(seen) == len(set(seen)), "a layout simulated twice on one partition"
