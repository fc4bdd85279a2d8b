"""The budget solver: reported figures, monotonicity in the budget, optimality and speed."""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxckpt.planning.memory import Candidates, Problem, Timeline, simulate
from fxckpt.planning.solve import greedy_curve, solve

STEP_MS = [0.0, 0.5, 1.0, 2.0, 3.0]
BYTES = [0, 100, 200, 300, 500, 800]
RECOMPUTE_MS = [math.inf, 0.0, 0.5, 1.0, 2.0, 4.0]
BANDWIDTH = [25.0, 100.0, 400.0, math.inf]  # bytes per ms: 100 B copies take 4 ms .. 0 ms
OVERHEADS_MS = [0.0, 0.0, 0.3, 2.0]  # per offloaded tensor
LINK_OVERHEAD_MS = [0.0, 0.0, 0.5, 3.0]  # per copy, on its queue


def _allowed(rec: float, can_offload: bool) -> list[str]:
    return ["keep"] + ["recompute"] * math.isfinite(rec) + ["offload"] * can_offload


@st.composite
def problems(draw, max_n: int = 8, max_half: int = 10) -> Problem:
    F = draw(st.integers(1, max_half))
    T = F + draw(st.integers(1, max_half))
    step = draw(st.lists(st.sampled_from(STEP_MS), min_size=T, max_size=T))
    cols: list[list] = [[] for _ in range(8)]
    for _ in range(draw(st.integers(0, max_n))):
        p = draw(st.integers(0, F - 1))
        fb = draw(st.integers(F, T - 1))
        rec, off = draw(st.sampled_from(RECOMPUTE_MS)), draw(st.booleans())
        forced = draw(st.sampled_from([None] * 4 + _allowed(rec, off)))
        row = (draw(st.sampled_from(BYTES)), p, draw(st.integers(p, F - 1)), fb,
               draw(st.integers(fb, T - 1)), rec, off, forced)
        for col, v in zip(cols, row, strict=True):
            col.append(v)
    fixed = draw(st.none() | st.lists(st.sampled_from([0, 100, 300]), min_size=T, max_size=T))
    overhead = draw(st.sampled_from(OVERHEADS_MS))
    # Copy buckets: candidates sharing an id copy together (None: each alone).
    n = len(cols[0])
    buckets = draw(st.none() | st.lists(st.integers(0, 3), min_size=n, max_size=n))
    link = draw(st.sampled_from(LINK_OVERHEAD_MS))
    return Problem(Timeline(step, F, draw(st.sampled_from(BANDWIDTH)), fixed, overhead, link),
                   Candidates(*cols, bucket=buckets))


def random_problem(rng: random.Random, n: int, bandwidth: float | None = None,
                   stack: bool = False) -> Problem:
    """Seeded instances for the optimality figures; ``stack``: backward mirrors the forward."""
    F = rng.randint(2, 12)
    T = F + rng.randint(2, 12)
    cols: list[list] = [[] for _ in range(7)]
    for _ in range(n):
        p = rng.randrange(F)
        fb = max(F, min(T - 1, F + (F - 1 - p) * (T - F) // F)) if stack else rng.randint(F, T - 1)
        row = (rng.choice(BYTES), p, rng.randint(p, F - 1), fb, rng.randint(fb, T - 1),
               rng.choice(RECOMPUTE_MS), rng.random() < 0.7)
        for col, v in zip(cols, row, strict=True):
            col.append(v)
    bw = rng.choice(BANDWIDTH) if bandwidth is None else bandwidth
    fixed = [rng.choice([0, 100, 200]) for _ in range(T)] if rng.random() < 0.5 else None
    return Problem(Timeline([rng.choice(STEP_MS) for _ in range(T)], F, bw, fixed),
                   Candidates(*cols))


def keep_peak(pb: Problem, prefetch: str = "auto") -> int:
    return simulate(pb, ["keep"] * len(pb), prefetch=prefetch).peak  # type: ignore[arg-type]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


# FXCKPT_EXAMPLES=2000 for a longer hunt than the default CI run.
PROPS = settings(max_examples=int(os.environ.get("FXCKPT_EXAMPLES", "60")), deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(problems(), st.sampled_from([1.1, 0.8, 0.5, 0.3, 0.1, 0.0]), st.sampled_from(["auto", "jit"]))
def test_every_method_reports_what_simulate_says(pb: Problem, frac: float, prefetch: str):
    budget = int(keep_peak(pb, prefetch) * frac)
    sols = {m: solve(pb, budget, method=m, prefetch=prefetch)
            for m in ("brute", "milp", "greedy", "auto")}
    for method, sol in sols.items():
        sim = simulate(pb, sol.choices, prefetch=prefetch)  # type: ignore[arg-type]
        assert (sol.peak, sol.peak_at) == (sim.peak, sim.peak_at), method
        assert close(sol.cost_ms, sim.cost_ms), method
        assert sol.feasible == (sol.peak <= budget), method
        for i, ch in enumerate(sol.choices):
            c = pb.candidates
            assert ch in _allowed(c.recompute_ms[i], c.can_offload[i]), method
            assert c.forced_of(i) in (None, ch), method
    # Brute force is exact; the others find a plan exactly when one exists (on these sizes).
    assert sols["milp"].feasible == sols["greedy"].feasible == sols["brute"].feasible
    assert sols["auto"].method_used == "greedy" and sols["auto"].choices == sols["greedy"].choices
    if sols["brute"].feasible:
        assert sols["milp"].cost_ms >= sols["brute"].cost_ms - 1e-9
        assert sols["greedy"].cost_ms >= sols["brute"].cost_ms - 1e-9
    else:
        assert sols["greedy"].peak >= sols["brute"].peak


@PROPS
@given(problems(max_n=40, max_half=20), st.sampled_from(["auto", "jit"]))
def test_greedy_tracks_every_point_exactly(pb: Problem, prefetch: str):
    curve = greedy_curve(pb, prefetch)
    assert len(curve.points) == len(curve.steps) + 1
    for k, (peak, cost) in enumerate(curve.points):
        if math.isinf(cost):
            continue  # a step on the way to the all-lowest end point, marked unusable
        sim = simulate(pb, curve.choices_at(k), prefetch=prefetch)  # type: ignore[arg-type]
        assert sim.peak == peak and close(sim.cost_ms, cost), k
    assert not any(math.isinf(curve.points[k][1]) for k in curve.frontier)


def assert_monotone(pb: Problem, budgets: list[int], prefetch: str = "auto") -> list:
    curve = greedy_curve(pb, prefetch)
    sols = [curve.solution(b) for b in sorted(budgets, reverse=True)]
    for big, small in pairwise(sols):
        assert small.peak <= big.peak
        assert small.cost_ms >= big.cost_ms - 1e-9 * max(1.0, big.cost_ms)
        assert big.evicted <= small.evicted
    return sols


@PROPS
@given(problems(max_n=30, max_half=15), st.sampled_from(["auto", "jit"]))
def test_greedy_is_monotone_in_the_budget(pb: Problem, prefetch: str):
    top = keep_peak(pb, prefetch)
    fracs = [int(top * f) for f in (1.0, 0.5, 0.25, 0.1)]
    sweep = [p + d for p, _ in greedy_curve(pb, prefetch).points for d in (-1, 0)]
    sols = assert_monotone(pb, fracs + sweep, prefetch)
    # A budget the all-keep plan fits evicts nothing, even where an eviction would be free.
    assert sols[0].choices == [pb.candidates.forced_of(i) or "keep" for i in range(len(pb))]


@PROPS
@given(problems(max_n=30, max_half=15), st.sampled_from(["auto", "jit"]))
def test_infeasible_budget_returns_the_lowest_peak(pb: Problem, prefetch: str):
    sol = solve(pb, -1, prefetch=prefetch)
    assert not sol.feasible
    lowest = [pb.candidates.lowest(i) for i in range(len(pb))]
    assert sol.peak <= simulate(pb, lowest, prefetch=prefetch).peak  # type: ignore[arg-type]
    assert sol.peak == min(p for p, _ in greedy_curve(pb, prefetch).points)


def test_no_budget_keeps_everything_not_forced():
    pb = random_problem(random.Random(1), 8)
    sol = solve(pb, None)
    assert sol.feasible and sol.choices == ["keep"] * 8 and sol.cost_ms == 0.0
    with pytest.raises(ValueError, match="method"):
        solve(pb, 10, method="simplex")


@pytest.mark.heavy
def test_optimality_against_brute_force(capsys):
    """Greedy's cost gap and MILP == brute on seeded instances with up to 10 candidates."""
    gaps, optimal, milp_exact, milp_contended = [], 0, [], []
    for seed in range(240):
        rng = random.Random(seed)
        n = 10 if seed % 60 == 0 else rng.randint(3, 8)
        uncontended = seed % 2 == 0  # infinite bandwidth: copies never queue
        pb = random_problem(rng, n, math.inf if uncontended else None, stack=seed % 3 == 0)
        for frac in (0.9, 0.7, 0.5):
            budget = int(keep_peak(pb) * frac)
            brute = solve(pb, budget, method="brute")
            if not brute.feasible:
                continue
            greedy, milp = solve(pb, budget, method="greedy"), solve(pb, budget, method="milp")
            assert greedy.feasible and milp.feasible
            gap = greedy.cost_ms - brute.cost_ms
            optimal += gap <= 1e-9
            gaps.append(gap / brute.cost_ms if brute.cost_ms > 1e-6 else gap * 1e6)
            (milp_exact if uncontended else milp_contended).append(milp.cost_ms - brute.cost_ms)
    mean, median = statistics.mean(gaps), statistics.median(gaps)
    with capsys.disabled():
        print(f"\ngreedy vs brute on {len(gaps)} feasible cases: mean gap {mean:.2%}, "
              f"median {median:.2%}, max {max(gaps):.2%}, optimal {optimal / len(gaps):.0%}; "
              f"milp-brute max {max(milp_exact):.1e} (uncontended), "
              f"{max(milp_contended):.2f} ms (contended copies)")
    # Measured: mean 2.5-3.5%, median 0, optimal ~94%. The misses are knapsack granularity:
    # the nested sequence must take one next step for every budget, and the step that is best
    # per byte of peak removed is not the cheapest way to shave a few bytes.
    assert median <= 1e-9
    assert optimal / len(gaps) >= 0.9
    assert mean <= 0.05
    assert max(milp_exact) <= 1e-6  # exact when copies never queue behind each other
    assert min(milp_contended) >= -1e-9  # never below the optimum


def big_problem(n: int = 10_000, T: int = 20_000, bandwidth: float = 2.5e6) -> Problem:
    """A transformer-shaped step: activations saved in order, used back in reverse."""
    rng, F = random.Random(0), T // 2
    cols: list[list] = [[] for _ in range(7)]
    for i in range(n):
        p = i * F // n
        fb = max(F, T - 1 - p - rng.randint(0, 3))
        row = (rng.choice([1, 2, 4, 8, 16]) * 2**20, p, min(F - 1, p + rng.randint(0, 3)), fb,
               min(T - 1, fb + rng.randint(0, 3)),
               math.inf if rng.random() < 0.1 else rng.uniform(0.01, 1.0), rng.random() < 0.8)
        for col, v in zip(cols, row, strict=True):
            col.append(v)
    step = [rng.uniform(0.01, 0.5) for _ in range(T)]
    return Problem(Timeline(step, F, bandwidth, [2**30] * T), Candidates(*cols))


def test_greedy_speed_and_monotonicity_at_10k(capsys):
    pb = big_problem()
    top = keep_peak(pb)
    t0 = time.perf_counter()
    sol = solve(pb, top // 2, method="auto")
    elapsed = time.perf_counter() - t0
    with capsys.disabled():
        # Printed, not asserted: a timed assert fails on a loaded machine (it read 6.7 s with
        # other work on both cores); benchmarks/planner_scaling.py measures solve time.
        print(f"\ngreedy, 10k candidates x 20k positions: {elapsed:.2f} s")
    assert sol.feasible and sol.peak <= top // 2
    assert_monotone(pb, [int(top * f) for f in (1.0, 0.5, 0.25, 0.1)])
