"""The real CUDA engine against a recording double of the hardware: each ordering rule.

``tests/cuda_double.py`` stands in for streams, events, copies and the caching allocator and
reports every pair of conflicting memory accesses that CUDA would not order. Each test plays
a step the way a compiled graph does (producer kernels, ``fxckpt::`` ops, consumer kernels,
the allocator reusing freed blocks) and asserts that no race was recorded. Removing any one
ordering call from ``fxckpt/runtime/cuda_engine.py`` (or the keepalive in ``ops.offload``)
makes at least one of them fail (``tests/runtime/test_mutants.py``).
"""

from __future__ import annotations

import gc

import pytest
import torch
from cuda_double import FakeCuda

from fxckpt.runtime import engine, ops, pool, stats
from fxckpt.runtime.settings import RuntimeSettings

OPS = torch.ops.fxckpt
DEV = torch.device("cpu")  # the double's "device": CudaEngine runs on it unchanged


def produce(hw: FakeCuda, n: int = 256, seed: int = 0) -> torch.Tensor:
    """A device tensor written by a kernel on the compute stream."""
    t = hw.empty(n, torch.float32, DEV)
    t.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    hw.kernel("producer", writes=[t])
    return t


def restore(h: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    ticket = OPS.prefetch(h)
    return OPS.wait(h, ticket, like.shape, like.stride(), like.dtype, like.device)


def test_a_step_is_race_free_exact_and_copies_only_page_locked_memory(hw):
    srcs = [produce(hw, 256 * (i + 1), seed=i) for i in range(3)]
    expected = [s.clone() for s in srcs]
    handles = [OPS.offload(s) for s in srcs]
    hw.kernel("forward rest", reads=srcs)
    for h, s in zip(handles, srcs, strict=True):
        OPS.offload_done(h, s)
    for h, want in zip(reversed(handles), reversed(expected), strict=True):
        got = restore(h, want)
        hw.kernel("consumer", reads=[got])
        assert torch.equal(got, want)
    assert hw.races == []
    assert hw.pageable_copies == []


def test_the_d2h_copy_is_ordered_after_the_producer(hw):
    src = produce(hw)
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    assert hw.races == []


def test_the_source_is_reused_in_place_only_after_the_copy_read_it(hw):
    # Inductor may write into the source's buffer right after offload_done.
    src = produce(hw)
    want = src.clone()
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    hw.kernel("in-place reuse", writes=[src])
    assert hw.races == []
    assert torch.equal(restore(h, want), want)


def test_the_source_block_is_reallocated_only_after_the_copy_read_it(hw):
    src = produce(hw)
    ptr = src.data_ptr()
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    del src  # the graph's last reference: the block goes back to the compute stream's list
    reused = hw.empty(256, torch.float32, DEV)
    assert reused.data_ptr() == ptr  # the scenario really exercises reuse
    hw.kernel("next layer", writes=[reused])
    assert hw.races == []
    del h


def test_a_source_whose_handle_dies_before_the_join_is_held_until_the_copy_is_ordered(hw):
    # The forward raised between offload and offload_done: graph and handle go together.
    src = produce(hw)
    ptr = src.data_ptr()
    h = OPS.offload(src)
    del h, src
    reused = hw.empty(256, torch.float32, DEV)
    assert reused.data_ptr() == ptr
    hw.kernel("next step", writes=[reused])
    assert hw.races == []


def test_the_h2d_copy_is_ordered_after_the_d2h_copy(hw):
    # No offload_done in between (legal: wait alone restores), so only the copy streams'
    # own ordering protects the host buffer.
    src = produce(hw)
    want = src.clone()
    h = OPS.offload(src)
    got = restore(h, want)
    hw.kernel("consumer", reads=[got])
    assert hw.races == []
    assert torch.equal(got, want)


def test_the_prefetch_buffer_waits_for_compute_to_be_done_with_its_previous_owner(hw):
    # pytorch#106360: the block prefetch allocates may be one compute just freed while a
    # queued kernel still reads it.
    src = produce(hw)
    want = src.clone()
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    scratch = hw.empty(256, torch.float32, DEV)
    hw.kernel("long kernel", reads=[scratch], writes=[scratch], ms=50.0)
    ptr = scratch.data_ptr()
    del scratch
    ticket = OPS.prefetch(h)
    got = OPS.wait(h, ticket, want.shape, want.stride(), want.dtype, want.device)
    assert got.data_ptr() == ptr
    hw.kernel("consumer", reads=[got])
    assert hw.races == []


def test_compute_reads_the_restored_tensor_only_after_its_copy(hw):
    src = produce(hw)
    want = src.clone()
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    hw.synchronize()  # the offload is long done: only the h2d ordering is left to check
    got = restore(h, want)
    hw.kernel("consumer", reads=[got])
    assert hw.races == []


def test_a_restored_tensor_read_on_another_stream_is_not_reallocated_under_it(hw):
    src = produce(hw)
    want = src.clone()
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    ticket = OPS.prefetch(h)  # allocated on the default compute stream
    other = hw.copy_stream(DEV, 99)  # stands for a user's second compute stream
    with hw.use_stream(other):
        got = OPS.wait(h, ticket, want.shape, want.stride(), want.dtype, want.device)
        hw.kernel("consumer on another stream", reads=[got], ms=50.0)
    ptr = got.data_ptr()
    del got
    reused = hw.empty(256, torch.float32, DEV)
    hw.kernel("next", writes=[reused])
    assert reused.data_ptr() != ptr  # held until the other stream is done with it
    assert hw.races == []
    hw.synchronize()
    assert hw.empty(256, torch.float32, DEV).data_ptr() == ptr


def test_a_prefetch_whose_handle_dies_before_its_wait_is_held_until_the_copy_lands(hw):
    src = produce(hw)
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    del src
    OPS.prefetch(h)
    rec = ops._records[int(h)]
    ptr = rec.dev[0].data_ptr()
    del rec, h  # the backward raised before the wait
    reused = hw.empty(256, torch.float32, DEV)
    assert reused.data_ptr() == ptr
    hw.kernel("next step", writes=[reused])
    assert hw.races == []


def test_a_pinned_buffer_is_reused_only_after_its_copies_completed(hw):
    def step(seed: int) -> int:
        src = produce(hw, seed=seed)
        want = src.clone()
        h = OPS.offload(src)
        OPS.offload_done(h, src)
        got = restore(h, want)
        hw.kernel("consumer", reads=[got])
        assert torch.equal(got, want)
        return ops._records[int(h)].host.data_ptr()

    first = step(0)
    second = step(1)  # first's copies have not completed: another buffer
    assert second != first
    assert hw.races == []
    hw.synchronize()
    assert step(2) in (first, second)  # completed: reused
    assert hw.races == []


def test_an_exception_mid_step_gives_every_buffer_and_block_back(hw):
    gc.collect()
    handles_before = ops.live_handles()
    blocks_before = hw.live_blocks()

    def step_that_raises() -> None:
        srcs = [produce(hw, 512, seed=i) for i in range(3)]
        handles = [OPS.offload(s) for s in srcs]
        OPS.offload_done(handles[0], srcs[0])
        OPS.prefetch(handles[0])  # in flight when the step dies
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        step_that_raises()
    gc.collect()
    assert ops.live_handles() == handles_before
    assert hw.live_blocks() == blocks_before
    hw.synchronize()
    usage = pool.get_pool("cpu").usage()
    assert usage["in_use_bytes"] == usage["pending_bytes"] == 0
    for _ in range(3):  # memory handed back is reused by the next step without a race
        t = hw.empty(512, torch.float32, DEV)
        hw.kernel("next step", writes=[t])
    assert hw.races == []


def test_copy_streams_are_dedicated_and_made_once_per_slot(hw):
    two = RuntimeSettings(copy_streams=2).key()
    for seed in range(4):
        src = produce(hw, seed=seed)
        h = OPS.offload(src, profile=two)
        OPS.offload_done(h, src)
        restore(h, src)
    names = {c[1] for c in hw.calls if c[0] == "wait_stream"}
    assert names == {"copy0@cpu", "copy1@cpu", "copy2@cpu", "copy3@cpu"}
    assert len(hw.streams) == 5  # the compute stream and four copy streams, no more


def test_profiles_of_two_stream_counts_interleave_race_free_on_their_own_engines(hw):
    # One model on one copy stream per direction, another on three, steps interleaved: each
    # transfer keeps every ordering rule on the streams of its own engine.
    three = RuntimeSettings(copy_streams=3).key()
    srcs = [produce(hw, 256 + 64 * i, seed=i) for i in range(6)]
    want = [s.clone() for s in srcs]
    keys = [None if i % 2 == 0 else three for i in range(6)]
    handles = [OPS.offload(s, profile=k) for s, k in zip(srcs, keys, strict=True)]
    hw.kernel("forward rest", reads=srcs)
    for h, s in zip(handles, srcs, strict=True):
        OPS.offload_done(h, s)
    for s in srcs:
        hw.kernel("in-place reuse", writes=[s])
    for h, w in zip(reversed(handles), reversed(want), strict=True):
        got = restore(h, w)
        hw.kernel("consumer", reads=[got])
        assert torch.equal(got, w)
    assert hw.races == []
    one_engine, three_engine = engine.get_engine(DEV, 1), engine.get_engine(DEV, 3)
    assert (one_engine.streams, three_engine.streams) == (1, 3)
    used = {c[1] for c in hw.calls if c[0] == "wait_stream"}
    # the one-stream profile's copies use slots 0 and 1; the other's reach slot 5
    assert used == {f"copy{slot}@cpu" for slot in range(6)}


def test_stalls_are_timed_on_the_compute_stream_and_read_without_synchronizing(hw):
    hw.bandwidth["cpu"] = 1024 / 5.0  # 1 KiB copies take 5 ms
    src = produce(hw)  # 1 ms: done at t=1
    h = OPS.offload(src)  # d2h runs from 1 to 6
    hw.kernel("forward rest", ms=2.0)  # compute reaches the join at t=3
    OPS.offload_done(h, src)  # compute idles from 3 to 6
    assert stats.snapshot()["stall_seconds"] == 0.0  # nothing completed yet: nothing read
    hw.advance(100.0)
    snap = stats.snapshot()
    assert snap["stall_seconds"] == pytest.approx(0.003)
    assert snap["copy_seconds"] == pytest.approx(0.005)
    events = len(hw.events)
    got = restore(h, src)  # h2d from 100 to 105; compute joins at 100
    hw.kernel("consumer", reads=[got])
    hw.advance(100.0)
    snap = stats.snapshot()
    assert snap["stall_seconds"] == pytest.approx(0.003 + 0.005)
    assert snap["copy_seconds"] == pytest.approx(0.010)
    assert len(hw.events) == events + 4  # h2d start/done, reached/released

    h2 = OPS.offload(produce(hw, seed=3))
    hw.advance(100.0)
    events = len(hw.events)
    OPS.offload_done(h2, src)  # the copy already completed: no stall, no timing events
    assert len(hw.events) == events
    assert stats.snapshot()["stall_seconds"] == pytest.approx(0.008)


def test_a_reset_drains_the_timings_still_in_flight_so_they_do_not_land_in_the_next_window(hw):
    hw.bandwidth["cpu"] = 1024 / 5.0  # 1 KiB copies take 5 ms
    src = produce(hw)
    h = OPS.offload(src)
    hw.kernel("forward rest", ms=2.0)
    OPS.offload_done(h, src)  # a 3 ms stall and a 5 ms copy, both still in flight
    stats.reset()  # the next window starts here (a benchmark's next timed step)
    hw.advance(100.0)
    snap = stats.snapshot()
    assert snap["stall_seconds"] == 0.0 and snap["copy_seconds"] == 0.0
    got = restore(h, src)  # issued after the reset: counted
    hw.kernel("consumer", reads=[got])
    hw.advance(100.0)
    assert stats.snapshot()["copy_seconds"] == pytest.approx(0.005)


def test_a_graphs_copy_meter_gets_the_event_timed_copies_and_stalls(hw):
    from fxckpt.runtime import copy_meter

    hw.bandwidth["cpu"] = 1024 / 5.0  # 1 KiB copies take 5 ms
    meter = copy_meter.CopyMeter()
    with copy_meter.running(meter):  # the forward of the graph the meter belongs to
        src = produce(hw)
        h = OPS.offload(src)
        hw.kernel("forward rest", ms=2.0)
        OPS.offload_done(h, src)  # compute idles 3 ms
    got = restore(h, src)  # the backward, outside the forward: still the graph's transfer
    hw.kernel("consumer", reads=[got])
    hw.advance(100.0)
    stats.snapshot()  # reads the completed events
    t = meter.read()
    assert t.copy_seconds == pytest.approx(0.010) and t.copied_bytes == 2 * 1024
    assert t.stall_seconds == pytest.approx(0.003 + 0.005)


def _streamed_weight(hw: FakeCuda, n: int = 1024) -> torch.Tensor:
    """A streamed weight as fxckpt.stream_weights leaves it: page-locked host memory it counts."""
    from fxckpt.runtime import weight_ops

    w = hw.page_locked(n * 4).view(torch.float32)
    w.copy_(torch.randn(n, generator=torch.Generator().manual_seed(1)))
    return weight_ops.adopt_host(w)


def test_a_streamed_weight_is_read_by_compute_only_after_its_copy_lands(hw):
    w = _streamed_weight(hw)
    hw.kernel("forward before the use", ms=5.0)
    h = OPS.weight_prefetch(w, DEV)
    got = OPS.wait(h, h, w.shape, w.stride(), w.dtype, DEV)
    hw.kernel("matmul", reads=[got])
    assert torch.equal(got, w)
    assert hw.races == [] and hw.pageable_copies == []


def test_the_optimizer_writes_a_host_weight_only_after_its_copies_read_it(hw):
    """The fence (run before every optimizer step that holds a streamed weight) orders the host's
    write after each copy still reading the weight."""
    from fxckpt.runtime import weight_ops

    w = _streamed_weight(hw)
    h = OPS.weight_prefetch(w, DEV)
    got = OPS.wait(h, h, w.shape, w.stride(), w.dtype, DEV)
    hw.kernel("matmul", reads=[got])
    del h
    weight_ops.fence()
    hw.host_access(w.data_ptr(), w.nbytes, write=True, what="optimizer step")
    assert hw.races == []


def test_a_streamed_weights_gradient_reaches_the_host_only_after_its_copy(hw):
    """``fxckpt::grad_offload`` where the gradient is produced, the join a few gradients later
    (its block reused after it), ``fxckpt::grad_host`` at the backward's end: the host reads
    the gradient (autograd accumulates it) only once it has seen the copy complete."""
    g = produce(hw)
    want = g.clone()
    h = OPS.grad_offload(g)
    hw.kernel("the next gradients", ms=5.0)
    OPS.offload_done(h, g)
    ptr = g.data_ptr()
    del g
    reused = hw.empty(256, torch.float32, DEV)
    assert reused.data_ptr() == ptr
    hw.kernel("the backward goes on", writes=[reused])
    host = OPS.grad_host(h, want.shape, want.dtype)
    hw.host_access(host.data_ptr(), host.nbytes, write=False, what="AccumulateGrad")
    assert torch.equal(host, want)
    assert hw.races == [] and hw.pageable_copies == []

