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


def test_under_inductor_nothing_is_planned_again_for_room() -> None:
    # Inductor's figure for a new plan is its schedule, known only once the plan's backward
    # has run: the step could not judge a new plan before running it, so it keeps its plans.
    step, asked = _step(held=2600, backward=4000)
    step.options = Options(memory_budget=BUDGET, compiler="inductor")
    use_room(step)
    assert asked == []
