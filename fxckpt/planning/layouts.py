"""Which blocks to recompute, searched together with keep / offload / single-op recompute.

A *layout* is a set of recompute segments over the repeated blocks: none, the first ``k`` of
the blocks in cost order as one-block segments (``k`` of ``N``, not a fixed ladder), or every
block in segments of ``s`` (what ``segment_stride=s`` would do). Each layout changes the
problem the greedy solves: a recomputed block's saved tensors are no longer saved, so they
count nothing, exactly as the budget counts them on the partition that carries the layout
out (it counts saved tensors; what the backward rebuilds is not saved).

That blindness would make one segment over the whole model look best at any low budget,
while its backward rebuilds the whole model at once. So a layout of longer segments is
offered only where, counting what it rebuilds (from the first backward use of its segment to
each tensor's last use), its lowest peak is no higher than one-block segments' counted so:
see :func:`admissible`. That test does not depend on the budget.

:func:`search` returns, of every point the admissible layouts offer, the cheapest (block
recompute plus the solver's added ms) whose peak meets the budget; also offered, per layout,
the plan that offloads everything it may. Points are ranked in one fixed order (cost,
layout, point) that does not depend on the budget, so as the budget shrinks the answer moves
along that order: its cost never falls and its peak never rises. Layouts are visited
best-first by a lower bound on what they can cost (block ms, then block ms plus a fractional
knapsack at the tightest positions), and the search stops once the next bound passes the
best plan found, which leaves the answer unchanged.

Plain numbers only, as in :mod:`fxckpt.planning.solve`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fxckpt.planning.memory import Problem, SimResult, isolated_offload, simulate
from fxckpt.planning.solve import Solution, greedy_curve, make_solution


@dataclass(frozen=True)
class Blocks:
    """What recomputing each block would free and cost, over the candidates of a Problem."""

    order: tuple[int, ...]  # every block, in execution order
    ms: Mapping[int, float]  # time to recompute each block's forward
    member: Sequence[int | None]  # per candidate: the block whose recompute frees it
    users: Sequence[tuple[int, ...]]  # per candidate: later blocks whose forward reads it
    # Per candidate: forward ms of the op that makes it (through views), what saving it
    # spares a block that is recomputed around it (empty: not known, see :func:`fill`).
    own_ms: Sequence[float] = ()


@dataclass(frozen=True)
class Layout:
    """Recompute segments, each a run of consecutive blocks rebuilt together."""

    segments: tuple[tuple[int, ...], ...]
    kind: str  # "none", "blocks" (one-block segments) or "stride"
    stride: int = 0

    @property
    def blocks(self) -> frozenset[int]:
        return frozenset(b for seg in self.segments for b in seg)

    def describe(self) -> str:
        if self.kind == "stride":
            return f"every block, in segments of {self.stride}"
        return f"blocks {sorted(self.blocks)}" if self.segments else "no blocks"


NONE = Layout((), "none")


def layouts(problem: Problem, blocks: Blocks) -> list[Layout]:
    """No blocks; the first k blocks in cost order for k = 1..N; every stride s = 2..N.

    Cost order: recompute ms per byte freed, cheapest first. Ties (identical blocks) go even
    blocks first: an isolated block frees its output too, which a neighbouring segment saves.
    """
    nbytes = dict.fromkeys(blocks.order, 0)
    for i, b in enumerate(blocks.member):
        if b is not None:
            nbytes[b] += problem.candidates.bytes[i]
    order = sorted(
        (b for b in blocks.order if nbytes[b] > 0),
        key=lambda b: (float(f"{blocks.ms[b] / nbytes[b]:.6g}"), b % 2, b),
    )
    out = [NONE]
    out += [Layout(tuple((b,) for b in sorted(order[:k])), "blocks") for k in range(1, len(order) + 1)]
    n = len(blocks.order)
    for s in range(2, n + 1):
        segs = tuple(tuple(blocks.order[j : j + s]) for j in range(0, n, s))
        out.append(Layout(segs, "stride", s))
    return out


def freed(blocks: Blocks, layout: Layout) -> dict[int, int]:
    """Candidate -> the segment (its index in ``layout.segments``) whose recompute frees it.

    A tensor that a later block in another segment reads is that segment's input: min-cut
    saves it at the boundary (``cleanup_recompute_tags``), so it is not freed.
    """
    seg_of = {b: k for k, seg in enumerate(layout.segments) for b in seg}
    out: dict[int, int] = {}
    for i, b in enumerate(blocks.member):
        k = seg_of.get(b) if b is not None else None
        if k is None:
            continue
        if any(seg_of.get(u, k) != k for u in blocks.users[i]):
            continue
        out[i] = k
    return out


def apply(problem: Problem, blocks: Blocks, layout: Layout, *, rebuilt: bool = False,
          kept: frozenset[int] = frozenset()) -> Problem:
    """``problem`` as it looks with ``layout``'s blocks recomputed (see the module doc).

    The freed tensors become forced recomputes the blocks pay for. ``rebuilt``: they count
    from their segment's first backward use to their own last use, instead of nothing.
    ``kept``: tensors of those blocks saved all the same (forced keeps, see :func:`fill`).
    """
    gone = {i: k for i, k in freed(blocks, layout).items() if i not in kept}
    if not gone and not kept:
        return problem
    c = problem.candidates
    start: dict[int, int] = {}
    for i, k in gone.items():
        start[k] = min(start.get(k, c.first_bw_use[i]), c.first_bw_use[i])
    forced: list[str | None] = list(c.forced) if c.forced is not None else [None] * len(c)
    first = list(c.first_bw_use)
    rec = list(c.recompute_ms)
    nbytes = list(c.bytes)
    for i, k in gone.items():
        forced[i], first[i], rec[i] = "recompute", start[k], 0.0
        nbytes[i] = nbytes[i] if rebuilt else 0
    for i in kept:
        forced[i] = "keep"
    return Problem(
        problem.timeline,
        dataclasses.replace(
            c, bytes=nbytes, first_bw_use=first, recompute_ms=rec, forced=forced
        ),
    )


def blocks_ms(blocks: Blocks, layout: Layout) -> float:
    return sum(blocks.ms[b] for b in layout.blocks)


@dataclass(frozen=True)
class Pick:
    """The search's answer: a layout and the solver's choices on the problem it leaves."""

    layout: Layout
    problem: Problem  # apply(original, layout)
    solution: Solution
    blocks_ms: float
    freed: dict[int, int]  # candidate -> segment index, for the layout's blocks
    kept: frozenset[int] = frozenset()  # tensors of those blocks saved all the same (fill)

    @property
    def cost_ms(self) -> float:
        return self.blocks_ms + self.solution.cost_ms

    @property
    def feasible(self) -> bool:
        return self.solution.feasible


def _offload_all(pb: Problem) -> list[str]:
    c = pb.candidates
    return [c.forced_of(i) or ("offload" if c.can_offload[i] else "keep") for i in range(len(c))]


def lower_bound(pb: Problem, budget: int, iso: Sequence[tuple[int, int, float]]) -> float:
    """A cost no plan of ``pb`` that meets ``budget`` can undercut (``math.inf``: none meets it).

    At the positions where keeping everything peaks, enough bytes must go; each candidate
    can free a position at no less per byte than its cheapest option there (an offload timed
    alone, its most favourable timing), and filling by that price is a fractional knapsack.
    """
    c = pb.candidates
    base = [c.forced_of(i) or "keep" for i in range(len(c))]
    resident = simulate(pb, base).resident
    if not resident or max(resident) <= budget:
        return 0.0
    F = pb.timeline.num_forward
    worst_fw = max(range(F), key=resident.__getitem__, default=0)
    worst_bw = max(range(F, len(resident)), key=resident.__getitem__, default=F)
    bound = 0.0
    for t in {worst_fw, worst_bw}:
        need = resident[t] - budget
        if need <= 0:
            continue
        offers: list[tuple[float, int]] = []
        for i in range(len(c)):
            if c.forced_of(i) is not None or not c.last_fw_use[i] < t <= c.last_bw_use[i]:
                continue
            best = math.inf
            if math.isfinite(c.recompute_ms[i]) and t < c.first_bw_use[i]:
                best = c.recompute_ms[i]
            done, issue, exposed = iso[i]
            if c.can_offload[i] and max(c.last_fw_use[i], done) < t < issue:
                best = min(best, exposed + pb.offload_fixed_ms(i))
            if math.isfinite(best) and c.bytes[i] > 0:
                offers.append((best / c.bytes[i], c.bytes[i]))
        offers.sort()
        cost = 0.0
        for per_byte, nbytes in offers:
            take = min(need, nbytes)
            cost, need = cost + per_byte * take, need - take
            if need <= 0:
                break
        if need > 0:
            return math.inf
        bound = max(bound, cost)
    return bound


class LayoutsAtLowest:
    """Each layout applied to one problem, every candidate at its lowest choice, simulated once
    per layout however often :func:`admissible`, :func:`lowest` and :func:`search` ask (pass
    the same one to each; ``blocks`` None: the layout with no blocks only)."""

    def __init__(self, problem: Problem, blocks: Blocks | None, prefetch: str) -> None:
        self.problem, self.prefetch = problem, prefetch
        self.options = layouts(problem, blocks) if blocks is not None and blocks.order else [NONE]
        self.blocks = blocks or Blocks((), {}, [None] * len(problem), [()] * len(problem))
        self._memo: dict[Layout, tuple[Problem, SimResult]] = {}
        self._allowed: list[int] | None = None

    def allowed(self) -> list[int]:
        """Indices of :attr:`options` that :func:`search` may choose (:func:`admissible`)."""
        if self._allowed is None:
            self._allowed = (admissible(self.problem, self.blocks, self.options, self.prefetch, self)
                             if len(self.options) > 1 else [0])  # fmt: skip
        return self._allowed

    def __call__(self, layout: Layout) -> tuple[Problem, SimResult]:
        got = self._memo.get(layout)
        if got is None:
            pb = apply(self.problem, self.blocks, layout, rebuilt=True)
            c = pb.candidates
            low = [c.lowest(i) for i in range(len(pb))]
            got = self._memo[layout] = (pb, simulate(pb, low, prefetch=self.prefetch))  # type: ignore[arg-type]
        return got


def admissible(problem: Problem, blocks: Blocks, options: Sequence[Layout], prefetch: str,
               low: LayoutsAtLowest | None = None) -> list[int]:
    """Indices of the layouts :func:`search` may choose: every one without longer segments,
    and a layout of longer segments only where its lowest peak, counting what its segments
    rebuild in the backward, is no higher than one-block segments over every block reach."""
    low = low or LayoutsAtLowest(problem, blocks, prefetch)
    per_block = Layout(tuple((b,) for b in blocks.order), "blocks")
    longer = [k for k, layout in enumerate(options) if layout.kind == "stride"]
    ceiling = low(per_block)[1].peak if longer else 0
    return [k for k, layout in enumerate(options)
            if layout.kind != "stride" or low(layout)[1].peak <= ceiling]


def lowest(problem: Problem, blocks: Blocks | None, prefetch: str = "auto",
           low: LayoutsAtLowest | None = None) -> list[int]:
    """The resident bytes at each position of the admissible layout whose lowest peak is
    lowest, every candidate at its lowest choice (what :func:`search` falls back to when no
    plan meets a budget). ``low``: ``problem``'s layouts, where already made."""
    low = low or LayoutsAtLowest(problem, blocks, prefetch)
    best: list[int] | None = None
    for k in low.allowed():
        res = low(low.options[k])[1].resident
        if best is None or max(res, default=0) < max(best, default=0):
            best = res
    return best or []


def lowest_peak(problem: Problem, blocks: Blocks | None, prefetch: str = "auto",
                low: LayoutsAtLowest | None = None) -> int:
    """The lowest peak any admissible layout reaches (:func:`lowest`)."""
    return max(lowest(problem, blocks, prefetch, low), default=0)


def within_reach(problem: Problem, budget: int, blocks: Blocks | None, prefetch: str = "auto",
                 low: LayoutsAtLowest | None = None) -> tuple[Problem, int, int]:
    """``problem`` and ``budget`` with the budget raised, position by position, to what the
    lowest layout reaches there where it is lower than that; and the most it was raised by.

    Where no plan meets a budget at some positions (a backward whose working set alone is
    over it), the others still hold theirs: the search then finds the cheapest plan that
    meets the budget wherever it can be met, and the floor elsewhere, instead of the plan
    that evicts all it can."""
    low_res = lowest(problem, blocks, prefetch, low)
    excess = [max(0, r - budget) for r in low_res]
    most = max(excess, default=0)
    if most == 0:
        return problem, budget, 0
    tl = problem.timeline
    fixed = list(tl.fixed_resident) if tl.fixed_resident is not None else [0] * tl.num_positions
    fixed = [f + most - e for f, e in zip(fixed, excess, strict=True)]
    return Problem(dataclasses.replace(tl, fixed_resident=fixed), problem.candidates), budget + most, most


def search(problem: Problem, blocks: Blocks | None, budget: int, prefetch: str = "auto",
           low: LayoutsAtLowest | None = None) -> Pick:
    """The cheapest point of any admissible layout that meets ``budget``; else the layout
    whose lowest peak is lowest (ties: less block time), at the solver's lowest peak on it.

    Without ``blocks`` only the layout with no blocks is searched. ``low``: ``problem``'s
    layouts, where already made.
    """
    low = low or LayoutsAtLowest(problem, blocks, prefetch)
    options, facts, allowed = low.options, low.blocks, low.allowed()
    S = problem.prefix_ms()
    iso = [isolated_offload(problem, S, i, prefetch) for i in range(len(problem))]
    # Best-first over lower bounds: a layout's block time bounds what it can cost, and its
    # knapsack bound (computed when that layout comes up) bounds it tighter. A layout runs
    # the greedy only when its bound comes up below the best plan found so far.
    queue = [(blocks_ms(facts, options[k]), k, False) for k in allowed]
    heapq.heapify(queue)
    best: tuple[float, int, int, Pick] | None = None
    while queue:
        bound, k, tight = heapq.heappop(queue)
        if best is not None and (bound, k) > best[:2]:
            break  # nothing left can beat it
        layout = options[k]
        ms = blocks_ms(facts, layout)
        pb = low(layout)[0]
        if not tight:
            bound = ms + lower_bound(pb, budget, iso)
            if math.isfinite(bound):
                heapq.heappush(queue, (bound, k, True))
            continue
        for j, sol in enumerate(_points(pb, budget, prefetch)):
            key = (ms + sol.cost_ms, k, j)
            if sol.feasible and (best is None or key < best[:3]):
                best = (*key, Pick(layout, pb, sol, ms, freed(facts, layout)))
    if best is not None:
        return fill(best[3], problem, facts, budget, prefetch)
    lowest: tuple[int, float, int] | None = None
    for k in allowed:
        here = (low(options[k])[1].peak, blocks_ms(facts, options[k]), k)
        lowest = here if lowest is None or here < lowest else lowest
    layout = options[lowest[2]] if lowest is not None else NONE
    pb = low(layout)[0]
    sol = greedy_curve(pb, prefetch).solution(budget)
    return Pick(layout, pb, sol, blocks_ms(facts, layout), freed(facts, layout))


def _points(pb: Problem, budget: int, prefetch: str) -> list[Solution]:
    """The greedy's answer for ``budget``, and the plan that offloads all it may."""
    greedy = greedy_curve(pb, prefetch).solution(budget)
    everything = make_solution(pb, _offload_all(pb), budget, "offload-all", prefetch)
    return [greedy, everything]


# What :func:`fill` leaves unfilled, of the budget: the partition that carries a layout out
# can hold a little more than this model of it (tensors min-cut saves at a segment's edge),
# and a plan filled to the byte would then need an offload to fit again.
FILL_MARGIN = 0.02


def fill(pick: Pick, problem: Problem, blocks: Blocks, budget: int, prefetch: str) -> Pick:
    """``pick`` with tensors of its recomputed blocks saved after all, while its peak stays
    within ``budget``: the room that whole blocks leave under the budget spares recompute.

    Blocks come whole, so a plan that recomputes them lands below the budget by up to a
    block's bytes. Each tensor saved there spares the op that makes it (``blocks.own_ms``);
    they are tried by ms spared per byte, most first, each kept where the simulated peak
    still meets the budget less :data:`FILL_MARGIN`. ``problem``: as :func:`search` was
    given it. The cost falls and the peak stays within the budget, so the pick stays the
    cheapest that meets it.
    """
    c = problem.candidates
    if not pick.freed or not blocks.own_ms or not pick.feasible:
        return pick
    limit = budget - int(budget * FILL_MARGIN)
    order = sorted((i for i in pick.freed if blocks.own_ms[i] > 0 and c.bytes[i] > 0),
                   key=lambda i: (-blocks.own_ms[i] / c.bytes[i], i))
    for i in order:
        if c.bytes[i] > limit - pick.solution.peak:
            continue  # saved from the forward on, it is held where the backward starts
        kept = pick.kept | {i}
        pb = apply(problem, blocks, pick.layout, rebuilt=True, kept=kept)
        choices = ["keep" if j in kept else ch for j, ch in enumerate(pick.solution.choices)]
        sol = make_solution(pb, choices, budget, pick.solution.method_used, prefetch)
        if sol.peak <= limit:
            spared = sum(blocks.own_ms[j] for j in kept)
            pick = Pick(pick.layout, pb, sol, max(0.0, blocks_ms(blocks, pick.layout) - spared),
                        {j: k for j, k in pick.freed.items() if j != i}, kept)
    return pick
