"""The partitioner pipeline: :data:`STAGES`, run in order over one :class:`Context`.

    cse               deduplicate the joint graph once, as min-cut would each run
    streamed weights  passes.weights: a streamed weight's device copy is never saved
    blocks            graph.blocks: find the repeated blocks and number them
    baseline min-cut  what torch alone would save (the plan's yardstick)
    budget            the graph's target: what its own forward and backward may hold for the
                      step's device peak to fit memory_budget (planning.step_budget)
    segment           passes.segment: tag segment interiors PREFER_RECOMPUTE (a stride)
    min-cut           torch's min-cut on the tagged graph; graph.activations: the saved
                      tensors, bytes per storage, lifetimes
    assumptions       the cost model's figures (bandwidth, compute rates, overheads)
    plan              passes.rounds: planning.plan_round decides (keep / recompute / offload
                      per storage, the blocks and single ops to recompute) with every byte the
                      partition holds at each position counted, the decision is carried out
                      (re-tag, min-cut again) and the next round decides; a fraction becomes
                      bytes here, between the lowest plan and the plain one
    settle            the Plan: every saved tensor's decision and reason, figures, notes
    offload           passes.offload: offload / prefetch / wait ops where passes.schedule
                      places them
    weight copies     passes.weights: weights kept on the device across steps where the target
                      leaves room; every other streamed weight's copy issued ahead of its use
    saved layouts     (Inductor) passes.saved_layout: saved graph inputs keep their layout
    note              the step's figures from the rewritten graphs' liveness, and the
                      forward's note of what it keeps
    pin positions     (Inductor) passes.schedule: every planned position holds in codegen
    log               the plan, to the log and the structured trace

Under a budget the stages run again, from a copy of the joint graph, where the rewritten
graphs' liveness holds more than the planner's model predicted: with the target lowered by the
overrun, at most :data:`MAX_PLANS` times in all (:func:`partition`).

Each stage is a function of the context; :mod:`fxckpt.passes.pipeline` runs them, times
each, and tells listeners (``fxckpt inspect``'s progress lines) when one is done.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch.fx as fx

from fxckpt._torch_compat import (
    dedup_joint,
    lazy_graph_modules,
)
from fxckpt.graph.activations import (
    bytes_per_storage,
    device_of,
    saved_activations,
)
from fxckpt.graph.blocks import find_blocks
from fxckpt.graph.costs import assumptions, node_flops
from fxckpt.graph.liveness import held_for_backward
from fxckpt.graph.sizes import planning_at
from fxckpt.options import Options
from fxckpt.passes.context import MAX_PLANS, Context
from fxckpt.passes.cutting import gc_frozen
from fxckpt.passes.inductor_peak import tag_graphs
from fxckpt.passes.note import insert_note, resident_names
from fxckpt.passes.offload import insert_offloads
from fxckpt.passes.pipeline import Stage, log_plan, run
from fxckpt.passes.rounds import (
    Attempt,
    GraphPair,
    Rounds,
    clone_joint,
    if_feasible,
    plan_rounds,
)
from fxckpt.passes.saved_layout import keep_input_layouts
from fxckpt.passes.schedule import pin_positions, placements
from fxckpt.passes.segment import segment_of, tag_segments
from fxckpt.passes.shape_budget import (
    check_attempt,
    ranged_symbols,
    sizes_note,
    upper_bounds_to_plan_for,
)
from fxckpt.passes.step_target import budget_stage, fraction_stage, report, search_blocks
from fxckpt.passes.weights import place_weights, tag_streamed
from fxckpt.planning import step_budget
from fxckpt.planning.account import PeakTarget
from fxckpt.planning.plan import Plan, plan_payload
from fxckpt.planning.plan_round import (
    Partition,
    infeasible,
    settle,
    timeline,
)
from fxckpt.planning.planner import build_plan
from fxckpt.planning.problem import segment_recompute_ms, user_offload_requests
from fxckpt.planning.size_range import fit_range
from fxckpt.planning.weights import step_estimate
from fxckpt.units import format_bytes, option_value

log = logging.getLogger(__name__)


def partition(
    joint: fx.GraphModule,
    joint_inputs: Any,
    options: Options,
    *,
    graph_name: str,
    num_fwd_outputs: int,
    record: Callable[[Plan], str],
    inductor: bool = False,
    measured: Mapping[str, float] | None = None,
    **kwargs: Any,
) -> GraphPair:
    """Partition ``joint`` into forward and backward graphs that carry out fxckpt's plan:
    the :data:`STAGES`, in order, over one :class:`Context`.

    Under a budget, where the rewritten graphs hold more than the graph's target (the
    planner's model is not their liveness), the stages run again from a copy of the joint
    graph with the target lowered by the overrun, at most :data:`MAX_PLANS` plans in all; the
    first that holds is kept, else the lowest, which the step reports
    (:mod:`fxckpt.planning.step_budget`). Only the plan kept is recorded.

    ``inductor``: Inductor compiles the result (see :func:`insert_note`). ``measured``:
    figures measured at run time that replace the cost model's (a re-plan, ``fxckpt.adapt``).
    """
    # A re-plan for the step plans at the ranges its graph's first plan saw: a range dynamo
    # narrowed since (a guard Inductor added, say) is not one the user fixed.
    ticket = step_budget.current()
    ranged = ranged_symbols(joint) if ticket is None else ticket.ranged(ranged_symbols(joint))
    bounds = upper_bounds_to_plan_for(joint, options, ranged)
    if bounds:
        log.info("fxckpt: planning for the longest lengths: %s", sorted(map(str, bounds.items())))

    def once(joint: fx.GraphModule, lowered: int) -> Context:
        ctx = Context(joint, joint_inputs, options, graph_name, num_fwd_outputs, inductor,
                      measured, {**kwargs, "num_fwd_outputs": num_fwd_outputs}, bounds,
                      lowered=lowered)  # fmt: skip
        return run(ctx, graph_name, STAGES)

    with lazy_graph_modules(), gc_frozen(), planning_at(bounds, ranged):
        # Bytes are a bound: a plan over it is planned again. A fraction is a point between the
        # graph's own lowest and plain plans: the plan made for it stands.
        bound = options.memory_budget is not None and not isinstance(options.memory_budget, float)
        spare = clone_joint(joint) if bound else None
        tries = [once(joint, 0)]
        while (spare is not None and tries[-1].over > 0 and not tries[-1].lowest
               and len(tries) < MAX_PLANS):
            last = tries[-1]
            log.info("fxckpt[%s] the rewritten graphs hold %d bytes over the target (forward %d, "
                     "backward %d); planning again %d bytes lower", graph_name, last.over,
                     *last.peaks, last.lowered + last.over)  # fmt: skip
            tries.append(once(clone_joint(spare), last.lowered + last.over))
        fits = [c for c in tries if c.over == 0]
        if not fits and spare is not None and tries[-1].target is not None:
            # No plan holds: the error names the smallest budget, so plan the lowest one
            # (every target at its least) if no try was that already.
            least = tries[-1].lowered + tries[-1].target.largest
            tries.append(once(clone_joint(spare), least))
            fits = [c for c in tries if c.over == 0]
        first = tries[0].target
        ctx = fits[0] if fits or first is None else min(
            tries, key=lambda c: first.over_by(c.peaks[0], c.peaks[1], c.held))
        report(ctx)
        assert ctx.plan is not None
        record(ctx.plan)
    assert ctx.fw is not None and ctx.bw is not None
    return ctx.fw, ctx.bw


def _cse(ctx: Context) -> None:
    # min-cut deduplicates the joint graph first; fxckpt runs min-cut two or more times, so
    # it deduplicates once here and every run skips that step.
    dedup = dedup_joint(ctx.joint)
    ctx.deduplicated = dedup is not None
    ctx.joint = dedup if dedup is not None else ctx.joint
    ctx.sizes = sizes_note(ctx.joint)  # under dynamic shapes, the lengths this plan is made for


def _tag_weights(ctx: Context) -> None:
    ctx.streamed = tag_streamed(ctx.joint)


def _weight_copies(ctx: Context) -> None:
    """Streamed weights: their copies scheduled ahead of each use, and kept on the device
    across steps where the target leaves room beside the plan's own peak."""
    assert ctx.fw is not None and ctx.bw is not None and ctx.plan is not None
    room = None
    if ctx.target is not None:
        # The room beside the plan's peak with every weight streamed and each trainable
        # weight's gradient on its way to the host, as the graphs will run: scheduled on
        # copies first, so that the gradients' device bytes are not counted to the end.
        trial_fw, trial_bw, _, _ = place_weights(clone_joint(ctx.fw), clone_joint(ctx.bw),
                                                 ctx.options.runtime_settings().key(), None)
        live = ctx.live_of(trial_fw, trial_bw)
        room = min(ctx.target.forward - live.forward_peak, ctx.target.backward - live.backward_peak)
    ctx.fw, ctx.bw, ctx.plan.weights, note = place_weights(
        ctx.fw, ctx.bw, ctx.options.runtime_settings().key(), room, ctx.graph_name)
    ctx.plan.notes.append(note)
    if (est := step_estimate(ctx.plan)) is not None:
        ctx.plan.notes.append(f"weight copies: {est.forward_ms:.1f} ms on the host-to-device queue "
                              f"in the forward, {est.backward_ms:.1f} ms in the backward; "
                              f"estimated wait {est.exposed_ms:.1f} ms, and {est.host_ms:.1f} ms "
                              f"of the {est.copies} copies' op calls on the compute thread")


def _blocks(ctx: Context) -> None:
    opts = ctx.options
    ctx.blocks = find_blocks(ctx.joint, opts.blocks, block_index=opts.block_index)


def _baseline(ctx: Context) -> None:
    # With a stride, the tagged copy is made first and the rounds re-tag copies of it, so the
    # baseline min-cut may consume the joint graph instead of a copy.
    ctx.source = clone_joint(ctx.joint) if ctx.stride > 0 else ctx.joint
    base_fw, base_bw = ctx.base = ctx.cut(ctx.joint, consume=ctx.stride > 0)
    ctx.baseline = saved_activations(base_fw, base_bw, ctx.num_fwd_outputs, ctx.blocks)
    ctx.device = device_of(base_fw)


def _segment(ctx: Context) -> None:
    assert ctx.source is not None
    width = ctx.options.segment_width if ctx.options.segment_width is not None else ctx.stride
    ctx.report = tag_segments(ctx.source, ctx.blocks, ctx.stride, width)


def _min_cut(ctx: Context) -> None:
    assert ctx.source is not None and ctx.base is not None
    ctx.requests = user_offload_requests(ctx.source)
    ctx.segment_ms = segment_recompute_ms(ctx.source, ctx.options.cost_model, ctx.device)
    # Nothing tagged: the partition is the baseline's. Without a budget no round re-tags the
    # source, so min-cut may consume it.
    budgeted = ctx.options.memory_budget is not None
    fw, bw = ctx.base if ctx.report.tagged == 0 else ctx.cut(ctx.source, consume=not budgeted)
    ctx.part = Partition(fw, bw, saved_activations(fw, bw, ctx.num_fwd_outputs, ctx.blocks))


def _assumptions(ctx: Context) -> None:
    ctx.assumed = assumptions(ctx.options, ctx.device, ctx.measured)  # probes run once per device


def _plan(ctx: Context) -> None:
    """The planning rounds (each reports its own steps), then, over a range of sizes, the
    rounds again under tighter budgets until the plan holds at every size."""
    assert ctx.part is not None and ctx.source is not None and ctx.base is not None
    if isinstance(ctx.options.memory_budget, float):
        fraction_stage(ctx)
    options, target = ctx.options, ctx.target
    plan_at = functools.partial(
        plan_rounds, Attempt(None, ctx.part, Rounds(), ctx.report, ctx.segment_ms),
        source=ctx.source, cut=ctx.cut, blocks=ctx.blocks, options=options, device=ctx.device,
        num_fwd_outputs=ctx.num_fwd_outputs, requests=ctx.requests, assumed=ctx.assumed,
        graph_name=ctx.graph_name, live_of=ctx.part_live,
        search_blocks=target is not None and search_blocks(ctx),
    )  # fmt: skip
    attempt = plan_at(target)
    if ctx.sizes and target is not None and if_feasible(attempt):
        # Under dynamic shapes the plan holds at other sizes while its saved activations stay
        # within what they are here: everything else the graph holds grows with the sizes
        # too (attention's temporaries faster than what a plan saves), so a size that saves
        # more gets a plan of its own.
        assert attempt.decision is not None
        sim = attempt.decision.solution.sim
        fixed = attempt.decision.problem.timeline.fixed_resident or [0] * len(sim.resident)
        allowed = max(r - f for r, f in zip(sim.resident, fixed, strict=True))
        check = functools.partial(check_attempt, base_fw=ctx.base[0], baseline=ctx.baseline,
                                  options=options, budget=allowed)  # fmt: skip
        ctx.range_check = check(attempt)
        if ctx.range_check.shortfall is not None:
            def again(b: int) -> Attempt | None:
                return if_feasible(plan_at(target.lowered(allowed - b)))

            attempt, ctx.range_check, _, ctx.replans = fit_range(
                attempt, ctx.range_check, allowed, again, check, lambda a: a.peak,
            )  # fmt: skip
    ctx.attempt = attempt
    ctx.part, ctx.report = attempt.part, attempt.report
    ctx.fw, ctx.bw = attempt.part.fw, attempt.part.bw


def _recompute_flops(ctx: Context, seen: Mapping[str, Any], final: set[str]) -> dict[str, float]:
    """FLOPs to rebuild each tensor the final partition no longer saves: a single op's as its
    round priced it; a recomputed block's or segment's tensors, their producer's in the
    baseline's forward (``FlopCounterMode``'s formulas: matmuls, convolutions, attention)."""
    rounds = ctx.attempt.rounds if ctx.attempt is not None else None
    nodes = {n.name: n for n in ctx.base[0].graph.nodes} if ctx.base is not None else {}
    out: dict[str, float] = {}
    for name in seen:
        if name in final:
            continue
        if rounds is not None and name in rounds.flops:
            out[name] = rounds.flops[name]
        elif name in nodes:
            out[name] = node_flops(nodes[name])
    return out


def _settle(ctx: Context) -> None:
    """The plan: each saved tensor's decision with its reason, the figures and the notes."""
    assert ctx.attempt is not None and ctx.part is not None
    options, target, sizes, ticket = ctx.options, ctx.target, ctx.sizes, ctx.ticket
    decision, part, rounds, report = ctx.attempt.decision, ctx.part, ctx.attempt.rounds, ctx.report
    stride = ctx.stride
    width = options.segment_width if options.segment_width is not None else stride
    blocks = ctx.blocks
    segments = {b: seg for b in blocks.blocks if (seg := segment_of(b, stride, width)) is not None}
    segments.update(dict.fromkeys(rounds.layout.blocks, -1))
    notes = blocks.notes(stride) + rounds.notes()
    if report.kept_random:
        notes.append(f"{report.kept_random} random ops inside segments stay saved")
    if ticket is not None:
        notes += ticket.notes()
    elif target is not None:
        notes.append(f"target: the graph's own forward within {format_bytes(target.forward)}, "
                     f"its backward within {format_bytes(target.backward)}")
    if ctx.span is not None:
        plain, floor = ctx.span
        notes.append(f"memory_budget={option_value('memory_budget', options.memory_budget)}: {format_bytes(floor)} (the lowest "
                     f"plan) + {options.memory_budget} x ({format_bytes(plain)} (plain min-cut) - "
                     f"{format_bytes(floor)}), the graph's own step peak in the planner's model")
    if ctx.lowered:
        notes.append(f"target lowered by {format_bytes(ctx.lowered)}: an earlier plan's rewritten "
                     "graphs held that much over it")
    saved_peak: int | None = None
    plan_timeline = None
    solution_ms = 0.0
    if decision is not None:
        solution = settle(decision, part.saved, options, None, ctx.graph_name, sizes=sizes,
                          step=True)  # fmt: skip
        solution_ms = solution.cost_ms
        fixed = decision.problem.timeline.fixed_resident or [0] * len(solution.sim.resident)
        saved_peak = max((r - f for r, f in zip(solution.sim.resident, fixed, strict=True)), default=0)
        plan_timeline = timeline(decision.problem, solution.sim.resident, decision.solution.budget_bytes,
                                 solution_ms, offsets=decision.offsets)  # fmt: skip
        if sizes:
            notes.append(f"planned for {sizes}")
            if ctx.replans:
                notes.append(f"re-planned {ctx.replans} time(s) under a lower target at the upper "
                             "end, for the budget to hold over the range fixed by mark_dynamic")  # fmt: skip
            if (short := ctx.range_check.shortfall) is not None:
                infeasible(ctx.graph_name, short.allowed, short.kept, options, sizes=short.at)
                notes.append(f"over {ctx.range_check.what} at {short.at}: {format_bytes(short.kept)} "
                             f"against {format_bytes(short.allowed)}")  # fmt: skip
            notes += ctx.range_check.install()
    seen = {a.name: a for a in ctx.baseline}
    for name, a in rounds.rebuilt.items():
        seen.setdefault(name, a)
    plan = ctx.plan = build_plan(
        ctx.graph_name,
        list(seen.values()),
        part.saved,
        decision.choices if decision is not None else {},
        segment_of_block=segments,
        recompute_reasons=rounds.reasons,
        keep_reasons={n: r for n, r in rounds.reasons.items() if n in rounds.saved},
        flops=_recompute_flops(ctx, seen, {a.name for a in part.saved}),
        budget_bytes=ticket.budget if ticket is not None else (target.largest if target else None),
        resident_peak_bytes=saved_peak,
        est_overhead_ms=ctx.attempt.segment_ms + rounds.recompute_ms + solution_ms,
        options=options.to_dict(),
        notes=notes,
    )
    plan.baseline_saved_bytes = bytes_per_storage(ctx.baseline)
    plan.step_inputs_bytes = ticket.saved_inputs if ticket is not None else 0
    plan.timeline = plan_timeline
    plan.assumptions = ctx.assumed
    if target is not None:
        plan.target = {"forward_bytes": target.forward, "backward_bytes": target.backward}
        if target.held is not None:
            plan.target["held_bytes"] = target.held
        if target.runs:  # each run's room, by which the step judges the plan (account.PeakTarget)
            plan.target["runs"] = [list(r) for r in target.runs]
            if target.cap is not None:
                plan.target["cap_bytes"] = target.cap


def _offload(ctx: Context) -> None:
    assert ctx.fw is not None and ctx.bw is not None and ctx.part is not None and ctx.attempt
    placed = placements(ctx.fw, ctx.bw, ctx.part, ctx.attempt.decision, ctx.options, ctx.inductor)
    profile = ctx.options.runtime_settings().key()
    ctx.fw, ctx.bw = insert_offloads(ctx.fw, ctx.bw, placed, profile, inductor=ctx.inductor)


def _saved_layouts(ctx: Context) -> None:
    assert ctx.fw is not None and ctx.bw is not None and ctx.plan is not None
    ctx.plan.notes += keep_input_layouts(ctx.fw, ctx.bw, ctx.num_fwd_outputs).note()


def _note(ctx: Context) -> None:
    """The step's figures from the rewritten graphs (their liveness; under Inductor, what it
    fuses left out), and the forward's note."""
    assert ctx.fw is not None and ctx.bw is not None and ctx.plan is not None
    assert ctx.part is not None and ctx.attempt is not None
    ctx.live = ctx.live_of(ctx.fw, ctx.bw)
    ctx.held = held_for_backward(ctx.fw, ctx.num_fwd_outputs)
    plan = ctx.plan
    plan.predicted_step_peak_bytes = ctx.live.peak
    plan.forward_peak_bytes, plan.backward_peak_bytes = ctx.peaks
    plan.held_bytes = ctx.held
    if ctx.span is not None and ctx.target is not None:
        # A fraction's own peak is where the planner's model put it; the rewritten graphs may
        # hold a little more: that, in bytes, is the budget the plan holds.
        own = max(*ctx.peaks, ctx.target.largest)
        if ctx.ticket is not None:
            ctx.ticket.fraction_target(PeakTarget(own, own), *ctx.span)
            plan.budget_bytes = ctx.ticket.budget
        plan.target = {"forward_bytes": own, "backward_bytes": own}
    if ctx.ticket is not None:
        plan.step = ctx.ticket.account(*ctx.peaks, ctx.held)
    payload = plan_payload(plan)
    resident = resident_names(ctx.fw, ctx.part.saved, ctx.attempt.decision)
    anchor = ctx.device if ctx.inductor else None
    ctx.fw = insert_note(ctx.fw, resident, payload, anchor_device=anchor)
    if ctx.inductor:  # Inductor's schedules of the two graphs give the step peak it allocates
        tag_graphs(ctx.fw, ctx.bw, payload)


def _pin_positions(ctx: Context) -> None:
    assert ctx.fw is not None and ctx.bw is not None
    ctx.fw, ctx.bw = pin_positions(ctx.fw), pin_positions(ctx.bw)


def _log(ctx: Context) -> None:
    assert ctx.plan is not None
    log_plan(ctx.plan)


def _under_inductor(ctx: Context) -> bool:
    return ctx.inductor


# The partitioner, top to bottom (docs/how-it-works.md draws it).
STAGES: tuple[Stage[Context], ...] = (
    Stage("cse", _cse),
    Stage("streamed weights", _tag_weights),
    Stage("blocks", _blocks),
    Stage("baseline min-cut", _baseline),
    Stage("budget", budget_stage, report=False),
    Stage("segment", _segment, when=lambda ctx: ctx.stride > 0),
    Stage("min-cut", _min_cut),
    Stage("assumptions", _assumptions),
    Stage("plan", _plan, report=False),  # its rounds report themselves
    Stage("settle", _settle, report=False),
    Stage("offload", _offload),
    Stage("weight copies", _weight_copies, when=lambda ctx: ctx.streamed > 0),
    Stage("saved layouts", _saved_layouts, when=_under_inductor),
    Stage("note", _note),
    Stage("pin positions", _pin_positions, when=_under_inductor),
    Stage("log", _log, report=False),
)
