"""Liveness and the memory simulator: the resident peak and added time of a given plan.

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
lowers them. Each offload also pays ``Timeline.copy_overhead_ms``: the compute thread's own
time to issue its four runtime ops and hand its two copies to the engine, which no compute
hides.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch.fx

Choice = Literal["keep", "recompute", "offload"]
Prefetch = Literal["auto", "jit"]
CHOICES: tuple[str, ...] = ("keep", "recompute", "offload")
# Price of an offload beyond its exposed time, so that an offload that costs nothing is
# still not taken when keeping fits: 1 GiB adds about 0.001 ms.
OFFLOAD_PRICE_MS_PER_BYTE = 1e-12


@dataclass(frozen=True)
class Timeline:
    """Positions of one step: ``len(step_ms)`` nodes, the first ``num_forward`` forward."""

    step_ms: Sequence[float]
    num_forward: int
    bandwidth_bytes_per_ms: float = math.inf
    fixed_resident: Sequence[int] | None = None  # saved bytes that are not candidates
    copy_overhead_ms: float = 0.0  # host time per offloaded tensor, never hidden

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
        if not (tl.copy_overhead_ms >= 0 and math.isfinite(tl.copy_overhead_ms)):
            raise ValueError("copy_overhead_ms must be finite and >= 0")
        fields = (c.produced, c.last_fw_use, c.first_bw_use, c.last_bw_use, c.recompute_ms)
        if any(len(f) != n for f in (*fields, c.can_offload)) or (
            c.forced is not None and len(c.forced) != n
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

    def copy_ms(self, i: int) -> float:
        return self.candidates.bytes[i] / self.timeline.bandwidth_bytes_per_ms

    def offload_fixed_ms(self, i: int) -> float:
        """What offloading ``i`` costs besides exposed copy time: the per-copy overhead and
        the small per-byte price that keeps free offloads from being taken when keeping fits."""
        return self.timeline.copy_overhead_ms + OFFLOAD_PRICE_MS_PER_BYTE * self.candidates.bytes[i]


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
    """Compute time that can cover candidate ``i``'s two copies."""
    c, F = problem.candidates, problem.timeline.num_forward
    d2h = S[F] - S[c.produced[i] + 1]
    return d2h + (S[c.first_bw_use[i]] - S[F] if prefetch == "auto" else 0.0)


def isolated_offload(problem: Problem, S: Sequence[float], i: int, prefetch: str
                     ) -> tuple[int, int, float]:
    """``(d2h_done, prefetch_issue, exposed_ms)`` of offloading ``i`` with no other copies.

    Every other offload only delays ``d2h_done``, moves ``prefetch_issue`` earlier and adds
    exposure, so these are the most favourable figures ``i`` can get.
    """
    c, F = problem.candidates, problem.timeline.num_forward
    d, p, b = problem.copy_ms(i), c.produced[i], c.first_bw_use[i]
    end = S[p + 1] + d
    exposed = max(0.0, end - max(S[p + 1], S[F]))
    if prefetch == "jit":
        return done_position(S, F, p, end), b, exposed + d
    start = S[b] - d
    return (done_position(S, F, p, end), issue_position(S, F, b, start),
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


def offload_schedule(problem: Problem, S: Sequence[float], offloaded: Sequence[int],
                     prefetch: str) -> tuple[dict[int, int], dict[int, int], dict[int, float]]:
    """``d2h_done``, ``prefetch_issue`` and exposed ms of each offloaded candidate."""
    c, F = problem.candidates, problem.timeline.num_forward
    done: dict[int, int] = {}
    issue: dict[int, int] = {}
    exposed = dict.fromkeys(offloaded, 0.0)
    end = -math.inf
    for i in sorted(offloaded, key=lambda j: (c.produced[j], j)):
        a = S[c.produced[i] + 1]
        start = max(a, end)
        end = start + problem.copy_ms(i)
        done[i] = done_position(S, F, c.produced[i], end)
        exposed[i] += max(0.0, end - max(start, S[F]))
    start = math.inf
    for i in sorted(offloaded, key=lambda j: (c.first_bw_use[j], j), reverse=True):
        d, b = problem.copy_ms(i), c.first_bw_use[i]
        if prefetch == "jit":
            issue[i], exposed[i] = b, exposed[i] + d
            continue
        start = min(S[b], start) - d
        issue[i] = issue_position(S, F, b, start)
        exposed[i] += max(0.0, min(S[F], start + d) - start)
    return done, issue, exposed


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
        elif ch == "offload":
            cost += exp[i] + problem.offload_fixed_ms(i)
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


# --- incremental simulation (the greedy's exact twin of simulate) -------------------------

_NEG = -(1 << 62)


class _MaxTree:
    """Range add, global max and leftmost argmax over integer positions."""

    def __init__(self, values: Sequence[int]) -> None:
        n = 1
        while n < max(1, len(values)):
            n *= 2
        self.n, self.ad = n, [0] * (2 * n)
        self.mx = [_NEG] * (2 * n)
        self.mx[n:n + len(values)] = values
        for k in range(n - 1, 0, -1):
            self.mx[k] = max(self.mx[2 * k], self.mx[2 * k + 1])

    def add(self, lo: int, hi: int, v: int) -> None:
        mx, ad = self.mx, self.ad
        lo, hi = lo + self.n, hi + self.n + 1
        l0, h0 = lo, hi - 1
        while lo < hi:
            if lo & 1:
                mx[lo] += v
                ad[lo] += v
                lo += 1
            if hi & 1:
                hi -= 1
                mx[hi] += v
                ad[hi] += v
            lo, hi = lo >> 1, hi >> 1
        l0, h0 = l0 >> 1, h0 >> 1
        while l0:  # refresh both boundary paths up to the root, once where they meet
            x, y = mx[2 * l0], mx[2 * l0 + 1]
            mx[l0] = (x if x > y else y) + ad[l0]
            if h0 != l0:
                x, y = mx[2 * h0], mx[2 * h0 + 1]
                mx[h0] = (x if x > y else y) + ad[h0]
            l0, h0 = l0 >> 1, h0 >> 1

    def argmaxes(self, limit: int) -> list[int]:
        """The first ``limit`` positions (leftmost first) where the maximum is reached."""
        out: list[int] = []
        stack = [(1, self.mx[1])]
        while stack and len(out) < limit:
            k, want = stack.pop()
            if k >= self.n:
                out.append(k - self.n)
                continue
            want -= self.ad[k]
            for child in (2 * k + 1, 2 * k):
                if self.mx[child] == want:
                    stack.append((child, want))
        return out


class _ChainTree:
    """End time of a FIFO copy chain, ``e = max(a, e_prev) + d``, over fixed slots (max-plus)."""

    def __init__(self, m: int) -> None:
        n = 1
        while n < max(1, m):
            n *= 2
        self.n, self.sm, self.best = n, [0.0] * (2 * n), [-math.inf] * (2 * n)

    def set(self, slot: int, a: float, d: float, on: bool) -> None:
        sm, best, k = self.sm, self.best, slot + self.n
        sm[k], best[k] = (d, a + d) if on else (0.0, -math.inf)
        k >>= 1
        while k:
            r = sm[2 * k + 1]
            sm[k] = sm[2 * k] + r
            x, y = best[2 * k] + r, best[2 * k + 1]
            best[k] = x if x > y else y
            k >>= 1


    def root_if(self, slot: int, a: float, d: float, on: bool) -> float:
        """The chain's end if ``slot`` were set so, without changing anything."""
        sm, best, k = self.sm, self.best, slot + self.n
        s, e = (d, a + d) if on else (0.0, -math.inf)
        while k > 1:
            if k & 1:  # right child: the sibling's copies run first
                x = best[k - 1] + s
                e, s = (x if x > e else e), sm[k - 1] + s
            else:
                x, y = e + sm[k + 1], best[k + 1]
                e, s = (x if x > y else y), s + sm[k + 1]
            k >>= 1
        return e


class IncrementalSim:
    """Exact residency and cost of a configuration that changes one candidate at a time.

    Agrees with :func:`simulate`: copy chains use the same recurrences. A stored D2H end is
    trusted only while ``done < F-1``, and a stored H2D start only while ``issue > F``. Past
    those clamps nothing later in the chain can change position.
    """

    def __init__(self, problem: Problem, prefetch: str, choices: list[str]) -> None:
        c, self.pb, self.jit = problem.candidates, problem, prefetch == "jit"
        n, S = len(c), problem.prefix_ms()
        self.S, self.F, self.SF = S, problem.timeline.num_forward, S[problem.timeline.num_forward]
        self.d = [problem.copy_ms(i) for i in range(n)]
        self.a = [S[p + 1] for p in c.produced]
        self.mode = list(choices)
        sim = simulate(problem, choices, prefetch=prefetch)  # type: ignore[arg-type]
        self.tree = _MaxTree(sim.resident)
        self.done, self.ip = list(sim.d2h_done), list(sim.prefetch_issue)
        self.end, self.st = [0.0] * n, [0.0] * n
        self.res = [residency(problem, i, ch, self.done[i], self.ip[i])
                    for i, ch in enumerate(choices)]
        self.dm: list[tuple[int, int]] = []  # D2H chain: (produced, i)
        self.hm: list[tuple[int, int]] = []  # H2D chain: (first_bw_use, i)
        order = sorted(range(n), key=lambda i: (c.produced[i], i))
        self.dslot = {i: k for k, i in enumerate(order)}
        order = sorted(range(n), key=lambda i: (c.first_bw_use[i], i), reverse=True)
        self.hslot = {i: k for k, i in enumerate(order)}
        self.dtree, self.htree = _ChainTree(n), _ChainTree(n)
        self.rec = sum(c.recompute_ms[i] for i in range(n) if choices[i] == "recompute")
        self.price = self.jit_ms = 0.0
        for i in (i for i in range(n) if choices[i] == "offload"):
            self._chains(i, True)
        e, s = -math.inf, math.inf  # fresh chain times, as simulate computes them
        for _, i in self.dm:
            e = self.end[i] = max(self.a[i], e) + self.d[i]
        for b, i in reversed(self.hm):
            s = self.st[i] = min(S[b], s) - self.d[i]

    def _chains(self, i: int, on: bool) -> None:
        c = self.pb.candidates
        for chain, key in ((self.dm, (c.produced[i], i)), (self.hm, (c.first_bw_use[i], i))):
            if not (self.jit and chain is self.hm):
                if on:
                    insort(chain, key)
                else:
                    del chain[bisect_left(chain, key)]
        self.dtree.set(self.dslot[i], self.a[i], self.d[i], on)
        if not self.jit:
            self.htree.set(self.hslot[i], -self.S[c.first_bw_use[i]], self.d[i], on)
        sign = 1 if on else -1
        self.price += sign * self.pb.offload_fixed_ms(i)
        self.jit_ms += sign * self.d[i] if self.jit else 0.0

    @property
    def cost(self) -> float:
        h2d = self.jit_ms if self.jit else max(0.0, self.SF + self.htree.best[1])
        return self.rec + self.price + max(0.0, self.dtree.best[1] - self.SF) + h2d

    @property
    def peak(self) -> int:
        return self.tree.mx[1]

    def _move(self, i: int, new: list[tuple[int, int]]) -> None:
        """Replace ``i``'s residency by ``new``: one range add per run where they differ."""
        b, ev = self.pb.candidates.bytes[i], {}  # type: int, dict[int, int]
        for sign, spans in ((-1, self.res[i]), (1, new)):
            for lo, hi in spans:
                ev[lo] = ev.get(lo, 0) + sign
                ev[hi + 1] = ev.get(hi + 1, 0) - sign
        run, start = 0, 0
        for pos in sorted(ev):
            if run:
                self.tree.add(start, pos - 1, run * b)
            run, start = run + ev[pos], pos
        self.res[i] = new

    def _refresh(self, j: int) -> None:
        self._move(j, residency(self.pb, j, "offload", self.done[j], self.ip[j]))

    def own(self, x: int) -> tuple[float | None, int, float | None, int]:
        """``(end, done, start, issue)`` of ``x`` if offloaded now (None: past a clamp).

        Only copies ahead of ``x`` in each FIFO decide its own timing, and they don't move.
        """
        c, S, F = self.pb.candidates, self.S, self.F
        p, b, d = c.produced[x], c.first_bw_use[x], self.d[x]
        k = bisect_left(self.dm, (p, x))
        j = self.dm[k - 1][1] if k else -1
        prev_end = self.end[j] if j >= 0 else -math.inf
        e = None if j >= 0 and self.done[j] == F - 1 else max(self.a[x], prev_end) + d
        done = F - 1 if e is None else done_position(S, F, p, e)
        if self.jit:
            return e, done, None, b
        k = bisect_left(self.hm, (b, x))
        j = self.hm[k][1] if k < len(self.hm) else -1
        next_start = self.st[j] if j >= 0 else math.inf
        s = None if j >= 0 and self.ip[j] == F else min(S[b], next_start) - d
        return e, done, s, F if s is None else issue_position(S, F, b, s)

    def delta_offload(self, x: int, on: bool) -> float:
        """Exact change of cost if ``x`` joins (``on``) or leaves the copy chains."""
        sign, c, d = (1 if on else -1), self.pb.candidates, self.d[x]
        d2h = self.dtree.root_if(self.dslot[x], self.a[x], d, on)
        if self.jit:
            h2d = self.jit_ms + sign * d
        else:
            neg_start = self.htree.root_if(self.hslot[x], -self.S[c.first_bw_use[x]], d, on)
            h2d = max(0.0, self.SF + neg_start)
        after = (self.rec + self.price + sign * self.pb.offload_fixed_ms(x)
                 + max(0.0, d2h - self.SF) + h2d)
        return after - self.cost

    def set_recompute(self, i: int) -> None:
        if self.mode[i] == "offload":
            self._unoffload(i)
        self.mode[i] = "recompute"
        self.rec += self.pb.candidates.recompute_ms[i]
        self._move(i, residency(self.pb, i, "recompute"))

    def set_offload(self, x: int) -> None:
        c = self.pb.candidates
        e, self.done[x], s, self.ip[x] = self.own(x)
        self._chains(x, True)
        self.mode[x] = "offload"
        self._refresh(x)
        if e is not None:  # later D2H copies slip
            self.end[x] = e
            self._walk_d2h(bisect_left(self.dm, (c.produced[x], x)) + 1, e)
        if s is not None:  # earlier prefetches move earlier
            self.st[x] = s
            self._walk_h2d(bisect_left(self.hm, (c.first_bw_use[x], x)) - 1, s)

    def _unoffload(self, x: int) -> None:
        c, F = self.pb.candidates, self.F
        kd = bisect_left(self.dm, (c.produced[x], x))
        kh = bisect_left(self.hm, (c.first_bw_use[x], x))
        self._chains(x, False)
        j = self.dm[kd - 1][1] if kd else -1
        if j < 0 or self.done[j] < F - 1:
            self._walk_d2h(kd, self.end[j] if j >= 0 else -math.inf)
        j = self.hm[kh][1] if kh < len(self.hm) else -1
        if not self.jit and (j < 0 or self.ip[j] > F):
            self._walk_h2d(kh - 1, self.st[j] if j >= 0 else math.inf)

    def _walk_d2h(self, k: int, e: float) -> None:
        """Redo D2H ends from chain index ``k`` on (``e``: the end before it) until settled."""
        c, S, F = self.pb.candidates, self.S, self.F
        for idx in range(k, len(self.dm)):
            j = self.dm[idx][1]
            e, old = max(self.a[j], e) + self.d[j], self.done[j]
            if old < F - 1 and e == self.end[j]:
                return  # absorbed by an idle gap: nothing later moves
            self.end[j], new = e, done_position(S, F, c.produced[j], e)
            if new != old:
                self.done[j] = new
                self._refresh(j)
            if old == new == F - 1:
                return  # past the end of the forward: later copies stay clamped

    def _walk_h2d(self, k: int, s: float) -> None:
        """Redo H2D starts from chain index ``k`` down (``s``: the start after it) until settled."""
        c, S, F = self.pb.candidates, self.S, self.F
        for idx in range(k, -1, -1):
            j = self.hm[idx][1]
            s, old = min(S[c.first_bw_use[j]], s) - self.d[j], self.ip[j]
            if old > F and s == self.st[j]:
                return
            self.st[j], new = s, issue_position(S, F, c.first_bw_use[j], s)
            if new != old:
                self.ip[j] = new
                self._refresh(j)
            if old == new == F:
                return  # before the backward starts: earlier prefetches stay at F


# --- whole-graph liveness -------------------------------------------------------------------


def _tensor_bytes(t: object) -> int:
    import torch

    if not isinstance(t, torch.Tensor):
        return 0
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # sparse / symbolic sizes: fall back to the view's own extent
        return int(t.numel()) * t.element_size()


def live_bytes_timeline(gm: torch.fx.GraphModule) -> list[int]:
    """Bytes of all live tensors at each node position of ``gm`` (the whole-graph timeline).

    Sizes come from ``node.meta["val"]`` (FakeTensors or tensors). Each storage is counted
    once: views share their base's storage, and it stays live from its first producer to the
    last use of any node that aliases it. Nodes without a tensor ``val`` count nothing.
    """
    import torch

    nodes = list(gm.graph.nodes)
    pos = {node: k for k, node in enumerate(nodes)}
    span: dict[object, list[int]] = {}  # storage key -> [bytes, first, last]
    keys_of: dict[torch.fx.Node, list[object]] = {}
    for k, node in enumerate(nodes):
        val = node.meta.get("val")
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        keys: list[object] = []
        for j, v in enumerate(vals):
            if not isinstance(v, torch.Tensor):
                continue
            try:
                key: object = ("storage", v.untyped_storage()._cdata)
            except Exception:
                key = ("node", node.name, j)
            keys.append(key)
            if key not in span:
                span[key] = [_tensor_bytes(v), k, k]
        keys_of[node] = keys
        last = max((pos[u] for u in node.users), default=k)
        for key in keys:
            span[key][2] = max(span[key][2], last)
    diff = [0] * (len(nodes) + 1)
    for nbytes, first, last in span.values():
        diff[first] += nbytes
        diff[last + 1] -= nbytes
    return list(accumulate(diff[: len(nodes)]))


def peak_live_bytes(gm: torch.fx.GraphModule) -> int:
    """The whole-graph peak: the largest entry of :func:`live_bytes_timeline`."""
    return max(live_bytes_timeline(gm), default=0)
