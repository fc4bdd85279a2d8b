"""The graph's target under ``memory_budget``, and its plan's figures back to the step.

The partitioner's ``budget`` stage asks the step (:mod:`fxckpt.planning.step_budget`) what its
budget in bytes leaves this graph's own forward and backward; a fraction becomes bytes in the
``plan`` stage, between the lowest plan and the plain one; once the graphs are rewritten, the
kept plan's figures go back to the step, which judges a miss.
"""

from __future__ import annotations

import warnings

from fxckpt.errors import BudgetError
from fxckpt.graph.activations import saved_inputs
from fxckpt.passes.context import Context
from fxckpt.planning import step_budget
from fxckpt.planning.account import PeakTarget
from fxckpt.planning.plan import plan_payload
from fxckpt.planning.plan_round import RoundPlanner, hints


def report(ctx: Context) -> None:
    """The kept plan's figures to the step; a miss with no step to judge it raises here."""
    assert ctx.plan is not None and ctx.live is not None
    if ctx.ticket is not None:
        decision = ctx.attempt.decision if ctx.attempt is not None else None
        ctx.ticket.planned(*ctx.peaks, ctx.held, over=ctx.over, lowest=ctx.lowest or ctx.over > 0,
                           sizes=ctx.sizes, pool_capped=bool(decision and decision.host_capped),
                           payload=plan_payload(ctx.plan))  # fmt: skip
    elif ctx.target is not None and ctx.over > 0:
        error = BudgetError(ctx.graph_name, ctx.target.largest, ctx.target.largest + ctx.over,
                            hints(ctx.options), ctx.sizes, scope="step")
        if ctx.options.on_infeasible == "raise":
            raise error
        warnings.warn(f"{error.summary} Running the smallest plan instead.", stacklevel=2)


def budget_stage(ctx: Context) -> None:
    """The graph's target in bytes: what the step's budget leaves its own forward and backward
    once the rest of the step is counted around them (a fraction's waits for the plan stage)."""
    ctx.ticket = step_budget.current()
    budget = ctx.options.resolve_budget(device=ctx.device)
    if budget is None:
        return
    if ctx.ticket is None:
        ctx.target = PeakTarget(budget, budget)
    else:
        assert ctx.base is not None
        saved = saved_inputs(ctx.base[0], ctx.num_fwd_outputs, ctx.ticket.produced)
        ctx.target = ctx.ticket.target(budget, ctx.graph_name, saved)
    if ctx.lowered:
        ctx.target = ctx.target.lowered(ctx.lowered)


def search_blocks(ctx: Context) -> bool:
    # Blocks are recomputed only where the user left segment_stride unset: a default is not a
    # constraint, a stride the user chose (0 included) is.
    opts = ctx.options
    return not opts.is_explicit("segment_stride") and ctx.stride == 0


def fraction_stage(ctx: Context) -> None:
    """A fraction ``f`` of the way from the lowest plan's step peak to plain min-cut's, in the
    planner's model: the graph's target in bytes."""
    assert ctx.part is not None and ctx.base is not None
    fraction = ctx.options.memory_budget
    assert isinstance(fraction, float)
    planner = RoundPlanner(ctx.options, None, ctx.device, ctx.blocks, ctx.num_fwd_outputs,
                           ctx.requests, ctx.assumed)  # fmt: skip
    live = ctx.part_live(ctx.part)
    _, floor = planner.plan_range(ctx.part, live, search_blocks=search_blocks(ctx))
    untagged = ctx.part.fw is ctx.base[0] and ctx.part.bw is ctx.base[1]
    plain = live.peak if untagged else ctx.live_of(*ctx.base).peak
    floor = min(floor, plain)
    ctx.span = (plain, floor)
    own = floor + int(fraction * (plain - floor))
    ctx.target = PeakTarget(own, own).lowered(ctx.lowered) if ctx.lowered else PeakTarget(own, own)
    if ctx.ticket is not None:
        ctx.ticket.fraction_target(ctx.target, plain, floor)
