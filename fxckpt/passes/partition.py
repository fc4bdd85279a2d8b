"""The partitioner pipeline, top to bottom.

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
import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from fxckpt._torch_compat import (
    OFFLOAD_POLICIES,
    CheckpointPolicy,
    min_cut_rematerialization_partition,
    trace_plan_artifact,
)
from fxckpt.errors import BudgetError
from fxckpt.graph import meta
from fxckpt.graph.activations import SavedActivation, bytes_per_storage, saved_activations
from fxckpt.graph.blocks import find_blocks
from fxckpt.graph.costs import measure_bandwidth, node_cost_ms
from fxckpt.graph.memory import Problem, simulate
from fxckpt.options import Options
from fxckpt.passes.budget import Storage, build_problem, decide, group_by_storage, reasons
from fxckpt.passes.offload import insert_note, insert_offloads
from fxckpt.passes.schedule import place_offloads
from fxckpt.passes.segment import segment_of, tag_segments
from fxckpt.planning.plan import Plan
from fxckpt.planning.planner import Choice, build_plan
from fxckpt.planning.solve import Solution
from fxckpt.runtime.pool import size_class

log = logging.getLogger(__name__)

GraphPair = tuple[fx.GraphModule, fx.GraphModule]


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
    return fx.GraphModule(joint, graph)


def min_cut(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> GraphPair:
    fw, bw = min_cut_rematerialization_partition(clone_joint(joint), joint_inputs, **kwargs)
    return fw, bw


def partition(
    joint: fx.GraphModule,
    joint_inputs: Any,
    options: Options,
    *,
    graph_name: str,
    num_fwd_outputs: int,
    record: Callable[[Plan], str],
    **kwargs: Any,
) -> GraphPair:
    """Partition ``joint`` into forward and backward graphs that carry out fxckpt's plan."""
    kwargs["num_fwd_outputs"] = num_fwd_outputs

    with step(graph_name, "blocks"):
        blocks = find_blocks(joint, options.blocks)
    with step(graph_name, "baseline min-cut"):
        base_fw, base_bw = min_cut(joint, joint_inputs, **kwargs)
        baseline = saved_activations(base_fw, base_bw, num_fwd_outputs, blocks)

    stride = options.segment_stride
    width = options.segment_width if options.segment_width is not None else stride
    tagged = clone_joint(joint)
    with step(graph_name, "segment"):
        report = tag_segments(tagged, blocks, stride, width)
    notes: list[str] = []
    if stride > 0 and not blocks.index_of:
        notes.append("no repeated blocks found: planned without segments")
    elif blocks.index_of:
        notes.append(f"blocks {blocks.blocks[0]}..{blocks.blocks[-1]} under {blocks.prefix!r}")
    if report.kept_random:
        notes.append(f"{report.kept_random} random ops inside segments stay saved")

    with step(graph_name, "min-cut"):
        fw, bw = min_cut(tagged, joint_inputs, **kwargs)
        final = saved_activations(fw, bw, num_fwd_outputs, blocks)

    device = _device_of(fw)
    budget = options.resolve_budget(bytes_per_storage(baseline), device=device)
    seen = {a.name: a for a in baseline}
    recompute_reasons: dict[str, str] = {}
    recompute_flops: dict[str, float] = {}
    added_ms = 0.0
    solution = problem = storages = None
    choices: dict[str, Choice] = {}
    for round_ in range(MAX_PLAN_ROUNDS):
        offloadable = {a.name for a in offload_candidates(final, fw, num_fwd_outputs, options)}
        storages = group_by_storage(final)
        forced, forced_why = _forced(storages, offloadable, user_offload_requests(tagged), options)
        if budget is None and not forced:
            choices, solution, problem = {}, None, None
            break
        with step(graph_name, f"plan round {round_}"):
            problem, flops = build_problem(
                storages,
                fw,
                step_costs(fw, options.cost_model, device),
                step_costs(bw, options.cost_model, device),
                bandwidth_bytes_per_ms(options, device),
                offloadable=offloadable,
                forced=forced,
                allow_recompute=budget is not None,
                cost_model=options.cost_model,
                device=device,
            )
            solution = decide(problem, budget, options.prefetch)
            choices = reasons(problem, solution, storages, flops, forced_why, budget)
        rebuilt = [
            a for s in storages if choices[s.key].kind == "recompute" for a in s.members
        ]
        if not rebuilt:
            break
        # A recompute choice is carried out by min-cut itself: tag, re-partition, re-plan.
        for i, s in enumerate(storages):
            if choices[s.key].kind == "recompute":
                added_ms += problem.candidates.recompute_ms[i]
        for a in rebuilt:
            recompute_reasons[a.name] = choices[a.storage].reason
            recompute_flops[a.name] = flops.get(a.name, 0.0)
            seen.setdefault(a.name, a)
        _tag_recompute(tagged, {a.name for a in rebuilt})
        with step(graph_name, "min-cut (re-plan)"):
            fw, bw = min_cut(tagged, joint_inputs, **kwargs)
            final = saved_activations(fw, bw, num_fwd_outputs, blocks)

    if solution is not None and problem is not None and storages is not None:
        if not solution.feasible and budget is not None:
            _infeasible(graph_name, budget, solution.peak, options)
        if cap_host_pool(final, choices, options.pinned_pool_bytes, graph_name):
            solution = _resimulate(problem, storages, choices, options.prefetch, solution)
        sim = solution.sim
        index = {s.key: i for i, s in enumerate(storages)}
        offloaded = [
            (a, sim.d2h_done[index[a.storage]], sim.prefetch_issue[index[a.storage]])
            for a in final
            if choices[a.storage].kind == "offload"
        ]
        peak: int | None = sim.peak
        added_ms += sim.cost_ms
        timeline = _timeline(problem, sim.resident, budget)
    else:
        offloaded, peak, timeline = [], None, None

    plan = build_plan(
        graph_name,
        list(seen.values()),
        final,
        choices,
        segment_of_block={
            b: seg
            for b in blocks.blocks
            if (seg := segment_of(b, stride, width)) is not None
        },
        recompute_reasons=recompute_reasons,
        flops=recompute_flops,
        budget_bytes=budget,
        resident_peak_bytes=peak,
        est_overhead_ms=added_ms,
        options=options.to_dict(),
        notes=notes,
    )
    plan.baseline_saved_bytes = bytes_per_storage(baseline)
    plan.timeline = timeline
    with step(graph_name, "offload"):
        fw, bw = insert_offloads(fw, bw, place_offloads(fw, bw, offloaded))
        payload = record(plan)
        resident = [a.name for a in final if choices.get(a.storage, _KEEP).kind == "keep"]
        fw = insert_note(fw, resident, payload)
    _log_plan(plan, final)
    return fw, bw


MAX_PLAN_ROUNDS = 4


def _forced(
    storages: list[Storage], offloadable: set[str], requested: set[str], options: Options
) -> tuple[dict[str, str], dict[str, str]]:
    forced: dict[str, str] = {}
    why: dict[str, str] = {}
    for s in storages:
        if not all(a.name in offloadable for a in s.members):
            continue
        if options.offload == "all":
            forced[s.key], why[s.key] = "offload", "offload: offload='all' asks for it"
        elif any(a.name in requested for a in s.members):
            forced[s.key], why[s.key] = "offload", "offload: the checkpoint policy asks for it"
    return forced, why


def _tag_recompute(joint: fx.GraphModule, names: set[str]) -> None:
    for node in joint.graph.nodes:
        if node.name in names:
            node.meta[meta.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE


def _infeasible(graph_name: str, budget: int, smallest: int, options: Options) -> None:
    hints = []
    if options.offload == "never":
        hints.append("offload='auto'")
    if options.segment_stride == 0:
        hints.append("segment_stride=1")
    elif options.segment_width is not None and options.segment_width < options.segment_stride:
        hints.append(f"segment_width={options.segment_stride}")
    if options.min_offload_bytes > 0 and options.offload != "never":
        hints.append("a smaller min_offload_bytes")
    error = BudgetError(graph_name, budget, smallest, hints)
    if options.on_infeasible == "raise":
        raise error
    warnings.warn(f"{error} Running the smallest plan instead.", stacklevel=2)


def _resimulate(
    problem: Problem, storages: list[Storage], choices: dict[str, Choice], prefetch: str, old: Solution
) -> Solution:
    picked = [choices[s.key].kind for s in storages]
    sim = simulate(problem, picked, prefetch=prefetch)  # type: ignore[arg-type]
    return dataclasses.replace(
        old, choices=picked, peak=sim.peak, peak_at=sim.peak_at, cost_ms=sim.cost_ms, sim=sim
    )


def _timeline(problem: Problem, resident: list[int], budget: int | None, points: int = 1200) -> dict[str, Any]:
    """Resident bytes over the step, max-pooled to at most ``points`` points, for reports."""
    keep_all = simulate(problem, ["keep"] * len(problem.candidates)).resident
    F, T = problem.timeline.num_forward, len(resident)
    step_ = max(1, math.ceil(T / points))
    pool = lambda xs: [max(xs[i : i + step_]) for i in range(0, T, step_)]  # noqa: E731
    return {
        "forward_end": F // step_,
        "positions": T,
        "stride": step_,
        "baseline": pool(keep_all),
        "plan": pool(resident),
        "budget": budget,
    }


_KEEP = Choice("keep", "")


def cap_host_pool(
    final: list[SavedActivation], choices: dict[str, Choice], cap: int | None, graph_name: str
) -> bool:
    """Keep, in forward order, the offloads that would not fit ``pinned_pool_bytes``.

    Returns whether any choice changed.
    """
    if cap is None:
        return False
    used, dropped = 0, 0
    seen: set[str] = set()
    for a in sorted(final, key=lambda a: a.produced):
        choice = choices.get(a.storage)
        if choice is None or choice.kind != "offload" or a.storage in seen:
            continue
        seen.add(a.storage)
        need = size_class(a.bytes)  # what the pool will really hand out
        if used + need <= cap:
            used += need
            continue
        choices[a.storage] = Choice(
            "keep", f"keep: the host pool is full (pinned_pool_bytes={cap}, {used} B in use)"
        )
        dropped += 1
    if dropped:
        warnings.warn(
            f"fxckpt[{graph_name}]: pinned_pool_bytes={cap} holds {used} B of offloads; "
            f"{dropped} more tensors stay on the device. Raise pinned_pool_bytes to offload them.",
            stacklevel=2,
        )
    return dropped > 0


def offload_candidates(
    final: list[SavedActivation], fw: fx.GraphModule, num_fwd_outputs: int, options: Options
) -> list[SavedActivation]:
    """Saved activations the runtime may offload.

    Never model outputs (the user holds them), never tensors with symbolic sizes (the
    restore op needs concrete sizes), never tensors below ``min_offload_bytes``.
    """
    if options.offload == "never":
        return []
    out = fw.graph.find_nodes(op="output")[0]
    user_outputs = {v.name for v in out.args[0][:num_fwd_outputs] if isinstance(v, fx.Node)}
    nodes = {n.name: n for n in fw.graph.nodes}
    result = []
    for a in final:
        val = nodes[a.name].meta["val"]
        if a.name in user_outputs or a.first_bw_use < 0 or a.bytes < options.min_offload_bytes:
            continue
        if any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride())):
            continue
        result.append(a)
    return result


def user_offload_requests(joint: fx.GraphModule) -> set[str]:
    """Names of nodes a user's selective-checkpoint policy asked to offload.

    torch defines ``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD`` but no torch partitioner reads
    them; fxckpt does.
    """
    return {
        n.name for n in joint.graph.nodes if n.meta.get(meta.RECOMPUTE) in OFFLOAD_POLICIES
    }


def _device_of(gm: fx.GraphModule) -> torch.device:
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type != "cpu":
            return val.device
    return torch.device("cpu")


def step_costs(gm: fx.GraphModule, cost_model: str, device: torch.device) -> list[float]:
    """Estimated compute milliseconds of each node of ``gm``, in graph order."""
    return [
        node_cost_ms(n, cost_model, device) if n.op == "call_function" else 0.0
        for n in gm.graph.nodes
    ]


def bandwidth_bytes_per_ms(options: Options, device: torch.device) -> float:
    if options.bandwidth is not None:
        return float(options.bandwidth) / 1e3
    if options.cost_model == "unit":
        return 1e6  # deterministic: 1 MB per unit step
    return measure_bandwidth(device)


def _log_plan(plan: Plan, final: list[SavedActivation]) -> None:
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
