"""One memory budget for the step: every graph of one ``torch.compile`` call gets a share.

Autograd holds each graph's saved tensors until that graph's backward runs, so what a step
holds for its backward is the sum over its graphs: dynamo's graph breaks, a loss after a
break, the regions of Hugging Face's gradient checkpointing, an MoE's routing. That sum is
what ``memory_budget`` bounds under ``budget_scope="step"`` (a fraction: of the graphs'
summed baselines; bytes: the step's bytes).

Graphs compile one at a time, in forward order (dynamo compiles a graph, runs it, then meets
the next one), so no graph knows what follows it. While graph ``k`` runs, forward or
backward, the graphs before it hold what their forwards left (``e_i``: their backwards come
later) and the graphs after it hold nothing (their forwards come later, their backwards ran
before). So the step's saved bytes peak at ``max_k (e_1 + ... + e_{k-1} + p_k)``, ``p_k``
being graph ``k``'s own resident peak, and at the forward's end they are ``e_1 + ... + e_n``.
Graph ``k``'s share is what the step's budget leaves once the graphs before it hold theirs:

    share_k = f * (b_1 + ... + b_k) - (e_1 + ... + e_{k-1})     (a fraction f)
    share_k = B - (e_1 + ... + e_{k-1})                          (bytes B)

``b_i`` is graph ``i``'s baseline. What an earlier graph left unused carries into the next
share, and so does what it could not give up (a share shrinks). A byte budget is thus split
by the graphs as they come: the first takes what it needs, the rest is left to the others.

Where a graph cannot reach its share, the step holds a debt. The graphs before the step's peak
are then re-planned to give it back, each compiled again from the same graph module (on
fake tensors) for what it held at its forward's end less the debt, largest holder first, at most ``MAX_REPLANS`` compiles per step;
the next step runs the new plans (the step that compiled them had already run the old ones).
A debt left after that is no error yet under a fraction: a later graph may still have room
(an MoE's small routing graph comes before the experts). The verdict waits for the step's
backward, which starts only once the whole forward has run: there a debt raises
:class:`~fxckpt.errors.BudgetError` (or warns, with ``on_infeasible="warn"``) naming the
step's smallest figure. Under a byte budget later graphs only add, so a debt raises at once.

A recompile of a graph that already had a share (a new shape, say) replaces its own entry.
The state lives with the ``torch.compile`` call (keyed weakly by the compiler object dynamo
holds for it), never process-wide: a second model or an EMA copy has steps of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxckpt import _torch_compat as compat
from fxckpt.errors import BudgetError
from fxckpt.options import Options
from fxckpt.planning.plan_round import hints

log = logging.getLogger(__name__)

# Compiles a step may spend re-planning earlier graphs, all graphs together.
MAX_REPLANS = 8

Compile = Callable[[Any, Sequence[Any]], Any]


@dataclasses.dataclass
class Graph:
    """One graph of the step: what it was given and what its plan holds."""

    name: str
    baseline: int = 0
    share: int = 0
    carried: int = 0  # what the graphs before it left over (negative: what they overran)
    peak: int = 0  # the plan's resident peak over the graph's forward and backward
    end: int = 0  # what it keeps between its forward and backward, while later graphs run
    inputs: int = 0  # bytes it saves of earlier graphs' outputs (in peak and end; no plan's)
    floor: bool = False  # its plan is the smallest the planner reaches (it missed its share)
    sizes: str = ""  # under dynamic shapes, the lengths its plan was made for
    pool_capped: bool = False  # the host budget kept offloads on the device that it needed gone
    known: bool = False  # planned in this process, or its plan reported by its first run
    recompile: Callable[[int], None] | None = None
    frame: str = ""  # dynamo's id for the compile, for a graph that never planned (no name)

    @property
    def label(self) -> str:
        return self.name or self.frame or "a graph"


class StepBudget:
    """The graphs of one step, in forward order, and the budget they share."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.graphs: dict[object, Graph] = {}
        self.replans = 0
        self.verdict_given = False

    # -- figures -------------------------------------------------------------------------
    def total(self) -> int:
        """The step's budget in bytes (a fraction: of the baselines of the graphs so far)."""
        budget = self.options.memory_budget
        if isinstance(budget, float):
            return int(budget * sum(g.baseline for g in self.graphs.values()))
        assert isinstance(budget, int)
        return budget

    def peak(self) -> tuple[int, Graph | None]:
        """The step's predicted peak of saved bytes, and the graph where it falls.

        While graph ``k`` runs, forward or backward, the graphs before it hold what their
        forwards left (their backwards come later) and the graphs after it hold nothing
        (their forwards come later, their backwards ran before): ``end_1 + ... + end_{k-1}
        + peak_k``. At the forward's end that is every graph's saved bytes together."""
        best, at, before = 0, None, 0
        for g in self.graphs.values():
            if before + g.peak >= best:
                best, at = before + g.peak, g
            before += g.end
        return best, at

    @property
    def debt(self) -> int:
        return max(0, self.peak()[0] - self.total())

    def available(self, key: object) -> int:
        """What the graphs before ``key`` leave of the step's budget, before ``key``'s own
        fraction is added (the share's part that does not depend on its baseline)."""
        before = self._before(key)
        budget = self.options.memory_budget
        held = sum(g.end for g in before)
        if isinstance(budget, float):
            return int(budget * sum(g.baseline for g in before)) - held
        assert isinstance(budget, int)
        return budget - held

    def _before(self, key: object) -> list[Graph]:
        out = []
        for k, g in self.graphs.items():
            if k == key:
                break
            out.append(g)
        return out

    # -- compiling -----------------------------------------------------------------------
    def compile(self, key: object, name: str | None, gm: Any, example_inputs: Sequence[Any],
                compile_fn: Compile) -> Any:
        """Compile one graph of the step under its share; returns what dynamo calls."""
        entry = self.graphs.get(key)
        if entry is None:
            compile_id = compat.current_compile_id()
            frame = "" if compile_id is None else str(compile_id).strip("[]")
            entry = self.graphs[key] = Graph(name or "", frame=frame)
        else:  # a recompile (a new shape, say) replaces the graph's own entry
            entry.known = entry.floor = False
        self.verdict_given = False
        fakes = _fakes(example_inputs)
        # Inputs an earlier graph computed (they carry autograd history): what this graph
        # saves of them is held for its backward only because it saves them. The step's
        # first graph has no earlier one (what eager code before it computed is not the
        # step's, as under a per-graph budget), so a one-graph step plans as that graph.
        produced = [
            (i, tuple(t.shape)) for i, t in enumerate(example_inputs)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ] if self._before(key) else []  # fmt: skip
        holder: list[Any] = []

        def build(fixed: int | None, inputs: Sequence[Any]) -> Any:
            # A re-plan keeps the graph's name; a first compile learns it when partitioned.
            ticket = Ticket(self, key, entry.name if fixed is not None else None, fixed)
            ticket.produced = produced
            with _active(ticket):
                return compile_fn(gm, inputs)

        holder.append(build(None, example_inputs))  # the real inputs are not kept past this
        entry.recompile = None
        if fakes is not None:
            replan_inputs = fakes

            def recompile(budget: int) -> None:
                entry.known = False  # the re-plan's partition says what it holds
                try:
                    with compat.no_tracing_context():
                        holder[0] = build(budget, replan_inputs)
                except Exception as e:  # the graph keeps the plan it runs; the step goes on
                    log.warning("fxckpt[%s] re-planning for the step failed: %s", entry.label, e)
                    entry.recompile, entry.floor, entry.known = None, True, True
                    return
                if not entry.known:
                    # A warm compile cache served the re-plan: no partition ran, and its plan
                    # reports itself on its first run (the next step). Until then it counts
                    # as what it was planned for, as a cold re-plan that met it would.
                    entry.peak, entry.end = min(entry.peak, budget), min(entry.end, budget)

            entry.recompile = recompile
        run = self._runner(holder, key)
        if self.debt > 0:
            self._settle(key)
        return run

    def _runner(self, holder: list[Any], key: object) -> Any:
        first = holder[0]

        @functools.wraps(first)
        def run(*args: Any, **kwargs: Any) -> Any:
            out = holder[0](*args, **kwargs)
            if self.debt > 0 and not self.verdict_given and torch.is_grad_enabled():
                self._arm_verdict(out)
            return out

        return run

    def _settle(self, key: object) -> None:
        """Graph ``key`` missed its share: take the debt back from the graphs before the peak,
        each re-planned for what it holds at its forward's end less the debt, the largest
        holder first. Bounded by ``MAX_REPLANS``."""
        graph = self.graphs[key]
        while self.debt > 0 and self.replans < MAX_REPLANS:
            _, at = self.peak()
            before = [] if at is None else self._before(next(
                k for k, g in self.graphs.items() if g is at))
            order = sorted((g for g in before if g.known and not g.floor and g.end > 0
                            and g.recompile is not None), key=lambda g: g.end, reverse=True)
            if not order:
                break
            g = order[0]
            self.replans += 1
            assert g.recompile is not None
            g.recompile(max(1, g.end - self.debt))  # at its floor, it is asked no more
        if self.debt > 0 and not isinstance(self.options.memory_budget, float):
            # Under a byte budget later graphs only add to the step: it cannot be met.
            self.verdict(graph.label)

    def _arm_verdict(self, out: Any) -> None:
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._verdict_hook)
                return

    def _verdict_hook(self, grad: torch.Tensor) -> None:
        if not self.verdict_given and self.debt > 0:
            self.verdict(None)

    def verdict(self, graph: str | None) -> None:
        """Raise (or warn) that the step cannot meet its budget, naming its smallest figure:
        the step's peak with every graph that missed its share at its floor.

        A step of one graph (or of one graph that saves anything) is that graph: its budget,
        plan and floor are the ones ``budget_scope="graph"`` gives it, and so is its error
        (the graph's name, the sizes its plan was made for, the hints)."""
        self.verdict_given = True
        graphs = list(self.graphs.values())
        pool_capped = any(g.pool_capped for g in graphs)
        smallest, at = self.peak()
        # A graph that saves nothing for its backward (no grad, or nothing to save) is
        # counted, not listed: it is no part of the figure.
        holding = [g for g in graphs if g.peak or g.end] or graphs
        if len(holding) == 1:
            (g,) = holding
            error = BudgetError(g.label, self.total(), smallest, hints(self.options, pool_capped),
                                g.sizes)  # fmt: skip
            plans = "plan"
        else:
            parts = ", ".join(
                f"{g.label} holds {g.end} after its forward, {g.peak} at most"
                + (f" (planned for {g.sizes})" if g.sizes else "")
                for g in holding
            )
            where = f"while {at.label} runs; " if at is not None else ""
            names = ", ".join(g.label for g in holding)
            idle = len(graphs) - len(holding)
            if idle:
                names += f"; {idle} more that save nothing"
            error = BudgetError(
                f"the step ({len(holding)} graphs: {names})", self.total(), smallest,
                hints(self.options, pool_capped), "; ".join(g.sizes for g in graphs if g.sizes),
                scope="step", detail=where + parts,
            )  # fmt: skip
            plans = "plans"
        if self.options.on_infeasible == "raise":
            raise error
        warnings.warn(f"{error.summary} Running the smallest {plans} instead.", stacklevel=2)


class Ticket:
    """One compile of one graph under a step budget: asks for the share, reports the plan."""

    def __init__(self, step: StepBudget, key: object, name: str | None, fixed: int | None) -> None:
        self.step, self.key, self.name, self.fixed = step, key, name, fixed
        self.produced: list[tuple[int, tuple[int, ...]]] = []  # (input index, shape)

    def cache_token(self) -> str:
        """What the plan depends on besides the graph and the options (compile-cache keys)."""
        if self.fixed is not None:
            return f"step-fixed-{self.fixed}"
        return f"step-available-{self.step.available(self.key)}"

    def share(self, baseline: int, graph_name: str, inputs: int = 0) -> int:
        """The budget of this graph's plan. Its baseline min-cut saves ``baseline`` bytes of
        activations and ``inputs`` bytes of earlier graphs' outputs (:func:`fxckpt.graph.activations.saved_inputs`):
        those count in the step and in the baseline, and come off the plan's budget."""
        step, entry = self.step, self.step.graphs[self.key]
        entry.baseline, entry.inputs = baseline + inputs, inputs
        entry.name = self.name = self.name or graph_name
        available = step.available(self.key)
        budget = step.options.memory_budget
        own = int(budget * entry.baseline) if isinstance(budget, float) else 0
        share = self.fixed if self.fixed is not None else available + own
        if self.fixed is None:  # bytes: what the graphs before it hold comes off the share
            entry.carried = available if isinstance(budget, float) else available - step.total()
        entry.share = max(1, share)
        return max(1, entry.share - inputs)

    def planned(self, peak: int, end: int, *, reached: bool, sizes: str = "",
                pool_capped: bool = False) -> None:
        """The plan's resident peak, and the bytes it keeps for the backward (its offloads'
        copies land while the next graph runs; its peak counts them in flight). ``sizes``
        and ``pool_capped`` say, as a per-graph budget's error would, where the plan was made
        and whether the host budget stood in its way."""
        entry = self.step.graphs[self.key]
        entry.peak, entry.end = peak + entry.inputs, end + entry.inputs
        entry.floor, entry.known = not reached, True
        entry.sizes, entry.pool_capped = sizes, pool_capped and not reached

    def inputs(self) -> int:
        """Bytes of earlier graphs' outputs this graph saves (its plan records them)."""
        entry = self.step.graphs.get(self.key)
        return entry.inputs if entry is not None else 0

    def reported(self, payload: str) -> None:
        """The plan a graph's first run reports: where a warm compile cache served the graph,
        no partition ran in this process, and this is how the step learns what it holds:
        the same figures :meth:`share` and :meth:`planned` record, earlier graphs' outputs
        it saves included."""
        entry = self.step.graphs.get(self.key)
        if entry is None or entry.known:
            return
        plan = json.loads(payload)
        inputs = int(plan.get("step_inputs_bytes") or 0)
        entry.name = entry.name or str(plan.get("name") or "")
        entry.inputs = inputs
        entry.baseline = int(plan.get("baseline_saved_bytes") or 0) + inputs
        entry.peak = int(plan.get("resident_peak_bytes") or 0) + inputs
        entry.share = int(plan.get("budget_bytes") or 0) + inputs
        kept = {r.get("storage") or r["name"]: r["bytes"]
                for r in plan.get("activations", []) if r.get("decision") == "keep"}
        entry.end = sum(kept.values()) + inputs
        entry.floor = entry.peak > entry.share
        entry.known = True
        if self.step.debt > 0:  # as a compile that missed its share would: settle it now
            self.step._settle(self.key)

    def notes(self) -> list[str]:
        entry = self.step.graphs[self.key]
        budget = self.step.options.memory_budget
        if self.fixed is not None:
            return [
                f"step budget: re-planned to {entry.share} bytes, so that a later graph's "
                "share fits the step"
            ]
        own = f"{budget} of its baseline {entry.baseline}" if isinstance(budget, float) else ""
        carried = (
            f"{entry.carried:+d} bytes carried from earlier graphs" if entry.carried else
            "nothing carried from earlier graphs"
        )
        saved = f", {entry.inputs} of them earlier graphs' outputs it saves" if entry.inputs else ""
        text = f"step budget: share {entry.share} bytes ({own}{', ' if own else ''}{carried}{saved})"
        if budget is not None and not isinstance(budget, float):
            text = f"step budget: share {entry.share} bytes of {budget} ({carried}{saved})"
        return [text]


_current: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar(
    "fxckpt_step_ticket", default=None
)


def current() -> Ticket | None:
    """The ticket of the graph being partitioned, or ``None`` under a per-graph budget."""
    return _current.get()


@contextlib.contextmanager
def _active(ticket: Ticket) -> Iterator[None]:
    token = _current.set(ticket)
    try:
        yield
    finally:
        _current.reset(token)


@contextlib.contextmanager
def keeping_share(ticket: Ticket | None, name: str) -> Iterator[None]:
    """A later compile of the graph ``ticket`` compiled (a run-time re-plan, :mod:`fxckpt.adapt`)
    under the share that graph holds now, so that the step's other graphs keep theirs; its
    plan reports to the step as the first did. Nothing to do outside a step budget."""
    if ticket is None:
        yield
        return
    entry = ticket.step.graphs.get(ticket.key)
    again = Ticket(ticket.step, ticket.key, name, entry.share if entry and entry.share else None)
    again.produced = ticket.produced
    with _active(again):
        yield


def _fakes(example_inputs: Sequence[Any]) -> list[Any] | None:
    """Fake copies of a graph's inputs, for re-planning it later without holding real tensors;
    ``None`` where no fake mode traced it (then the graph is not re-planned)."""
    mode = compat.detect_fake_mode(example_inputs)
    if mode is None:
        return None if any(isinstance(t, torch.Tensor) for t in example_inputs) else list(example_inputs)
    return [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]


_steps: weakref.WeakKeyDictionary[Any, StepBudget] = weakref.WeakKeyDictionary()


def applies(options: Options) -> bool:
    """Whether a step budget shares ``options.memory_budget`` among graphs: the step scope,
    with a budget in bytes or a fraction (``"auto"`` is what is free when each graph
    compiles, which already leaves out what the graphs before it hold)."""
    budget = options.memory_budget
    return options.budget_scope == "step" and isinstance(budget, (int, float))


def step_for(options: Options) -> StepBudget:
    """The step of the ``torch.compile`` call compiling now (a step of its own outside one)."""
    owner = compat.compile_call_owner()
    if owner is None:
        return StepBudget(options)
    step = _steps.get(owner)
    if step is None or step.options.cache_key() != options.cache_key():
        step = _steps[owner] = StepBudget(options)
    return step


def graph_key() -> object:
    """Which graph of the step compiles now: dynamo's frame, so that a recompile of the frame
    replaces its own entry."""
    compile_id = compat.current_compile_id()
    return object() if compile_id is None else compile_id.frame_id

