"""The partitioner pipeline, top to bottom.

    0. cse                 deduplicate the joint graph once, as min-cut would each run
    1. graph.blocks        find the repeated blocks and number them
    2. baseline min-cut    what torch alone would save (the plan's yardstick)
    3. passes.segment      tag segment interiors PREFER_RECOMPUTE, one ac_graph_id each
    4. torch min-cut       partition into forward and backward
    5. graph.activations   the saved tensors, bytes per storage, lifetimes
    6. planning rounds     passes.plan_round decides (keep / recompute / offload per
                           storage, the blocks and single ops to recompute); passes.rounds
                           carries a decision out: it re-tags the joint graph and runs
                           min-cut again, then asks the next round. Over a range of sizes
                           fixed by mark_dynamic, passes.size_range has the rounds run again
                           under a tighter budget until the plan holds at every size
    7. passes.offload      offload / prefetch / wait ops, and the saved-bytes note
    8. passes.saved_layout (Inductor) saved graph inputs leave in their own layout, so
                           Inductor's layout optimization saves no channels-last copy
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx

from fxckpt._torch_compat import (
    dedup_joint,
    lazy_graph_modules,
    min_cut_rematerialization_partition,
    min_cut_without_cse,
    trace_plan_artifact,
)
from fxckpt.graph.activations import (
    SavedActivation,
    bytes_per_storage,
    device_of,
    hoist_saved_views,
    saved_activations,
)
from fxckpt.graph.blocks import BlockFacts, find_blocks
from fxckpt.graph.costs import assumptions
from fxckpt.graph.liveness import step_peak_bytes
from fxckpt.options import Options
from fxckpt.passes import step_budget
from fxckpt.passes.budget import segment_recompute_ms, user_offload_requests
from fxckpt.passes.host import read_ahead, with_tiers
from fxckpt.passes.offload import BucketPlacement, Placement, insert_note, insert_offloads
from fxckpt.passes.plan_round import Partition, RoundDecision, infeasible, settle, timeline
from fxckpt.passes.rounds import (
    Attempt,
    GraphPair,
    Rounds,
    clone_joint,
    if_feasible,
    plan_rounds,
    step,
)
from fxckpt.passes.saved_layout import keep_input_layouts
from fxckpt.passes.schedule import coalesce, fused_intermediates, pin_positions, place_offloads
from fxckpt.passes.segment import SegmentReport, segment_of, tag_segments
from fxckpt.passes.shape_budget import BudgetCheck, check_budget, plan_for_longest, sizes_note
from fxckpt.passes.size_range import fit_range
from fxckpt.planning.plan import Plan, describe_assumptions
from fxckpt.planning.planner import build_plan

log = logging.getLogger(__name__)


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Keep Python's cyclic garbage collector off the objects that exist before a partition.

    A compile keeps close to a million objects alive, and partitioning builds and drops
    hundreds of thousands of FX objects, so full collections keep triggering and each one
    walks them all: about half of a min-cut run on a 24-layer decoder. ``gc.freeze()`` moves
    the existing objects out of the collector's reach for the length of the partition, which
    still collects its own garbage as it goes; ``gc.unfreeze()`` hands them back. Measured on
    that decoder with a segment stride (four compiles each): first step 5.24 s frozen, 5.77 s
    with the collector disabled instead, 6.58 s untouched.

    ``gc.unfreeze()`` thaws every frozen object, so where the program froze some itself (a
    server after start-up, say) the collector is paused instead, which leaves theirs alone.
    """
    if gc.get_freeze_count() > 0 or not gc.isenabled():
        enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if enabled:
                gc.enable()
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def min_cut(
    joint: fx.GraphModule,
    *,
    joint_inputs: Any,
    deduplicated: bool = False,
    consume: bool = False,
    **kwargs: Any,
) -> GraphPair:
    """torch's min-cut on a copy of ``joint``, or on ``joint`` itself where ``consume``
    (min-cut rewrites the graph it is given; nothing may use ``joint`` afterwards).

    ``deduplicated``: ``joint`` came from :func:`dedup_joint`, so min-cut skips its own
    common-subexpression pass (about 40 % of its time on a decoder).
    """
    run = min_cut_without_cse if deduplicated else min_cut_rematerialization_partition
    fw, bw = run(joint if consume else clone_joint(joint), joint_inputs, **kwargs)
    hoist_saved_views(fw)
    return fw, bw


def _partition_context(fn: Callable[..., GraphPair]) -> Callable[..., GraphPair]:
    """Run ``fn`` with lazy graph modules and the program's objects frozen (see above)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> GraphPair:
        with lazy_graph_modules(), gc_frozen():
            return fn(*args, **kwargs)

    return wrapper


@_partition_context
@plan_for_longest
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
    """Partition ``joint`` into forward and backward graphs that carry out fxckpt's plan.

    ``inductor``: Inductor compiles the result (see :func:`insert_note`). ``measured``:
    figures measured at run time that replace the cost model's (a re-plan, ``fxckpt.adapt``).
    """
    kwargs["num_fwd_outputs"] = num_fwd_outputs
    # min-cut deduplicates the joint graph first; fxckpt runs min-cut two or more times, so
    # it deduplicates once here and every run skips that step.
    with step(graph_name, "cse"):
        dedup = dedup_joint(joint)
    joint = dedup if dedup is not None else joint
    sizes = sizes_note(joint)  # under dynamic shapes, the lengths this plan is made for

    def cut(gm: fx.GraphModule, consume: bool = False) -> GraphPair:
        return min_cut(
            gm, joint_inputs=joint_inputs, deduplicated=dedup is not None, consume=consume, **kwargs
        )

    stride = options.segment_stride
    width = options.segment_width if options.segment_width is not None else stride
    with step(graph_name, "blocks"):
        blocks = find_blocks(joint, options.blocks, block_index=options.block_index)
    # With a stride, the tagged copy is made first and the rounds re-tag copies of it, so the
    # baseline min-cut may consume the joint graph instead of a copy.
    source = clone_joint(joint) if stride > 0 else joint
    with step(graph_name, "baseline min-cut"):
        base_fw, base_bw = cut(joint, consume=stride > 0)
        baseline = saved_activations(base_fw, base_bw, num_fwd_outputs, blocks)
    device = device_of(base_fw)
    budget = options.resolve_budget(bytes_per_storage(baseline), device=device)
    ticket = step_budget.current()  # one graph of a step: its share of the step's budget
    if ticket is not None and budget is not None:
        inputs = step_budget.saved_inputs(base_fw, num_fwd_outputs, ticket.produced)
        budget = ticket.share(bytes_per_storage(baseline), graph_name, inputs)
    report = SegmentReport({}, 0, 0, 0)
    if stride > 0:
        with step(graph_name, "segment"):
            report = tag_segments(source, blocks, stride, width)
    requests = user_offload_requests(source)
    segment_ms = segment_recompute_ms(source, options.cost_model, device)
    with step(graph_name, "min-cut"):
        # Nothing tagged: the partition is the baseline's. Without a budget no round re-tags
        # the source, so min-cut may consume it.
        fw, bw = (
            (base_fw, base_bw) if report.tagged == 0 else cut(source, consume=budget is None)
        )
        part = Partition(fw, bw, saved_activations(fw, bw, num_fwd_outputs, blocks))
    with step(graph_name, "assumptions"):
        assumed = assumptions(options, device, measured)  # probes run once per device
    # Blocks are recomputed only where the user left segment_stride unset: a default is not a
    # constraint, a stride the user chose (0 included) is.
    plan_at = functools.partial(
        plan_rounds, Attempt(None, part, Rounds(), report, segment_ms), source=source, cut=cut,
        blocks=blocks, options=options, device=device, num_fwd_outputs=num_fwd_outputs,
        requests=requests, assumed=assumed, graph_name=graph_name,
        search_blocks=budget is not None and not options.is_explicit("segment_stride") and stride == 0,
    )  # fmt: skip
    attempt = plan_at(budget)
    range_check, replans = BudgetCheck(), 0
    if sizes and budget is not None and if_feasible(attempt):
        check = functools.partial(_check_budget, base_fw=base_fw, baseline=baseline,
                                  options=options, budget=budget)  # fmt: skip
        range_check = check(attempt)
        if range_check.shortfall is not None:
            attempt, range_check, budget, replans = fit_range(
                attempt, range_check, budget, lambda b: if_feasible(plan_at(b)), check,
                lambda a: a.peak,
            )  # fmt: skip
    decision, part, rounds, report = attempt.decision, attempt.part, attempt.rounds, attempt.report
    fw, bw = part.fw, part.bw

    segments = {b: seg for b in blocks.blocks if (seg := segment_of(b, stride, width)) is not None}
    segments.update(dict.fromkeys(rounds.layout.blocks, -1))
    notes = _notes(blocks, stride) + rounds.notes()
    if report.kept_random:
        notes.append(f"{report.kept_random} random ops inside segments stay saved")
    peak = plan_timeline = None
    solution_ms = 0.0
    if decision is not None:
        solution = settle(decision, part.saved, options, budget, graph_name, sizes=sizes,
                          step=ticket is not None)  # fmt: skip
        peak, solution_ms = solution.sim.peak, solution.cost_ms
        if ticket is not None:
            kinds = zip(decision.storages, solution.choices, strict=True)
            kept = [s.bytes for s, k in kinds if k == "keep"]
            ticket.planned(peak, sum(kept), reached=solution.feasible, sizes=sizes,
                           pool_capped=decision.host_capped)  # fmt: skip
            notes += ticket.notes()
        plan_timeline = timeline(decision.problem, solution.sim.resident, budget)
        if sizes:
            notes.append(f"planned for {sizes}")
            if replans:
                notes.append(f"re-planned {replans} time(s), now under {budget} bytes at the "
                             "upper end, for the budget to hold over the range fixed by mark_dynamic")  # fmt: skip
            if (short := range_check.shortfall) is not None:
                infeasible(graph_name, short.allowed, short.kept, options, sizes=short.at)
                notes.append(f"over {range_check.what} at {short.at}: {short.kept} bytes "
                             f"against {short.allowed}")  # fmt: skip
            notes += range_check.install()
    seen = {a.name: a for a in baseline}
    for name, a in rounds.rebuilt.items():
        seen.setdefault(name, a)
    plan = build_plan(
        graph_name,
        list(seen.values()),
        part.saved,
        decision.choices if decision is not None else {},
        segment_of_block=segments,
        recompute_reasons=rounds.reasons,
        flops=rounds.flops,
        budget_bytes=budget,
        resident_peak_bytes=peak,
        est_overhead_ms=attempt.segment_ms + rounds.recompute_ms + solution_ms,
        options=options.to_dict(),
        notes=notes,
    )
    plan.baseline_saved_bytes = bytes_per_storage(baseline)
    plan.step_inputs_bytes = ticket.inputs() if ticket is not None else 0
    plan.timeline = plan_timeline
    plan.assumptions = assumed
    with step(graph_name, "offload"):
        placements = _placements(fw, bw, part, decision, options, inductor)
        profile = options.runtime_settings().key()
        fw, bw = insert_offloads(fw, bw, placements, profile)
    if inductor:
        with step(graph_name, "saved layouts"):
            plan.notes += keep_input_layouts(fw, bw, num_fwd_outputs).note()
    with step(graph_name, "note"):
        # Under Inductor, what it computes inside fused kernels never reaches memory.
        fused = fused_intermediates(fw) | fused_intermediates(bw) if inductor else set()
        plan.predicted_step_peak_bytes = step_peak_bytes(fw, bw, fused)
        payload = record(plan)
        resident = _resident(fw, part, decision)
        fw = insert_note(fw, resident, payload, anchor_device=device if inductor else None)
    if inductor:
        with step(graph_name, "pin positions"):
            fw, bw = pin_positions(fw), pin_positions(bw)
    _log_plan(plan)
    return fw, bw


def _check_budget(
    attempt: Attempt, *, base_fw: fx.GraphModule, baseline: list[SavedActivation],
    options: Options, budget: int,
) -> BudgetCheck:
    decision = attempt.decision
    assert decision is not None
    sim = decision.solution.sim
    return check_budget(
        problem=decision.problem, kinds=decision.solution.choices, d2h_done=sim.d2h_done,
        prefetch_issue=sim.prefetch_issue, storage_keys=[st.key for st in decision.storages],
        fw=attempt.part.fw, final=attempt.part.saved, baseline_fw=base_fw, baseline=baseline,
        options=options, budget=budget,
    )  # fmt: skip


def _resident(fw: fx.GraphModule, part: Partition, decision: RoundDecision | None) -> list[str]:
    """Kept saved tensors the note reports. RNG states the partitioner saves to replay a
    recomputed op (``run_and_save_rng_state``) carry real tensors as meta values, which
    Inductor's fake-tensor lowering of the note would refuse; they are a few KiB."""
    nodes = {n.name: n for n in fw.graph.nodes}
    return [
        a.name
        for a in part.saved
        if (decision is None or decision.kind_of(a.storage) == "keep")
        and not _is_rng_state(nodes[a.name])
    ]


def _is_rng_state(node: fx.Node) -> bool:
    rng = torch.ops.higher_order.run_and_save_rng_state
    parent = node.args[0] if node.target is operator.getitem and node.args else None
    return node.target is rng or (isinstance(parent, fx.Node) and parent.target is rng)


def _placements(
    fw: fx.GraphModule, bw: fx.GraphModule, part: Partition, decision: RoundDecision | None,
    options: Options, inductor: bool,
) -> list[Placement | BucketPlacement]:
    """Where each offloaded tensor's ops go: the simulator's copy positions, a disk tensor's
    prefetch issued earlier by its read time, its offload marked for the disk tier, and the
    host-tier members of each copy bucket merged into one bucket's ops."""
    if decision is None:
        return []
    sim = decision.solution.sim
    buckets = decision.problem.buckets
    index = {s.key: i for i, s in enumerate(decision.storages)}
    offloaded = [
        (a, sim.d2h_done[index[a.storage]], sim.prefetch_issue[index[a.storage]])
        for a in part.saved
        if decision.kind_of(a.storage) == "offload"
    ]
    offloaded = read_ahead(offloaded, decision.choices, decision.problem, options)
    bucket_of = {a.name: buckets.of[index[a.storage]] for a, _, _ in offloaded}
    ready = {a.name: buckets.ready[bucket_of[a.name]] for a, _, _ in offloaded}
    placed = place_offloads(fw, bw, offloaded, fused=inductor, ready=ready)
    return coalesce(fw, bw, with_tiers(placed, part.saved, decision.choices), bucket_of)


def _notes(blocks: BlockFacts, stride: int) -> list[str]:
    if stride > 0 and not blocks.index_of:
        return ["no repeated blocks found: planned without segments"]
    if blocks.source == "given":
        return [f"the graph is block {blocks.blocks[0]} (block_index)"] if blocks.index_of else []
    if blocks.index_of:
        return [blocks.describe()]
    return []


def _log_plan(plan: Plan) -> None:
    log.info("fxckpt %s", plan.summary())
    for row in plan.activations:
        log.debug(
            "fxckpt[%s] %-24s %-28s %10d B  %s",
            plan.name,
            row.name,
            row.module or "-",
            row.bytes,
            row.decision.reason,
        )
    for note in plan.notes:
        log.info("fxckpt[%s] %s", plan.name, note)
    if plan.assumptions:
        log.info("fxckpt[%s] assumed: %s", plan.name, describe_assumptions(plan.assumptions))
    trace_plan_artifact(plan.name, json.dumps(plan.to_dict()))
