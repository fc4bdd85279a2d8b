"""The memory simulator on hand-built timelines, and whole-graph liveness on a traced graph."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxckpt.graph.liveness import live_bytes_timeline, peak_live_bytes
from fxckpt.planning.memory import (
    OFFLOAD_PRICE_MS_PER_BYTE,
    Candidates,
    Problem,
    Timeline,
    simulate,
)


def two_tensors(bandwidth: float = 100.0, produced_b: int = 1) -> Problem:
    """F=3, T=6, 1 ms per node (S = 0..6), 10 fixed bytes everywhere.

    A: 100 B, produced 0, last fw use 1, bw uses 4..5, recompute 2 ms.
    B:  50 B, produced ``produced_b``, last fw use 1, bw use 3, recompute 1 ms.
    """
    return Problem(
        Timeline([1.0] * 6, 3, bandwidth, [10] * 6),
        Candidates(
            bytes=[100, 50], produced=[0, produced_b], last_fw_use=[1, 1], first_bw_use=[4, 3],
            last_bw_use=[5, 3], recompute_ms=[2.0, 1.0], can_offload=[True, True],
        ),
    )


def test_keep_and_recompute_residency():
    pb = two_tensors()
    # Both count from the end of their last forward use (position 1) on: before that the
    # forward needs them whatever the plan says.
    keep = simulate(pb, ["keep", "keep"])
    assert keep.resident == [10, 10, 160, 160, 110, 110]
    assert (keep.peak, keep.peak_at, keep.cost_ms) == (160, 2, 0.0)
    rec = simulate(pb, ["recompute", "keep"])  # A lives only over its backward uses [4, 5]
    assert rec.resident == [10, 10, 60, 60, 110, 110]
    assert (rec.peak, rec.peak_at, rec.cost_ms) == (110, 4, 2.0)
    both = simulate(pb, ["recompute", "recompute"])
    assert both.resident == [10, 10, 10, 60, 110, 110]
    assert both.cost_ms == 3.0


def test_offload_auto_hides_behind_compute():
    # A's copies take 1 ms. D2H runs 1..2 (done at position 1); the prefetch must start at 3,
    # which is position 3, the first backward node. Both hide, so only the price is paid.
    sim = simulate(two_tensors(), ["offload", "keep"], prefetch="auto")
    assert (sim.d2h_done[0], sim.prefetch_issue[0]) == (1, 3)
    assert sim.resident == [10, 10, 60, 160, 110, 110]
    assert sim.exposed_ms == [0.0, 0.0]
    assert sim.cost_ms == pytest.approx(100 * OFFLOAD_PRICE_MS_PER_BYTE)
    assert sim.hide_ms[0] == 2.0 + 1.0  # forward after production + backward before first use
    assert (sim.d2h_done[1], sim.prefetch_issue[1]) == (-1, -1)


def test_offload_jit_prefetches_at_first_use_and_pays_the_copy():
    sim = simulate(two_tensors(), ["offload", "keep"], prefetch="jit")
    assert sim.prefetch_issue[0] == 4
    assert sim.resident == [10, 10, 60, 60, 110, 110]
    assert sim.exposed_ms[0] == 1.0
    assert sim.cost_ms == pytest.approx(1.0 + 100 * OFFLOAD_PRICE_MS_PER_BYTE)


def test_slow_copies_are_exposed_and_keep_the_tensor_resident():
    # 4 ms copies: D2H 1..5 runs 2 ms past the forward's end (S[F]=3); the prefetch would have
    # to start at 0, 3 ms before the backward starts.
    sim = simulate(two_tensors(bandwidth=25.0), ["offload", "keep"])
    assert (sim.d2h_done[0], sim.prefetch_issue[0]) == (2, 3)
    assert sim.exposed_ms[0] == pytest.approx(2.0 + 3.0)
    assert sim.resident == simulate(two_tensors(bandwidth=25.0), ["keep", "keep"]).resident


def test_d2h_is_one_fifo_channel():
    # B alone copies 1..1.5 and is freed after position 1. Behind A (1..2) it copies 2..2.5 and
    # stays resident through position 2.
    pb = two_tensors(produced_b=0)
    alone = simulate(pb, ["keep", "offload"])
    queued = simulate(pb, ["offload", "offload"])
    assert alone.d2h_done[1] == 1 and queued.d2h_done[1] == 2
    assert alone.resident[2] == 10 + 100
    assert queued.resident[2] == 10 + 50
    # H2D is FIFO too: B's prefetch (needed at 3) would start at 2.5, before the backward;
    # it is issued at F and 0.5 ms of it is exposed.
    assert queued.prefetch_issue == [3, 3]
    assert queued.exposed_ms[1] == pytest.approx(0.5)


def test_a_copy_that_outlives_the_forward_use_keeps_the_tensor_resident():
    # 2 ms copies: A's D2H runs 1..3, past its last forward use (position 1), so A stays
    # resident through position 2, where the copy ends.
    sim = simulate(two_tensors(bandwidth=50.0), ["offload", "keep"])
    assert sim.d2h_done[0] == 2
    assert sim.resident[:3] == [10, 10, 10 + 100 + 50]


def test_copy_overhead_is_paid_per_offload_and_never_hidden():
    pb = two_tensors()
    priced = Problem(dataclasses.replace(pb.timeline, copy_overhead_ms=0.25), pb.candidates)
    one = simulate(priced, ["offload", "keep"])
    two = simulate(priced, ["offload", "offload"])
    assert one.cost_ms == pytest.approx(0.25 + 100 * OFFLOAD_PRICE_MS_PER_BYTE)
    # Two offloads pay it twice on top of whatever their queued copies expose.
    assert two.cost_ms - simulate(pb, ["offload", "offload"]).cost_ms == pytest.approx(0.5)
    assert one.resident == simulate(pb, ["offload", "keep"]).resident
    with pytest.raises(ValueError, match="copy_overhead_ms"):
        Problem(dataclasses.replace(pb.timeline, copy_overhead_ms=-1.0), pb.candidates)


def test_zero_length_nodes_and_infinite_bandwidth():
    pb = Problem(
        Timeline([0.0, 1.0, 0.0, 0.0, 1.0], 2, math.inf),
        Candidates([8], [0], [0], [3], [4], [math.inf], [True]),
    )
    sim = simulate(pb, ["offload"])
    assert (sim.d2h_done[0], sim.prefetch_issue[0]) == (0, 3)
    assert sim.resident == [0, 0, 0, 8, 8]
    assert sim.exposed_ms == [0.0]


def test_problem_validation():
    with pytest.raises(ValueError, match="first_bw_use"):
        Problem(Timeline([1.0] * 4, 2), Candidates([1], [0], [0], [1], [3], [1.0], [True]))
    with pytest.raises(ValueError, match="forced to recompute"):
        Problem(Timeline([1.0] * 4, 2),
                Candidates([1], [0], [0], [2], [3], [math.inf], [True], ["recompute"]))
    with pytest.raises(ValueError, match="choices"):
        simulate(two_tensors(), ["keep"])


def test_live_bytes_timeline_of_a_traced_graph():
    def f(x, w):
        z = (x @ w).relu()
        return z.view(-1).sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(64, 128), torch.randn(128, 32))
    ops = [n.op if n.op != "call_function" else str(n.target) for n in gm.graph.nodes]
    assert ops == ["placeholder", "placeholder", "aten.mm.default", "aten.relu.default",
                   "aten.view.default", "aten.sum.default", "output"]
    x, w, mm, relu, total = 64 * 128 * 4, 128 * 32 * 4, 64 * 32 * 4, 64 * 32 * 4, 4
    # x and w die at mm; mm dies at relu; relu's storage lives on through its view until sum.
    assert live_bytes_timeline(gm) == [
        x, x + w, x + w + mm, mm + relu, relu, relu + total, total,
    ]
    assert peak_live_bytes(gm) == x + w + mm
