"""A step that fits its budget with room to spare gives the room back to the graphs that gave
something up for it (fxckpt.planning.step_room), and keeps a new plan only where the step's
account still fits: the figures here are plain numbers, the compiles stand-ins."""

from __future__ import annotations

import json
from typing import Any

from fxckpt.options import Options
from fxckpt.planning import step_budget as sb
from fxckpt.planning.account import HEADROOM, GraphFigures, PeakTarget, targets
from fxckpt.planning.step_room import use_room

BUDGET, START = 20_000, 2_000
GAVE_UP = json.dumps({"offloaded_bytes": 4096})


def _step(held: int, backward: int, payload: str = GAVE_UP) -> tuple[sb.StepBudget, list[Any]]:
    """A layer graph that runs four times a step, planned for the target its first plan's
    figures gave it; its plan keeps ``held`` and peaks at ``backward`` in its backward."""
    step = sb.StepBudget(Options(memory_budget=BUDGET, compiler="eager"))
    step.runs, step.start_bytes = ["L"] * 4, START
    first = GraphFigures(forward_peak=900, backward_peak=1600, held=800)
    target = targets(BUDGET, START, [first] * 4, ["L"] * 4, "L")
    asked: list[Any] = []
    step.graphs["L"] = sb.Graph("L", forward_peak=600, backward_peak=backward, held=held,
                                target=target, known=True, payload=payload,
                                recompile=asked.append, compiled=["first plan"])  # fmt: skip
    return step, asked


def test_the_room_a_fitting_step_leaves_is_planned_for_again() -> None:
    # Its plan kept 1000 bytes less a run than its target allowed and its backward's peak did
    # not fall with it: four runs leave the step over 3000 bytes, and its target, asked again
    # with these figures, lets its backward have more.
    step, asked = _step(held=2600, backward=4000)
    assert step.fits() and BUDGET - HEADROOM - step.account().peak > BUDGET / 40
    g = step.graphs["L"]

    def better(target: PeakTarget) -> None:
        asked.append(target)
        g.forward_peak, g.backward_peak, g.held = 700, target.backward, min(3000, target.held or 0)
        g.target, g.compiled[0] = target, "second plan"

    g.recompile = better
    use_room(step)
    assert asked and asked[0].backward > 4000
    assert g.compiled[0] == "second plan" and step.fits()
    assert step.replanning_steps == 1


def test_a_new_plan_that_does_not_fit_the_step_is_not_kept() -> None:
    step, _ = _step(held=2600, backward=4000)
    g = step.graphs["L"]
    before = (g.forward_peak, g.backward_peak, g.held, g.target, g.payload)

    def worse(target: PeakTarget) -> None:  # its partition held more than the model of it
        g.forward_peak, g.backward_peak, g.held = 700, target.backward + 500, target.held or 0
        g.target, g.payload, g.compiled[0] = target, "{}", "second plan"

    g.recompile = worse
    use_room(step)
    assert (g.forward_peak, g.backward_peak, g.held, g.target, g.payload) == before
    assert g.compiled[0] == "first plan" and step.fits()
    assert step.replanning_steps == 0


def test_a_plan_that_gave_nothing_up_is_not_planned_again() -> None:
    step, asked = _step(held=2600, backward=4000, payload=json.dumps({"offloaded_bytes": 0}))
    use_room(step)
    assert asked == []


def test_a_step_with_little_room_left_plans_nothing_again() -> None:
    # Its target, asked again, would let its backward have more (its peak did not fall with
    # what it keeps), but the step is within a fortieth of its budget: no compile for that.
    step, asked = _step(held=2800, backward=5400)
    g = step.graphs["L"]
    assert step.target("L").backward > g.target.backward
    assert step.fits() and BUDGET - HEADROOM - step.account().peak < BUDGET / 40
    use_room(step)
    assert asked == []


def _inductor_step(schedules: dict[str, tuple[int, int]], under: int
                   ) -> tuple[sb.StepBudget, list[Any], list[bool]]:
    """A graph run once a step under Inductor, planned to its target in liveness (13,000 and
    13,500 bytes), which Inductor's schedule of it (``schedules``, by plan) holds 2,000 less.
    Its stand-in compile makes a plan whose backward's liveness is ``under`` bytes under what
    its target asks, and notes whether the backward compiled with the forward."""
    payload = json.dumps({"offloaded_bytes": 4096, "forward_peak_bytes": 13_000,
                          "backward_peak_bytes": 13_500})
    schedules[payload] = (11_000, 11_500)
    step = sb.StepBudget(Options(memory_budget=BUDGET, compiler="inductor"),
                         scheduled=schedules.get)  # fmt: skip
    step.runs, step.start_bytes = ["G"], START
    target = targets(BUDGET, START, [GraphFigures(13_000, 13_500, 9_000)], ["G"], "G")
    asked: list[Any] = []
    lowered_now: list[bool] = []
    g = step.graphs["G"] = sb.Graph("G", forward_peak=13_000, backward_peak=13_500, held=9_000,
                                    target=target, known=True, payload=payload,
                                    compiled=["first plan"])  # fmt: skip

    def plan(want: PeakTarget) -> None:
        import torch._functorch.config as functorch_config

        asked.append(want)
        lowered_now.append(functorch_config.force_non_lazy_backward_lowering)
        live = (13_000, want.backward - under)
        g.payload = json.dumps({"offloaded_bytes": 1024, "forward_peak_bytes": live[0],
                                "backward_peak_bytes": live[1]})
        g.forward_peak, g.backward_peak, g.target, g.compiled[0] = *live, want, "second plan"

    g.recompile = plan
    sb.scheduled_figures(step.graphs.values(), step.scheduled)
    return step, asked, lowered_now


def test_under_inductor_the_room_its_schedule_leaves_is_planned_for() -> None:
    # The account counts Inductor's figures (11,500 at the backward): the step leaves 2,404
    # bytes. The plan is made for its liveness, so its target's phases are raised by what the
    # schedule held less (2,000 each), and the backward compiles with the forward, so that the
    # new plan's schedule judges it before it runs.
    schedules: dict[str, tuple[int, int]] = {}
    step, asked, lowered_now = _inductor_step(schedules, under=1_000)
    g = step.graphs["G"]
    assert (g.forward_peak, g.backward_peak) == (11_000, 11_500)
    share = BUDGET - HEADROOM - START
    assert BUDGET - HEADROOM - step.account().peak == share - 11_500
    new = json.dumps({"offloaded_bytes": 1024, "forward_peak_bytes": 13_000,
                      "backward_peak_bytes": share + 1_000})
    schedules[new] = (11_000, share - 300)  # its schedule, 300 bytes under the share
    use_room(step)
    assert [(a.forward, a.backward) for a in asked] == [(share + 2_000, share + 2_000)]
    assert lowered_now == [True]
    # Judged by the schedule (its liveness alone is over the budget), and kept.
    assert g.compiled[0] == "second plan" and (g.forward_peak, g.backward_peak) == schedules[new]
    assert step.fits() and step.replanning_steps == 1


def test_under_inductor_a_new_plan_is_judged_by_its_schedule() -> None:
    # Its liveness alone would fit the step; its schedule does not: the graph keeps the plan
    # it ran, and is not planned again for as loose a target.
    schedules: dict[str, tuple[int, int]] = {}
    step, asked, _ = _inductor_step(schedules, under=2_200)
    g = step.graphs["G"]
    share = BUDGET - HEADROOM - START
    new = json.dumps({"offloaded_bytes": 1024, "forward_peak_bytes": 13_000,
                      "backward_peak_bytes": share - 200})
    schedules[new] = (11_000, share + 100)
    use_room(step)
    assert len(asked) == 1 and g.compiled[0] == "first plan"
    assert (g.forward_peak, g.backward_peak) == (11_000, 11_500) and step.fits()
    use_room(step)
    assert len(asked) == 1


def test_under_inductor_a_new_plan_without_its_schedule_is_not_kept() -> None:
    # Served by a warm cache without its figures: its schedule is not known, and its liveness,
    # which fits, is no bound on it.
    step, asked, _ = _inductor_step({}, under=2_200)
    use_room(step)
    assert len(asked) == 1 and step.graphs["G"].compiled[0] == "first plan"
    assert step.replanning_steps == 0
