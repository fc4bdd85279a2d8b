"""Runtime counters and the plan registry."""

from __future__ import annotations

import pytest
import torch

from fxckpt.runtime import engine, pool, stats

OPS = torch.ops.fxckpt


@pytest.fixture(autouse=True)
def _clean_runtime():
    engine.configure(copy_streams=1)
    pool.set_pool_cap(None)
    stats.reset()
    yield
    engine.configure(copy_streams=1)
    pool.set_pool_cap(None)


def _round_trip(src: torch.Tensor) -> None:
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    OPS.prefetch(h)
    assert torch.equal(OPS.wait(h, h, src.shape, src.stride(), src.dtype, src.device), src)


def test_offloaded_bytes_equal_prefetched_bytes_and_count_spans():
    base = torch.randn(10, 8)
    srcs = [base, base[3:, 1:5], base.t(), base.to(torch.bfloat16)]
    for s in srcs:
        _round_trip(s)
    snap = stats.snapshot()
    # base[3:, 1:5] reaches from element 25 to element 76 of base: a 52-element span.
    assert snap["offloaded_bytes"] == 320 + 52 * 4 + 320 + 160
    assert snap["prefetched_bytes"] == snap["offloaded_bytes"]
    assert snap["offload_calls"] == 4
    assert snap["fallbacks"] == 0


def test_stall_seconds_count_time_blocked_on_copies():
    engine.configure(copy_delay_s=0.05)
    _round_trip(torch.randn(100))
    assert stats.snapshot()["stall_seconds"] >= 0.08  # one blocked offload_done and one wait


def test_copy_seconds_count_the_workers_copy_time_and_reset_zeroes_them():
    engine.configure(copy_delay_s=0.05)
    _round_trip(torch.randn(100))
    assert stats.snapshot()["copy_seconds"] >= 0.1  # both copies, each delayed 0.05 s
    stats.reset()
    assert stats.snapshot()["copy_seconds"] == 0.0


def test_reset_zeroes_counters_and_rebases_the_high_water_mark():
    _round_trip(torch.randn(1 << 16))
    before = stats.snapshot()
    assert before["offload_calls"] == 1 and before["pool_bytes"] > 0
    stats.add_plan_payload('{"plan": 1}')
    stats.reset()
    after = stats.snapshot()
    for name in ("offloaded_bytes", "prefetched_bytes", "offload_calls", "fallbacks"):
        assert after[name] == 0, name
    assert after["stall_seconds"] == 0.0
    assert after["pool_bytes"] == before["pool_bytes"]  # memory still held
    assert after["pool_high_water_bytes"] == after["pool_bytes"]
    assert stats.plan_payloads() == []


def test_high_water_tracks_the_peak():
    p = pool.HostPool(pinned=False)
    start = stats.snapshot()["pool_bytes"]
    bufs = [p.acquire(200_000) for _ in range(3)]
    for b in bufs:
        p.release(b)
    p.trim()
    snap = stats.snapshot()
    assert snap["pool_bytes"] == start
    assert snap["pool_high_water_bytes"] >= start + 3 * pool.size_class(200_000)


def test_snapshot_has_every_documented_figure():
    assert set(stats.snapshot()) == {
        "offloaded_bytes",
        "prefetched_bytes",
        "stall_seconds",
        "copy_seconds",
        "offload_calls",
        "fallbacks",
        "resident_saved_bytes",
        "pool_bytes",
        "pinned_bytes",
        "pool_high_water_bytes",
        "pool_hits",
        "pool_misses",
        "host_allocations",
        "host_high_water_bytes",
        "disk_bytes",
        "disk_write_seconds",
        "disk_read_seconds",
        "disk_fallbacks",
        "disk_files",
    }


def test_note_saved_counts_each_storage_once():
    base = torch.randn(16, 16)
    other = torch.randn(7, dtype=torch.bfloat16)
    OPS.note_saved([base, base[2:], base.t(), other, other[1:]], "")
    assert stats.snapshot()["resident_saved_bytes"] == base.nbytes + other.nbytes
    OPS.note_saved([], "")
    assert stats.snapshot()["resident_saved_bytes"] == 0


def test_plan_payloads_are_ordered_and_deduplicated_by_value():
    OPS.note_saved([torch.ones(2)], '{"graph": "b"}')
    OPS.note_saved([torch.ones(2)], '{"graph": "a"}')
    OPS.note_saved([torch.ones(2)], "".join(['{"graph": ', '"b"}']))  # equal, not identical
    OPS.note_saved([torch.ones(2)], "")
    stats.add_plan_payload('{"graph": "a"}')
    assert stats.plan_payloads() == ['{"graph": "b"}', '{"graph": "a"}']
