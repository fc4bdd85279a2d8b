"""Dynamic shapes and the memory budget: one plan per range of sizes it holds for.

Under dynamic shapes one compiled graph serves every length of a dimension, but a plan is
made with numbers. The rule:

1. **A range with an end: plan for its longest length.** A size symbol with an upper bound
   (dynamo's ``mark_dynamic(t, dim, max=N)``, or a range dynamo derived) is planned at
   that bound. Saved bytes grow with the length, so a byte budget that fits there fits every
   shorter length; where none fits, the budget is infeasible at that length (``BudgetError``
   at compile time, naming it). dynamo refuses a guard that narrows a range the user marked
   (``ConstraintViolationError``), so one graph must serve it all, and the plan is checked
   at every size of the range (its ends and the sizes where the plan's resident bytes less
   the budget turn). A fraction can fail below the upper end: tensors that grow more slowly
   than the baseline take a larger share of it at shorter lengths. The plan is then made
   again at the upper end under a tighter budget until the whole range holds
   (:func:`fit_range`), or ``BudgetError`` names the size where it cannot.
2. **Otherwise guard the sizes the plan holds for.** The plan is made for this call's sizes,
   and a guard is installed in dynamo's shape environment that is true exactly while the
   plan's resident bytes stay within the budget:
   - a byte budget ``B``: ``resident(s) <= B``;
   - a fraction ``f``: ``resident(s) <= f * baseline(s)``, each length's own baseline (what
     plain min-cut saves at that length).
   A call outside that range fails the guard; dynamo compiles the graph again for the new
   sizes, and fxckpt makes a new plan for them (or raises ``BudgetError`` naming them).

``resident(s)`` is the plan's resident saved bytes as polynomials in the size symbols, one
per position of the step where the peak can fall: positions whose polynomial another
position's bounds term by term can never hold the peak, so only the others are guarded.
Copy timings are those of the planning sizes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import sympy
import torch
import torch.fx as fx

from fxckpt._torch_compat import (
    free_unbacked,
    symbol_hints,
    symbol_lower_bound,
    symbol_upper_bound,
)
from fxckpt.graph.activations import SavedActivation
from fxckpt.graph.sizes import (
    concrete,
    describe,
    is_ranged,
    planning_values,
    size_symbols,
)
from fxckpt.options import Options
from fxckpt.planning.memory import Problem, residency
from fxckpt.planning.size_range import Shortfall, worst_in_range

if TYPE_CHECKING:
    from fxckpt.passes.rounds import Attempt

log = logging.getLogger(__name__)

# More sets than this on the frontier are merged into their union: one guard that still holds
# wherever every one of them would (it only recompiles sooner).
MAX_GUARDS = 8

Poly = dict[Any, Any]  # term -> coefficient, from sympy


def _byte_budget(options: Options) -> bool:
    budget = options.memory_budget
    return isinstance(budget, int) or budget == "auto"


def ranged_symbols(joint: fx.GraphModule) -> frozenset[str]:
    """The names of the joint graph's size symbols whose range has an end now."""
    env, symbols = size_symbols(_placeholder_vals(joint))
    if env is None:
        return frozenset()
    return frozenset(str(s) for s in symbols if symbol_upper_bound(env, s) is not None)


def upper_bounds_to_plan_for(joint: fx.GraphModule, options: Options,
                             ranged: frozenset[str] | None = None) -> dict[sympy.Symbol, int]:
    """The size symbols a budget is planned at, with the bound each is planned at; of the
    symbols named in ``ranged`` only, where given."""
    if options.memory_budget is None:
        return {}
    env, symbols = size_symbols(_placeholder_vals(joint))
    if env is None:
        return {}
    hints = symbol_hints(env)
    out = {}
    for s in symbols:
        upper = symbol_upper_bound(env, s)
        if upper is not None and upper > int(hints.get(s, upper)) and (ranged is None or str(s) in ranged):
            out[s] = upper
    return out


def _placeholder_vals(gm: fx.GraphModule) -> list[Any]:
    return [
        v
        for n in gm.graph.find_nodes(op="placeholder")
        if isinstance(v := n.meta.get("val"), torch.Tensor | torch.SymInt)
    ]


def _poly(expr: Any) -> Poly:
    if not isinstance(expr, sympy.Expr):
        return {sympy.Integer(1): sympy.Integer(int(expr))}
    return dict(sympy.expand(expr).as_coefficients_dict())


def _dominates(a: Poly, b: Poly) -> bool:
    """``a(s) >= b(s)`` for every size: each term's coefficient is at least as large."""
    return all(a.get(t, 0) >= c for t, c in b.items()) and all(
        c >= 0 for t, c in a.items() if t not in b
    )


def peak_candidates(
    problem: Problem, kinds: Sequence[str], d2h_done: Sequence[int], issue: Sequence[int],
    sym_bytes: Sequence[Any],
) -> list[set[int]]:
    """Sets of candidates resident together at the positions where the peak can fall, for
    any sizes: the other positions' resident polynomials are bounded term by term by one of
    these."""
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for i, kind in enumerate(kinds):
        for a, b in residency(problem, i, kind, d2h_done[i], issue[i]):
            starts.setdefault(a, []).append(i)
            ends.setdefault(b + 1, []).append(i)
    polys = [_poly(_expr(b)) for b in sym_bytes]
    live: set[int] = set()
    snapshots: list[tuple[frozenset[int], Poly]] = []
    for t in sorted(set(starts) | set(ends)):
        for i in ends.get(t, ()):
            live.discard(i)
        for i in starts.get(t, ()):
            live.add(i)
        if t in starts and live:
            total: Poly = {}
            for i in live:
                for term, c in polys[i].items():
                    total[term] = total.get(term, 0) + c
            snapshots.append((frozenset(live), total))
    frontier: list[tuple[frozenset[int], Poly]] = []
    for members, p in snapshots:
        if any(_dominates(q, p) for _, q in frontier):
            continue
        frontier = [(m, q) for m, q in frontier if not _dominates(p, q)]
        frontier.append((members, p))
    return [set(m) for m, _ in frontier]


def _expr(v: Any) -> Any:
    return v.node.expr if isinstance(v, torch.SymInt) else int(v)

def _storage_nbytes(gm: fx.GraphModule, acts: Iterable[SavedActivation]) -> dict[str, Any]:
    """Bytes of each storage as the graph computes them: a SymInt under dynamic shapes.

    Only sizes of the graph's inputs can be guarded. A size symbol of anything else (the CPU
    generator state a recomputed random op saves is fakeified with a size of its own under
    ``dynamic=True``) has no input to test, so it is read at its hint, a constant.
    """
    _, guardable = size_symbols(_placeholder_vals(gm))
    nodes = {n.name: n for n in gm.graph.nodes}
    out: dict[str, Any] = {}
    for a in acts:
        if a.storage not in out:
            nbytes = nodes[a.name].meta["val"].untyped_storage().nbytes()
            if isinstance(nbytes, torch.SymInt) and not nbytes.node.expr.free_symbols <= guardable:
                nbytes = concrete(nbytes)
            out[a.storage] = nbytes
    return out


@dataclasses.dataclass
class BudgetCheck:
    """What :func:`check_budget` found for one plan. Nothing is installed on the graph until
    :meth:`install`, so a plan that is re-planned leaves no guard behind."""

    what: str = ""
    guards: list[Any] = dataclasses.field(default_factory=list)  # SymBools of rule 2
    ranges: int = 0  # conditions checked over a range fixed by mark_dynamic
    shortfall: Shortfall | None = None  # the worst point of such a range, where it fails

    def install(self) -> list[str]:
        """Install the guards; the notes for the plan."""
        for cond in self.guards:
            bool(cond)  # evaluating a SymBool installs it as a guard on the compiled graph
        notes = []
        if self.guards:
            notes.append(f"guarded to sizes where the plan meets {self.what} "
                         f"({len(self.guards)} condition(s)); other sizes compile a new plan")
        if self.ranges and self.shortfall is None:
            notes.append(f"meets {self.what} at every size of the range fixed by mark_dynamic")
        return notes


def check_budget(
    *,
    problem: Problem,
    kinds: Sequence[str],
    d2h_done: Sequence[int],
    prefetch_issue: Sequence[int],
    storage_keys: Sequence[str],
    fw: fx.GraphModule,
    final: Sequence[SavedActivation],
    baseline_fw: fx.GraphModule,
    baseline: Sequence[SavedActivation],
    options: Options,
    budget: int | None,
) -> BudgetCheck:
    """Rule 2's guards for one plan, and rule 1's check over the ranges fixed by
    ``mark_dynamic`` (module docstring). ``budget``: the saved activations the plan allows
    itself, in bytes (what its target allows the whole graph, scaled to what it saves)."""
    if budget is None:
        return BudgetCheck()
    sym = _storage_nbytes(fw, final)
    sym_bytes = [sym[k] for k in storage_keys]
    if not any(isinstance(b, torch.SymInt) for b in sym_bytes):
        return BudgetCheck()
    env = next(b.node.shape_env for b in sym_bytes if isinstance(b, torch.SymInt))
    sets = peak_candidates(problem, kinds, d2h_done, prefetch_issue, sym_bytes)
    totals = [torch.sym_sum([sym_bytes[i] for i in sorted(m)]) for m in sets]
    bound: Any = budget
    scale = 1
    what = f"the {budget} bytes of saved activations its plan allows"
    if len(sets) > MAX_GUARDS:
        # Every candidate's bytes are >= 0 at any size, so the union's bytes bound each set's.
        totals = [torch.sym_sum([sym_bytes[i] for i in sorted(set().union(*sets))])]
    # The sizes the plan was made for: a dimension's upper bound where it was planned there,
    # else the call's own size.
    hints = symbol_hints(env)
    at_plan = {**hints, **{s: sympy.Integer(v) for s, v in planning_values().items()}}
    out = BudgetCheck(what)
    for total in totals:
        cond = total * scale <= bound
        if not isinstance(cond, torch.SymBool):
            continue
        expr = cond.node.expr
        if not expr.free_symbols or free_unbacked(expr) or not bool(expr.xreplace(at_plan)):
            # Known true for every size; or not testable; or not true at the planning sizes
            # themselves (a plan over its budget, already reported): no guard.
            continue
        fixed = {s: u for s in expr.free_symbols
                 if is_ranged(s) and (u := symbol_upper_bound(env, s)) is not None}
        if not fixed:
            out.guards.append(cond)
            continue
        # A guard that narrows a range the user marked dynamic is refused by dynamo
        # (ConstraintViolationError): one graph serves the whole range, so the plan must hold
        # at every size in it.
        out.ranges += 1
        # Sizes outside the fixed ranges are read at their hints: rule 2 guards them.
        free = {s: v for s, v in hints.items() if s not in fixed}
        kept, allowed = (sympy.sympify(_expr(v)).xreplace(free) for v in (total * scale, bound))
        lower = {s: symbol_lower_bound(env, s) for s in fixed}
        if (worst := worst_in_range(kept, allowed, scale, lower, fixed)) is not None:
            short = Shortfall(worst[1], worst[2], describe(env, worst[0]))
            if out.shortfall is None or short.over > out.shortfall.over:
                out.shortfall = short
    return out


def sizes_note(joint: fx.GraphModule) -> str:
    """``L['idx'].size()[1]=512 (upper bound)``: the sizes a plan is made for, or ""."""
    env, symbols = size_symbols(_placeholder_vals(joint))
    if env is None:
        return ""
    bounds = planning_values()
    hints = symbol_hints(env)
    values = {s: bounds.get(s, int(hints[s])) for s in symbols if s in hints or s in bounds}
    text = describe(env, values)
    return f"{text} (upper bound)" if bounds else text


def check_attempt(
    attempt: Attempt, *, base_fw: fx.GraphModule, baseline: list[SavedActivation],
    options: Options, budget: int,
) -> BudgetCheck:
    """:func:`check_budget` of a planning round's result."""
    decision = attempt.decision
    assert decision is not None
    sim = decision.solution.sim
    return check_budget(
        problem=decision.problem, kinds=decision.solution.choices, d2h_done=sim.d2h_done,
        prefetch_issue=sim.prefetch_issue, storage_keys=[st.key for st in decision.storages],
        fw=attempt.part.fw, final=attempt.part.saved, baseline_fw=base_fw, baseline=baseline,
        options=options, budget=budget,
    )  # fmt: skip
