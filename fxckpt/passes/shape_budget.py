"""Dynamic shapes and the memory budget: one plan per range of sizes it holds for.

Under dynamic shapes one compiled graph serves every length of a dimension, but a plan is
made with numbers. The rule:

1. **Plan for the longest length when there is one.** With a byte budget and a size symbol
   that has an upper bound (``torch._dynamo.mark_dynamic(t, dim, max=N)``, or a range dynamo
   derived), the plan is made with that symbol at its bound. Saved bytes grow with the length,
   so a plan that fits there fits every shorter length; where none fits, the budget is
   infeasible at that length (``BudgetError`` at compile time, naming the length).
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

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from typing import Any

import sympy
import torch
import torch.fx as fx

from fxckpt._torch_compat import free_unbacked, symbol_hints, symbol_upper_bound
from fxckpt.graph.activations import SavedActivation
from fxckpt.graph.memory import Problem, residency
from fxckpt.graph.sizes import describe, planning_at, planning_values, size_symbols
from fxckpt.options import Options

log = logging.getLogger(__name__)

# More sets than this on the frontier are merged into their union: one guard that still holds
# wherever every one of them would (it only recompiles sooner).
MAX_GUARDS = 8

Poly = dict[Any, Any]  # term -> coefficient, from sympy


def _byte_budget(options: Options) -> bool:
    budget = options.memory_budget
    return isinstance(budget, int) or budget == "auto"


def upper_bounds_to_plan_for(joint: fx.GraphModule, options: Options) -> dict[sympy.Symbol, int]:
    """The size symbols a byte budget is planned at, with the bound each is planned at."""
    if not _byte_budget(options):
        return {}
    env, symbols = size_symbols(_placeholder_vals(joint))
    if env is None:
        return {}
    hints = symbol_hints(env)
    out = {}
    for s in symbols:
        upper = symbol_upper_bound(env, s)
        if upper is not None and upper > int(hints.get(s, upper)):
            out[s] = upper
    return out


def plan_for_longest(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run the partitioner ``fn(joint, joint_inputs, options, ...)`` with sizes read at the
    upper bounds :func:`upper_bounds_to_plan_for` finds."""

    @functools.wraps(fn)
    def wrapper(joint: fx.GraphModule, joint_inputs: Any, options: Options, **kwargs: Any) -> Any:
        bounds = upper_bounds_to_plan_for(joint, options)
        if bounds:
            log.info("fxckpt: planning for the longest lengths: %s", sorted(map(str, bounds.items())))
        with planning_at(bounds):
            return fn(joint, joint_inputs, options, **kwargs)

    return wrapper


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


def _storage_nbytes(nodes: dict[str, fx.Node], acts: Iterable[SavedActivation]) -> dict[str, Any]:
    """Bytes of each storage as the graph computes them: a SymInt under dynamic shapes."""
    out: dict[str, Any] = {}
    for a in acts:
        if a.storage not in out:
            val = nodes[a.name].meta["val"]
            out[a.storage] = val.untyped_storage().nbytes()
    return out


def guard_budget(
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
) -> list[str]:
    """Install the guards of rule 2 (module docstring); returns notes for the plan."""
    if budget is None:
        return []
    nodes = {n.name: n for n in fw.graph.nodes}
    sym = _storage_nbytes(nodes, final)
    sym_bytes = [sym[k] for k in storage_keys]
    if not any(isinstance(b, torch.SymInt) for b in sym_bytes):
        return []
    env = next(b.node.shape_env for b in sym_bytes if isinstance(b, torch.SymInt))
    sets = peak_candidates(problem, kinds, d2h_done, prefetch_issue, sym_bytes)
    totals = [torch.sym_sum([sym_bytes[i] for i in sorted(m)]) for m in sets]
    if _byte_budget(options):
        bound: Any = budget
        scale = 1
        what = f"memory_budget={budget} bytes"
    else:
        fraction = Fraction(str(options.memory_budget))
        base_nodes = {n.name: n for n in baseline_fw.graph.nodes}
        bound = torch.sym_sum(list(_storage_nbytes(base_nodes, baseline).values())) * fraction.numerator
        scale = fraction.denominator
        what = f"memory_budget={options.memory_budget} of each length's baseline"
    if len(sets) > MAX_GUARDS:
        # Every candidate's bytes are >= 0 at any size, so the union's bytes bound each set's.
        totals = [torch.sym_sum([sym_bytes[i] for i in sorted(set().union(*sets))])]
    hints = symbol_hints(env)
    guarded = 0
    for total in totals:
        cond = total * scale <= bound
        if not isinstance(cond, torch.SymBool):
            continue
        expr = cond.node.expr
        if free_unbacked(expr) or not bool(expr.xreplace(hints)):
            # Not true at the planning sizes themselves (a plan over its budget, already
            # reported), or not testable: the run-time check in stats warns instead.
            continue
        bool(cond)  # evaluating a SymBool installs it as a guard on the compiled graph
        guarded += 1
    if not guarded:
        return []
    return [f"guarded to sizes where the plan meets {what} ({guarded} condition(s)); "
            "other sizes compile a new plan"]


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
