"""The partitioner pipeline: :data:`STAGES`, run in order over one :class:`Context`.

    cse               deduplicate the joint graph once, as min-cut would each run
    streamed weights  passes.weights: a streamed weight's device copy is never saved
    blocks            graph.blocks: find the repeated blocks and number them
    baseline min-cut  what torch alone would save (the plan's yardstick)
    budget            the budget in bytes; under a step budget, this graph's share
    device budget     (device_budget) what streamed weights' copies leave bounds the saved ones
    segment           passes.segment: tag segment interiors PREFER_RECOMPUTE (a stride)
    min-cut           torch's min-cut on the tagged graph; graph.activations: the saved
                      tensors, bytes per storage, lifetimes
    assumptions       the cost model's figures (bandwidth, compute rates, overheads)
    plan              passes.rounds: planning.plan_round decides (keep / recompute / offload
                      per storage, the blocks and single ops to recompute), the decision is
                      carried out (re-tag, min-cut again) and the next round decides; over a
                      range fixed by mark_dynamic, planning.size_range plans again under a
                      tighter budget until the plan holds at every size
    settle            the Plan: every saved tensor's decision and reason, figures, notes
    offload           passes.offload: offload / prefetch / wait ops where passes.schedule
                      places them
    weight copies     passes.weights: under device_budget, weights kept across steps where
                      room is left; every other streamed weight's copy issued ahead of its use
    saved layouts     (Inductor) passes.saved_layout: saved graph inputs keep their layout
    note              the predicted step peak, and the forward's note of what it keeps
    pin positions     (Inductor) passes.schedule: every planned position holds in codegen
    log               the plan, to the log and the structured trace

Under ``peak_budget`` the stages run again, each time from a copy of the joint graph, with the
saved activations held lower until the predicted step peak fits (:mod:`fxckpt.passes.peak_fit`).

Each stage is a function of the context; :mod:`fxckpt.passes.pipeline` runs them, times
each, and tells listeners (``fxckpt inspect``'s progress lines) when one is done.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx

from fxckpt._torch_compat import (
    dedup_joint,
    lazy_graph_modules,
)
from fxckpt.errors import BudgetError
from fxckpt.graph.activations import (
    SavedActivation,
    bytes_per_storage,
    device_of,
    saved_activations,
    saved_inputs,
)
from fxckpt.graph.blocks import BlockFacts, find_blocks
from fxckpt.graph.costs import assumptions
from fxckpt.graph.liveness import step_peak_bytes
from fxckpt.graph.sizes import planning_at
from fxckpt.options import Options
from fxckpt.passes.cutting import gc_frozen, min_cut
from fxckpt.passes.inductor_peak import tag_graphs
from fxckpt.passes.note import insert_note, resident_names
from fxckpt.passes.offload import insert_offloads
from fxckpt.passes.peak_fit import fit_peak
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
from fxckpt.passes.schedule import fused_intermediates, pin_positions, placements
from fxckpt.passes.segment import SegmentReport, segment_of, tag_segments
from fxckpt.passes.shape_budget import (
    BudgetCheck,
    check_attempt,
    sizes_note,
    upper_bounds_to_plan_for,
)
from fxckpt.passes.weights import activation_room, place_weights, tag_streamed
from fxckpt.planning import step_budget
from fxckpt.planning.plan import Plan, plan_payload
from fxckpt.planning.plan_round import Partition, infeasible, settle, timeline
from fxckpt.planning.planner import build_plan
from fxckpt.planning.problem import segment_recompute_ms, user_offload_requests
from fxckpt.planning.size_range import fit_range
from fxckpt.planning.weights import step_estimate

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Context:
    """One graph's partition as it goes through the stages: the inputs, then what each
    stage adds, in stage order. ``bounds`` are the sizes the plan is made for (the upper
    ends of ranges fixed by ``mark_dynamic``; empty under static shapes)."""

    # The partitioner's inputs.
    joint: fx.GraphModule
    joint_inputs: Any
    options: Options
    graph_name: str
    num_fwd_outputs: int
    record: Callable[[Plan], str]
    inductor: bool
    measured: Mapping[str, float] | None
    min_cut_kwargs: dict[str, Any]
    bounds: dict[Any, int]
    # cse
    deduplicated: bool = False
    sizes: str = ""
    # streamed weights
    streamed: int = 0  # stream_in nodes of the joint graph
    weight_lead: int | None = None  # device budget: a prefetch lead smaller than the default
    short_lead: bool = False  # planned again with it: the default left the activations too little
    # peak_budget (passes.peak_fit): what the saved activations are held to, and the plan's
    # note that says why
    act_cap: int | None = None
    cap_note: str = ""
    capped: bool = False  # the cap, not a budget of the user's, bounds the plan: its miss is judged there
    # blocks
    blocks: BlockFacts = dataclasses.field(default_factory=lambda: BlockFacts("none"))
    source: fx.GraphModule | None = None  # the joint graph that segments tag
    # baseline min-cut
    base: GraphPair | None = None
    baseline: list[SavedActivation] = dataclasses.field(default_factory=list)
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    # budget
    budget: int | None = None
    ticket: step_budget.Ticket | None = None
    # segment, min-cut
    report: SegmentReport = dataclasses.field(default_factory=lambda: SegmentReport({}, 0, 0, 0))
    requests: set[str] = dataclasses.field(default_factory=set)
    segment_ms: float = 0.0
    part: Partition | None = None
    # assumptions, plan
    assumed: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    attempt: Attempt | None = None
    range_check: BudgetCheck = dataclasses.field(default_factory=BudgetCheck)
    replans: int = 0
    # settle, offload, note, pin positions: the plan and the graphs that carry it out
    plan: Plan | None = None
    fw: fx.GraphModule | None = None
    bw: fx.GraphModule | None = None

    @property
    def stride(self) -> int:
        return self.options.segment_stride

    def cut(self, gm: fx.GraphModule, consume: bool = False) -> GraphPair:
        return min_cut(gm, joint_inputs=self.joint_inputs, deduplicated=self.deduplicated,
                       consume=consume, **self.min_cut_kwargs)  # fmt: skip


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

    ``inductor``: Inductor compiles the result (see :func:`insert_note`). ``measured``:
    figures measured at run time that replace the cost model's (a re-plan, ``fxckpt.adapt``).
    """
    bounds = upper_bounds_to_plan_for(joint, options)
    if bounds:
        log.info("fxckpt: planning for the longest lengths: %s", sorted(map(str, bounds.items())))

    def once(joint: fx.GraphModule, record: Callable[[Plan], str], cap: int | None = None,
             note: str = "") -> Context:
        args = (joint_inputs, options, graph_name, num_fwd_outputs, record, inductor, measured,
                {**kwargs, "num_fwd_outputs": num_fwd_outputs}, bounds)
        # device_budget: where the default lead leaves the activations too little, one weight ahead.
        again = clone_joint(joint) if options.device_budget is not None else None
        ctx = Context(joint, *args, act_cap=cap, cap_note=note)
        try:
            run(ctx, graph_name, STAGES)
        except BudgetError as e:
            if again is None or e.option != "device_budget" or ctx.weight_lead is not None:
                raise
            ctx = Context(again, *args, short_lead=True, act_cap=cap, cap_note=note)  # min-cut consumed the joint
            run(ctx, graph_name, STAGES)
        return ctx

    # Planned more than once (each plan from a copy: min-cut consumes the joint), only the plan
    # kept is recorded: its forward carries that payload already.
    def trial(cap: int | None, note: str) -> Context:
        return once(clone_joint(joint), plan_payload, cap, note)

    plan_of = operator.attrgetter("plan")
    with lazy_graph_modules(), gc_frozen(), planning_at(bounds):
        if options.peak_budget is not None:
            ctx = fit_peak(trial, plan_of, options, graph_name)
        else:
            ctx = once(joint, record)
        if ctx.record is not record:
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
    assert ctx.fw is not None and ctx.bw is not None and ctx.plan is not None
    total = ctx.options.device_budget
    room = None if total is None else int(total) - ctx.plan.resident_peak_bytes
    ctx.fw, ctx.bw, ctx.plan.weights, note = place_weights(
        ctx.fw, ctx.bw, ctx.options.runtime_settings().key(), room, ctx.weight_lead)
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


def _budget(ctx: Context) -> None:
    baseline_bytes = bytes_per_storage(ctx.baseline)
    ctx.budget = ctx.options.resolve_budget(baseline_bytes, device=ctx.device)
    ctx.ticket = step_budget.current()  # one graph of a step: its share of the step's budget
    if ctx.ticket is not None and ctx.budget is not None:
        assert ctx.base is not None
        inputs = saved_inputs(ctx.base[0], ctx.num_fwd_outputs, ctx.ticket.produced)
        ctx.budget = ctx.ticket.share(baseline_bytes, ctx.graph_name, inputs)


def _device_budget(ctx: Context) -> None:
    """Under ``device_budget``: what the streamed weights do not take bounds the saved
    activations (with ``memory_budget``, the smaller of the two)."""
    room, ctx.weight_lead = activation_room(ctx.joint, ctx.options.device_budget, ctx.graph_name,
                                            short=ctx.short_lead)
    ctx.budget = room if ctx.budget is None else min(ctx.budget, room)


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
    fw, bw = ctx.base if ctx.report.tagged == 0 else ctx.cut(ctx.source, consume=ctx.budget is None)
    ctx.part = Partition(fw, bw, saved_activations(fw, bw, ctx.num_fwd_outputs, ctx.blocks))


def _assumptions(ctx: Context) -> None:
    ctx.assumed = assumptions(ctx.options, ctx.device, ctx.measured)  # probes run once per device


def _plan(ctx: Context) -> None:
    """The planning rounds (each reports its own steps), then, over a range of sizes, the
    rounds again under tighter budgets until the plan holds at every size."""
    assert ctx.part is not None and ctx.source is not None and ctx.base is not None
    if ctx.act_cap is not None and (ctx.budget is None or ctx.act_cap < ctx.budget):
        ctx.budget, ctx.capped = ctx.act_cap, True
    options, budget, stride = ctx.options, ctx.budget, ctx.stride
    # Blocks are recomputed only where the user left segment_stride unset: a default is not a
    # constraint, a stride the user chose (0 included) is.
    plan_at = functools.partial(
        plan_rounds, Attempt(None, ctx.part, Rounds(), ctx.report, ctx.segment_ms),
        source=ctx.source, cut=ctx.cut, blocks=ctx.blocks, options=options, device=ctx.device,
        num_fwd_outputs=ctx.num_fwd_outputs, requests=ctx.requests, assumed=ctx.assumed,
        graph_name=ctx.graph_name,
        search_blocks=budget is not None and not options.is_explicit("segment_stride") and stride == 0,
    )  # fmt: skip
    attempt = plan_at(budget)
    if ctx.sizes and budget is not None and if_feasible(attempt):
        check = functools.partial(check_attempt, base_fw=ctx.base[0], baseline=ctx.baseline,
                                  options=options, budget=budget)  # fmt: skip
        ctx.range_check = check(attempt)
        if ctx.range_check.shortfall is not None:
            attempt, ctx.range_check, ctx.budget, ctx.replans = fit_range(
                attempt, ctx.range_check, budget, lambda b: if_feasible(plan_at(b)), check,
                lambda a: a.peak,
            )  # fmt: skip
    ctx.attempt = attempt
    ctx.part, ctx.report = attempt.part, attempt.report
    ctx.fw, ctx.bw = attempt.part.fw, attempt.part.bw


def _settle(ctx: Context) -> None:
    """The plan: each saved tensor's decision with its reason, the figures and the notes."""
    assert ctx.attempt is not None and ctx.part is not None
    options, budget, sizes, ticket = ctx.options, ctx.budget, ctx.sizes, ctx.ticket
    decision, part, rounds, report = ctx.attempt.decision, ctx.part, ctx.attempt.rounds, ctx.report
    stride = ctx.stride
    width = options.segment_width if options.segment_width is not None else stride
    blocks = ctx.blocks
    segments = {b: seg for b in blocks.blocks if (seg := segment_of(b, stride, width)) is not None}
    segments.update(dict.fromkeys(rounds.layout.blocks, -1))
    notes = blocks.notes(stride) + rounds.notes()
    if ctx.cap_note:
        notes.append(ctx.cap_note)
    if report.kept_random:
        notes.append(f"{report.kept_random} random ops inside segments stay saved")
    peak = plan_timeline = None
    solution_ms = 0.0
    if decision is not None:
        solution = settle(decision, part.saved, options, budget, ctx.graph_name, sizes=sizes,
                          step=ticket is not None or ctx.capped)  # fmt: skip
        peak, solution_ms = solution.sim.peak, solution.cost_ms
        if ticket is not None:
            kinds = zip(decision.storages, solution.choices, strict=True)
            kept = [s.bytes for s, k in kinds if k == "keep"]
            ticket.planned(peak, sum(kept), reached=solution.feasible, sizes=sizes,
                           pool_capped=decision.host_capped)  # fmt: skip
            notes += ticket.notes()
        plan_timeline = timeline(decision.problem, solution.sim.resident, budget, solution_ms)
        if sizes:
            notes.append(f"planned for {sizes}")
            if ctx.replans:
                notes.append(f"re-planned {ctx.replans} time(s), now under {budget} bytes at the "
                             "upper end, for the budget to hold over the range fixed by mark_dynamic")  # fmt: skip
            if (short := ctx.range_check.shortfall) is not None:
                infeasible(ctx.graph_name, short.allowed, short.kept, options, sizes=short.at)
                notes.append(f"over {ctx.range_check.what} at {short.at}: {short.kept} bytes "
                             f"against {short.allowed}")  # fmt: skip
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
        flops=rounds.flops,
        budget_bytes=budget,
        resident_peak_bytes=peak,
        est_overhead_ms=ctx.attempt.segment_ms + rounds.recompute_ms + solution_ms,
        options=options.to_dict(),
        notes=notes,
    )
    plan.baseline_saved_bytes = bytes_per_storage(ctx.baseline)
    plan.step_inputs_bytes = ticket.inputs() if ticket is not None else 0
    plan.timeline = plan_timeline
    plan.assumptions = ctx.assumed


def _offload(ctx: Context) -> None:
    assert ctx.fw is not None and ctx.bw is not None and ctx.part is not None and ctx.attempt
    placed = placements(ctx.fw, ctx.bw, ctx.part, ctx.attempt.decision, ctx.options, ctx.inductor)
    profile = ctx.options.runtime_settings().key()
    ctx.fw, ctx.bw = insert_offloads(ctx.fw, ctx.bw, placed, profile, inductor=ctx.inductor)


def _saved_layouts(ctx: Context) -> None:
    assert ctx.fw is not None and ctx.bw is not None and ctx.plan is not None
    ctx.plan.notes += keep_input_layouts(ctx.fw, ctx.bw, ctx.num_fwd_outputs).note()


def _note(ctx: Context) -> None:
    assert ctx.fw is not None and ctx.bw is not None and ctx.plan is not None
    assert ctx.part is not None and ctx.attempt is not None
    # Under Inductor, what it computes inside fused kernels never reaches memory.
    fused = fused_intermediates(ctx.fw) | fused_intermediates(ctx.bw) if ctx.inductor else set()
    ctx.plan.predicted_step_peak_bytes = step_peak_bytes(ctx.fw, ctx.bw, fused)
    payload = ctx.record(ctx.plan)
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
    Stage("budget", _budget, report=False),
    Stage("device budget", _device_budget, when=lambda ctx: ctx.options.device_budget is not None),
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
