"""device_budget trades saved activations for resident weights where the weights' copies
cannot hide behind the forward (fxckpt.passes.device_fit), and the estimate it trades on."""

from __future__ import annotations

import re

import pytest
import torch
from test_weights import Blocks, _assert_matches_eager, _fresh  # noqa: F401  (the fixture)

import fxckpt
from fxckpt.passes.device_fit import added_ms
from fxckpt.planning.plan import PlannedWeight
from fxckpt.planning.weights import exposed_copy_ms


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


def _plan_under(link: str | None, budget: int) -> fxckpt.Plan:
    torch._dynamo.reset()
    fxckpt.reset_stats()
    torch.manual_seed(0)
    options = {"compiler": "eager", "device_budget": budget}
    with fxckpt.emulate_link(link):
        _assert_matches_eager(Blocks(depth=4), options, x_rows=512)
    (plan,) = fxckpt.last_plans()
    return plan


WEIGHT = 64 * 64 * 4


def test_a_copy_bound_forward_trades_saved_activations_for_resident_weights() -> None:
    # Through a 2 MB/s link a 16 KiB weight takes 8 ms to copy, against well under a
    # millisecond of the block's compute: the forward waits for nearly every copy. The
    # budget holds every saved activation (planned first) and about two weights beside the
    # three copies in flight; held lower, the activations leave room for more weights.
    plain = _plan_under(None, 10**9)
    budget = plain.resident_peak_bytes + 5 * WEIGHT
    plan = _plan_under("2MB/s", budget)
    note = next((n for n in plan.notes if n.startswith("device_budget: the saved activations held to")), None)
    assert note is not None, plan.notes
    first = float(re.search(r"planned first: ([\d.]+) ms added", note).group(1))  # type: ignore[union-attr]
    chosen = added_ms(plan)
    assert chosen is not None and chosen < first
    assert plan.resident_peak_bytes < plain.resident_peak_bytes
    assert plan.resident_weight_bytes > 2 * WEIGHT
    assert any(n.startswith("weight copies:") and "estimated wait" in n for n in plan.notes)


def test_copies_that_hide_leave_the_activations_planned_first() -> None:
    plain = _plan_under(None, 10**9)
    plan = _plan_under("100GB/s", plain.resident_peak_bytes + 5 * WEIGHT)
    assert not any(n.startswith("device_budget: the saved activations held to") for n in plan.notes)
    assert plan.resident_peak_bytes == plain.resident_peak_bytes
