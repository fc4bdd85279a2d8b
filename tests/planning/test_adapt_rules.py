"""The re-planning trigger on recorded timings: pure and deterministic (no run, no clock)."""

from __future__ import annotations

import pytest

from fxckpt.planning.adapt import (
    DEFAULT_POLICY,
    PROBE_MAX_BYTES,
    PROBE_MAX_SECONDS,
    PROBE_MIN_BYTES,
    Policy,
    StepSample,
    judge,
    probe_bytes,
)

MB = 1e6
POLICY = Policy(warmup_steps=2, window_steps=5)  # the default, spelled out


def steps(n: int, *, step: float = 0.100, stall: float = 0.0, copy: float = 0.020,
          nbytes: int = 2_000_000) -> list[StepSample]:
    return [StepSample(step, stall, copy, nbytes) for _ in range(n)]


WARM = steps(2, step=5.0, stall=2.0, copy=2.0)  # a first step that compiles and stalls


def test_the_default_policy_is_the_documented_one() -> None:
    assert DEFAULT_POLICY == POLICY
    p = DEFAULT_POLICY
    assert (p.stall_fraction, p.bandwidth_factor, p.max_replans) == (0.02, 1.5, 2)
    assert (p.stall_floor_s, p.copy_floor_s) == (0.005, 0.005)


def test_nothing_is_judged_before_the_warm_up_and_the_window() -> None:
    assert judge(WARM + steps(4), 100 * MB, recomputes=False, policy=POLICY) is None
    assert judge(WARM + steps(5), 100 * MB, recomputes=False, policy=POLICY) is not None


def test_the_warm_up_is_not_judged() -> None:
    v = judge(WARM + steps(5), 100 * MB, recomputes=False, policy=POLICY)
    assert v is not None and not v.replan and v.stall_seconds == 0.0


def test_a_stalling_plan_on_a_slower_link_replans_with_the_measured_bandwidth() -> None:
    # 2 MB in 20 ms: 100 MB/s measured against 400 MB/s assumed; 10 ms stall of a 100 ms step
    v = judge(WARM + steps(5, stall=0.010), 400 * MB, recomputes=False, policy=POLICY)
    assert v is not None and v.replan
    assert v.planning_bandwidth == pytest.approx(100 * MB)
    assert v.measured_bandwidth == pytest.approx(100 * MB)
    assert "stall" in v.reason and "100 MB/s" in v.describe()


def test_a_stall_below_the_share_of_the_step_does_not_replan() -> None:
    # 10 ms of a 1 s step is 1 %: under the 2 % threshold
    v = judge(WARM + steps(5, step=1.0, stall=0.010), 400 * MB, recomputes=False, policy=POLICY)
    assert v is not None and not v.replan


def test_a_stall_below_the_absolute_floor_does_not_replan() -> None:
    # 4 ms of a 20 ms step is 20 %, but under the 5 ms floor
    v = judge(WARM + steps(5, step=0.020, stall=0.004), 400 * MB, recomputes=False, policy=POLICY)
    assert v is not None and not v.replan


def test_a_stall_counts_against_the_link_only_up_to_the_copies_own_time() -> None:
    # 50 ms waits on copies that took 0.1 ms: a thread that missed its turn, not a link
    v = judge(WARM + steps(5, stall=0.050, copy=0.0001, nbytes=400_000), 4000 * MB,
              recomputes=False, policy=POLICY)
    assert v is not None and not v.replan
    assert v.stall_seconds == pytest.approx(0.0001)


def test_the_median_ignores_two_noisy_steps_of_five() -> None:
    noisy = steps(2, stall=0.020) + steps(3, stall=0.0)
    v = judge(WARM + noisy, 400 * MB, recomputes=False, policy=POLICY)
    assert v is not None and not v.replan
    v = judge(WARM + steps(3, stall=0.020) + steps(2), 400 * MB, recomputes=False, policy=POLICY)
    assert v is not None and v.replan


def test_a_stall_with_the_link_as_assumed_replans_with_the_bandwidth_compute_saw() -> None:
    # 2 MB in 20 ms is the assumed 100 MB/s, yet 10 ms stall per step: the window is short
    v = judge(WARM + steps(5, stall=0.010), 100 * MB, recomputes=False, policy=POLICY)
    assert v is not None and v.replan
    assert v.planning_bandwidth == pytest.approx(2_000_000 / 0.030)  # bytes / (copy + stall)
    assert "window" in v.reason


def test_a_faster_link_replans_a_plan_that_recomputes() -> None:
    # 2 MB in 20 ms = 100 MB/s against 25 MB/s assumed, no stall
    v = judge(WARM + steps(5), 25 * MB, recomputes=True, policy=POLICY)
    assert v is not None and v.replan and v.planning_bandwidth == pytest.approx(100 * MB)
    assert "faster" in v.reason


def test_a_faster_link_leaves_a_plan_that_recomputes_nothing_alone() -> None:
    v = judge(WARM + steps(5), 25 * MB, recomputes=False, policy=POLICY)
    assert v is not None and not v.replan


def test_a_faster_link_whose_copies_are_a_few_small_memcpys_is_not_judged() -> None:
    # 40 KB in 0.1 ms per step: 400 MB/s, 16x the assumed, but under the 5 ms copy floor
    v = judge(WARM + steps(5, copy=0.0001, nbytes=40_000), 25 * MB, recomputes=True,
              policy=POLICY)
    assert v is not None and not v.replan


def test_within_the_factor_nothing_replans() -> None:
    v = judge(WARM + steps(5), 70 * MB, recomputes=True, policy=POLICY)  # measured 1.43x
    assert v is not None and not v.replan


def test_a_slower_link_whose_copies_still_hide_is_left_alone() -> None:
    v = judge(WARM + steps(5), 1000 * MB, recomputes=True, policy=POLICY)  # 10x slower, no stall
    assert v is not None and not v.replan


def test_no_copies_no_verdict_to_replan() -> None:
    v = judge(WARM + steps(5, copy=0.0, nbytes=0), 100 * MB, recomputes=True, policy=POLICY)
    assert v is not None and not v.replan and v.measured_bandwidth is None


def test_a_plan_whose_copies_are_too_few_to_measure_the_link_asks_for_a_probe() -> None:
    v = judge(WARM + steps(5, copy=0.0, nbytes=0), 25 * MB, recomputes=True, policy=POLICY)
    assert v is not None and not v.replan and v.wants_probe
    # nothing recomputed: offloading more could replace nothing, no probe
    v = judge(WARM + steps(5, copy=0.0, nbytes=0), 25 * MB, recomputes=False, policy=POLICY)
    assert v is not None and not v.replan and not v.wants_probe
    # copies that measure the link need no probe
    v = judge(WARM + steps(5), 100 * MB, recomputes=True, policy=POLICY)
    assert v is not None and not v.wants_probe


def test_a_probe_over_the_factor_replans_with_the_probed_bandwidth() -> None:
    # the plan assumed 25 MB/s and offloads nothing; a probe measured 100 MB/s (4x)
    v = judge(WARM + steps(5, copy=0.0, nbytes=0), 25 * MB, recomputes=True,
              probed_bandwidth=100 * MB, policy=POLICY)
    assert v is not None and v.replan and not v.wants_probe
    assert v.planning_bandwidth == pytest.approx(100 * MB)
    assert "probe" in v.reason and "probed 100 MB/s" in v.describe()


def test_a_probe_within_the_factor_or_slower_leaves_the_plan_alone() -> None:
    for probed in (35 * MB, 25 * MB, 5 * MB):  # 1.4x, as assumed, 5x slower
        v = judge(WARM + steps(5, copy=0.0, nbytes=0), 25 * MB, recomputes=True,
                  probed_bandwidth=probed, policy=POLICY)
        assert v is not None and not v.replan and not v.wants_probe, probed


def test_a_probe_does_not_override_copies_that_measure_the_link() -> None:
    # 2 MB in 20 ms measure 100 MB/s, the assumed figure: a stale fast probe changes nothing
    v = judge(WARM + steps(5), 100 * MB, recomputes=True, probed_bandwidth=1000 * MB,
              policy=POLICY)
    assert v is not None and not v.replan


def test_a_probe_of_small_copies_replans_a_plan_that_recomputes() -> None:
    # copies under the 5 ms floor do not measure the link; the probe does
    v = judge(WARM + steps(5, copy=0.0001, nbytes=40_000), 25 * MB, recomputes=True,
              probed_bandwidth=400 * MB, policy=POLICY)
    assert v is not None and v.replan and v.planning_bandwidth == pytest.approx(400 * MB)


def test_the_probe_moves_what_the_plan_recomputes_capped() -> None:
    assert probe_bytes(1 << 20, 100 * MB) == 1 << 20
    assert probe_bytes(64 << 20, 100 * MB) == PROBE_MAX_BYTES  # 4 MiB under 0.1 s at 100 MB/s
    assert probe_bytes(64 << 20, 10 * MB) == int(10 * MB * PROBE_MAX_SECONDS)  # 0.1 s of copy
    assert probe_bytes(0, 100 * MB) == PROBE_MIN_BYTES
