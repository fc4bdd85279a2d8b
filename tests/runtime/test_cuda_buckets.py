"""Buckets on the real CUDA engine against the recording double: every ordering rule of
``test_cuda_protocol.py`` holds for a bucket of tensors copied together, with one event per
direction. ``tests/runtime/test_mutants.py`` runs this file with the protocol's, so removing
any one ordering call also fails a test here (see its table)."""

from __future__ import annotations

import torch
from cuda_double import FakeCuda

from fxckpt.runtime import ops, stats

OPS = torch.ops.fxckpt
DEV = torch.device("cpu")  # the double's "device": CudaEngine runs on it unchanged


def produce(hw: FakeCuda, sizes: tuple[int, ...] = (256, 64, 512), seed: int = 0
            ) -> list[torch.Tensor]:
    """One block's tensors, each written by a kernel on the compute stream."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        t = hw.empty(n, torch.float32, DEV)
        t.copy_(torch.randn(n, generator=g))
        hw.kernel("producer", writes=[t])
        out.append(t)
    return out


def restore(h: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    ticket = OPS.prefetch(h)
    return wait(h, ticket, like)


def wait(h: torch.Tensor, ticket: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    sizes = [n for t in like for n in t.shape]
    strides = [s for t in like for s in t.stride()]
    return OPS.wait_many(h, ticket, sizes, strides, [t.dim() for t in like], like[0].dtype,
                         like[0].device)


def test_a_bucket_step_is_race_free_exact_with_one_event_per_direction(hw):
    srcs = produce(hw)
    want = [s.clone() for s in srcs]
    events = len(hw.events)
    h = OPS.offload_many(srcs)
    assert len(hw.events) == events + 2  # the copy's start and done: one copy for three
    hw.kernel("forward rest", reads=srcs)
    OPS.offload_many_done(h, srcs)
    events = len(hw.events)
    got = restore(h, want)
    assert len(hw.events) == events + 4  # copy start/done, and the compute wait's reached/released
    for g, w in zip(got, want, strict=True):
        hw.kernel("consumer", reads=[g])
        assert torch.equal(g, w)
    assert len({g.data_ptr() for g in got}) == 3  # a block each, freed at its own last use
    assert stats.snapshot()["copy_handoffs"] == 2
    assert hw.races == []
    assert hw.pageable_copies == []


def test_the_bucket_copy_is_ordered_after_every_producer(hw):
    srcs = produce(hw)
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    assert hw.races == []


def test_members_are_reused_in_place_only_after_the_copy_read_them(hw):
    srcs = produce(hw)
    want = [s.clone() for s in srcs]
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    hw.kernel("in-place reuse", writes=srcs)
    assert hw.races == []
    assert all(torch.equal(g, w) for g, w in zip(restore(h, want), want, strict=True))


def test_member_blocks_are_reallocated_only_after_the_copy_read_them(hw):
    srcs = produce(hw)
    ptr = srcs[2].data_ptr()
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    del srcs
    reused = hw.empty(512, torch.float32, DEV)
    assert reused.data_ptr() == ptr
    hw.kernel("next layer", writes=[reused])
    assert hw.races == []
    del h


def test_members_whose_handle_dies_before_the_join_are_held_until_the_copy_is_ordered(hw):
    srcs = produce(hw)
    ptr = srcs[0].data_ptr()
    h = OPS.offload_many(srcs)
    del h, srcs
    reused = hw.empty(256, torch.float32, DEV)
    assert reused.data_ptr() == ptr
    hw.kernel("next step", writes=[reused])
    assert hw.races == []


def test_the_bucket_h2d_copy_is_ordered_after_its_d2h_copy(hw):
    srcs = produce(hw)
    want = [s.clone() for s in srcs]
    h = OPS.offload_many(srcs)
    got = restore(h, want)
    hw.kernel("consumer", reads=got)
    assert hw.races == []
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_the_prefetch_buffers_wait_for_compute_to_be_done_with_their_previous_owner(hw):
    srcs = produce(hw)
    want = [s.clone() for s in srcs]
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    scratch = hw.empty(64, torch.float32, DEV)
    hw.kernel("long kernel", reads=[scratch], writes=[scratch], ms=50.0)
    ptr = scratch.data_ptr()
    del scratch
    got = restore(h, want)
    assert ptr in {g.data_ptr() for g in got}
    hw.kernel("consumer", reads=got)
    assert hw.races == []


def test_compute_reads_the_restored_members_only_after_their_copy(hw):
    srcs = produce(hw)
    want = [s.clone() for s in srcs]
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    hw.synchronize()
    got = restore(h, want)
    hw.kernel("consumer", reads=got)
    assert hw.races == []


def test_members_read_on_another_stream_are_not_reallocated_under_them(hw):
    srcs = produce(hw)
    want = [s.clone() for s in srcs]
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    ticket = OPS.prefetch(h)
    other = hw.copy_stream(DEV, 99)
    with hw.use_stream(other):
        got = wait(h, ticket, want)
        hw.kernel("consumer on another stream", reads=got, ms=50.0)
    ptrs = [g.data_ptr() for g in got]
    del got
    for n, ptr in zip((256, 64, 512), ptrs, strict=True):
        reused = hw.empty(n, torch.float32, DEV)
        hw.kernel("next", writes=[reused])
        assert reused.data_ptr() != ptr
    assert hw.races == []


def test_a_bucket_prefetch_whose_handle_dies_before_its_wait_is_held_until_the_copy_lands(hw):
    srcs = produce(hw)
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    del srcs
    OPS.prefetch(h)
    rec = ops._records[int(h)]
    ptr = rec.dev[2].data_ptr()
    del rec, h
    reused = hw.empty(512, torch.float32, DEV)
    assert reused.data_ptr() == ptr
    hw.kernel("next step", writes=[reused])
    assert hw.races == []


def test_a_bucket_takes_one_pinned_buffer_reused_only_after_its_copies_completed(hw):
    def step(seed: int) -> int:
        srcs = produce(hw, seed=seed)
        want = [s.clone() for s in srcs]
        before = stats.snapshot()
        h = OPS.offload_many(srcs)
        after = stats.snapshot()
        assert after["pool_hits"] + after["pool_misses"] == before["pool_hits"] + before["pool_misses"] + 1
        OPS.offload_many_done(h, srcs)
        got = restore(h, want)
        hw.kernel("consumer", reads=got)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        return ops._records[int(h)].host.data_ptr()

    first = step(0)
    second = step(1)
    assert second != first
    assert hw.races == []
    hw.synchronize()
    assert step(2) in (first, second)
    assert hw.races == []
