"""Copy buckets in the simulator: one copy, one overhead and one join per bucket, members held
until the bucket's join, and the solver's incremental twin in step with it."""

from __future__ import annotations

import math
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxckpt.planning.incremental import IncrementalSim
from fxckpt.planning.memory import (
    OFFLOAD_PRICE_MS_PER_BYTE,
    Candidates,
    Problem,
    Timeline,
    simulate,
)


def block(bucket: list[int] | None, overhead: float = 0.5, bandwidth: float = 100.0) -> Problem:
    """F=4, T=8, 1 ms per node (S = 0..8). Three tensors of one block:

    A: 100 B, produced 0, last fw use 1, bw uses 6..7.
    B: 100 B, produced 1, last fw use 1, bw use 5.
    C: 100 B, produced 2, last fw use 2, bw uses 4..7.
    """
    return Problem(
        Timeline([1.0] * 8, 4, bandwidth, None, overhead),
        Candidates(
            bytes=[100, 100, 100], produced=[0, 1, 2], last_fw_use=[1, 1, 2],
            first_bw_use=[6, 5, 4], last_bw_use=[7, 5, 7], recompute_ms=[math.inf] * 3,
            can_offload=[True] * 3, bucket=bucket,
        ),
    )


def test_a_bucket_pays_one_overhead_and_copies_once_its_last_member_exists():
    alone = simulate(block(None), ["offload"] * 3)
    together = simulate(block([0, 0, 0]), ["offload"] * 3)
    price = 300 * OFFLOAD_PRICE_MS_PER_BYTE
    # Alone: three overheads; only C's copy back (1 ms, needed at S=4) is exposed.
    assert alone.cost_ms == pytest.approx(3 * 0.5 + 1.0 + price)
    # One copy of 3 ms, from the end of C's producer (S=3) to S=6: 2 ms past the forward's
    # end (S=4). Back: it must land by S=4 (C's first use), so it cannot start before the
    # backward: 3 ms exposed. One overhead.
    assert together.cost_ms == pytest.approx(0.5 + 2.0 + 3.0 + price)
    # Each member is held from its last forward use to the join (clamped to the forward's
    # last position), and back from the bucket's issue position to its own last use.
    assert together.d2h_done == [3, 3, 3]
    assert together.prefetch_issue == [4, 4, 4]
    assert together.resident == [0, 0, 200, 300, 300, 300, 200, 200]
    # Alone, A's copy (1 ms from S=1) ends at S=2, B's at S=3, C's at S=4.
    assert alone.d2h_done == [1, 2, 3]
    assert alone.resident[2] == 100


def test_bucket_timing_does_not_depend_on_which_members_are_offloaded():
    # A alone in the bucket still waits for C's production and joins at the bucket's last
    # forward use: the runtime places the bucket's ops at fixed positions.
    sim = simulate(block([0, 0, 0]), ["offload", "keep", "keep"])
    assert sim.d2h_done[0] == 3  # copy S=3..4, ends in position 3
    assert sim.prefetch_issue[0] == 4  # need: C's first use, 4, whatever C's choice
    assert sim.cost_ms == pytest.approx(0.5 + 1.0 + 100 * OFFLOAD_PRICE_MS_PER_BYTE)


def test_the_per_candidate_fixed_cost_is_a_lower_bound_that_adds_up_to_the_bucket():
    pb = block([0, 0, 1])
    assert pb.offload_fixed_ms(0) == pytest.approx(0.25 + 100 * OFFLOAD_PRICE_MS_PER_BYTE)
    assert pb.offload_fixed_ms(2) == pytest.approx(0.5 + 100 * OFFLOAD_PRICE_MS_PER_BYTE)
    assert pb.offload_fixed_total([0, 1]) == pytest.approx(pb.offload_fixed_ms(0) * 2)
    assert pb.offload_fixed_total([0]) > pb.offload_fixed_ms(0)


# --------------------------------------------------------------------------------------------
# The incremental twin: every change of one candidate, against a fresh simulation.
# --------------------------------------------------------------------------------------------

PROPS = settings(max_examples=int(os.environ.get("FXCKPT_EXAMPLES", "250")), deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


@st.composite
def bucketed(draw) -> tuple[Problem, int]:
    F = draw(st.integers(1, 8))
    T = F + draw(st.integers(1, 8))
    n = draw(st.integers(1, 10))
    rng = random.Random(draw(st.integers(0, 2**32)))
    cols: list[list] = [[] for _ in range(7)]
    for _ in range(n):
        p = rng.randrange(F)
        fb = rng.randint(F, T - 1)
        row = (rng.choice([0, 50, 100, 300]), p, rng.randint(p, F - 1), fb, rng.randint(fb, T - 1),
               rng.choice([math.inf, 0.5, 2.0]), True)
        for col, v in zip(cols, row, strict=True):
            col.append(v)
    step = [rng.choice([0.0, 0.5, 1.0, 3.0]) for _ in range(T)]
    bw = draw(st.sampled_from([25.0, 100.0, 400.0]))
    buckets = [rng.randrange(3) for _ in range(n)]
    pb = Problem(Timeline(step, F, bw, None, draw(st.sampled_from([0.0, 0.3])),
                          draw(st.sampled_from([0.0, 0.0, 0.7, 2.5]))),
                 Candidates(*cols, bucket=buckets))
    return pb, draw(st.integers(0, 2**32))


@PROPS
@given(bucketed(), st.sampled_from(["auto", "jit"]))
def test_the_incremental_twin_follows_any_sequence_of_changes(case, prefetch):
    pb, seed = case
    rng = random.Random(seed)
    n = len(pb)
    mode = ["keep"] * n
    tr = IncrementalSim(pb, prefetch, list(mode))
    for _ in range(3 * n):
        i = rng.randrange(n)
        if mode[i] == "recompute":
            continue
        if mode[i] == "keep" and rng.random() < 0.7:
            want = simulate(pb, [*mode[:i], "offload", *mode[i + 1:]], prefetch=prefetch)
            assert tr.delta_offload(i, True) == pytest.approx(want.cost_ms - tr.cost, abs=1e-9)
            _, joined, _, issue = tr.own(i)
            tr.set_offload(i)
            mode[i] = "offload"
            assert (joined, issue) == (want.d2h_done[i], want.prefetch_issue[i])
        elif math.isfinite(pb.candidates.recompute_ms[i]):
            if mode[i] == "offload":
                want = simulate(pb, [*mode[:i], "keep", *mode[i + 1:]], prefetch=prefetch)
                assert tr.delta_offload(i, False) == pytest.approx(want.cost_ms - tr.cost, abs=1e-9)
            tr.set_recompute(i)
            mode[i] = "recompute"
        sim = simulate(pb, mode, prefetch=prefetch)
        assert tr.peak == sim.peak
        assert tr.cost == pytest.approx(sim.cost_ms, abs=1e-9)
        for t, r in enumerate(sim.resident):
            assert _resident_at(tr, t) == r, (t, mode)


def _resident_at(tr: IncrementalSim, t: int) -> int:
    """The twin's resident bytes at position ``t`` (its range-add tree, read at one leaf)."""
    k = t + tr.tree.n
    total = tr.tree.mx[k]
    k >>= 1
    while k:
        total += tr.tree.ad[k]
        k >>= 1
    return total
