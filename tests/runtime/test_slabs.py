"""The pinned pool carves its buffers out of page-locked slabs; the cap bounds locked bytes.

Page-locked bytes are read from the CUDA double (what was registered with the "driver"), not
from the pool's own books.
"""

from __future__ import annotations

import gc

import pytest
from cuda_double import FakeCuda

from fxckpt import _cuda
from fxckpt.runtime import stats
from fxckpt.runtime.pool import HostPool, PoolExhausted, size_class
from fxckpt.runtime.slabs import MIN_SLAB_BYTES

MiB = 2**20


@pytest.fixture
def hw(monkeypatch):
    gc.collect()  # pools of earlier tests give their slabs back first
    double = FakeCuda()
    monkeypatch.setattr(_cuda, "CUDA", double)
    stats.reset()
    return double


def test_many_buffers_share_one_page_locked_slab(hw):
    p = HostPool(pinned=True)
    before = stats.snapshot()["pinned_bytes"]
    sizes = [5000 + 997 * i for i in range(100)]  # 5 KB .. 104 KB, dozens of classes
    bufs = [p.acquire(n) for n in sizes]
    assert all(b.numel() == size_class(n) for b, n in zip(bufs, sizes, strict=True))
    assert hw.lock_calls == 1  # one registration, not one per buffer
    assert hw.locked_bytes() == MIN_SLAB_BYTES == p.bytes
    assert stats.snapshot()["pinned_bytes"] - before == hw.locked_bytes()
    carved = sum(b.numel() for b in bufs)
    assert carved <= 1.25 * sum(sizes)  # torch's power-of-two rounding: up to 2x
    ptrs = sorted((b.data_ptr(), b.numel()) for b in bufs)
    assert all(a + n <= b for (a, n), (b, _) in zip(ptrs, ptrs[1:], strict=False))  # disjoint


def test_a_buffer_larger_than_a_slab_gets_a_slab_of_its_own_size_in_whole_pages(hw):
    p = HostPool(pinned=True)
    big = p.acquire(100 * MiB + 1)
    assert big.numel() == size_class(100 * MiB + 1)
    assert hw.locked_bytes() == -(-big.numel() // 4096) * 4096


def test_the_cap_bounds_page_locked_bytes_and_idle_slabs_are_recarved(hw):
    cap = 3 * MiB + 123
    p = HostPool(pinned=True, max_bytes=cap)
    held = []
    with pytest.raises(PoolExhausted, match="host_budget"):
        while True:
            held.append(p.acquire(300_000))
            assert hw.locked_bytes() <= cap
    assert hw.locked_bytes() <= cap
    locks = hw.lock_calls
    for b in held:
        p.release(b)
    other = [p.acquire(700_000) for _ in range(3)]  # another class: the idle slab is re-carved
    assert hw.lock_calls == locks
    assert len({b.data_ptr() for b in other}) == 3
    assert hw.locked_bytes() <= cap


def test_a_slab_is_unlocked_only_when_every_buffer_in_it_is_idle(hw):
    p = HostPool(pinned=True)
    a, b = p.acquire(10_000), p.acquire(10_000)
    done = [False]
    p.release(a)
    p.release(b, (lambda: done[0],))  # a copy still reads b
    assert p.trim() == 0
    assert hw.locked_bytes() == MIN_SLAB_BYTES
    done[0] = True
    assert p.trim() == MIN_SLAB_BYTES
    assert hw.locked_bytes() == 0
    assert p.usage() == {"bytes": 0, "free_bytes": 0, "pending_bytes": 0, "in_use_bytes": 0}


def test_lowering_the_cap_unlocks_idle_slabs_and_a_dead_pool_unlocks_the_rest(hw):
    p = HostPool(pinned=True)
    big = p.acquire(MIN_SLAB_BYTES)  # fills the first slab
    small = p.acquire(4096)  # a second slab
    assert hw.lock_calls == 2
    p.release(small)
    p.set_cap(MIN_SLAB_BYTES)
    assert hw.locked_bytes() == MIN_SLAB_BYTES  # the busy slab stays
    del big, small
    pinned = stats.snapshot()["pinned_bytes"]
    del p
    gc.collect()
    assert hw.locked_bytes() == 0
    assert stats.snapshot()["pinned_bytes"] == pinned - MIN_SLAB_BYTES


def test_the_unpinned_pool_is_unchanged_one_allocation_per_buffer(hw):
    p = HostPool(pinned=False)
    bufs = [p.acquire(5000 * (i + 1)) for i in range(5)]
    assert hw.lock_calls == 0
    assert p.bytes == sum(b.numel() for b in bufs)
    assert stats.snapshot()["host_allocations"] == 5


def _disk_tier_step(p, sizes, tiers_, slots):
    """One forward's host traffic in production order: host-tier offloads hold their buffer;
    disk-tier ones pass through a staging buffer, ``slots`` at most in flight."""
    from fxckpt.runtime.staging import staged_bytes

    held, flight = [], []
    for n, t in zip(sizes, tiers_, strict=True):
        if t.kind == "host":
            held.append(p.acquire(n))
            continue
        if t.kind != "disk":  # kept on the device: no host memory
            continue
        if len(flight) == slots:
            p.release(flight.pop(0))  # the oldest write ends
        try:
            flight.append(p.acquire_staging(staged_bytes(n), slots))
        except PoolExhausted:
            assert flight, "no staging buffer with none in flight"
            p.release(flight.pop(0))
            flight.append(p.acquire_staging(staged_bytes(n), slots))
    for b in held + flight:
        p.release(b)


@pytest.mark.parametrize("share", [0.5, 0.25, 0.125])
def test_what_the_planner_puts_in_host_memory_fits_the_slabs_under_the_host_budget(hw, share):
    # A decoder's saved tensors, two layers, production order (d=2048, ffn=6144, 1k tokens,
    # fp32: norms, projections, attention, the MLP): many size classes, and staging for the
    # disk tier in every one of them.
    from fxckpt.planning import tiers
    from fxckpt.runtime.staging import STAGING_SLOTS, staged_bytes

    layer = [8 * MiB, 4 * MiB, 8 * MiB, 8 * MiB, 64 * 1024, 8 * MiB, 8 * MiB, 48 * MiB,
             24 * MiB, 24 * MiB, 24 * MiB, 8 * MiB]  # fmt: skip
    sizes = layer + layer + [4096, 8 * MiB]
    items = [tiers.Item(n, size_class(n), size_class(staged_bytes(n)), 10.0, 10.0)
             for n in sizes]  # fmt: skip
    budget = int(share * sum(it.host_bytes for it in items))
    from fxckpt.runtime.slabs import carving_fits, whole_pages

    def fits(classes, staging):  # as planning/host.py asks for a pinned pool
        return carving_fits(classes, budget, whole_pages(staging))

    placed = tiers.assign(items, budget, tiers.DiskRates(1e6, 1e6), allow_recompute=False,
                          staging_slots=STAGING_SLOTS, fits=fits)  # fmt: skip
    assert "disk" in {t.kind for t in placed}
    p = HostPool(pinned=True, max_bytes=budget)
    for _ in range(3):  # the first step lays the slabs out; the next ones reuse them
        _disk_tier_step(p, sizes, placed, STAGING_SLOTS)
        assert hw.locked_bytes() <= budget
