"""``device_budget``: saved activations and resident weights traded under one budget.

The partition plans the saved activations first and keeps resident the weights whose copies
fit in what they leave (:func:`fxckpt.passes.weights.plan_weights`). Where that plan's
streamed weights cannot all hide their copies behind the forward (the host-to-device queue
needs more time than the forward's compute), a byte of saved activations recomputed or
offloaded may buy more than it costs: each byte of weights kept resident is a byte less to
copy, in the forward and again in the backward. :func:`trade` plans the graph again with the
saved activations held lower, by the bytes of copies the forward cannot hide and by half of
them, and keeps the plan of least estimated added time: the activations' (recompute, copy
waits, ``Plan.est_overhead_ms``) plus the weights' copy waits
(:func:`fxckpt.planning.weights.exposed_copy_ms`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from fxckpt.planning.plan import Plan
from fxckpt.planning.weights import step_estimate

log = logging.getLogger(__name__)

T = TypeVar("T")


def added_ms(plan: Plan) -> float | None:
    """The plan's estimated added time: its activations' and its weights' copy waits."""
    est = step_estimate(plan)
    return None if est is None else plan.est_overhead_ms + est.exposed_ms


def trade(attempt: Callable[[int | None, str], T], plan_of: Callable[[T], Plan],
          graph_name: str) -> T:
    """``attempt(cap, note)`` partitions with the saved activations held to ``cap`` bytes
    (``None``: the activations first), ``note`` going into its plan's notes; returns the
    attempt of least :func:`added_ms`, the activations-first plan unless another is cheaper."""
    first = attempt(None, "")
    plan = plan_of(first)
    est, cost = step_estimate(plan), added_ms(plan)
    if est is None or cost is None or plan.resident_peak_bytes == 0 or plan.timeline is None:
        return first
    forward = float(plan.timeline["forward_compute_ms"])
    bandwidth = float(plan.assumptions.get("bandwidth_bytes_per_s", {}).get("value") or 0.0)
    unhidden = int(max(0.0, est.forward_ms - forward) * bandwidth / 1e3)  # bytes
    if unhidden <= 0:
        return first
    best, best_cost = first, cost
    for share in (1.0, 0.5):
        cap = plan.resident_peak_bytes - int(share * unhidden)
        if cap <= 0:
            continue
        note = (f"device_budget: the saved activations held to {cap} bytes, "
                f"{plan.resident_peak_bytes - cap} below what they take when planned first, for "
                f"more weights to stay on the device (planned first: {cost:.1f} ms added)")
        got = attempt(cap, note)
        c = added_ms(plan_of(got))
        log.info("fxckpt[%s] device_budget: saved activations held to %d bytes: estimated %s "
                 "ms added (activations first: %.1f ms)", graph_name, cap, c, cost)
        if c is not None and c < best_cost:
            best, best_cost = got, c
    return best
