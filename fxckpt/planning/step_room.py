"""The room a step leaves under its budget, given back to the graphs that gave it up.

A graph's target is set from the figures known when it is planned: what the graphs before it
hold, and, for a graph that runs several times a step, its own plan's working set beside what
it keeps. A plan made for that target can leave room the step does not use: a layer graph
that offloads until its backward's peak fits keeps less for its backward than its target
allowed, and the earlier runs of it hold less than its target counted on. The step's account
sees that room once the step has run.

So where a step fits its budget with more than :data:`ROOM` of it unused, each graph whose
plan gave something up (it offloads or recomputes) and whose target, asked again with the
step's figures, grew, is planned again for that target: the largest holders first, at most
:data:`MAX_RAISES` times a graph. A new plan is kept only where the step's account, with its
figures, still fits the budget; else the graph goes back to the plan it ran, compiled as it
was, and keeps it. Nothing runs before it is judged, so the step's peak never rises above the
budget on the way.

Under Inductor a plan's figures are Inductor's own schedule of its two graphs, which can hold
less than the plan's liveness (values that stay inside fused kernels): the room a plan made
for its liveness leaves. A plan there is made again for its target raised by that difference,
with its backward compiled at once (``compat.backward_compiled_now``; it otherwise compiles at
its first run), so that the new plan's schedule, not its liveness, judges it before it runs.
A new plan whose schedule is not known then (a warm cache without its figures) is not kept.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from fxckpt import _torch_compat as compat
from fxckpt.planning.account import HEADROOM, PeakTarget
from fxckpt.planning.step_graphs import Graph, no_tighter, scheduled_figures, scheduled_gaps
from fxckpt.units import format_bytes

if TYPE_CHECKING:
    from fxckpt.planning.step_budget import StepBudget

log = logging.getLogger(__name__)

# The unused part of the budget, as a fraction of it, that makes a fitting step plan again.
ROOM = 1 / 40
# Re-plans for more room, per graph, until its next compile.
MAX_RAISES = 4
# What a graph's own plan is judged by, restored with its compiled graphs.
_FIGURES = ("forward_peak", "backward_peak", "held", "target", "over", "lowest", "known",
            "payload", "sizes", "pool_capped")


def use_room(step: StepBudget) -> None:
    """Plan again, for the room the step leaves, each graph that gave something up to fit."""
    from fxckpt.planning.step_budget import MAX_REPLANS

    budget = step.budget
    assert budget is not None
    inductor = step.options.compiler == "inductor"
    raised = 0
    for k, _ in step.holders():
        spare = budget - HEADROOM - step.account().peak
        if spare < budget * ROOM or step.replans >= MAX_REPLANS:
            break
        g = step.graphs[k]
        if g.recompile is None or not g.known or g.target is None or g.raises >= MAX_RAISES:
            continue
        want = step.target(k)  # numbers only (under Inductor its gaps read the plan's JSON)
        if inductor:  # a plan is made for its liveness; its schedule held that much less
            want = want.raised(*scheduled_gaps(g, step.scheduled))
        if g.refused is not None and no_tighter(want, g.refused):
            continue  # as loose as a target whose plan did not fit: it would not fit either
        if not _grows(want, g, budget) or not _gave_up(g):
            continue
        before = {f: getattr(g, f) for f in _FIGURES}
        compiled = g.compiled[0] if g.compiled else None
        step.replans += 1
        g.raises += 1
        log.info("fxckpt[%s] the step leaves %s of its budget unused; planning it again for "
                 "more (forward within %s, backward within %s)", g.label, format_bytes(spare),
                 format_bytes(want.forward), format_bytes(want.backward))
        if inductor:
            with compat.backward_compiled_now():
                g.recompile(want)
            judged = scheduled_figures([g], step.scheduled) or step.scheduled(g.payload) is not None
        else:
            g.recompile(want)
            judged = True
        if g.known and judged and step.fits():
            raised += 1
            continue
        log.info("fxckpt[%s] the new plan does not fit the step; it keeps the plan it ran", g.label)
        for f, v in before.items():
            setattr(g, f, v)
        g.refused = want
        if compiled is not None:
            g.compiled[0] = compiled
    if raised:
        step.replanning_steps += 1
        step.eager.again()  # new plans: what the step holds beside them is measured again


def _gave_up(g: Graph) -> bool:
    """Whether the graph's plan offloads or recomputes anything (else more room keeps it)."""
    try:
        plan: dict[str, Any] = json.loads(g.payload) if g.payload else {}
    except ValueError:
        return False
    return bool(plan.get("offloaded_bytes") or plan.get("recomputed_bytes"))


def _grows(want: PeakTarget, g: Graph, budget: int) -> bool:
    """Whether ``want`` lets a phase of the graph have more than its target did, by a useful
    amount, and its plan as it runs meets it (so the plan it would replace fits it too)."""
    had = g.target
    assert had is not None
    step_bytes = budget // 200
    more = max(want.forward - had.forward, want.backward - had.backward)
    return more >= step_bytes and want.met_by(g.forward_peak, g.backward_peak, g.held)
