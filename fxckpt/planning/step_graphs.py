"""One graph of a step's account, and the ticket one compile of it plans under.

:class:`Graph` holds what :mod:`fxckpt.planning.step_budget` knows of a graph: what it takes,
what its plan holds, and how to plan it again. A :class:`Ticket` is handed to the partitioner
while the graph compiles: it gives the graph its target and takes the plan's figures back.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fxckpt import _torch_compat as compat
from fxckpt.planning.account import HEADROOM, GraphFigures, PeakTarget, compose
from fxckpt.units import format_bytes

if TYPE_CHECKING:
    from fxckpt.planning.step_budget import StepBudget


@dataclasses.dataclass
class Graph:
    """One graph of the step: what it takes, what its plan holds, and how to plan it again."""

    name: str
    frame: str = ""  # dynamo's id for the compile, for a graph that never planned (no name)
    gradients: int = 0  # parameter gradients its backward creates
    params: list[weakref.ref[torch.Tensor]] = dataclasses.field(default_factory=list)
    inputs: int = 0  # earlier graphs' outputs it takes
    saved_inputs: int = 0  # of those, the bytes its forward saves
    forward_peak: int = 0
    backward_peak: int = 0
    held: int = 0
    target: PeakTarget | None = None  # what its current plan was made for
    over: int = 0  # bytes its plan holds over that target (at its lowest plan)
    lowest: bool = False  # its plan is the smallest the planner reaches for its target
    known: bool = False  # planned in this process, or its plan reported by its first run
    sizes: str = ""
    pool_capped: bool = False
    payload: str = ""  # its plan, for Inductor's own figures
    fraction: tuple[int, int] | None = None  # a fraction's (plain, floor), the own figures
    recompile: Callable[[PeakTarget], None] | None = None
    ranged: frozenset[str] = frozenset()  # size symbols with a range's end at its first plan
    compiled: list[Any] = dataclasses.field(default_factory=list)  # what its runs call
    raises: int = 0  # re-plans for more room than its plan was made for
    refused: PeakTarget | None = None  # the last such target whose plan did not fit the step

    @property
    def label(self) -> str:
        return self.name or self.frame or "a graph"

    def figures(self) -> GraphFigures:
        return GraphFigures(self.forward_peak, self.backward_peak, self.held, self.gradients,
                            self.inputs, self.saved_inputs)

    def liveness(self) -> GraphFigures:
        """Its figures at its plan's own liveness peaks (a compiler's schedule left out)."""
        fw, bw = plan_peaks(self.payload)
        fw = min(fw or self.forward_peak, self.forward_peak)
        bw = min(bw or self.backward_peak, self.backward_peak)
        return dataclasses.replace(self.figures(), forward_peak=fw, backward_peak=bw)


def no_tighter(a: PeakTarget, b: PeakTarget) -> bool:
    """Whether target ``a`` asks nothing that ``b`` did not already ask."""
    held_a = a.held if a.held is not None else 1 << 62
    held_b = b.held if b.held is not None else 1 << 62
    return a.forward >= b.forward and a.backward >= b.backward and held_a >= held_b


def scheduled_figures(graphs: Any, scheduled: Callable[[str], tuple[int, int] | None]) -> bool:
    """Take the compiler's own schedule peaks (Inductor's, known once a graph's backward has
    compiled) as the graphs' figures, above or below the plans' liveness: what the device
    holds under that compiler. Whether any changed."""
    changed = False
    for g in graphs:
        if not g.payload:
            continue
        parts = scheduled(g.payload)
        if parts is None or parts == (g.forward_peak, g.backward_peak):
            continue
        g.forward_peak, g.backward_peak = parts
        changed = True
        if g.target is not None and not g.target.met_by(g.forward_peak, g.backward_peak, g.held):
            g.over = g.target.over_by(g.forward_peak, g.backward_peak, g.held)
    return changed


def scheduled_gaps(g: Graph, scheduled: Callable[[str], tuple[int, int] | None]
                   ) -> tuple[int, int]:
    """By how much the compiler's schedule of the plan held less than the plan's liveness, in
    its forward and in its backward (negative: more). A plan is made for its liveness, so a
    re-plan for a target in schedule figures aims each phase that much higher."""
    parts = scheduled(g.payload) if g.payload else None
    if parts is None:
        return 0, 0
    fw, bw = plan_peaks(g.payload)
    return fw - parts[0], bw - parts[1]


@functools.lru_cache(maxsize=256)
def plan_peaks(payload: str) -> tuple[int, int]:
    """A plan's forward and backward liveness peaks (0 where it has none), read once per plan:
    the step reads them at step starts."""
    try:
        plan = json.loads(payload) if payload else {}
    except ValueError:
        return 0, 0
    return int(plan.get("forward_peak_bytes") or 0), int(plan.get("backward_peak_bytes") or 0)


def scheduled_margin(g: Graph, scheduled: Callable[[str], tuple[int, int] | None]) -> int:
    """What the compiler's schedule held over the plan's liveness, in the phase where it held
    the most over it (0 where it held no more in either)."""
    return max(0, *(-gap for gap in scheduled_gaps(g, scheduled)))


class Ticket:
    """One compile of one graph of the step: gives its target, takes its figures."""

    def __init__(self, step: StepBudget, key: object, name: str | None,
                 fixed: PeakTarget | None) -> None:
        self.step, self.key, self.name, self.fixed = step, key, name, fixed
        self.produced: list[tuple[int, tuple[int, ...]]] = []  # (input index, shape)

    @property
    def entry(self) -> Graph:
        return self.step.graphs[self.key]

    @property
    def budget(self) -> int | None:
        """The step's budget in bytes; for a fraction, what this graph's target makes of it
        with the start level (``None`` before the fraction is resolved, or with no budget)."""
        budget = self.step.budget
        if budget is None and self.entry.fraction is not None and self.entry.target is not None:
            return self.step.start_bytes + self.entry.target.largest
        return budget

    def ranged(self, now: frozenset[str]) -> frozenset[str]:
        """The size symbols whose range's end the plan is made for: those of the graph's first
        plan (``now`` at a first compile; a re-plan keeps them)."""
        if self.fixed is None:
            self.entry.ranged = now
        return now & self.entry.ranged

    @property
    def saved_inputs(self) -> int:
        return self.entry.saved_inputs

    def cache_token(self) -> str:
        """What the plan depends on besides the graph and the options (compile-cache keys)."""
        if self.fixed is not None:
            return f"step-fixed-{self.fixed.forward}-{self.fixed.backward}"
        keys, figures = self.step.sequence()
        before = sum(f.held + f.saved_inputs for f in figures)
        return f"step-{self.step.budget}-{self.step.start_bytes}-{before}"

    def target(self, budget: int, graph_name: str, saved_inputs: int) -> PeakTarget:
        """The graph's target: its fixed one (a re-plan), else what the budget leaves it."""
        entry = self.entry
        entry.name = self.name = self.name or graph_name
        entry.saved_inputs = saved_inputs
        if self.fixed is not None:
            entry.target = self.fixed
        else:
            own = GraphFigures(0, 0, 0, entry.gradients, entry.inputs, saved_inputs)
            entry.target = self.step.target(self.key, own)
        return entry.target

    def fraction_target(self, target: PeakTarget, plain: int, floor: int) -> None:
        """A fraction's target, from the graph's own range of plans."""
        self.entry.target, self.entry.fraction = target, (plain, floor)

    def account(self, forward_peak: int, backward_peak: int, held: int) -> dict[str, int]:
        """The step's predicted account with this graph's figures: total and parts."""
        e = self.entry
        own = GraphFigures(forward_peak, backward_peak, held, e.gradients, e.inputs,
                           e.saved_inputs)
        keys, figures = self.step.sequence()
        runs = [own if k == self.key else f
                for k, f in zip([k for k in keys if k in self.step.graphs], figures, strict=True)]
        if self.key not in keys:
            runs.append(own)
        return compose(self.step.start_bytes, runs).parts()

    def planned(self, forward_peak: int, backward_peak: int, held: int, *, over: int,
                lowest: bool = True, sizes: str = "", pool_capped: bool = False,
                payload: str = "") -> None:
        """The kept plan's figures; ``over``: bytes over its target (its lowest plan)."""
        e = self.entry
        e.forward_peak, e.backward_peak, e.held = forward_peak, backward_peak, held
        e.over, e.lowest, e.known = over, over > 0 and lowest, True
        e.sizes, e.pool_capped = sizes, pool_capped and over > 0
        e.payload = payload or e.payload

    def reported(self, payload: str) -> None:
        """The plan a graph's first run reports: where a warm compile cache served the graph,
        no partition ran in this process, and this is how the step learns what it holds."""
        entry = self.step.graphs.get(self.key)
        if entry is None:
            return
        entry.payload = payload
        if entry.known:
            return
        plan = json.loads(payload)
        entry.name = entry.name or str(plan.get("name") or "")
        entry.saved_inputs = int(plan.get("step_inputs_bytes") or 0)
        entry.forward_peak = int(plan.get("forward_peak_bytes") or 0)
        entry.backward_peak = int(plan.get("backward_peak_bytes") or 0)
        entry.held = int(plan.get("held_bytes") or 0)
        if (t := plan.get("target")) is not None:
            held, cap = t.get("held_bytes"), t.get("cap_bytes")
            entry.target = PeakTarget(int(t["forward_bytes"]), int(t["backward_bytes"]),
                                      None if held is None else int(held),
                                      tuple((int(k), int(f), int(b)) for k, f, b in t.get("runs", ())),
                                      None if cap is None else int(cap))  # fmt: skip
            entry.over = entry.target.over_by(entry.forward_peak, entry.backward_peak, entry.held)
        entry.known = True

    def notes(self) -> list[str]:
        e, step = self.entry, self.step
        if e.target is None or step.budget is None:  # a fraction's note is the plan's own
            return []
        if self.fixed is not None:
            return [f"step budget: planned again for the step: forward within "
                    f"{format_bytes(e.target.forward)}, backward within "
                    f"{format_bytes(e.target.backward)}"]
        keys, figures = step.sequence()  # the runs of other graphs (a recompile replaces its own)
        figures = [f for k, f in zip(keys, figures, strict=True) if k != self.key]
        before = sum(f.held + f.saved_inputs for f in figures)
        return [f"step budget: {format_bytes(step.budget or 0)} for the step; it starts at "
                f"{format_bytes(step.start_bytes)}, the {len(figures)} run(s) before this graph "
                f"hold {format_bytes(before)}: forward within {format_bytes(e.target.forward)}, "
                f"backward within {format_bytes(e.target.backward)}"]


# A named budget adds 3 % to the headroom and the lowest plans' predicted peak: what eager code
# holds is measured on other plans (1.4 % apart under HF's checkpointing), Inductor's ~1 %.
NAMED_MARGIN = 0.03


def named_budget(peak: int) -> int:
    """The budget a :class:`BudgetError` names for a step whose lowest plans peak at ``peak``."""
    return int((peak + HEADROOM) * (1 + NAMED_MARGIN)) + 1


def fake_inputs(example_inputs: Sequence[Any]) -> list[Any] | None:
    """Fake copies of a graph's inputs, for re-planning it later without holding real tensors;
    ``None`` where no fake mode traced it (then the graph is not re-planned)."""
    mode = compat.detect_fake_mode(example_inputs)
    if mode is None:
        return None if any(isinstance(t, torch.Tensor) for t in example_inputs) else list(example_inputs)
    return [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
