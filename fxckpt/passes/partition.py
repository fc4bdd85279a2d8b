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
from collections.abc import Callable, Iterator
from typing import Any

import torch.fx as fx

from fxckpt._torch_compat import min_cut_rematerialization_partition, trace_plan_artifact
from fxckpt.graph.activations import SavedActivation, saved_activations
from fxckpt.graph.blocks import find_blocks
from fxckpt.options import Options
from fxckpt.passes.segment import segment_of, tag_segments
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
    record: Callable[[Plan], None],
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

    choices: dict[str, Choice] = {}
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
    _log_plan(plan, final)
    record(plan)
    return fw, bw


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
