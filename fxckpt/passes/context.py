"""The partitioner's :class:`Context`: one graph's partition as it goes through the stages of
:data:`fxckpt.passes.partition.STAGES`, the inputs first, then what each stage adds."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from fxckpt.graph.activations import SavedActivation
from fxckpt.graph.blocks import BlockFacts
from fxckpt.graph.liveness import StepLiveness, step_liveness
from fxckpt.options import Options
from fxckpt.passes.cutting import min_cut
from fxckpt.passes.rounds import Attempt, GraphPair
from fxckpt.passes.schedule import fused_intermediates
from fxckpt.passes.segment import SegmentReport
from fxckpt.passes.shape_budget import BudgetCheck
from fxckpt.planning import step_budget
from fxckpt.planning.account import PeakTarget
from fxckpt.planning.plan import Plan
from fxckpt.planning.plan_round import Partition

# Plans of one graph under a budget, the first included: the later ones lower the target by
# what the rewritten graphs held over it.
MAX_PLANS = 3


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
    inductor: bool
    measured: Mapping[str, float] | None
    min_cut_kwargs: dict[str, Any]
    bounds: dict[Any, int]
    # Bytes the target is lowered by: the earlier plans' overrun (MAX_PLANS).
    lowered: int = 0
    # cse
    deduplicated: bool = False
    sizes: str = ""
    # streamed weights
    streamed: int = 0  # stream_in nodes of the joint graph
    # blocks
    blocks: BlockFacts = dataclasses.field(default_factory=lambda: BlockFacts("none"))
    source: fx.GraphModule | None = None  # the joint graph that segments tag
    # baseline min-cut
    base: GraphPair | None = None
    baseline: list[SavedActivation] = dataclasses.field(default_factory=list)
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    # budget: the graph's target (a fraction's is set in the plan stage)
    target: PeakTarget | None = None
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
    span: tuple[int, int] | None = None  # a fraction's (plain, floor), the planner's model
    # settle, offload, note, pin positions: the plan and the graphs that carry it out
    plan: Plan | None = None
    fw: fx.GraphModule | None = None
    bw: fx.GraphModule | None = None
    live: StepLiveness | None = None  # the rewritten graphs' live bytes (note)
    held: int = 0  # what the forward leaves for its backward (note)

    @property
    def stride(self) -> int:
        return self.options.segment_stride

    @property
    def over(self) -> int:
        """Bytes by which the rewritten graphs hold more than the target (0: it holds)."""
        if self.target is None or self.live is None:
            return 0
        return self.target.over_by(*self.peaks, self.held)

    @property
    def peaks(self) -> tuple[int, int]:
        """The forward's and the backward's own peak, streamed weights kept resident added."""
        assert self.live is not None
        resident = self.plan.resident_weight_bytes if self.plan is not None else 0
        return self.live.forward_peak + resident, self.live.backward_peak + resident

    @property
    def lowest(self) -> bool:
        """Whether the plan is the planner's lowest (its model met no lower target)."""
        a = self.attempt
        return a is not None and a.decision is not None and not a.decision.reached

    def cut(self, gm: fx.GraphModule, consume: bool = False) -> GraphPair:
        return min_cut(gm, joint_inputs=self.joint_inputs, deduplicated=self.deduplicated,
                       consume=consume, **self.min_cut_kwargs)  # fmt: skip

    def live_of(self, fw: fx.GraphModule, bw: fx.GraphModule) -> StepLiveness:
        """A partition's own live bytes (under Inductor, what it fuses left out)."""
        fused = fused_intermediates(fw) | fused_intermediates(bw) if self.inductor else set()
        return step_liveness(fw, bw, fused)

    def part_live(self, part: Partition) -> StepLiveness:
        """:meth:`live_of` a partition being planned, once per partition."""
        if "live" not in part.memo:
            part.memo["live"] = self.live_of(part.fw, part.bw)
        return part.memo["live"]
