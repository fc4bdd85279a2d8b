"""The greedy's exact twin of :func:`~fxckpt.graph.memory.simulate`: residency and cost of a
configuration that changes one candidate at a time, in logarithmic time per change.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Sequence

from fxckpt.graph.memory import Problem, done_position, issue_position, residency, simulate

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
