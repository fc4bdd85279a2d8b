"""One budget for the step: ``memory_budget`` bounds the device peak of the whole step.

A step's graphs are those of one ``torch.compile`` call: dynamo's graph breaks, a loss after a
break, the regions of Hugging Face's gradient checkpointing, a layer graph that runs once per
layer. The state lives with the call (keyed weakly by the compiler object dynamo holds for it,
never per process), one entry per compile of a dynamo frame (the step counts those that
ran), and a second model (an EMA copy) has steps of its own.

**The account** (:mod:`fxckpt.planning.account`). The step's peak is what the device held when
the step started (the *start level*), plus, at the worst moment, what the runs before it hold
for their backwards, the gradients the backward has made so far, and the live bytes of the run
in progress. Each run of a graph counts: a graph that runs once per layer holds what its
forward saves once per layer.

**The start level is measured.** On a GPU it is the allocator's figure when a step's first
forward begins (``torch.cuda.memory_allocated``: parameters, optimizer state, inputs, anything
else kept there). The CPU keeps no such counter, so there it is what the step is given: the
storages of the parameters, buffers and inputs its graphs take, their gradients, and the state
of any optimizer handed to :func:`fxckpt.watch`.

**Compiling.** Graphs compile one at a time, in forward order, during the first step. Each
gets a :class:`~fxckpt.planning.account.PeakTarget`: the budget less the start level and what
the runs before it in this step hold. A graph at its lowest plan that still misses its target
makes the graphs before it plan again for less, largest holder first.

**Each step after that.** A step starts at a forward that follows a backward. There the run
order of the step just finished is known and the start level is measured again: the account
is composed from every graph's figures, and where it is over the budget (the optimizer's state
appeared after the first ``optimizer.step()``, a graph runs several times, Inductor's own
schedule holds more than the plan's liveness) the graphs whose runs hold more than their
target are compiled again for it, before the step's first graph runs (where it fits with
room to spare, the graphs that gave something up are planned again for that room instead,
:mod:`fxckpt.planning.step_room`), at most
:data:`MAX_REPLANS` compiles per step and :data:`MAX_STEP_REPLANS` steps that re-plan. The
first step in which nothing compiles, and the first after each re-plan, is measured whole:
what it held beyond the plans' figures (eager code between the graphs; under Inductor, what
a plan holds beyond its schedule's figure) counts from then on
(:class:`~fxckpt.planning.start_level.EagerBytes`). A step
that still cannot fit once that is known (the third, usually) raises
:class:`~fxckpt.errors.BudgetError` (``on_infeasible="warn"``: warns) naming the smallest
budget the step reaches, with its parts; the steps before it run the lowest plans.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fxckpt import _torch_compat as compat
from fxckpt._torch_compat import pytree
from fxckpt.errors import BudgetError
from fxckpt.options import Options
from fxckpt.planning.account import (
    HEADROOM,
    Account,
    GraphFigures,
    PeakTarget,
    compose,
    targets,
)
from fxckpt.planning.plan_round import hints
from fxckpt.planning.start_level import EagerBytes, StartLevel, alive, new_gradients, storage_bytes
from fxckpt.planning.step_graphs import (
    Graph,
    Ticket,
    fake_inputs,
    named_budget,
    no_tighter,
    scheduled_figures,
    scheduled_margin,
)
from fxckpt.planning.step_room import use_room
from fxckpt.units import format_bytes

log = logging.getLogger(__name__)

# Compiles one step may spend re-planning its graphs, all graphs together.
MAX_REPLANS = 8
# Steps that may re-plan after the first (the optimizer's state appears; Inductor's figures:
# each re-plan's own figure is measured a step later, and may move the target again).
MAX_STEP_REPLANS = 8
# A start level this much above what the plans assumed re-plans the step.
START_SLACK = 1 / 200

Compile = Callable[[Any, Sequence[Any]], Any]


class StepBudget:
    """The graphs of one ``torch.compile`` call's step, their runs, and the budget they share."""

    def __init__(self, options: Options,
                 scheduled: Callable[[str], tuple[int, int] | None] = lambda payload: None,
                 held: Callable[[Any, torch.device], int] | None = None,
                 meter: Callable[[torch.device], Any] | None = None) -> None:
        self.options = options
        self.eager = EagerBytes(meter)  # what the step holds beyond the plans, measured
        self.compiles = 0  # compiles of this step's graphs so far (a measured step has none)
        self.compiling: object | None = None  # the graph whose first compile runs now
        self.compiles_at_start = 0
        self.scheduled = scheduled  # a plan's peaks in its compiler's schedule (inductor_peak)
        self.graphs: dict[object, Graph] = {}
        self.start = StartLevel(held)
        self.start_bytes = 0  # the start level the plans were made for
        self.runs: list[object] = []  # the last whole step's runs, in forward order
        self.current: list[object] = []  # the step in progress
        self.backward_seen = False
        self.steps = 0
        self.replanning_steps = 0
        self.replans = 0  # compiles spent on this step's re-plans
        self.verdict_given = False
        self._budget: int | None = None

    # -- figures ---------------------------------------------------------------------------
    @property
    def budget(self) -> int | None:
        """The step's budget in bytes (``None``: a fraction, or no limit)."""
        if self._budget is None:
            self._budget = self.options.resolve_budget(device=self.start.device)
        return self._budget

    def sequence(self) -> tuple[list[object], list[GraphFigures]]:
        """The runs the account adds up: the last whole step's, else those so far and the
        graph compiling now (its first run comes right after its compile)."""
        keys = list(self.runs or self.current)
        if not self.runs and self.compiling is not None and self.compiling not in keys:
            keys.append(self.compiling)
        keys = [k for k in keys if k in self.graphs]
        return keys, [self.graphs[k].figures() for k in keys]

    @property
    def level(self) -> int:
        """The start level the plans count: measured, and what eager code was seen to add."""
        return self.start_bytes + self.eager.bytes

    def eager_gradients(self, figures: list[GraphFigures]) -> int:
        """Parameter gradients the step makes that no run's backward makes: of the parameters
        eager code uses (the compiled module's others), counted from the backward's start."""
        return max(0, self.start.new_gradients() - sum(f.gradients for f in figures))

    def account(self, start: int | None = None) -> Account:
        keys, figures = self.sequence()
        return compose(self.level if start is None else start, figures,
                       self.eager_gradients(figures))

    def fits(self) -> bool:
        """Whether the account, with :data:`account.HEADROOM` free, is within the budget."""
        budget = self.budget
        return budget is None or self.account().peak + HEADROOM <= budget

    def target(self, key: object, own: GraphFigures | None = None) -> PeakTarget:
        """Graph ``key``'s target under the budget in bytes: see :func:`account.targets`."""
        budget = self.budget
        assert budget is not None
        keys, figures = self.sequence()
        # The graph's own runs make its gradients, whether it has run yet or not.
        mine = [] if key in keys else [own or self.graphs[key].figures()]
        return targets(budget, self.level, figures, keys, key, own,
                       self.eager_gradients(figures + mine))

    # -- compiling -------------------------------------------------------------------------
    def compile(self, key: object, gm: Any, example_inputs: Sequence[Any],
                compile_fn: Compile) -> Any:
        """Compile one graph of the step under its target; returns what dynamo calls."""
        entry = self.graphs.get(key)
        if entry is None:
            compile_id = compat.current_compile_id()
            frame = "" if compile_id is None else str(compile_id).strip("[]")
            entry = self.graphs[key] = Graph("", frame=frame)
        else:  # a recompile (a new shape, say) replaces the graph's own entry
            entry.known = entry.lowest = False
        self.verdict_given = False
        self.start.take(key, example_inputs)
        if not self.current and not self.runs:  # the step's first graph: the level it starts at
            self.start_bytes = self.start.measure()
        entry.params = [weakref.ref(t) for t in example_inputs
                        if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is None]
        entry.gradients = new_gradients(alive(entry.params))
        entry.inputs = sum(storage_bytes(t) for t in example_inputs
                           if isinstance(t, torch.Tensor) and t.grad_fn is not None)
        fakes = fake_inputs(example_inputs)
        # Inputs an earlier graph computed (they carry autograd history): what this graph
        # saves of them is held for its backward only because it saves them.
        produced = [(i, tuple(t.shape)) for i, t in enumerate(example_inputs)
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None]  # fmt: skip
        holder: list[Any] = []

        def build(fixed: PeakTarget | None, inputs: Sequence[Any]) -> Any:
            ticket = Ticket(self, key, entry.name if fixed is not None else None, fixed)
            ticket.produced = produced
            with _active(ticket):
                return compile_fn(gm, inputs)

        self.compiles += 1
        holder.append(build(None, example_inputs))  # the real inputs are not kept past this
        entry.recompile, entry.compiled, entry.raises, entry.refused = None, holder, 0, None
        if fakes is not None:
            def recompile(target: PeakTarget) -> None:
                entry.known = False  # the re-plan's partition says what it holds
                self.compiles += 1
                try:
                    with compat.no_tracing_context():
                        holder[0] = build(target, fakes)
                except Exception as e:  # the graph keeps the plan it runs; the step goes on
                    log.warning("fxckpt[%s] re-planning for the step failed: %s", entry.label, e)
                    entry.recompile, entry.lowest, entry.known = None, True, True
                    return
                if not entry.known:
                    # A warm compile cache served the re-plan: no partition ran, and its plan
                    # reports itself on its first run (the next step). Until then it counts
                    # as what it was planned for, as a cold re-plan that met it would.
                    entry.target = target
                    entry.forward_peak = min(entry.forward_peak, target.forward)
                    entry.backward_peak = min(entry.backward_peak, target.backward)

            entry.recompile = recompile
        if entry.over > 0:
            self.compiling = key
            try:
                self._settle(key)
            finally:
                self.compiling = None
        return self._runner(holder, key)

    def _runner(self, holder: list[Any], key: object) -> Any:
        first = holder[0]

        @functools.wraps(first)
        def run(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():
                self._forward(key)
            out = holder[0](*args, **kwargs)
            if torch.is_grad_enabled():
                self._arm(out)
            return out

        return run

    # -- steps -------------------------------------------------------------------------------
    def _forward(self, key: object) -> None:
        """A forward of graph ``key`` begins: after a backward, a new step."""
        if self.backward_seen and self.current:
            self.backward_seen = False
            self.runs, self.current = self.current, []
            self.steps += 1
            self.replans = 0
            # Inductor's figures first: what the measured step held beyond the plans is counted
            # over them (counted over the liveness figures, it would count their gap twice).
            if self.budget is not None:
                scheduled_figures(self.graphs.values(), self.scheduled)
            if self.eager.measuring:
                keys, figures = self.sequence()
                live = [self.graphs[k].liveness() for k in keys]
                predicted = self.account(start=0).peak
                self.eager.measured(predicted, predicted - compose(0, live, self.eager_gradients(figures)).peak)
            self._step_starts()
            self.compiles_at_start = self.compiles
            if self.budget is not None:
                self.eager.measure(self.start.device)
        self.current.append(key)

    def _arm(self, out: Any) -> None:
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._backward_hook)
                return

    def _backward_hook(self, grad: torch.Tensor) -> None:
        if not self.backward_seen and self.eager.measuring:
            compat.at_backward_end(self._step_ends)
        self.backward_seen = True

    def _step_ends(self) -> None:
        """The backward of a measured step ended: so did the step."""
        self.eager.step_ended(quiet=self.compiles == self.compiles_at_start)

    def _step_starts(self) -> None:
        """Between two steps: measure the start level, and plan again the graphs whose runs
        hold more than the budget leaves them."""
        budget = self.budget
        if budget is None:
            return
        level = self.start.measure()
        for g in self.graphs.values():  # a gradient kept from the last step is in the level now
            g.gradients = new_gradients(alive(g.params))
        grew = level > self.start_bytes + max(4096, int(budget * START_SLACK))
        if grew:
            log.info("fxckpt: the step starts at %s, %s more than its plans assumed; planning "
                     "again", format_bytes(level), format_bytes(level - self.start_bytes))
        self.start_bytes = max(level, self.start_bytes) if not grew else level
        if self.fits():
            if self.replanning_steps < MAX_STEP_REPLANS:
                use_room(self)  # a step with room to spare gives it back
            return
        if self.replanning_steps < MAX_STEP_REPLANS:
            self.replanning_steps += 1
            self._rebalance()
            if self.replans:
                self.eager.again()  # new plans: what the step holds beside them is measured again
        # The verdict waits for the re-plans to end, and for what the step holds beside the
        # plans that run now to be measured (a re-plan compiles in one step, the next is
        # measured): else the figure it names is not the lowest plans', or too small.
        settled = self._settled() or self.replanning_steps >= MAX_STEP_REPLANS
        measured = self.eager.known or self.steps > 3 + 2 * self.replanning_steps
        if not self.fits() and not self.verdict_given and settled and measured:
            self.verdict(None)

    def _rebalance(self) -> None:
        """Compile again, for its target in this step, each graph whose runs hold more than
        it: the largest holders first, at most :data:`MAX_REPLANS` compiles."""
        for k, runs in self.holders():
            if self.fits() or self.replans >= MAX_REPLANS:
                return
            g = self.graphs[k]
            if (want := self._lower(k)) is None or g.recompile is None:
                continue
            self.replans += 1
            log.info("fxckpt[%s] runs %d time(s) a step and holds more than the budget leaves "
                     "it; planning it again (forward within %s, backward within %s)", g.label,
                     runs, format_bytes(want.forward), format_bytes(want.backward))
            g.recompile(want)

    def holders(self) -> list[tuple[object, int]]:
        """Each graph of the step with its runs a step, the largest holders first."""
        keys, _ = self.sequence()
        counts = {k: keys.count(k) for k in keys if k in self.graphs}
        return sorted(counts.items(), key=lambda kc: -kc[1] * max(self.graphs[kc[0]].held, 1))

    def _lower(self, k: object) -> PeakTarget | None:
        """The target graph ``k`` would plan again for: its share less what the compiler's
        schedule held over the plan's liveness; None where it meets its share, is at its floor
        for a target as tight already, or cannot plan again."""
        g = self.graphs[k]
        if g.recompile is None or not g.known:
            return None
        want = self.target(k)
        if want.met_by(g.forward_peak, g.backward_peak, g.held):
            return None
        want = want.lowered(scheduled_margin(g, self.scheduled))
        return None if g.lowest and g.target is not None and no_tighter(want, g.target) else want

    def _settled(self) -> bool:
        """Whether no graph of the step would plan again: none has a lower plan, and none
        re-planned waits for its first run to report its plan."""
        graphs = {k: self.graphs[k] for k in self.sequence()[0] if k in self.graphs}
        return all((g.known or g.target is None) and self._lower(k) is None for k, g in graphs.items())

    def _settle(self, key: object) -> None:
        """Graph ``key`` missed its target at its lowest plan: the graphs before it plan again."""
        if self.budget is not None:
            self._rebalance()

    def verdict(self, graph: str | None) -> None:
        """Raise (or warn) that the step cannot meet its budget, naming the smallest budget
        it reaches (the account with every graph that missed its target at its lowest plan)
        and that budget's parts."""
        self.verdict_given = True
        budget = self.budget
        assert budget is not None
        account = self.account()
        graphs = [g for g in self.graphs.values() if g.known]
        holding = [g for g in graphs if g.held or g.forward_peak or g.backward_peak] or graphs
        names = ", ".join(g.label for g in holding)
        idle = len(self.graphs) - len(holding)
        if idle:
            names += f"; {idle} more that save nothing"
        keys, _ = self.sequence()
        runs = len(keys)
        where = "the step" if len(holding) <= 1 else f"the step ({len(holding)} graphs, {runs} runs: {names})"
        label = graph if graph and len(holding) <= 1 else where
        error = BudgetError(
            label, budget, named_budget(account.peak),
            hints(self.options, any(g.pool_capped for g in graphs)),
            "; ".join(dict.fromkeys(g.sizes for g in graphs if g.sizes)),
            scope="step", parts=account.parts(),
        )
        if self.options.on_infeasible == "raise":
            raise error
        warnings.warn(f"{error.summary} Running the smallest plans instead.", stacklevel=2)


_current: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar(
    "fxckpt_step_ticket", default=None
)


def current() -> Ticket | None:
    """The ticket of the graph being partitioned, or ``None`` outside a step."""
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
    under the target that graph holds now, so that the step's other graphs keep theirs; its
    plan reports to the step as the first did. Nothing to do outside a step."""
    if ticket is None:
        yield
        return
    entry = ticket.step.graphs.get(ticket.key)
    again = Ticket(ticket.step, ticket.key, name, entry.target if entry else None)
    again.produced = ticket.produced
    with _active(again):
        yield


_steps: weakref.WeakKeyDictionary[Any, StepBudget] = weakref.WeakKeyDictionary()


def applies(options: Options) -> bool:
    """Whether a step account holds the graphs of this compile: wherever a budget is set."""
    return options.memory_budget is not None


def step_for(options: Options,
             scheduled: Callable[[str], tuple[int, int] | None] = lambda payload: None,
             held: Callable[[Any, torch.device], int] | None = None,
             meter: Callable[[torch.device], Any] | None = None) -> StepBudget:
    """The step of the ``torch.compile`` call compiling now (a step of its own outside one);
    ``scheduled``, ``held`` and ``meter``: see :class:`StepBudget` and :class:`StartLevel`."""
    owner = compat.compile_call_owner()
    if owner is None:
        return StepBudget(options, scheduled, held, meter)
    step = _steps.get(owner)
    if step is None or step.options.cache_key() != options.cache_key():
        step = _steps[owner] = StepBudget(options, scheduled, held, meter)
    return step


def graph_key() -> object:
    """Which graph of the step compiles now: a compile of a dynamo frame (they live side by side,
    each with its guards: Hugging Face's layers compile once per layer index under a cache)."""
    compile_id = compat.current_compile_id()
    return object() if compile_id is None else (compile_id.frame_id, compile_id.frame_compile_id)
