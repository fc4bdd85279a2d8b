"""Exact solvers that check the greedy: brute force (n <= 12) and a MILP (scipy's HiGHS).

:func:`fxckpt.planning.solve.solve` reaches them with ``method="brute"`` / ``"milp"``; they
are not used to plan (their optima are not nested across budgets), only to measure how far
the greedy is from the best plan.
"""

from __future__ import annotations

import math
import time
from itertools import pairwise, product

from fxckpt.planning.memory import Problem, isolated_offload, offload_schedule, residency, simulate
from fxckpt.planning.solve import base_choices


def brute(problem: Problem, budget: int, prefetch: str) -> list[str]:
    """Every combination: min cost among those that fit, else min peak (ties: min cost)."""
    c, n, T = problem.candidates, len(problem), problem.timeline.num_positions
    if n > 12:
        raise ValueError(f"brute force is for n <= 12 candidates, got {n}")
    S = problem.prefix_ms()
    fixed = list(problem.timeline.fixed_resident or [0] * T)
    allowed = [c.allowed(i) for i in range(n)]
    may_off = [i for i in range(n) if "offload" in allowed[i]]
    best: tuple | None = None  # (infeasible, cost or peak, peak or cost, choices)

    def vec(spans: list[tuple[int, int]], b: int) -> list[int]:
        v = [0] * T
        for lo, hi in spans:
            for t in range(lo, hi + 1):
                v[t] += b
        return v

    kr = {(i, ch): vec(residency(problem, i, ch), c.bytes[i])
          for i in range(n) for ch in ("keep", "recompute")}
    for off in product((False, True), repeat=len(may_off)):
        chosen = [i for i, o in zip(may_off, off, strict=True) if o]
        if any(allowed[i] == ("offload",) for i in set(may_off) - set(chosen)):
            continue
        done, issue, exp = offload_schedule(problem, S, chosen, prefetch)
        base, cost0 = fixed[:], sum(exp.values()) + problem.offload_fixed_total(chosen)
        for i in chosen:
            base = [x + y for x, y in zip(base, vec(residency(problem, i, "offload", done[i],
                                                              issue[i]), c.bytes[i]), strict=True)]
        rest = [i for i in range(n) if i not in done]
        opts = [[ch for ch in ("keep", "recompute") if ch in allowed[i]] for i in rest]
        for combo in product(*opts):
            res, cost = base, cost0
            for i, ch in zip(rest, combo, strict=True):
                res = [x + y for x, y in zip(res, kr[i, ch], strict=True)]
                cost += c.recompute_ms[i] if ch == "recompute" else 0.0
            peak = max(res, default=0)
            choices = ["offload"] * n
            for i, ch in zip(rest, combo, strict=True):
                choices[i] = ch
            key = (0, cost, peak, choices) if peak <= budget else (1, peak, cost, choices)
            if best is None or key < best:
                best = key
    assert best is not None
    return best[3]


def milp(problem: Problem, budget: int, prefetch: str, time_limit: float = 10.0
          ) -> list[str] | None:
    """HiGHS on the optimistic copy model; if its answer breaks the budget, on the pessimistic one.

    Optimistic: each offload timed alone on the channels, the most favourable timing it can
    get, so the model is exact when copies do not queue and infeasible only if the problem is.
    Pessimistic: each offload timed as if everything that may be offloaded were, which bounds
    its residency for any actual set (both FIFO chains are max-plus in the offloaded set). So
    that answer fits when simulated. Returns None when scipy is missing, the budget can't be
    met, or HiGHS runs out of time; the caller then falls back to the greedy.
    """
    try:
        import numpy  # noqa: F401
        import scipy.optimize  # noqa: F401
    except ImportError:
        return None
    n, S = len(problem), problem.prefix_ms()
    allkeep = simulate(problem, ["keep"] * n, prefetch=prefetch).resident  # type: ignore[arg-type]
    if max(allkeep, default=0) <= budget:
        return base_choices(problem)
    if n == 0:
        return None
    may_offload = [i for i in range(n) if "offload" in problem.candidates.allowed(i)]
    done, issue, exposed = offload_schedule(problem, S, may_offload, prefetch)
    models = ([isolated_offload(problem, S, i, prefetch) for i in range(n)],
              [(done.get(i, -1), issue.get(i, -1), exposed.get(i, 0.0)) for i in range(n)])
    deadline = time.monotonic() + time_limit
    for timing in models:
        choices = _milp_once(problem, budget, allkeep, timing, deadline - time.monotonic())
        if choices is None:
            return None
        if simulate(problem, choices, prefetch=prefetch).peak <= budget:  # type: ignore[arg-type]
            return choices
    return None


def _milp_once(problem: Problem, budget: int, allkeep: list[int],
               timing: list[tuple[int, int, float]], time_limit: float) -> list[str] | None:
    """One HiGHS solve; ``timing[i]``: offload ``i``'s (d2h_done, prefetch_issue, exposed ms)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    c, n, T = problem.candidates, len(problem), problem.timeline.num_positions
    if time_limit <= 0:
        return None
    unit = float(2**20) if max(c.bytes) >= 2**20 else 1.0
    obj, lo, hi = np.zeros(2 * n), np.zeros(2 * n), np.ones(2 * n)
    spans: list[tuple[int, int]] = [(0, -1)] * (2 * n)  # flag j frees positions spans[j]
    for i, (done, issue, exposed) in enumerate(timing):
        allowed = c.allowed(i)
        obj[i] = c.recompute_ms[i] if math.isfinite(c.recompute_ms[i]) else 0.0
        obj[n + i] = exposed + problem.offload_fixed_ms(i)
        hi[i], hi[n + i] = "recompute" in allowed, "offload" in allowed
        lo[i], lo[n + i] = allowed == ("recompute",), allowed == ("offload",)
        spans[i] = (c.last_fw_use[i] + 1, c.first_bw_use[i] - 1)
        if "offload" in allowed:
            spans[n + i] = (max(c.last_fw_use[i], done) + 1, issue - 1)
    # Positions between consecutive span ends share one covering set: keep the tightest row.
    cuts = sorted({0, T, *(x for a, b in spans if a <= b for x in (a, b + 1))})
    rows, rhs = [], []
    for u, v in pairwise(cuts):
        need = max(allkeep[u:v], default=0) - budget
        if need > 0:
            rows.append([c.bytes[j % n] / unit if spans[j][0] <= u <= spans[j][1] else 0.0
                         for j in range(2 * n)])
            rhs.append(need / unit)
    one = np.zeros((n, 2 * n))
    one[np.arange(n), np.arange(n)] = one[np.arange(n), n + np.arange(n)] = 1
    r = milp(obj, integrality=np.ones(2 * n), bounds=Bounds(lo, hi),
             constraints=[LinearConstraint(np.array(rows), np.array(rhs), np.inf),
                          LinearConstraint(one, 0, 1)],
             options={"time_limit": time_limit, "mip_rel_gap": 1e-9})
    if r.x is None:
        return None
    x = np.round(r.x).astype(int)
    return ["recompute" if x[i] else "offload" if x[n + i] else "keep" for i in range(n)]
