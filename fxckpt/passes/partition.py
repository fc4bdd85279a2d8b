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
import json
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch.fx as fx

import torch

from fxckpt._torch_compat import (
    OFFLOAD_POLICIES,
    min_cut_rematerialization_partition,
    trace_plan_artifact,
)
from fxckpt.graph import meta
from fxckpt.graph.costs import measure_bandwidth, node_cost_ms
from fxckpt.graph.activations import SavedActivation, saved_activations
from fxckpt.graph.blocks import find_blocks
from fxckpt.options import Options
from fxckpt.passes.offload import insert_note, insert_offloads
from fxckpt.passes.schedule import place_offloads
from fxckpt.passes.segment import segment_of, tag_segments
from fxckpt.runtime.pool import size_class
from fxckpt.planning.plan import Plan
from fxckpt.planning.planner import Choice, build_plan

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

    offloadable = offload_candidates(final, fw, num_fwd_outputs, options)
    choices: dict[str, Choice] = {}
    with step(graph_name, "plan"):
        if options.offload == "all":
            for a in offloadable:
                choices[a.storage] = Choice("offload", "offload: offload='all' asks for it")
        requested = user_offload_requests(tagged)
        for a in offloadable:
            if a.name in requested and a.storage not in choices:
                choices[a.storage] = Choice("offload", "offload: the checkpoint policy asks for it")
        cap_host_pool(final, choices, options.pinned_pool_bytes, graph_name)
    plan = build_plan(
        graph_name,
        baseline,
        final,
        choices,
        segment_of_block={
            b: seg
            for b in blocks.blocks
            if (seg := segment_of(b, stride, width)) is not None
        },
        budget_bytes=None,
        options=options.to_dict(),
        notes=notes,
    )
    offloaded = [a for a in final if choices.get(a.storage, _KEEP).kind == "offload"]
    with step(graph_name, "offload"):
        device = _device_of(fw)
        placements = place_offloads(
            fw,
            bw,
            offloaded,
            fw_step_ms=step_costs(fw, options.cost_model, device),
            bw_step_ms=step_costs(bw, options.cost_model, device),
            bytes_per_ms=bandwidth_bytes_per_ms(options, device),
            jit=options.prefetch == "jit",
        )
        fw, bw = insert_offloads(fw, bw, placements)
        payload = record(plan)
        resident = [a.name for a in final if choices.get(a.storage, _KEEP).kind == "keep"]
        fw = insert_note(fw, resident, payload)
    _log_plan(plan, final)
    return fw, bw


_KEEP = Choice("keep", "")


def cap_host_pool(
    final: list[SavedActivation], choices: dict[str, Choice], cap: int | None, graph_name: str
) -> None:
    """Keep, in forward order, the offloads that would not fit ``pinned_pool_bytes``."""
    if cap is None:
        return
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
