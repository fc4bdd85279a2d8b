"""The greedy's exact twin of :func:`~fxckpt.planning.memory.simulate`: residency and cost of a
configuration that changes one candidate at a time, in logarithmic time per change.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Sequence

from fxckpt.planning.memory import (
    OFFLOAD_PRICE_MS_PER_BYTE,
    Problem,
    bucket_schedule,
    done_position,
    issue_position,
    residency,
    simulate,
)

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

    Agrees with :func:`simulate`: copy chains use the same recurrences, one chain entry per
    bucket with an offloaded member (its copy time the sum of theirs). A stored D2H end is
    trusted only while ``done < F-1``, and a stored H2D start only while ``issue > F``. Past
    those clamps nothing later in the chain can change position.
    """

    def __init__(self, problem: Problem, prefetch: str, choices: list[str]) -> None:
        c, self.problem, self.jit = problem.candidates, problem, prefetch == "jit"
        bk = self.buckets = problem.buckets
        n, m, S = len(c), len(bk.members), problem.prefix_ms()
        # starts_ms[t]: when position t starts; the forward's positions end at forward_end_ms.
        self.starts_ms, self.num_forward = S, problem.timeline.num_forward
        self.forward_end_ms = S[self.num_forward]
        self.overhead = problem.timeline.copy_overhead_ms
        self.link = problem.timeline.link_overhead_ms  # a bucket's copy pays it once
        self.copy_ms = [problem.copy_ms(i) for i in range(n)]
        self.bucket_ready_ms = [S[r + 1] for r in bk.ready]  # per bucket: when its copy may start
        self.bucket_copy_ms = [0.0] * m  # per bucket: copy ms of its offloaded members
        self.bucket_offloaded = [0] * m  # per bucket: offloaded members
        self.mode = list(choices)
        sim = simulate(problem, choices, prefetch=prefetch)  # type: ignore[arg-type]
        self.tree = _MaxTree(sim.resident)
        done, issue, _ = bucket_schedule(problem, S, [i for i in range(n) if choices[i] == "offload"],
                                         prefetch)
        self.done, self.issue = [-1] * m, [-1] * m
        for g, v in done.items():
            self.done[g] = v
        for g, v in issue.items():
            self.issue[g] = v
        self.d2h_end, self.h2d_start = [0.0] * m, [0.0] * m
        self.res = [residency(problem, i, ch, *self._positions(i))
                    for i, ch in enumerate(choices)]
        self.d2h_chain: list[tuple[int, int]] = []  # D2H chain: (ready, bucket)
        self.h2d_chain: list[tuple[int, int]] = []  # H2D chain: (need, bucket)
        order = sorted(range(m), key=lambda g: (bk.ready[g], g))
        self.dslot = {g: k for k, g in enumerate(order)}
        order = sorted(range(m), key=lambda g: (bk.need[g], g), reverse=True)
        self.hslot = {g: k for k, g in enumerate(order)}
        self.dtree, self.htree = _ChainTree(m), _ChainTree(m)
        self.recompute_ms = sum(c.recompute_ms[i] for i in range(n) if choices[i] == "recompute")
        self.price = self.jit_ms = 0.0
        for i in (i for i in range(n) if choices[i] == "offload"):
            self._join_chain(i, True)
        e, s = -math.inf, math.inf  # fresh chain times, as simulate computes them
        for _, g in self.d2h_chain:
            e = self.d2h_end[g] = max(self.bucket_ready_ms[g], e) + self.bucket_copy_ms[g]
        for _, g in reversed(self.h2d_chain):
            s = self.h2d_start[g] = min(S[bk.need[g]], s) - self.bucket_copy_ms[g]

    def _positions(self, i: int) -> tuple[int, int]:
        """``(join, issue)`` of candidate ``i``'s bucket as it stands (-1 where not copied)."""
        g = self.buckets.of[i]
        if self.done[g] < 0:
            return -1, -1
        return max(self.done[g], self.buckets.last_fw[g]), self.issue[g]

    def _join_chain(self, i: int, on: bool) -> None:
        """Count ``i`` in (``on``) or out of its bucket's copies, chains and prices."""
        g, sign = self.buckets.of[i], 1 if on else -1
        was = self.bucket_offloaded[g] > 0
        self.bucket_offloaded[g] += sign
        self.bucket_copy_ms[g] += sign * self.copy_ms[i] + (self.link if on and not was else 0.0)
        if self.bucket_offloaded[g] == 0:
            self.bucket_copy_ms[g] = 0.0  # no float residue in an idle bucket
        now = self.bucket_offloaded[g] > 0
        if was != now:
            for chain, key in ((self.d2h_chain, (self.buckets.ready[g], g)), (self.h2d_chain, (self.buckets.need[g], g))):
                if not (self.jit and chain is self.h2d_chain):
                    if now:
                        insort(chain, key)
                    else:
                        del chain[bisect_left(chain, key)]
            self.price += sign * self.overhead
        self.dtree.set(self.dslot[g], self.bucket_ready_ms[g], self.bucket_copy_ms[g], now)
        if not self.jit:
            self.htree.set(self.hslot[g], -self.starts_ms[self.buckets.need[g]], self.bucket_copy_ms[g], now)
        self.price += sign * OFFLOAD_PRICE_MS_PER_BYTE * self.problem.candidates.bytes[i]
        if self.jit:
            self.jit_ms += sign * self.copy_ms[i] + (sign * self.link if was != now else 0.0)

    @property
    def cost(self) -> float:
        h2d = self.jit_ms if self.jit else max(0.0, self.forward_end_ms + self.htree.best[1])
        return self.recompute_ms + self.price + max(0.0, self.dtree.best[1] - self.forward_end_ms) + h2d

    @property
    def peak(self) -> int:
        return self.tree.mx[1]

    def _move(self, i: int, new: list[tuple[int, int]]) -> None:
        """Replace ``i``'s residency by ``new``: one range add per run where they differ."""
        b, ev = self.problem.candidates.bytes[i], {}  # type: int, dict[int, int]
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

    def _refresh(self, g: int) -> None:
        """Bucket ``g``'s positions moved: move each of its offloaded members with them."""
        for j in self.buckets.members[g]:
            if self.mode[j] == "offload":
                self._move(j, residency(self.problem, j, "offload", *self._positions(j)))

    def _own(self, x: int) -> tuple[float | None, int, float | None, int]:
        """``(end, done, start, issue)`` of ``x``'s bucket were ``x`` offloaded now (None:
        past a clamp). Only copies ahead of the bucket in each FIFO decide its timing."""
        bk, S, F = self.buckets, self.starts_ms, self.num_forward
        g, d = bk.of[x], self.copy_ms[x]
        p, b = bk.ready[g], bk.need[g]
        if self.bucket_offloaded[g]:  # the bucket already copies: it grows by x's bytes
            e = None if self.done[g] == F - 1 else self.d2h_end[g] + d
        else:
            d += self.link  # a new copy on the queue
            k = bisect_left(self.d2h_chain, (p, g))
            j = self.d2h_chain[k - 1][1] if k else -1
            prev_end = self.d2h_end[j] if j >= 0 else -math.inf
            e = None if j >= 0 and self.done[j] == F - 1 else max(self.bucket_ready_ms[g], prev_end) + d
        done = F - 1 if e is None else done_position(S, F, p, e)
        if self.jit:
            return e, done, None, b
        if self.bucket_offloaded[g]:
            s = None if self.issue[g] == F else self.h2d_start[g] - d
        else:
            k = bisect_left(self.h2d_chain, (b, g))
            j = self.h2d_chain[k][1] if k < len(self.h2d_chain) else -1
            next_start = self.h2d_start[j] if j >= 0 else math.inf
            s = None if j >= 0 and self.issue[j] == F else min(S[b], next_start) - d
        return e, done, s, F if s is None else issue_position(S, F, b, s)

    def own(self, x: int) -> tuple[float | None, int, float | None, int]:
        """``(end, join, start, issue)`` of ``x`` if offloaded now (None: past a clamp); the
        join is where the forward would wait for its bucket's copy."""
        e, done, s, issue = self._own(x)
        return e, max(done, self.buckets.last_fw[self.buckets.of[x]]), s, issue

    def delta_offload(self, x: int, on: bool) -> float:
        """Exact change of cost if ``x`` joins (``on``) or leaves the copy chains."""
        sign, g = (1 if on else -1), self.buckets.of[x]
        opened = (self.bucket_offloaded[g] == 0) if on else (self.bucket_offloaded[g] == 1)
        dg = self.bucket_copy_ms[g] + sign * self.copy_ms[x] + (self.link if on and opened else 0.0)
        active = self.bucket_offloaded[g] + sign > 0
        dg = dg if active else 0.0
        d2h = self.dtree.root_if(self.dslot[g], self.bucket_ready_ms[g], dg, active)
        if self.jit:
            h2d = self.jit_ms + sign * (self.copy_ms[x] + (self.link if opened else 0.0))
        else:
            neg_start = self.htree.root_if(self.hslot[g], -self.starts_ms[self.buckets.need[g]], dg, active)
            h2d = max(0.0, self.forward_end_ms + neg_start)
        price = sign * (OFFLOAD_PRICE_MS_PER_BYTE * self.problem.candidates.bytes[x]
                        + (self.overhead if opened else 0.0))
        after = self.recompute_ms + self.price + price + max(0.0, d2h - self.forward_end_ms) + h2d
        return after - self.cost

    def set_recompute(self, i: int) -> None:
        if self.mode[i] == "offload":
            self._unoffload(i)
        self.mode[i] = "recompute"
        self.recompute_ms += self.problem.candidates.recompute_ms[i]
        self._move(i, residency(self.problem, i, "recompute"))

    def set_offload(self, x: int) -> None:
        bk = self.buckets
        g = bk.of[x]
        e, done, s, ip = self._own(x)
        self._join_chain(x, True)
        self.mode[x] = "offload"
        self.done[g], self.issue[g] = done, ip
        self._refresh(g)
        if e is not None:  # later D2H copies slip
            self.d2h_end[g] = e
            self._walk_d2h(bisect_left(self.d2h_chain, (bk.ready[g], g)) + 1, e)
        if s is not None:  # earlier prefetches move earlier
            self.h2d_start[g] = s
            self._walk_h2d(bisect_left(self.h2d_chain, (bk.need[g], g)) - 1, s)

    def _unoffload(self, x: int) -> None:
        bk, F = self.buckets, self.num_forward
        g = bk.of[x]
        kd = bisect_left(self.d2h_chain, (bk.ready[g], g))
        kh = bisect_left(self.h2d_chain, (bk.need[g], g))
        self._join_chain(x, False)
        self.mode[x] = "keep"  # out of its bucket's members until the caller sets it
        if self.bucket_offloaded[g] == 0:
            self.done[g] = self.issue[g] = -1
        # Redo the chains from the bucket's place: itself (smaller now) or the next one.
        j = self.d2h_chain[kd - 1][1] if kd else -1
        if j < 0 or self.done[j] < F - 1:
            self._walk_d2h(kd, self.d2h_end[j] if j >= 0 else -math.inf)
        if not self.jit:
            nxt = kh + 1 if self.bucket_offloaded[g] else kh
            j = self.h2d_chain[nxt][1] if nxt < len(self.h2d_chain) else -1
            if j < 0 or self.issue[j] > F:
                self._walk_h2d(nxt - 1, self.h2d_start[j] if j >= 0 else math.inf)

    def _walk_d2h(self, k: int, e: float) -> None:
        """Redo D2H ends from chain index ``k`` on (``e``: the end before it) until settled."""
        S, F, ready = self.starts_ms, self.num_forward, self.buckets.ready
        for idx in range(k, len(self.d2h_chain)):
            g = self.d2h_chain[idx][1]
            e, old = max(self.bucket_ready_ms[g], e) + self.bucket_copy_ms[g], self.done[g]
            if old < F - 1 and e == self.d2h_end[g]:
                return  # absorbed by an idle gap: nothing later moves
            self.d2h_end[g], new = e, done_position(S, F, ready[g], e)
            if new != old:
                self.done[g] = new
                self._refresh(g)
            if old == new == F - 1:
                return  # past the end of the forward: later copies stay clamped

    def _walk_h2d(self, k: int, s: float) -> None:
        """Redo H2D starts from chain index ``k`` down (``s``: the start after it) until settled."""
        S, F, need = self.starts_ms, self.num_forward, self.buckets.need
        for idx in range(k, -1, -1):
            g = self.h2d_chain[idx][1]
            s, old = min(S[need[g]], s) - self.bucket_copy_ms[g], self.issue[g]
            if old > F and s == self.h2d_start[g]:
                return
            self.h2d_start[g], new = s, issue_position(S, F, need[g], s)
            if new != old:
                self.issue[g] = new
                self._refresh(g)
            if old == new == F:
                return  # before the backward starts: earlier prefetches stay at F
