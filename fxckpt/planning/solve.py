"""Budget solver: keep, recompute or offload each candidate so the resident peak fits.

Solvers take a :class:`~fxckpt.planning.memory.Problem` (plain numbers) and return a
:class:`Solution` whose ``peak``, ``cost_ms`` and per-candidate figures all come from
:func:`~fxckpt.planning.memory.simulate`, the single source of truth.

Methods:

- ``"greedy"`` (near-linear) builds ONE budget-independent sequence of configurations, then
  picks a point of it per budget. Each step looks at the current resident peak: on a plateau,
  the peak position whose cheapest fix is dearest. At that position it takes, of the two
  cheapest options per byte freed (keep→recompute, keep→offload, offload→recompute; ties by
  index), the one with the least added ms per byte of peak it removes (tried; on a plateau,
  capped at the level below it). Offload prices are exact marginals on the FIFO channels,
  re-evaluated lazily. Evicted sets only grow along the
  sequence, so they are nested. Its peak is *not* monotone, though: an offload queues on the
  copy channels and can hold another offloaded tensor resident longer. So binary search over
  the prefix length would not be valid. Every point's exact peak and cost are therefore
  tracked (:class:`~fxckpt.planning.incremental.IncrementalSim`). The Pareto chain is kept: points
  whose peak falls strictly and whose cost never falls, with none beaten on both counts by an
  earlier one. A budget gets the first chain point that fits. As the budget shrinks, that point
  moves later, so the peak never rises, the cost never falls and the evicted sets stay nested
  (torch's own budget is not monotone, pytorch#197838). Below the chain's lowest peak, its last
  point comes back with ``feasible=False``. There is no step that un-evicts unneeded items:
  which items are unneeded depends on the budget, and dropping them would break nesting. The
  Pareto chain is the monotone-safe form of that improvement.
- ``"milp"`` uses scipy.optimize.milp (HiGHS, ~10 s limit). Variables are binary recompute and
  offload flags per candidate (keep = neither). There is one memory row per run of positions
  with the same covering set whose all-keep residency exceeds the budget. Bytes are scaled to
  MiB once tensors are that big (raw byte coefficients let the solver report
  "optimal" answers that broke constraints). A linear model can't see FIFO queueing, so each
  offload gets a per-candidate timing computed independently of the other choices. First it
  is timed alone: exact when copies don't queue behind each other. If that answer's simulated
  peak breaks the budget, it is solved again with every offload timed as if all offloadable
  tensors were offloaded; that answer always fits.
- ``"brute"``: every combination (n <= 12), the checker for tests.
- ``"auto"`` is greedy. MILP optima are not nested across budgets (a larger budget can move a keep), and
  monotonicity in the budget is a hard requirement, so the MILP stays a checker.

The MILP and brute force live in :mod:`fxckpt.planning.checkers`.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fxckpt.planning.incremental import IncrementalSim
from fxckpt.planning.memory import (
    Problem,
    SimResult,
    isolated_offload,
    simulate,
)

METHODS = ("auto", "greedy", "milp", "brute")
_RECOMPUTE, _OFFLOAD = 0, 1  # kinds of index entries: what the step turns a tensor into
_HIDE = 1 << 60  # taken off plateau positions to read the level below them
_PLATEAU = 16  # peak positions compared per greedy step
_LOOKAHEAD = 2  # cheapest-per-byte options whose actual peak drop is tried per step


@dataclass(frozen=True)
class Solution:
    choices: list[str]
    peak: int
    peak_at: int
    cost_ms: float
    feasible: bool
    method_used: str
    budget_bytes: int | None
    exposed_ms: list[float]  # per candidate: copy time not hidden by compute
    hide_ms: list[float]  # per candidate: compute available to hide its copies
    sim: SimResult

    @property
    def evicted(self) -> frozenset[int]:
        return frozenset(i for i, c in enumerate(self.choices) if c != "keep")


def make_solution(problem: Problem, choices: Sequence[str], budget: int | None, method: str,
            prefetch: str) -> Solution:
    sim = simulate(problem, choices, prefetch=prefetch)  # type: ignore[arg-type]
    return Solution(list(choices), sim.peak, sim.peak_at, sim.cost_ms,
                    budget is None or sim.peak <= budget, method, budget, sim.exposed_ms,
                    sim.hide_ms, sim)


def base_choices(problem: Problem) -> list[str]:
    c = problem.candidates
    return [c.forced_of(i) or "keep" for i in range(len(c))]


def solve(problem: Problem, budget_bytes: int | None, *, method: str = "auto",
          prefetch: str = "auto") -> Solution:
    """Choose keep / recompute / offload per candidate so the resident peak fits the budget.

    Minimises the estimated added ms. Forced candidates keep their forced choice. If no
    choice fits, the lowest-peak solution found comes back with ``feasible=False``. ``"milp"``
    falls back to the greedy (``method_used="greedy"``) when scipy is missing, the budget
    can't be met, or HiGHS runs out of time.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}; expected one of {METHODS}")
    if prefetch not in ("auto", "jit"):
        raise ValueError(f"prefetch={prefetch!r}; expected 'auto' or 'jit'")
    if budget_bytes is None:
        return make_solution(problem, base_choices(problem), None, "greedy" if method == "auto" else method,
                       prefetch)
    if method == "brute":
        from fxckpt.planning.checkers import brute

        return make_solution(problem, brute(problem, budget_bytes, prefetch), budget_bytes,
                             "brute", prefetch)
    if method == "milp":
        from fxckpt.planning.checkers import milp

        choices = milp(problem, budget_bytes, prefetch)
        if choices is not None:
            return make_solution(problem, choices, budget_bytes, "milp", prefetch)
    return greedy_curve(problem, prefetch).solution(budget_bytes)


# --- greedy ---------------------------------------------------------------------------------


class _CoverIndex:
    """Entries ``(key, i, kind, version)`` on position intervals; cheapest valid one at t.

    An entry is valid while ``live[2 * i + kind] == version``; stale ones are dropped lazily.
    """

    def __init__(self, T: int, live: list[int]) -> None:
        n = 1
        while n < max(1, T):
            n *= 2
        self.n, self.live = n, live
        self.heaps: list[list[tuple]] = [[] for _ in range(2 * n)]

    def push(self, entry: tuple, lo: int, hi: int, build: bool = False) -> None:
        add = list.append if build else heapq.heappush  # sorted appends already form heaps
        lo, hi = lo + self.n, hi + self.n + 1
        while lo < hi:
            if lo & 1:
                add(self.heaps[lo], entry)
                lo += 1
            if hi & 1:
                hi -= 1
                add(self.heaps[hi], entry)
            lo, hi = lo >> 1, hi >> 1

    def best(self, t: int, pop: bool = False) -> tuple | None:
        """The cheapest valid entry covering ``t``; with ``pop``, ``(entry, node)`` taken out."""
        k, found, where, live = t + self.n, None, 0, self.live
        while k:
            h = self.heaps[k]
            while h and live[2 * h[0][1] + h[0][2]] != h[0][3]:
                heapq.heappop(h)
            if h and (found is None or h[0] < found):
                found, where = h[0], k
            k >>= 1
        if pop and found is not None:
            heapq.heappop(self.heaps[where])
            return found, where
        return found


@dataclass
class GreedyCurve:
    """The greedy's budget-independent sequence and its Pareto points."""

    problem: Problem
    prefetch: str
    steps: list[tuple[int, str]]  # (candidate, new choice), applied in order
    points: list[tuple[int, float]]  # (peak, cost) after 0, 1, ... steps
    frontier: list[int]  # kept point indices: peak falls, cost rises

    def choices_at(self, k: int) -> list[str]:
        choices = base_choices(self.problem)
        for i, ch in self.steps[:k]:
            choices[i] = ch
        return choices

    def solution(self, budget: int) -> Solution:
        k = next((k for k in self.frontier if self.points[k][0] <= budget), self.frontier[-1])
        return make_solution(self.problem, self.choices_at(k), budget, "greedy", self.prefetch)


def greedy_curve(problem: Problem, prefetch: str = "auto") -> GreedyCurve:
    """Build the greedy's sequence once; :meth:`GreedyCurve.solution` answers any budget."""
    # The build allocates ~1e5 small tuples and no reference cycles; cyclic GC passes over
    # the large heaps cost a quarter of the run time at 10k candidates.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _greedy_curve(problem, prefetch)
    finally:
        if was_enabled:
            gc.enable()


def _greedy_curve(problem: Problem, prefetch: str) -> GreedyCurve:
    n = len(problem)
    S, base = problem.prefix_ms(), base_choices(problem)
    tr = IncrementalSim(problem, prefetch, base)
    live = [-1] * (2 * n)  # version of the valid entry of each (candidate, kind), -1: none
    index = _CoverIndex(problem.timeline.num_positions, live)
    for entry, lo, hi in sorted(_initial_entries(problem, prefetch, S, live)):
        if lo <= hi:
            index.push(entry, lo, hi, build=True)
    steps: list[tuple[int, str]] = []
    points = [(tr.peak, tr.cost)]
    while True:
        tops, t = _worst_peak(tr, index)
        opts = _step_options(problem, tr, index, live, t)
        if not opts:
            break
        i, choice = _take_step(problem, tr, index, live, tops, opts)
        steps.append((i, choice))
        points.append((tr.peak, tr.cost))
    _close_sequence(problem, prefetch, tr, steps, points)
    return GreedyCurve(problem, prefetch, steps, points, _frontier(points))


# An option of one greedy step: (index entry, node it was popped from, added ms, spans freed).
_Option = tuple[tuple, int, float, list[tuple[int, int]]]


def _initial_entries(problem: Problem, prefetch: str, S: Sequence[float],
                     live: list[int]) -> list[tuple[tuple, int, int]]:
    """Every candidate's first entries, ``(entry, lo, hi)``, priced from all-keep; marks them
    live (version 0)."""
    c = problem.candidates
    initial: list[tuple[tuple, int, int]] = []
    for i in range(len(problem)):
        if c.forced_of(i) is not None or c.bytes[i] <= 0:
            continue
        if math.isfinite(c.recompute_ms[i]):
            initial.append(((c.recompute_ms[i] / c.bytes[i], i, _RECOMPUTE, 0),
                            c.last_fw_use[i] + 1, c.first_bw_use[i] - 1))
            live[2 * i + _RECOMPUTE] = 0
        if c.can_offload[i]:
            done, issue, exp = isolated_offload(problem, S, i, prefetch)
            key = (exp + problem.offload_fixed_ms(i)) / c.bytes[i]
            initial.append(((key, i, _OFFLOAD, 0), max(c.last_fw_use[i], done) + 1, issue - 1))
            live[2 * i + _OFFLOAD] = 0
    return initial


def _repush(index: _CoverIndex, live: list[int], i: int, kind: int, key: float,
            spans: list[tuple[int, int]]) -> None:
    """Re-queue candidate ``i``'s ``kind`` entry at ``key`` on ``spans``, as a new version."""
    v = live[2 * i + kind] = live[2 * i + kind] + 1
    for lo, hi in spans:
        if lo <= hi:
            index.push((key, i, kind, v), lo, hi)


def _worst_peak(tr: IncrementalSim, index: _CoverIndex
                ) -> tuple[list[tuple[tuple | None, int]], int]:
    """The peak positions with their cheapest entries, and the one to work at."""
    # On a plateau, work first where the cheapest fix is dearest: the other peak positions
    # may then come down with it (a cheap item covering one of them would be wasted).
    tops = [(index.best(t), t) for t in tr.tree.argmaxes(_PLATEAU)]
    t = min(tops, key=lambda et: (et[0] is not None, -(et[0] or (0.0,))[0], et[1]))[1]
    return tops, t


def _step_options(problem: Problem, tr: IncrementalSim, index: _CoverIndex, live: list[int],
                  t: int) -> list[_Option]:
    """Up to ``_LOOKAHEAD`` cheapest-per-byte options at ``t``, popped from the index; stale
    offload prices and moved spans are re-queued instead."""
    c = problem.candidates
    opts: list[_Option] = []
    while len(opts) < _LOOKAHEAD and (got := index.best(t, pop=True)) is not None:
        e, node = got
        key, i, kind, _ = e
        fbu, b = c.first_bw_use[i], c.bytes[i]
        if kind == _RECOMPUTE and tr.mode[i] == "offload":
            spans = [(lo, min(hi, fbu - 1)) for lo, hi in tr.res[i] if lo < fbu]
            if not any(lo <= t <= hi for lo, hi in spans):
                _repush(index, live, i, _RECOMPUTE, key, spans)  # not resident at t any more
                continue
            opts.append((e, node, c.recompute_ms[i] + tr.delta_offload(i, False), spans))
        elif kind == _OFFLOAD:
            _, done, _, issue = tr.own(i)
            spans = [(max(c.last_fw_use[i], done) + 1, issue - 1)]
            exact = tr.delta_offload(i, True)
            if not spans[0][0] <= t <= spans[0][1] or exact / b > key * (1 + 1e-9) + 1e-15:
                # The price went up or the gap moved.
                _repush(index, live, i, _OFFLOAD, exact / b, spans)
                continue
            opts.append((e, node, exact, spans))
        else:
            opts.append((e, node, c.recompute_ms[i], [(c.last_fw_use[i] + 1, fbu - 1)]))
    return opts


def _best_option(problem: Problem, tr: IncrementalSim, index: _CoverIndex,
                 tops: list[tuple[tuple | None, int]], opts: list[_Option]) -> tuple:
    """The entry of the option with the least cost per byte of peak removed; every option's
    entry goes back on the node it came from."""
    c = problem.candidates
    # Of the cheapest-per-byte options, take the one with the least cost per byte of peak
    # it can remove: freeing bytes below the next level down buys nothing yet. With one
    # peak position, try each option; on a plateau, cap at the level outside the plateau.
    peak, ranked, cap = tr.peak, [], 0
    if 1 < len(tops) < _PLATEAU:  # a cut-off plateau hides no level below
        for _, u in tops:
            tr.tree.add(u, u, -_HIDE)
        cap = peak - tr.peak
        for _, u in tops:
            tr.tree.add(u, u, _HIDE)
    for e, node, dcost, spans in opts:
        b = c.bytes[e[1]]
        if len(tops) > 1:
            useful = min(b, cap)
        else:
            for lo, hi in spans:
                tr.tree.add(lo, hi, -b)
            useful = peak - tr.peak
            for lo, hi in spans:
                tr.tree.add(lo, hi, b)
        ranked.append(((0, dcost / useful) if useful > 0 else (1, 0.0), e))
        heapq.heappush(index.heaps[node], e)
    return min(ranked)[1]


def _take_step(problem: Problem, tr: IncrementalSim, index: _CoverIndex, live: list[int],
               tops: list[tuple[tuple | None, int]], opts: list[_Option]) -> tuple[int, str]:
    """Apply the best of ``opts``: ``(candidate, its new choice)``."""
    e = _best_option(problem, tr, index, tops, opts)
    i, choice = e[1], "offload" if e[2] == _OFFLOAD else "recompute"
    tr.set_offload(i) if choice == "offload" else tr.set_recompute(i)
    live[2 * i + _OFFLOAD] = -1  # no more keep->offload; recompute ends both kinds
    if choice == "recompute":
        live[2 * i + _RECOMPUTE] = -1
    return i, choice


def _close_sequence(problem: Problem, prefetch: str, tr: IncrementalSim,
                    steps: list[tuple[int, str]], points: list[tuple[int, float]]) -> None:
    """Append the closing steps and their points to ``steps`` and ``points``."""
    c, n = problem.candidates, len(problem)
    # Close the sequence with every candidate in its lowest-residency mode: where the steps
    # above stalled (no single eviction lowered the peak), that plan can still sit lower, and
    # the frontier then offers it. Each of these steps is an eviction too, so sets stay nested.
    # One simulate() prices the end point; the points in between are marked unusable (same
    # peak, infinite cost), because pricing each incrementally re-queues the copy channels.
    closing = [
        (i, low)
        for i in range(n)
        if c.forced_of(i) is None
        and c.bytes[i] > 0
        and (low := c.lowest(i)) != "keep"
        and tr.mode[i] != low
    ]
    if closing:
        final = [tr.mode[i] for i in range(n)]
        for i, low in closing:
            final[i] = low
        sim = simulate(problem, final, prefetch=prefetch)  # type: ignore[arg-type]
        for _ in closing[:-1]:
            points.append((points[-1][0], math.inf))
        points.append((sim.peak, sim.cost_ms))
        steps.extend(closing)


def _frontier(points: list[tuple[int, float]]) -> list[int]:
    """Indices with strictly falling peak and non-decreasing cost; none beaten by an earlier one.

    Walks back from the lowest peak. An earlier point that is no worse on both counts replaces
    the points after it; one that is worse on both is skipped.
    """
    kmin = min(range(len(points)), key=lambda k: (points[k][0], points[k][1], k))
    stack = [kmin]
    for k in range(kmin - 1, -1, -1):
        pk, ck = points[k]
        while len(stack) > 1 and pk <= points[stack[-1]][0] and ck <= points[stack[-1]][1]:
            stack.pop()
        if pk > points[stack[-1]][0] and ck <= points[stack[-1]][1]:
            stack.append(k)
    return stack[::-1]
