"""What streamed weights' copies are estimated to make compute wait (fxckpt.planning.weights),
and the plan's note that gives it."""

from __future__ import annotations

import pytest
import torch
from test_weights import Blocks, _assert_matches_eager, _fresh  # noqa: F401  (the fixture)

import fxckpt
from fxckpt.planning.plan import PlannedWeight
from fxckpt.planning.weights import exposed_copy_ms, step_estimate


def _w(name: str, nbytes: int, decision: str = "stream", fw: int = 1, bw: int = 1) -> PlannedWeight:
    return PlannedWeight(name, name, (nbytes // 4,), "float32", nbytes, fw, bw, decision, "")  # type: ignore[arg-type]


def test_the_estimate_charges_what_each_pass_cannot_hide_and_each_passs_first_copy() -> None:
    weights = [_w("a", 1000), _w("b", 3000), _w("c", 5000, "resident")]
    # 1 MB/s: 1 ms per KB. Forward: 4 ms of copies behind 1 ms of compute; backward: the same
    # 4 ms and 2 KB of reloads behind 10 ms. Each pass's first copy (a, 1 ms) has nothing
    # before it to hide behind.
    est = exposed_copy_ms(weights, bandwidth=1e6, overhead_ms=0.0, forward_compute_ms=1.0,
                          backward_compute_ms=10.0, restored_bytes=2000)
    assert (est.forward_ms, est.backward_ms) == pytest.approx((4.0, 6.0))
    assert est.exposed_ms == pytest.approx((4.0 - 1.0) + 0.0 + 2 * 1.0)
    # A resident weight moves nothing; a per-copy overhead counts once per copy.
    est = exposed_copy_ms(weights, bandwidth=1e6, overhead_ms=0.5, forward_compute_ms=100.0,
                          backward_compute_ms=100.0)
    assert (est.forward_ms, est.backward_ms) == pytest.approx((5.0, 5.0))
    assert est.exposed_ms == pytest.approx(2 * 1.5)
    assert exposed_copy_ms([_w("c", 5000, "resident")], bandwidth=1e6, overhead_ms=0.0,
                           forward_compute_ms=0.0, backward_compute_ms=0.0).exposed_ms == 0.0
    # The copies' op calls take the compute thread's time, one charge per copy: a, forward and
    # backward, and b, backward only; nothing for the resident c. The wait does not change.
    weights = [_w("a", 1000), _w("b", 3000, fw=0), _w("c", 5000, "resident")]
    est = exposed_copy_ms(weights, bandwidth=1e6, overhead_ms=0.0, forward_compute_ms=100.0,
                          backward_compute_ms=100.0, host_overhead_ms=0.25)
    assert (est.copies, est.host_ms) == (3, pytest.approx(0.75))
    assert est.exposed_ms == pytest.approx(2 * 1.0)


def _plan_under(budget: int) -> fxckpt.Plan:
    torch._dynamo.reset()
    torch.manual_seed(0)
    with fxckpt.emulate_link("2MB/s"):
        _assert_matches_eager(Blocks(depth=4), {"compiler": "eager", "memory_budget": budget}, x_rows=512)
    return fxckpt.last_plans()[-1]


def test_a_plan_with_streamed_weights_says_what_their_copies_are_estimated_to_cost() -> None:
    # Through a 2 MB/s link a 16 KiB weight takes 8 ms to copy, against well under a
    # millisecond of the block's compute: the forward waits for nearly every copy.
    kept = _plan_under(10**9)
    weight = 64 * 64 * 4
    # A step budget of about the saved activations and three weights' copies: the step runs,
    # with no room beside it to keep a weight on the device.
    streamed = _plan_under(kept.resident_peak_bytes + 3 * weight)
    assert kept.weights and all(w.decision == "resident" for w in kept.weights)
    assert all(w.decision == "stream" for w in streamed.weights if w.bytes == weight)
    for plan in (kept, streamed):
        note = next(n for n in plan.notes if n.startswith("weight copies:"))
        assert "estimated wait" in note and "op calls on the compute thread" in note
    # Kept on the device, nothing is copied after the first step; streamed, each pass waits at
    # least for its first copy (8 ms each).
    held, est = step_estimate(kept), step_estimate(streamed)
    assert held is not None and held.exposed_ms == 0.0
    assert est is not None and est.exposed_ms > 2 * 8.0
    # Each streamed use is a copy whose op calls cost the plan's copy_overhead_ms.
    uses = sum(w.forward_uses + w.backward_uses for w in streamed.weights if w.decision == "stream")
    per_copy = streamed.assumptions["copy_overhead_ms"]["value"]
    assert per_copy > 0 and est.copies == uses > 0
    assert est.host_ms == pytest.approx(uses * per_copy) and held.host_ms == 0.0
