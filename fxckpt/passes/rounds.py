"""Planning rounds under one budget: decide, carry the decision out, decide again.

A round (:mod:`fxckpt.planning.plan_round`) decides one partition. Carrying a decision out
re-tags a copy of the joint graph (the blocks and single ops to rebuild) and runs min-cut
again; the next round decides what that partition saved. :func:`plan_rounds` runs them from
one starting partition without changing it, so the partitioner can run them again under
another budget (:func:`fxckpt.passes.shape_budget.fit_range`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from fxckpt._torch_compat import make_graph_module
from fxckpt.graph.activations import SavedActivation, saved_activations
from fxckpt.graph.blocks import BlockFacts
from fxckpt.graph.liveness import StepLiveness
from fxckpt.options import Options
from fxckpt.passes.pipeline import timed
from fxckpt.passes.segment import SegmentReport, tag_recompute, tag_save, tag_segments
from fxckpt.planning.account import PeakTarget
from fxckpt.planning.layouts import NONE, Layout
from fxckpt.planning.plan_round import Partition, RoundDecision, RoundPlanner
from fxckpt.planning.problem import segment_recompute_ms

GraphPair = tuple[fx.GraphModule, fx.GraphModule]


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



# Partitions a budget may add after the first: one to carry out the first round's blocks and
# single ops, and up to two more when min-cut saved something the prediction freed.
MAX_RECUTS = 3


@dataclasses.dataclass
class Rounds:
    """What the rounds asked min-cut to rebuild so far, and why."""

    layout: Layout = NONE
    names: set[str] = dataclasses.field(default_factory=set)
    saved: set[str] = dataclasses.field(default_factory=set)  # kept inside recomputed blocks
    stuck: set[str] = dataclasses.field(default_factory=set)
    rebuilt: dict[str, SavedActivation] = dataclasses.field(default_factory=dict)
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    flops: dict[str, float] = dataclasses.field(default_factory=dict)
    ms_of: dict[str, float] = dataclasses.field(default_factory=dict)  # storage -> ms
    recuts: int = 0

    @property
    def recompute_ms(self) -> float:
        return sum(self.ms_of.values())

    def take(self, decision: RoundDecision, part: Partition) -> None:
        new = decision.layout
        if new.kind == "blocks" and self.layout.kind == "blocks":
            blocks = sorted(self.layout.blocks | new.blocks)
            self.layout = Layout(tuple((b,) for b in blocks), "blocks")
        elif new.blocks:
            self.layout = new
        self.names |= decision.recompute
        self.saved |= decision.saved
        for a in part.saved:
            if a.name in decision.saved or a.name in decision.recompute:
                self.reasons[a.name] = decision.choices[a.storage].reason
            if a.name in decision.recompute:
                self.flops[a.name] = decision.flops.get(a.name, 0.0)
                self.rebuilt[a.name] = a
                self.ms_of[a.storage] = decision.recompute_ms.get(a.storage, 0.0)

    def carried_out(self, part: Partition) -> None:
        """Tensors min-cut saved although asked to rebuild them (a boundary between two
        checkpoint regions forces a save there): later rounds must keep or offload them."""
        self.recuts += 1
        still = {a.name for a in part.saved} & self.names
        for a in part.saved:
            if a.name in still:
                self.reasons.pop(a.name, None)
                self.flops.pop(a.name, None)
                self.rebuilt.pop(a.name, None)
                self.ms_of.pop(a.storage, None)
        self.stuck |= still

    def notes(self) -> list[str]:
        if not self.layout.blocks:
            return []
        return [f"segment_stride is unset: recomputes {self.layout.describe()} to meet the budget"]


@dataclasses.dataclass
class Attempt:
    """The rounds' result under one budget."""

    decision: RoundDecision | None
    part: Partition
    rounds: Rounds
    report: SegmentReport
    segment_ms: float

    @property
    def peak(self) -> int:
        """The simulated resident peak of the last round's solution (0 without one)."""
        return self.decision.solution.peak if self.decision is not None else 0


def plan_rounds(
    start: Attempt, target: PeakTarget | None, *, source: fx.GraphModule,
    cut: Callable[..., GraphPair], blocks: BlockFacts, options: Options, device: torch.device,
    num_fwd_outputs: int, requests: set[str], assumed: dict[str, dict[str, Any]],
    search_blocks: bool, graph_name: str, live_of: Callable[[Partition], StepLiveness],
) -> Attempt:
    """Planning rounds (the pipeline's plan stage) from ``start``'s partition under ``target``;
    neither ``source`` nor ``start`` is changed, so another target can start again from them.
    ``live_of``: a partition's own live bytes at each position (the step's figure)."""
    planner = RoundPlanner(options, target, device, blocks, num_fwd_outputs, requests, assumed)
    part, report, segment_ms, rounds = start.part, start.report, start.segment_ms, Rounds()
    with timed(graph_name, "plan round 0"):
        decision = planner.decide(part, live_of(part) if target is not None else None,
                                  search_blocks=search_blocks)
    while decision is not None and decision.rewrites and rounds.recuts < MAX_RECUTS:
        rounds.take(decision, part)
        with timed(graph_name, "segment"):
            tagged = clone_joint(source)
            if rounds.layout.blocks:
                report = tag_layout(tagged, blocks, rounds.layout)
            tag_save(tagged, rounds.saved)
            tag_recompute(tagged, rounds.names)
            segment_ms = segment_recompute_ms(tagged, options.cost_model, device)
        with timed(graph_name, "min-cut (re-plan)"):
            fw, bw = cut(tagged, consume=True)
            part = Partition(fw, bw, saved_activations(fw, bw, num_fwd_outputs, blocks))
        rounds.carried_out(part)
        # Where min-cut saved more than the first round predicted, a later round may add
        # blocks too (one-block segments on top of those already recomputed).
        with timed(graph_name, f"plan round {rounds.recuts}"):
            decision = planner.decide(
                part, live_of(part) if target is not None else None,
                search_blocks=search_blocks and rounds.layout.kind != "stride",
                allow_recompute=rounds.recuts < MAX_RECUTS, keep_first=True, stuck=rounds.stuck,
            )  # fmt: skip
    return Attempt(decision, part, rounds, report, segment_ms)


def if_feasible(attempt: Attempt) -> Attempt | None:
    return attempt if attempt.decision is not None and attempt.decision.feasible else None


def tag_layout(joint: fx.GraphModule, blocks: BlockFacts, layout: Layout) -> SegmentReport:
    """Tag a layout's segments as :func:`tag_segments` tags a user's stride."""
    if layout.kind == "stride":
        return tag_segments(joint, blocks, layout.stride, layout.stride)
    return tag_segments(joint, blocks, 0, 0, extra_blocks=layout.blocks)
