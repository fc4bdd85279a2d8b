"""The host pool: size classes, steady-state reuse, the cap and its fallback, no leaks."""

from __future__ import annotations

import gc
import random
import threading
import time
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fxckpt.runtime import engine, ops, pool, stats
from fxckpt.runtime.pool import HostMemoryWarning, HostPool, PoolExhausted, size_class

OPS = torch.ops.fxckpt


@pytest.fixture(autouse=True)
def _clean_runtime():
    engine.configure()
    pool.set_pool_cap(None)
    stats.reset()
    yield
    engine.configure()
    pool.set_pool_cap(None)


def _round_trip(src: torch.Tensor) -> torch.Tensor:
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    OPS.prefetch(h)
    return OPS.wait(h, h, src.shape, src.stride(), src.dtype, src.device)


@given(st.integers(min_value=0, max_value=1 << 40))
def test_size_class_bounds_waste(nbytes):
    cls = size_class(nbytes)
    assert cls >= nbytes
    assert cls <= max(pool.MIN_CLASS_BYTES, nbytes + nbytes // 4)
    assert size_class(cls) == cls


def test_size_classes_are_four_per_octave():
    assert [size_class(n) for n in (1, 4096, 4097, 5121, 8192, 8193)] == [
        4096,
        4096,
        5120,
        6144,
        8192,
        10240,
    ]
    octave = {size_class(n) for n in range((1 << 20) + 1, (1 << 21) + 1, 997)}
    assert len(octave) == 4


def test_varying_lengths_share_at_most_two_classes():
    rng = random.Random(0)
    sizes = [rng.randint(900_000, 1 << 20) for _ in range(50)]
    assert len({size_class(n) for n in sizes}) <= 2


def test_pending_buffer_is_reused_only_after_its_copy_completes():
    p = HostPool(pinned=False)
    buf = p.acquire(10_000)
    done = threading.Event()
    p.release(buf, (done.is_set,))
    other = p.acquire(10_000)
    assert other.data_ptr() != buf.data_ptr()
    assert p.usage()["pending_bytes"] == buf.numel()
    done.set()
    assert p.acquire(10_000).data_ptr() == buf.data_ptr()


def test_pending_check_does_not_stop_at_the_first_unfinished_entry():
    p = HostPool(pinned=False)
    slow, fast = p.acquire(5000), p.acquire(5000)
    p.release(slow, (lambda: False,))
    p.release(fast, (lambda: True,))
    assert p.acquire(5000).data_ptr() == fast.data_ptr()


def test_cap_evicts_idle_buffers_of_other_classes_before_giving_up():
    p = HostPool(pinned=False, max_bytes=3 * 8192)
    a, b = p.acquire(8000), p.acquire(8000)
    p.release(a)
    p.release(b)
    c = p.acquire(20_000)  # class 20480: fits only once both idle 8 KiB buffers go
    assert p.bytes == c.numel() == 20480
    with pytest.raises(PoolExhausted, match="cap of 24576 bytes"):
        p.acquire(8000)


def test_lowering_the_cap_frees_idle_buffers_and_a_dead_pool_leaves_the_stats():
    p = HostPool(pinned=False)
    bufs = [p.acquire(100_000) for _ in range(4)]
    assert stats.snapshot()["pool_bytes"] >= 4 * size_class(100_000)
    for b in bufs:
        p.release(b)
    del b, bufs
    p.set_cap(size_class(100_000))
    assert p.bytes == size_class(100_000)
    before = stats.snapshot()["pool_bytes"]
    del p
    gc.collect()
    assert stats.snapshot()["pool_bytes"] == before - size_class(100_000)


@pytest.mark.parametrize("pinned", [False, True])
def test_a_buffer_returned_after_the_cap_was_lowered_is_not_handed_out_over_it(pinned):
    # In use while the cap drops to 0, then released: the next acquire must not reuse it
    # (the pool would hold more than its cap), it falls back like any other over the cap.
    if pinned and not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA")
    p = HostPool(pinned=pinned)
    buf = p.acquire(2000)
    p.set_cap(0)
    p.release(buf)
    del buf
    with pytest.raises(PoolExhausted, match="cap of 0 bytes"):
        p.acquire(2000)
    assert p.bytes == 0


def test_steady_state_makes_no_host_allocation():
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(200):
        rows = rng.randint(700, 1000)  # 700..1000 KiB per tensor: three size classes
        live = []
        for _ in range(3):
            src = torch.randn(rows, 256, generator=gen)
            h = OPS.offload(src)
            OPS.offload_done(h, src)
            live.append((h, src))
        for h, src in reversed(live):
            OPS.prefetch(h)
            assert torch.equal(OPS.wait(h, h, src.shape, src.stride(), src.dtype, src.device), src)
        del live, h
        snap = stats.snapshot()
        samples.append((snap["pool_bytes"], snap["host_allocations"]))
    warm = samples[50]
    assert samples[-1] == warm, "the pool grew after warm-up"
    # 3 live tensors a step, 3 size classes; torch 2.11 frees handles a step later, hence 12.
    assert warm[0] <= 12 * size_class(1000 * 1024)
    assert stats.snapshot()["pool_hits"] >= 150 * 3


def test_cap_falls_back_to_the_device_with_exactly_one_warning():
    gc.collect()
    cap = pool.get_pool("cpu").usage()["in_use_bytes"] + 2 * size_class(64 * 1024)
    pool.set_pool_cap(cap)
    srcs = [torch.randn(128, 128)[:, 1:] for _ in range(5)]  # 64 KiB spans, one class
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handles = [OPS.offload(s) for s in srcs]
    ours = [w for w in caught if issubclass(w.category, HostMemoryWarning)]
    assert len(ours) == 1
    assert "host_budget" in str(ours[0].message)
    assert "stays on the device" in str(ours[0].message)
    assert stats.snapshot()["fallbacks"] == 3
    assert pool.get_pool("cpu").bytes <= cap
    for h, s in zip(handles, srcs, strict=True):
        assert torch.equal(OPS.wait(h, h, s.shape, s.stride(), s.dtype, s.device), s)
        assert torch.equal(OPS.wait(h, h, s.shape, s.stride(), s.dtype, s.device), s)


def test_handle_dropped_before_prefetch_returns_its_buffer():
    p = pool.get_pool("cpu")
    gc.collect()
    before = p.usage()
    src = torch.randn(50_000)
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    assert p.usage()["in_use_bytes"] == before["in_use_bytes"] + size_class(src.nbytes)
    del h  # the forward raised before any backward: autograd drops the saved handle
    after = p.usage()
    assert after["in_use_bytes"] == before["in_use_bytes"]
    assert after["bytes"] == after["free_bytes"] + after["pending_bytes"] + after["in_use_bytes"]


def test_handle_dropped_mid_prefetch_is_held_until_the_copy_lands():
    engine.configure(copy_delay_s=0.3)
    p = pool.get_pool("cpu")
    src = torch.randn(70_000)
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    OPS.prefetch(h)
    del h
    assert p.usage()["pending_bytes"] >= size_class(src.nbytes)
    deadline = time.monotonic() + 10
    while p.usage()["pending_bytes"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.usage()["pending_bytes"] == 0


class _Block(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        h = OPS.offload(y)
        OPS.offload_done(h, y)
        ctx.save_for_backward(h)
        ctx.meta = (y.shape, y.stride(), y.dtype, y.device)
        return y * 2

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        y = OPS.wait(h, h, *ctx.meta)
        return grad * 2 * (1 - y * y)


def test_a_thousand_training_steps_leak_nothing():
    gc.collect()
    base_handles = ops.live_handles()
    x = torch.randn(64, 96, requires_grad=True)
    threads_after_warmup = None
    for step in range(1000):
        loss = _Block.apply(_Block.apply(x)).sum()
        loss.backward()
        if step == 5:
            snap = stats.snapshot()
            warm = (snap["pool_bytes"], snap["host_allocations"])
            threads_after_warmup = threading.active_count()
    snap = stats.snapshot()
    assert ops.live_handles() == base_handles
    assert (snap["pool_bytes"], snap["host_allocations"]) == warm
    assert threading.active_count() == threads_after_warmup
    assert snap["offload_calls"] == 2000
    assert snap["offloaded_bytes"] == snap["prefetched_bytes"]
