"""The partitioner pipeline, top to bottom.

    0. cse                 deduplicate the joint graph once, as min-cut would each run
    1. graph.blocks        find the repeated blocks and number them
    2. baseline min-cut    what torch alone would save (the plan's yardstick)
    3. passes.segment      tag segment interiors PREFER_RECOMPUTE, one ac_graph_id each
    4. torch min-cut       partition into forward and backward
    5. graph.activations   the saved tensors, bytes per storage, lifetimes
    6. planning            keep / recompute / offload under the budget; a recompute
                           choice re-tags the joint graph and reruns min-cut
    7. passes.offload      offload / prefetch / wait ops, and the saved-bytes note
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import logging
import operator
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from fxckpt._torch_compat import (
    dedup_joint,
    lazy_graph_modules,
    make_graph_module,
    min_cut_rematerialization_partition,
    min_cut_without_cse,
    trace_plan_artifact,
)
from fxckpt.graph.activations import SavedActivation, bytes_per_storage, saved_activations
from fxckpt.graph.blocks import BlockFacts, find_blocks
from fxckpt.graph.memory import Problem
from fxckpt.options import Options
from fxckpt.passes.budget import (
    _KEEP,
    Storage,
    _device_of,
    _forced,
    _infeasible,
    _resimulate,
    _tag_recompute,
    _timeline,
    bandwidth_bytes_per_ms,
    build_problem,
    decide,
    group_by_storage,
    offload_candidates,
    reasons,
    segment_recompute_ms,
    step_costs,
    user_offload_requests,
)
from fxckpt.passes.host import HostReport, place_tiers, read_ahead, warn_host_short, with_tiers
from fxckpt.passes.offload import insert_note, insert_offloads
from fxckpt.passes.schedule import place_offloads
from fxckpt.passes.segment import SegmentReport, segment_of, tag_segments
from fxckpt.planning.plan import Plan
from fxckpt.planning.planner import Choice, build_plan
from fxckpt.planning.solve import Solution

log = logging.getLogger(__name__)

GraphPair = tuple[fx.GraphModule, fx.GraphModule]


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


@contextlib.contextmanager
def step(graph: str, name: str) -> Iterator[None]:
    """Time one pipeline step and log it; every step of every graph goes through here."""
    start = time.perf_counter()
    yield
    log.debug("fxckpt[%s] %-18s %.1f ms", graph, name, (time.perf_counter() - start) * 1e3)


def clone_joint(joint: fx.GraphModule) -> fx.GraphModule:
    """A copy of the joint graph whose node.meta dicts can be changed independently.

    min-cut rewrites tags and may replace the graph (CSE), so each run gets its own copy.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    result = graph.graph_copy(joint.graph, env)
    old_out = joint.graph.find_nodes(op="output")[0]
    new_out = graph.output(result)
    new_out.meta = dict(old_out.meta)
    return make_graph_module(joint, graph)


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
    return fw, bw


@dataclasses.dataclass
class Attempt:
    """One partition of the joint graph and the planner's answer for it."""

    tagged: fx.GraphModule  # the joint graph as tagged for this partition
    fw: fx.GraphModule
    bw: fx.GraphModule
    final: list[SavedActivation]
    choices: dict[str, Choice]
    solution: Solution | None = None
    problem: Problem | None = None
    storages: list[Storage] | None = None
    rebuilt: dict[str, SavedActivation] = dataclasses.field(default_factory=dict)
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    flops: dict[str, float] = dataclasses.field(default_factory=dict)
    recompute_ms: float = 0.0
    segment_ms: float = 0.0  # the backward's recompute of segment interiors, estimated
    host: HostReport | None = None  # what the host budget moved

    @property
    def feasible(self) -> bool:
        return self.solution is None or self.solution.feasible


def _partition_context(fn: Callable[..., GraphPair]) -> Callable[..., GraphPair]:
    """Run ``fn`` with lazy graph modules and the program's objects frozen (see above)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> GraphPair:
        with lazy_graph_modules(), gc_frozen():
            return fn(*args, **kwargs)

    return wrapper


@_partition_context
def partition(
    joint: fx.GraphModule,
    joint_inputs: Any,
    options: Options,
    *,
    graph_name: str,
    num_fwd_outputs: int,
    record: Callable[[Plan], str],
    inductor: bool = False,
    **kwargs: Any,
) -> GraphPair:
    """Partition ``joint`` into forward and backward graphs that carry out fxckpt's plan.

    ``inductor``: Inductor compiles the result (see :func:`insert_note`).
    """
    kwargs["num_fwd_outputs"] = num_fwd_outputs
    # min-cut deduplicates the joint graph first; fxckpt runs min-cut two or more times, so
    # it deduplicates once here and every run skips that step.
    with step(graph_name, "cse"):
        dedup = dedup_joint(joint)
    joint = dedup if dedup is not None else joint

    def cut(gm: fx.GraphModule, consume: bool = False) -> GraphPair:
        return min_cut(
            gm, joint_inputs=joint_inputs, deduplicated=dedup is not None, consume=consume, **kwargs
        )

    stride = options.segment_stride
    width = options.segment_width if options.segment_width is not None else stride
    with step(graph_name, "blocks"):
        blocks = find_blocks(joint, options.blocks, block_index=options.block_index)
    # With a stride, the tagged copy is made first and nothing needs the joint graph after
    # the baseline (the extra one-block segments come only without a stride of the user's), so
    # the baseline min-cut may consume it instead of a copy.
    first_tagged = clone_joint(joint) if stride > 0 else None
    with step(graph_name, "baseline min-cut"):
        base_fw, base_bw = cut(joint, consume=first_tagged is not None)
        baseline = saved_activations(base_fw, base_bw, num_fwd_outputs, blocks)
    device = _device_of(base_fw)
    budget = options.resolve_budget(bytes_per_storage(baseline), device=device)

    segments = {b: seg for b in blocks.blocks if (seg := segment_of(b, stride, width)) is not None}
    notes = _notes(blocks, stride)
    # A budget that offload alone cannot meet recomputes more blocks, in a fixed order, so a
    # smaller budget only ever moves further along it (the resident peak stays monotone).
    for extra in _extra_segment_steps(blocks.blocks, segments, budget, options):
        if stride > 0 or extra:
            # The baseline consumed the joint graph only when a stride made this copy first,
            # and then this loop runs once.
            assert first_tagged is not None or stride == 0, "the joint graph was consumed"
            tagged = first_tagged if first_tagged is not None else clone_joint(joint)
            first_tagged = None
            with step(graph_name, "segment"):
                report = tag_segments(tagged, blocks, stride, width, extra_blocks=extra)
        else:
            # No segments: plan on the joint itself; _plan copies it before re-tagging.
            tagged, report = joint, SegmentReport({}, 0, 0, 0)
        # Nothing tagged: the partition is the baseline's, so skip a min-cut run.
        reuse = (base_fw, base_bw) if report.tagged == 0 else None
        attempt = _plan(
            tagged, cut, blocks, options, budget, device, graph_name, num_fwd_outputs, reuse,
            owned=tagged is not joint,
        )
        if attempt.feasible:
            break
    if extra:
        segments.update({b: -1 for b in extra})
        notes.append(f"recomputes blocks {sorted(extra)} to meet the budget")
    if report.kept_random:
        notes.append(f"{report.kept_random} random ops inside segments stay saved")

    peak = timeline = None
    if attempt.solution is not None and attempt.problem is not None:
        feasible = attempt.solution.feasible
        if budget is not None and not feasible:
            _infeasible(graph_name, budget, attempt.solution.peak, options)
        # Offloads the host budget kept on the device can push a plan that met the budget
        # over it; that must raise (or warn) like any infeasible budget, not pass silently.
        elif budget is not None and attempt.solution.peak > budget:
            _infeasible(graph_name, budget, attempt.solution.peak, options, pool_capped=True)
        warn_host_short(graph_name, attempt.host)
        peak = attempt.solution.sim.peak
        timeline = _timeline(attempt.problem, attempt.solution.sim.resident, budget)
    seen = {a.name: a for a in baseline}
    for name, a in attempt.rebuilt.items():
        seen.setdefault(name, a)
    plan = build_plan(
        graph_name,
        list(seen.values()),
        attempt.final,
        attempt.choices,
        segment_of_block=segments,
        recompute_reasons=attempt.reasons,
        flops=attempt.flops,
        budget_bytes=budget,
        resident_peak_bytes=peak,
        est_overhead_ms=attempt.segment_ms
        + attempt.recompute_ms
        + (attempt.solution.cost_ms if attempt.solution else 0.0),
        options=options.to_dict(),
        notes=notes,
    )
    plan.baseline_saved_bytes = bytes_per_storage(baseline)
    plan.timeline = timeline
    fw, bw = attempt.fw, attempt.bw
    with step(graph_name, "offload"):
        offloaded = read_ahead(_offloaded(attempt), attempt.choices, attempt.problem, options)
        placed = with_tiers(place_offloads(fw, bw, offloaded), attempt.final, attempt.choices)
        fw, bw = insert_offloads(fw, bw, placed)
        payload = record(plan)
        resident = _resident(fw, attempt)
        fw = insert_note(fw, resident, payload, anchor_device=device if inductor else None)
    _log_plan(plan)
    return fw, bw


MAX_PLAN_ROUNDS = 4


def _plan(
    tagged: fx.GraphModule,
    cut: Callable[..., GraphPair],
    blocks: BlockFacts,
    options: Options,
    budget: int | None,
    device: torch.device,
    graph_name: str,
    num_fwd_outputs: int,
    reuse: GraphPair | None = None,
    *,
    owned: bool = True,
) -> Attempt:
    """Partition, then plan; recompute choices re-tag the joint graph and partition again.

    ``owned``: ``tagged`` is this attempt's own copy; otherwise it is copied before the
    first re-tag (copying a large joint graph costs about as much as a tenth of a min-cut).
    Without a budget nothing is recomputed, so no re-tag follows and min-cut may consume an
    owned ``tagged``; what the plan reads from it is read first.
    """
    requests = user_offload_requests(tagged)
    segment_ms = segment_recompute_ms(tagged, options.cost_model, device)
    with step(graph_name, "min-cut"):
        fw, bw = reuse if reuse is not None else cut(tagged, consume=owned and budget is None)
        attempt = Attempt(tagged, fw, bw, saved_activations(fw, bw, num_fwd_outputs, blocks), {})
    attempt.segment_ms = segment_ms
    # Tensors min-cut kept saving although they were tagged for recompute (a boundary between
    # two checkpoint regions forces a save there): later rounds must keep or offload them.
    stuck: set[str] = set()
    for round_ in range(MAX_PLAN_ROUNDS):
        # The last round's choices are final, with no partition after it to carry out a
        # recompute: it may only keep or offload.
        last = round_ == MAX_PLAN_ROUNDS - 1
        offloadable = {a.name for a in offload_candidates(attempt.final, attempt.fw, num_fwd_outputs, options)}
        storages = group_by_storage(attempt.final)
        forced, forced_why = _forced(storages, offloadable, requests, options)
        if budget is None and not forced:
            return attempt
        with step(graph_name, f"plan round {round_}"):
            problem, flops = build_problem(
                storages,
                attempt.fw,
                step_costs(attempt.fw, options.cost_model, device),
                step_costs(attempt.bw, options.cost_model, device),
                bandwidth_bytes_per_ms(options, device),
                offloadable=offloadable,
                forced=forced,
                allow_recompute=budget is not None and not last,
                cost_model=options.cost_model,
                device=device,
                not_recomputable=stuck,
            )
            solution = decide(problem, budget, options.prefetch)
            choices = reasons(problem, solution, storages, flops, forced_why, budget)
            # The host budget may send offloads to disk, or turn them into recompute / keep.
            attempt.host, changed = place_tiers(problem, storages, choices, options,
                                                allow_recompute=not last,
                                                report=attempt.host)  # fmt: skip
            if changed:
                solution = _resimulate(problem, storages, choices, options.prefetch, solution)
        attempt.choices, attempt.solution, attempt.problem, attempt.storages = (
            choices, solution, problem, storages
        )
        rebuilt = [a for s in storages if choices[s.key].kind == "recompute" for a in s.members]
        if not rebuilt:
            return attempt
        # min-cut carries out recompute choices itself: tag them, partition again, re-plan.
        ms_of = {
            s.key: problem.candidates.recompute_ms[i]
            for i, s in enumerate(storages)
            if choices[s.key].kind == "recompute"
        }
        attempt.recompute_ms += sum(ms_of.values())
        for a in rebuilt:
            attempt.reasons[a.name] = choices[a.storage].reason
            attempt.flops[a.name] = flops.get(a.name, 0.0)
            attempt.rebuilt[a.name] = a
        if not owned:
            attempt.tagged, owned = clone_joint(tagged), True
        _tag_recompute(attempt.tagged, {a.name for a in rebuilt})
        with step(graph_name, "min-cut (re-plan)"):
            attempt.fw, attempt.bw = cut(attempt.tagged)
            attempt.final = saved_activations(attempt.fw, attempt.bw, num_fwd_outputs, blocks)
        still = {a.name for a in attempt.final} & {a.name for a in rebuilt}
        for name in still:
            attempt.reasons.pop(name, None)
            attempt.flops.pop(name, None)
            attempt.rebuilt.pop(name, None)
        attempt.recompute_ms -= sum(ms_of[k] for k in {a.storage for a in rebuilt if a.name in still})
        stuck |= still
    return attempt


def _extra_segment_steps(
    blocks: tuple[int, ...], segments: dict[int, int], budget: int | None, options: Options
) -> Iterator[frozenset[int]]:
    """Blocks to recompute on top of the user's segments: none, then every other free block,
    then every free block. Only with a budget and no stride of the user's own."""
    yield frozenset()
    if budget is None or options.segment_stride > 0:
        return
    free = [b for b in blocks if b not in segments]
    if len(free) > 1:
        yield frozenset(free[::2])
    if free:
        yield frozenset(free)


def _resident(fw: fx.GraphModule, attempt: Attempt) -> list[str]:
    """Kept saved tensors the note reports. RNG states the partitioner saves to replay a
    recomputed op (``run_and_save_rng_state``) carry real tensors as meta values, which
    Inductor's fake-tensor lowering of the note would refuse; they are a few KiB."""
    nodes = {n.name: n for n in fw.graph.nodes}
    return [
        a.name
        for a in attempt.final
        if attempt.choices.get(a.storage, _KEEP).kind == "keep" and not _is_rng_state(nodes[a.name])
    ]


def _is_rng_state(node: fx.Node) -> bool:
    rng = torch.ops.higher_order.run_and_save_rng_state
    parent = node.args[0] if node.target is operator.getitem and node.args else None
    return node.target is rng or (isinstance(parent, fx.Node) and parent.target is rng)


def _offloaded(attempt: Attempt) -> list[tuple[SavedActivation, int, int]]:
    if attempt.solution is None or attempt.storages is None:
        return []
    sim = attempt.solution.sim
    index = {s.key: i for i, s in enumerate(attempt.storages)}
    return [
        (a, sim.d2h_done[index[a.storage]], sim.prefetch_issue[index[a.storage]])
        for a in attempt.final
        if attempt.choices[a.storage].kind == "offload"
    ]


def _notes(blocks: BlockFacts, stride: int) -> list[str]:
    if stride > 0 and not blocks.index_of:
        return ["no repeated blocks found: planned without segments"]
    if blocks.source == "given":
        return [f"the graph is block {blocks.blocks[0]} (block_index)"] if blocks.index_of else []
    if blocks.index_of:
        return [f"blocks {blocks.blocks[0]}..{blocks.blocks[-1]} under {blocks.prefix!r}"]
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
    trace_plan_artifact(plan.name, json.dumps(plan.to_dict()))
