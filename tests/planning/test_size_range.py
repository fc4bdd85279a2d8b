"""Where a plan over a range fixed by mark_dynamic fails, on plain polynomials, and the loop
that re-plans until the whole range holds."""

from __future__ import annotations

import dataclasses

import sympy

from fxckpt.planning.size_range import Shortfall, fit_range, worst_in_range

s, b = sympy.symbols("s b", integer=True, positive=True)


def test_the_worst_size_can_lie_inside_the_range() -> None:
    # A plan keeping tensors linear in the length against a baseline with a quadratic term:
    # both ends hold, the middle does not.
    kept, allowed = 40 * s + 400, s**2 / 4 + 30 * s + 420
    for end in (1, 64):
        assert kept.subs(s, end) <= allowed.subs(s, end)
    worst = worst_in_range(kept, allowed, 1, {s: 1}, {s: 64})
    assert worst is not None
    point, k, a = worst
    assert point == {s: 20} and k == 1200 and a == 1120  # the gap turns at s = 20


def test_a_plan_that_holds_everywhere_has_no_shortfall() -> None:
    assert worst_in_range(10 * s, s**2 + 10 * s, 1, {s: 2}, {s: 128}) is None


def test_the_worst_ratio_is_reported_and_scale_divides_both_sides() -> None:
    # 10 * kept <= 3 * baseline, kept = 100 s, baseline = 300 s + 40: over at every size,
    # most (by ratio) at the largest.
    point, k, a = worst_in_range(10 * 100 * s, 3 * (300 * s + 40), 10, {s: 2}, {s: 8})  # type: ignore[misc]
    assert point == {s: 8} and k == 800 and a == (3 * 2440) // 10


def test_two_dimensions_are_read_at_the_corners_and_the_turns_between() -> None:
    kept, allowed = b * (40 * s + 400), b * (s**2 / 4 + 30 * s + 420)
    point, _, _ = worst_in_range(kept, allowed, 1, {s: 1, b: 1}, {s: 64, b: 8})  # type: ignore[misc]
    assert point[s] == 20


def test_a_gap_that_is_no_polynomial_is_read_across_the_range() -> None:
    # A floor division of a size (a view of half the length, say) is no polynomial.
    kept, allowed = 40 * s + 400, sympy.floor(s**2 / 4) + 30 * s + 420
    worst = worst_in_range(kept, allowed, 1, {s: 1}, {s: 64})
    assert worst is not None and 10 <= worst[0][s] <= 30


@dataclasses.dataclass
class _Check:
    shortfall: Shortfall | None


def test_fit_range_tightens_until_the_range_holds() -> None:
    tried: list[int] = []

    def plan_at(budget: int) -> int:
        tried.append(budget)
        return budget  # an attempt whose peak is the budget it was made under

    def check(attempt: int) -> _Check:
        return _Check(Shortfall(attempt, 600, "s=2") if attempt > 600 else None)

    best, found, budget, replans = fit_range(1000, check(1000), 1000, plan_at, check, lambda a: a)
    assert found.shortfall is None and best == budget == 600 and replans == 1 and tried == [600]


def test_fit_range_keeps_the_best_attempt_where_no_plan_meets_a_tighter_budget() -> None:
    def check(attempt: int) -> _Check:
        return _Check(Shortfall(attempt, attempt // 2, "s=2"))

    best, found, budget, replans = fit_range(1000, check(1000), 1000, lambda _: None, check, lambda a: a)
    assert best == budget == 1000 and replans == 1 and found.shortfall is not None


def test_fit_range_gives_up_after_its_bound() -> None:
    calls: list[int] = []

    def plan_at(budget: int) -> int:
        calls.append(budget)
        return budget

    def check(attempt: int) -> _Check:  # never holds, but each attempt is a bit closer
        return _Check(Shortfall(attempt, attempt - 1, "s=2"))

    *_, replans = fit_range(1000, check(1000), 1000, plan_at, check, lambda a: a)
    assert replans == len(calls) == 4 and calls == sorted(calls, reverse=True)
