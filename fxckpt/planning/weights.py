"""What streamed weights' copies cost a step, in the planner's numbers (no fx here).

A plan under ``device_budget`` keeps some weights' device copies across steps and copies the
rest to the device at each use, forward and backward, on the host-to-device queue the
activations' reloads use too. :func:`exposed_copy_ms` estimates the time compute waits for
those copies: per pass, what the queue needs beyond the compute it runs behind, plus the
pass's first copy, which has no compute before it to hide behind: what a weight kept
resident saves. Beside that wait, each copy's op calls take the compute thread's time
(``copy_overhead_ms`` per copy), which no compute hides. Each plan's notes give both
(``weight copies: ...``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fxckpt.planning.plan import Plan, PlannedWeight


@dataclass(frozen=True)
class CopyEstimate:
    """The streamed weights' copies of one step, as :func:`exposed_copy_ms` priced them."""

    forward_ms: float  # the queue's time for the forward's copies
    backward_ms: float  # the backward's: the weights again, and the activations' reloads
    exposed_ms: float  # what compute is estimated to wait for them
    host_ms: float = 0.0  # the copies' op calls on the compute thread
    copies: int = 0  # copies per step


def exposed_copy_ms(weights: Sequence[PlannedWeight], *, bandwidth: float, overhead_ms: float,
                    forward_compute_ms: float, backward_compute_ms: float,
                    restored_bytes: int = 0, host_overhead_ms: float = 0.0) -> CopyEstimate:
    """Estimated wait for the streamed weights' copies of a step (``bandwidth`` in bytes/s,
    ``overhead_ms`` per copy on the link); ``restored_bytes``: the activations' reloads in the
    backward; ``host_overhead_ms``: each copy's op calls on the compute thread."""
    streamed = [w for w in weights if w.decision == "stream"]
    copies = sum(w.forward_uses + w.backward_uses for w in streamed)
    if not streamed or bandwidth <= 0:
        return CopyEstimate(0.0, 0.0, 0.0, copies * host_overhead_ms, copies)

    def queue_ms(nbytes: int, copies: int) -> float:
        return 1e3 * nbytes / bandwidth + copies * overhead_ms

    fw = queue_ms(sum(w.bytes * w.forward_uses for w in streamed),
                  sum(w.forward_uses for w in streamed))
    bw = queue_ms(sum(w.bytes * w.backward_uses for w in streamed) + restored_bytes,
                  sum(w.backward_uses for w in streamed))
    first = [w for w in streamed if w.forward_uses], [w for w in streamed if w.backward_uses]
    lead = sum(queue_ms(ws[0].bytes, 1) for ws in first if ws)  # each pass's first copy
    exposed = max(0.0, fw - forward_compute_ms) + max(0.0, bw - backward_compute_ms) + lead
    return CopyEstimate(fw, bw, exposed, copies * host_overhead_ms, copies)


def step_estimate(plan: Plan) -> CopyEstimate | None:
    """:func:`exposed_copy_ms` of a plan's weight rows, from its own assumptions and timeline
    (``None`` where it has no streamed weight or no timeline)."""
    if not plan.weights or plan.timeline is None or "forward_compute_ms" not in plan.timeline:
        return None
    assumed = plan.assumptions
    bandwidth = float(assumed.get("bandwidth_bytes_per_s", {}).get("value") or 0.0)
    overhead = float(assumed.get("link_overhead_ms", {}).get("value") or 0.0)
    host = float(assumed.get("copy_overhead_ms", {}).get("value") or 0.0)
    forward = float(plan.timeline["forward_compute_ms"])
    # The graphs' compute (the recompute min-cut carried out included) and what copies add;
    # a plan written before that figure existed has the graphs' compute only.
    backward = float(plan.timeline.get("predicted_step_ms", plan.timeline["compute_ms"])) - forward
    restored = plan.offloaded_bytes
    return exposed_copy_ms(plan.weights, bandwidth=bandwidth, overhead_ms=overhead,
                           forward_compute_ms=forward, backward_compute_ms=backward,
                           restored_bytes=restored, host_overhead_ms=host)
