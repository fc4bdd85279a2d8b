"""A plan over a range of sizes that ``mark_dynamic`` fixed: where in the range it fails its
budget, and the re-plans that make it hold over all of it.

dynamo refuses a guard that narrows such a range, so one graph serves every size in it. The
plan is made at the range's upper end (:func:`fxckpt.passes.shape_budget.upper_bounds_to_plan_for`);
what it keeps resident, less what the budget allows, is a polynomial in the sizes, and that
need not be largest at an end of the range.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import sympy
from mpmath.libmp import NoConvergence

A = TypeVar("A")


class _Checked(Protocol):
    @property
    def shortfall(self) -> Shortfall | None: ...


C = TypeVar("C", bound=_Checked)


@dataclasses.dataclass
class Shortfall:
    """Where a plan fails its budget inside a range fixed by ``mark_dynamic``."""

    kept: int  # resident bytes the plan keeps there
    allowed: int  # what the budget allows there
    at: str  # the sizes, ``L['idx'].size()[1]=2``

    @property
    def over(self) -> float:
        """How far over: kept / allowed."""
        return self.kept / max(self.allowed, 1)


def _over(check: _Checked) -> float:
    return 0.0 if check.shortfall is None else check.shortfall.over


# Re-plans at a tighter budget before a range fixed by mark_dynamic is declared infeasible.
MAX_RANGE_REPLANS = 4


def fit_range(
    first: A, check: C, budget: int, plan_at: Callable[[int], A | None],
    check_of: Callable[[A], C], peak_of: Callable[[A], int],
) -> tuple[A, C, int, int]:
    """Re-plan until the plan holds over every range fixed by ``mark_dynamic``.

    The plan is made at the range's upper end, so it meets the budget there; at shorter
    lengths tensors that shrink more slowly than the baseline (linear against quadratic, say)
    can take more than the fraction. Each re-plan is made at the upper end again, with a budget
    tightened by how far the worst length is over, until the whole range holds.
    ``plan_at(bytes)`` returns ``None`` when no plan meets that budget at the upper end.

    Returns the attempt with the smallest overrun, its check, the budget it was planned
    under and the number of re-plans. A shortfall left on the check is the caller's to raise.
    """
    best, best_check, best_budget = first, check, budget
    current, replans = first, 0
    while check.shortfall is not None and replans < MAX_RANGE_REPLANS:
        short = check.shortfall
        tighter = min(budget - 1, peak_of(current) * short.allowed // max(short.kept, 1))
        if tighter <= 0:
            break
        nxt = plan_at(tighter)
        replans += 1
        if nxt is None:
            break
        current, budget, check = nxt, tighter, check_of(nxt)
        if _over(check) < _over(best_check):
            best, best_check, best_budget = current, check, budget
    return best, best_check, best_budget, replans


def worst_in_range(
    kept: Any, allowed: Any, scale: int, lower: dict[Any, int], upper: dict[Any, int]
) -> tuple[dict[Any, int], int, int] | None:
    """The sizes in the box ``lower..upper`` where ``kept <= allowed`` fails by the largest
    ratio, with both sides there divided by ``scale``; None where it holds at every size.

    ``kept`` and ``allowed`` are sympy expressions in the symbols of ``upper`` only. Their
    difference need not be largest at an end of the range (a baseline's quadratic terms
    against a plan's linear ones make it concave), so it is read at the ends and at every
    size where it turns along one dimension: with one dimension that covers every local
    maximum; with several, the turning points along each dimension at the others' ends.
    """
    worst: tuple[dict[Any, int], int, int] | None = None
    for point in _range_points(kept - allowed, lower, upper):
        values = {s: sympy.Integer(v) for s, v in point.items()}
        k, a = int(kept.xreplace(values)), int(allowed.xreplace(values))
        if k > a and (worst is None or k * max(worst[2], 1) > worst[1] * max(a, 1)):
            worst = (point, k // scale, a // scale)
    return worst


def _range_points(
    gap: Any, lower: dict[Any, int], upper: dict[Any, int]
) -> list[dict[Any, int]]:
    """The corners of the box ``lower..upper``, and for each dimension the integer sizes
    around each real root of ``d gap / d s`` inside its range, the others at their ends."""
    symbols = sorted(upper, key=str)
    axes: dict[Any, set[int]] = {s: {lower[s], upper[s]} for s in symbols}
    for s in symbols:
        others = [x for x in symbols if x is not s]
        for corner in itertools.product(*[(lower[x], upper[x]) for x in others]):
            at = {x: sympy.Integer(v) for x, v in zip(others, corner, strict=True)}
            axes[s] |= _turning_sizes(gap.xreplace(at), s, lower[s], upper[s])
    grid = itertools.product(*[sorted(axes[s]) for s in symbols])
    return [dict(zip(symbols, p, strict=True)) for p in grid]


def _turning_sizes(expr: Any, s: Any, lo: int, hi: int) -> set[int]:
    """Integer sizes next to each turning point of ``expr`` in ``s`` strictly inside
    ``lo..hi``; where ``expr`` is not a polynomial in ``s`` (a floor division of a size, say),
    sizes spread over the range instead."""
    try:
        roots = sympy.Poly(sympy.diff(expr, s), s).nroots()
    except (sympy.polys.polyerrors.BasePolynomialError, NoConvergence):
        return {min(hi, max(lo, round(lo + (hi - lo) * k / 32))) for k in range(33)}
    out: set[int] = set()
    for r in roots:
        if abs(sympy.im(r)) < 1e-9 and lo < (x := float(sympy.re(r))) < hi:
            out |= {max(lo, math.floor(x)), min(hi, math.ceil(x))}
    return out
