"""The memory simulator: the resident peak and added time of a given plan.

The simulator works on plain numbers (:class:`Problem`) so that solvers and their tests never
touch fx. A step is ``T`` timeline positions: forward nodes ``0..F-1``, then backward nodes
``F..T-1``; node ``t`` runs during ``[S[t], S[t+1])`` where ``S`` is the prefix sum of
``step_ms``.

A saved tensor counts while it is held *for the backward*: from the end of its last forward
use on. Until then the forward itself needs it, whatever the plan says, exactly as it needs
the activations no one saves; counting that stretch would charge keep and offload for the
forward's working set while recompute (and a segment's interior) went free. Residency of
one saved tensor, by choice:

- keep: ``[last_fw_use + 1, last_bw_use]``;
- recompute: ``[first_bw_use, last_bw_use]`` (rebuilt right before its first backward use);
- offload: ``[last_fw_use + 1, d2h_done]`` (the copy still reading it) and
  ``[prefetch_issue, last_bw_use]``.

Copies run on two serial FIFO channels. D2H copies start when their tensor is produced
(``S[produced+1]``), in production order; the forward waits at its end for any copy still
running, so what runs past ``S[F]`` is exposed and ``d2h_done`` is clamped to ``F-1``. H2D
copies are placed as late as possible (walking backward from each ``first_bw_use``, in FIFO
order) but never before the backward starts, ``S[F]``; what would have to start earlier is
exposed, and ``prefetch_issue`` is the position whose node is running when the copy must
start. With ``prefetch="jit"`` every prefetch is issued at ``first_bw_use`` and fully exposed.
Both exposed totals are max-plus expressions of the offloaded set, so adding an offload never
lowers them. A copy occupies its channel for ``link_overhead_ms + bytes / bandwidth``: the
per-copy time of the link itself (a DMA setup on a GPU, the emulated link's overhead on the
CPU), paid once per bucket. Each copy also pays ``Timeline.copy_overhead_ms``: the compute thread's own
time to issue its four runtime ops and hand its two copies to the engine, which no compute
hides.

**Buckets.** Candidates that share a ``Candidates.bucket`` id are copied together: one copy
each way, one overhead, one join. The copies above then run per bucket, over the bytes of its
offloaded members: the D2H copy starts once every member exists (``ready``, the latest
``produced`` of the bucket), the forward joins it at ``d2h_done`` but not before the bucket's
last forward use (``last_fw``: the join keeps every member's source alive), and the H2D copy
must land before the bucket's earliest backward use (``need``). Each offloaded member is then
resident ``[last_fw_use + 1, join]`` and ``[prefetch_issue, last_bw_use]`` (it is restored into
a buffer of its own, freed at its own last use). ``ready``, ``last_fw`` and ``need`` are taken
over every candidate of the bucket, offloaded or not, so a bucket's timing never depends on
which of its members the plan offloads; the runtime places the bucket's ops at exactly these
positions. The overhead is paid once per bucket with an offloaded member.

:mod:`fxckpt.planning.incremental` is the solver's incremental twin of :func:`simulate`;
:mod:`fxckpt.graph.liveness` counts every tensor of a graph, not only the saved ones.
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

Prefetch = Literal["auto", "jit"]
CHOICES: tuple[str, ...] = ("keep", "recompute", "offload")
# Price of an offload beyond its exposed time, so that an offload that costs nothing is
# still not taken when keeping fits: 1 GiB adds about 0.001 ms. Not a cost-model figure (so
# not in graph.costs.CostTable): it estimates nothing about any machine, the plan does not
# record it among its assumptions, and no measurement or option replaces it. It is part of
# the solver's objective, a tie-break between plans of equal time, shared by this simulator
# and its incremental twin (planning/incremental.py); change it and plans change everywhere.
OFFLOAD_PRICE_MS_PER_BYTE = 1e-12


@dataclass(frozen=True)
class Timeline:
    """Positions of one step: ``len(step_ms)`` nodes, the first ``num_forward`` forward."""

    step_ms: Sequence[float]
    num_forward: int
    bandwidth_bytes_per_ms: float = math.inf
    fixed_resident: Sequence[int] | None = None  # saved bytes that are not candidates
    copy_overhead_ms: float = 0.0  # host time per offloaded tensor, never hidden
    link_overhead_ms: float = 0.0  # each copy's fixed time on its queue (a bucket's once)

    @property
    def num_positions(self) -> int:
        return len(self.step_ms)


@dataclass(frozen=True)
class Candidates:
    """The saved tensors the planner decides about, one entry per tensor in each list."""

    bytes: Sequence[int]
    produced: Sequence[int]
    last_fw_use: Sequence[int]
    first_bw_use: Sequence[int]
    last_bw_use: Sequence[int]
    recompute_ms: Sequence[float]  # math.inf: cannot be recomputed (RNG ops, graph inputs)
    can_offload: Sequence[bool]
    forced: Sequence[str | None] | None = None  # None | "keep" | "recompute" | "offload"
    bucket: Sequence[int] | None = None  # copied together where ids are equal; None: alone

    def __len__(self) -> int:
        return len(self.bytes)

    def forced_of(self, i: int) -> str | None:
        return None if self.forced is None else self.forced[i]

    def allowed(self, i: int) -> tuple[str, ...]:
        """The choices candidate ``i`` may take."""
        f = self.forced_of(i)
        if f is not None:
            return (f,)
        ok = ["keep"]
        if math.isfinite(self.recompute_ms[i]):
            ok.append("recompute")
        if self.can_offload[i]:
            ok.append("offload")
        return tuple(ok)

    def lowest(self, i: int) -> str:
        """The allowed choice with the smallest residency (recompute ⊆ offload ⊆ keep)."""
        ok = self.allowed(i)
        return next(c for c in ("recompute", "offload", "keep") if c in ok)


@dataclass(frozen=True)
class Problem:
    timeline: Timeline
    candidates: Candidates

    def __post_init__(self) -> None:
        tl, c = self.timeline, self.candidates
        T, F, n = tl.num_positions, tl.num_forward, len(c)
        if not 0 <= F <= T or any(s < 0 for s in tl.step_ms):
            raise ValueError("need 0 <= num_forward <= len(step_ms) and step_ms >= 0")
        if tl.fixed_resident is not None and len(tl.fixed_resident) != T:
            raise ValueError("fixed_resident needs one entry per position")
        if not tl.bandwidth_bytes_per_ms > 0:
            raise ValueError("bandwidth_bytes_per_ms must be > 0")
        for name in ("copy_overhead_ms", "link_overhead_ms"):
            if not (getattr(tl, name) >= 0 and math.isfinite(getattr(tl, name))):
                raise ValueError(f"{name} must be finite and >= 0")
        fields = (c.produced, c.last_fw_use, c.first_bw_use, c.last_bw_use, c.recompute_ms)
        if any(len(f) != n for f in (*fields, c.can_offload)) or any(
            opt is not None and len(opt) != n for opt in (c.forced, c.bucket)
        ):
            raise ValueError("every Candidates list needs one entry per candidate")
        for i in range(n):
            p, lf, fb, lb = c.produced[i], c.last_fw_use[i], c.first_bw_use[i], c.last_bw_use[i]
            if not (0 <= p <= lf < F <= fb <= lb < T) or c.bytes[i] < 0:
                raise ValueError(f"candidate {i}: need 0 <= produced <= last_fw_use < F <= "
                                 f"first_bw_use <= last_bw_use < T and bytes >= 0")
            f = c.forced_of(i)
            if f not in (None, *CHOICES):
                raise ValueError(f"candidate {i}: forced={f!r}")
            if f == "recompute" and not math.isfinite(c.recompute_ms[i]):
                raise ValueError(f"candidate {i} is forced to recompute but cannot be")
            if f == "offload" and not c.can_offload[i]:
                raise ValueError(f"candidate {i} is forced to offload but cannot be")

    def __len__(self) -> int:
        return len(self.candidates)

    def prefix_ms(self) -> list[float]:
        """``S``: ``S[t]`` is when node ``t`` starts; ``S[T]`` is the end of the step."""
        return [0.0, *accumulate(float(s) for s in self.timeline.step_ms)]

    @functools.cached_property
    def buckets(self) -> Buckets:
        """The copy buckets: one per candidate unless ``Candidates.bucket`` groups them."""
        return Buckets.of_candidates(self.candidates)

    def copy_ms(self, i: int) -> float:
        """Time ``i``'s bytes occupy a copy queue (each copy adds ``link_overhead_ms`` once)."""
        return self.candidates.bytes[i] / self.timeline.bandwidth_bytes_per_ms

    def offload_fixed_ms(self, i: int) -> float:
        """What offloading ``i`` costs besides exposed copy time, as a lower bound: its share
        of its bucket's per-copy overhead (the whole overhead when it is copied alone; exact
        when the whole bucket is offloaded) and the small per-byte price that keeps free
        offloads from being taken when keeping fits."""
        share = self.timeline.copy_overhead_ms / len(self.buckets.members[self.buckets.of[i]])
        return share + OFFLOAD_PRICE_MS_PER_BYTE * self.candidates.bytes[i]

    def offload_fixed_total(self, offloaded: Iterable[int]) -> float:
        """The exact fixed cost of offloading ``offloaded``: one overhead per bucket copied,
        and the per-byte price of each tensor."""
        of, chosen = self.buckets.of, list(offloaded)
        nbytes = sum(self.candidates.bytes[i] for i in chosen)
        return (self.timeline.copy_overhead_ms * len({of[i] for i in chosen})
                + OFFLOAD_PRICE_MS_PER_BYTE * nbytes)


@dataclass(frozen=True)
class Buckets:
    """Candidates grouped into copy buckets, and each bucket's fixed positions."""

    of: list[int]  # candidate -> bucket index
    members: list[list[int]]  # bucket -> its candidates, in index order
    ready: list[int]  # the bucket's D2H copy starts after this forward position
    last_fw: list[int]  # the forward joins the copy no earlier than this position
    need: list[int]  # the H2D copy lands before this backward position

    @staticmethod
    def of_candidates(c: Candidates) -> Buckets:
        ids = list(c.bucket) if c.bucket is not None else list(range(len(c)))
        index: dict[int, int] = {}
        of = [index.setdefault(g, len(index)) for g in ids]
        members: list[list[int]] = [[] for _ in index]
        for i, g in enumerate(of):
            members[g].append(i)
        return Buckets(
            of=of,
            members=members,
            ready=[max(c.produced[i] for i in m) for m in members],
            last_fw=[max(c.last_fw_use[i] for i in m) for m in members],
            need=[min(c.first_bw_use[i] for i in m) for m in members],
        )


@dataclass(frozen=True)
class SimResult:
    resident: list[int]  # resident saved bytes per position
    peak: int
    peak_at: int  # first position where the peak is reached (-1 if there are no positions)
    d2h_done: list[int]  # -1 where not offloaded
    prefetch_issue: list[int]  # -1 where not offloaded
    exposed_ms: list[float]  # copy time not hidden by compute, per candidate
    hide_ms: list[float]  # compute available to hide each candidate's copies
    cost_ms: float  # estimated added step time: recompute + exposed copies + per-copy costs


def done_position(S: Sequence[float], F: int, produced: int, end: float) -> int:
    """Last position whose node is running when a D2H copy ending at ``end`` finishes."""
    return min(F - 1, max(produced, bisect_left(S, end) - 1))


def issue_position(S: Sequence[float], F: int, first_bw_use: int, start: float) -> int:
    """Position at whose start a prefetch that must begin at ``start`` is issued."""
    return max(F, min(first_bw_use, bisect_right(S, start) - 1))


def hide_ms(problem: Problem, S: Sequence[float], i: int, prefetch: str) -> float:
    """Compute time that can cover candidate ``i``'s two copies (its bucket's windows)."""
    bk, F = problem.buckets, problem.timeline.num_forward
    g = bk.of[i]
    d2h = S[F] - S[bk.ready[g] + 1]
    return d2h + (S[bk.need[g]] - S[F] if prefetch == "auto" else 0.0)


def isolated_offload(problem: Problem, S: Sequence[float], i: int, prefetch: str
                     ) -> tuple[int, int, float]:
    """``(d2h_done, prefetch_issue, exposed_ms)`` of offloading ``i`` with no other copies
    (alone in its bucket; ``d2h_done`` is where the forward joins the copy).

    Every other offload only delays ``d2h_done``, moves ``prefetch_issue`` earlier and adds
    exposure, so these are the most favourable figures ``i`` can get.
    """
    bk, F = problem.buckets, problem.timeline.num_forward
    g = bk.of[i]
    d, p, b = problem.copy_ms(i) + problem.timeline.link_overhead_ms, bk.ready[g], bk.need[g]
    end = S[p + 1] + d
    exposed = max(0.0, end - max(S[p + 1], S[F]))
    joined = max(done_position(S, F, p, end), bk.last_fw[g])
    if prefetch == "jit":
        return joined, b, exposed + d
    start = S[b] - d
    return (joined, issue_position(S, F, b, start),
            exposed + max(0.0, min(S[F], start + d) - start))


def residency(problem: Problem, i: int, choice: str, done: int = -1, issue: int = -1
              ) -> list[tuple[int, int]]:
    """Inclusive position intervals where candidate ``i`` is resident under ``choice``."""
    c = problem.candidates
    lf = c.last_fw_use[i]
    if choice == "keep":
        return [(lf + 1, c.last_bw_use[i])]
    if choice == "recompute":
        return [(c.first_bw_use[i], c.last_bw_use[i])]
    copying = [(lf + 1, done)] if done > lf else []
    return [*copying, (issue, c.last_bw_use[i])]


def bucket_schedule(problem: Problem, S: Sequence[float], offloaded: Sequence[int],
                    prefetch: str) -> tuple[dict[int, int], dict[int, int], dict[int, float]]:
    """Per bucket with an offloaded member: the position of its D2H copy's end (``done``,
    before the join's ``last_fw`` floor), its H2D issue position, and its exposed ms."""
    bk, F = problem.buckets, problem.timeline.num_forward
    d: dict[int, float] = {}
    for i in offloaded:  # one copy per bucket: its bytes' time and one link overhead
        d[bk.of[i]] = d.get(bk.of[i], problem.timeline.link_overhead_ms) + problem.copy_ms(i)
    done: dict[int, int] = {}
    issue: dict[int, int] = {}
    exposed = dict.fromkeys(d, 0.0)
    end = -math.inf
    for g in sorted(d, key=lambda h: (bk.ready[h], h)):
        start = max(S[bk.ready[g] + 1], end)
        end = start + d[g]
        done[g] = done_position(S, F, bk.ready[g], end)
        exposed[g] += max(0.0, end - max(start, S[F]))
    start = math.inf
    for g in sorted(d, key=lambda h: (bk.need[h], h), reverse=True):
        b = bk.need[g]
        if prefetch == "jit":
            issue[g], exposed[g] = b, exposed[g] + d[g]
            continue
        start = min(S[b], start) - d[g]
        issue[g] = issue_position(S, F, b, start)
        exposed[g] += max(0.0, min(S[F], start + d[g]) - start)
    return done, issue, exposed


def offload_schedule(problem: Problem, S: Sequence[float], offloaded: Sequence[int],
                     prefetch: str) -> tuple[dict[int, int], dict[int, int], dict[int, float]]:
    """``d2h_done`` (the join), ``prefetch_issue`` and exposed ms of each offloaded candidate;
    a bucket's exposure is shared among its offloaded members by their copy time."""
    bk = problem.buckets
    done, issue, exposed = bucket_schedule(problem, S, offloaded, prefetch)
    share: dict[int, float] = {}
    for i in offloaded:
        share[bk.of[i]] = share.get(bk.of[i], 0.0) + problem.copy_ms(i)
    out_done, out_issue, out_exp = {}, {}, {}
    for i in offloaded:
        g = bk.of[i]
        out_done[i] = max(done[g], bk.last_fw[g])
        out_issue[i] = issue[g]
        part = problem.copy_ms(i) / share[g] if share[g] > 0 else 1.0 / _count(bk, g, offloaded)
        out_exp[i] = exposed[g] * part
    return out_done, out_issue, out_exp


def _count(bk: Buckets, g: int, offloaded: Sequence[int]) -> int:
    return sum(1 for i in offloaded if bk.of[i] == g)


def simulate(problem: Problem, choices: Sequence[str], *, prefetch: Prefetch = "auto"
             ) -> SimResult:
    """Resident saved bytes per position, the peak and the added time of ``choices``.

    O(n log n + T): intervals go into a difference array.
    """
    c, tl = problem.candidates, problem.timeline
    n, T = len(c), tl.num_positions
    if len(choices) != n or any(ch not in CHOICES for ch in choices):
        raise ValueError("choices needs one of 'keep', 'recompute', 'offload' per candidate")
    S = problem.prefix_ms()
    offloaded = [i for i in range(n) if choices[i] == "offload"]
    done, issue, exp = offload_schedule(problem, S, offloaded, prefetch)
    diff = [0] * (T + 1)
    cost = 0.0
    for i, ch in enumerate(choices):
        for lo, hi in residency(problem, i, ch, done.get(i, -1), issue.get(i, -1)):
            diff[lo] += c.bytes[i]
            diff[hi + 1] -= c.bytes[i]
        if ch == "recompute":
            cost += c.recompute_ms[i]
    cost += sum(exp.values()) + problem.offload_fixed_total(offloaded)
    fixed = tl.fixed_resident if tl.fixed_resident is not None else [0] * T
    resident = [f + r for f, r in zip(fixed, accumulate(diff[:T]), strict=True)]
    peak = max(resident, default=0)
    return SimResult(
        resident=resident,
        peak=peak,
        peak_at=resident.index(peak) if resident else -1,
        d2h_done=[done.get(i, -1) for i in range(n)],
        prefetch_issue=[issue.get(i, -1) for i in range(n)],
        exposed_ms=[exp.get(i, 0.0) for i in range(n)],
        hide_ms=[hide_ms(problem, S, i, prefetch) for i in range(n)],
        cost_ms=cost,
    )
