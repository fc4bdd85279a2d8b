"""``peak_budget``: one graph planned again until its predicted step peak fits.

The planner bounds the saved activations; the step's peak is those at their worst moment plus
what the backward allocates beside them (gradients, temporaries, what it rebuilds and
restores), which the plan predicts only once the graphs are rewritten
(:func:`fxckpt.graph.liveness.step_peak_bytes`). So :func:`fit_peak` plans with the saved
activations capped at the peak budget, reads the predicted step peak, and plans again with the
cap lowered by what the peak is over, until it fits: the part beside the saved activations
moves little between plans of one graph, so one or two more plans usually do.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import TypeVar

from fxckpt.errors import BudgetError
from fxckpt.options import Options
from fxckpt.planning.plan import Plan
from fxckpt.planning.plan_round import hints

log = logging.getLogger(__name__)

T = TypeVar("T")

# Plans of one graph under peak_budget before the smallest of them stands.
MAX_PEAK_PLANS = 5


def fit_peak(attempt: Callable[[int, str], T], plan_of: Callable[[T], Plan], options: Options,
             graph_name: str) -> T:
    """``attempt(cap, note)`` partitions with the saved activations held to ``cap`` bytes,
    ``note`` going into its plan's notes; returns,
    of at most :data:`MAX_PEAK_PLANS` attempts, the one of least estimated added time whose
    predicted step peak is within ``options.peak_budget``.

    The first cap is the budget itself (the saved activations are part of the peak); a plan
    over it sets the next cap that much lower, and once one plan fits and one does not, the
    caps halve the gap between them, so the plan kept holds as much as fits. Where no plan
    fits, the one of the smallest predicted peak, after a :class:`BudgetError` naming
    ``peak_budget`` (``on_infeasible="warn"``: a warning)."""
    target = options.peak_budget
    assert isinstance(target, int)
    cap = target
    over: int | None = None  # the smallest cap whose plan was over
    fits: list[tuple[int, T]] = []  # (cap, attempt) of the plans that fit
    tried: list[T] = []
    for k in range(MAX_PEAK_PLANS):
        got = attempt(cap, f"peak_budget={target} bytes: the saved activations held to {cap} "
                           "bytes for the step's peak to fit")
        tried.append(got)
        plan = plan_of(got)
        peak = plan.predicted_step_peak_bytes
        assert peak is not None
        log.info("fxckpt[%s] peak_budget=%d: plan %d, saved activations held to %d bytes, "
                 "step peak %d bytes", graph_name, target, k + 1, cap, peak)
        floor = plan.resident_peak_bytes > cap  # the planner's smallest plan: none goes lower
        if peak <= target:
            fits.append((cap, got))
            if cap >= target or over is None:
                break  # nothing larger to try
        else:
            over = cap if over is None else min(over, cap)
            if floor or plan.resident_peak_bytes == 0:
                break
        largest_fit = max((c for c, _ in fits), default=None)
        if largest_fit is not None and over is not None:
            if over - largest_fit <= max(1, target // 200):
                break  # within 0.5 % of the budget
            cap = (largest_fit + over) // 2
        else:  # over by (peak - target): hold the saved activations that much lower
            cap = max(1, min(cap, plan.resident_peak_bytes) - (peak - target))
    if fits:
        return min(fits, key=lambda f: (plan_of(f[1]).est_overhead_ms, -f[0]))[1]
    best = min(tried, key=lambda t: plan_of(t).predicted_step_peak_bytes or 0)
    smallest = plan_of(best).predicted_step_peak_bytes
    assert smallest is not None
    error = BudgetError(graph_name, target, smallest, hints(options), option="peak_budget")
    if options.on_infeasible == "raise":
        raise error
    warnings.warn(f"{error.summary} Running the plan of the smallest step peak instead.",
                  stacklevel=2)
    return best
