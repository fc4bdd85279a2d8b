"""The bucket ops on the CPU engine: exact round trips of mixed layouts, one hand-off each way
and one pool buffer per bucket, fake strides, missing waits caught, failures and fallbacks."""

from __future__ import annotations

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import engine, ops, pool, stats

OPS = torch.ops.fxckpt
# Every test here runs at memcpy speed and through an emulated link (conftest.py).
pytestmark = pytest.mark.usefixtures("link_mode")


@pytest.fixture(autouse=True)
def _clean_runtime():
    engine.configure()
    pool.set_pool_cap(None)
    stats.reset()
    yield
    engine.configure()
    pool.set_pool_cap(None)


def members() -> list[torch.Tensor]:
    """One dtype, four layouts: contiguous, a view with an offset, transposed, broadcast."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(10, 8, generator=g)
    return [torch.randn(33, generator=g), base[3:, 1:5], base.t(),
            torch.randn(4, 1, generator=g).expand(4, 6), torch.empty(0, 3)]


def wait(h: torch.Tensor, ticket: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    sizes = [n for t in like for n in t.shape]
    strides = [s for t in like for s in t.stride()]
    return OPS.wait_many(h, ticket, sizes, strides, [t.dim() for t in like], like[0].dtype,
                         like[0].device)


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "wait_only"])
def test_a_bucket_round_trip_is_exact_with_delayed_copies(prefetch):
    engine.configure(copy_delay_s=0.01, poison_fresh=True)
    srcs = members()
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    ticket = OPS.prefetch(h) if prefetch else h
    out = wait(h, ticket, srcs)
    for o, s in zip(out, srcs, strict=True):
        assert (o.shape, o.stride(), o.dtype) == (s.shape, s.stride(), s.dtype)
        assert torch.equal(o, s)
    storages = {o.untyped_storage().data_ptr() for o in out if o.numel()}
    assert len(storages) == 4  # a buffer of its own each, none of them a source's
    assert not storages & {s.untyped_storage().data_ptr() for s in srcs}


def test_a_bucket_is_one_copy_each_way_and_one_pool_buffer():
    srcs = members()
    before = stats.snapshot()
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    wait(h, OPS.prefetch(h), srcs)
    after = stats.snapshot()
    assert after["copy_handoffs"] - before["copy_handoffs"] == 2
    assert after["offload_calls"] - before["offload_calls"] == 1
    taken = (after["pool_hits"] + after["pool_misses"]) - (before["pool_hits"] + before["pool_misses"])
    assert taken == 1
    assert after["offloaded_bytes"] == after["prefetched_bytes"] == ops._records[int(h)].nbytes


def test_fake_strides_equal_real_strides():
    srcs = members()
    h = OPS.offload_many(srcs)
    real = wait(h, h, srcs)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(s) for s in srcs]
        fh = OPS.offload_many(fakes)
        fake = wait(fh, fh, fakes)
    assert [(f.shape, f.stride(), f.dtype) for f in fake] == [
        (r.shape, r.stride(), r.dtype) for r in real
    ]
    assert (fh.shape, fh.dtype, fh.device) == (h.shape, h.dtype, h.device)


def test_opcheck_bucket_ops():
    srcs = members()[:3]
    test_utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(OPS.offload_many.default, (srcs,), test_utils=test_utils)
    h = OPS.offload_many(srcs)
    torch.library.opcheck(OPS.offload_many_done.default, (h, srcs))
    sizes = [n for t in srcs for n in t.shape]
    strides = [s for t in srcs for s in t.stride()]
    args = (h, h, sizes, strides, [t.dim() for t in srcs], srcs[0].dtype, srcs[0].device)
    torch.library.opcheck(OPS.wait_many.default, args)


def test_a_skipped_wait_is_caught_by_the_values():
    # The test of the test: with the joins made no-ops, the restored values are the poison
    # the fresh buffers were filled with, not the sources.
    engine.configure(copy_delay_s=0.05, poison_fresh=True, unsafe_skip_waits=True)
    srcs = members()[:3]
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    out = wait(h, OPS.prefetch(h), srcs)
    assert not all(torch.equal(o, s) for o, s in zip(out, srcs, strict=True))
    engine.configure()
    gc.collect()


def test_wait_twice_for_retain_graph_gives_fresh_equal_tensors():
    engine.configure(copy_delay_s=0.005, poison_fresh=True)
    srcs = members()[:3]
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    first = wait(h, h, srcs)
    for t in first:
        t.zero_()
    second = wait(h, h, srcs)
    assert all(torch.equal(o, s) for o, s in zip(second, srcs, strict=True))


def test_a_failed_bucket_copy_is_a_clean_error_and_the_next_one_works():
    engine.configure(fail_next_copies=1)
    srcs = members()[:3]
    h = OPS.offload_many(srcs)
    with pytest.raises(RuntimeCopyError, match="bucket of 3"):
        OPS.offload_many_done(h, srcs)
    del h
    engine.configure()
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    assert all(torch.equal(o, s) for o, s in zip(wait(h, h, srcs), srcs, strict=True))


def test_no_host_memory_keeps_the_bucket_on_the_device_with_exact_values():
    pool.set_pool_cap(0)
    srcs = members()[:3]
    with pytest.warns(pool.HostMemoryWarning):
        h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    assert stats.snapshot()["fallbacks"] == 1
    assert all(torch.equal(o, s) for o, s in zip(wait(h, h, srcs), srcs, strict=True))


def test_the_handle_dying_gives_the_buffer_back():
    gc.collect()
    base = ops.live_handles(), pool.get_pool("cpu").usage()["in_use_bytes"]
    srcs = members()[:3]
    h = OPS.offload_many(srcs)
    OPS.offload_many_done(h, srcs)
    wait(h, h, srcs)
    assert ops.live_handles() == base[0] + 1
    del h
    gc.collect()
    assert (ops.live_handles(), pool.get_pool("cpu").usage()["in_use_bytes"]) == base


def test_bad_buckets_are_refused_with_the_reason():
    with pytest.raises(RuntimeCopyError, match="one dtype"):
        OPS.offload_many([torch.randn(3), torch.ones(3, dtype=torch.int64)])
    srcs = members()[:2]
    h = OPS.offload_many(srcs)
    with pytest.raises(RuntimeCopyError, match="was offloaded with sizes"):
        wait(h, h, srcs[::-1])
    with pytest.raises(RuntimeCopyError, match="do not add up"):
        OPS.wait_many(h, h, [33], [1], [1, 2], torch.float32, torch.device("cpu"))


def _qkv() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A fused projection's output and three head-split views of it, one storage."""
    base = torch.randn(2, 4, 24, generator=torch.Generator().manual_seed(1))
    return base, [z.view(2, 4, 2, 4).transpose(1, 2) for z in base.split(8, dim=-1)]


def _shared_kwargs(views: list[torch.Tensor]) -> dict[str, list[int]]:
    return {"groups": [0] * len(views), "offsets": [v.storage_offset() for v in views],
            "strides": [s for v in views for s in v.stride()]}  # fmt: skip


def _restore_shared(h: torch.Tensor, views: list[torch.Tensor], span: int) -> list[torch.Tensor]:
    (stretch,) = OPS.wait_many(h, OPS.prefetch(h), [span], [1], [1], views[0].dtype, views[0].device)
    return [stretch.as_strided(v.shape, v.stride(), v.storage_offset()) for v in views]


@pytest.mark.parametrize("lies", ["as_compiled", "relaid"])
def test_views_of_one_storage_cross_once_and_come_back_as_one_buffer(lies):
    engine.configure(copy_delay_s=0.002, poison_fresh=True)
    base, views = _qkv()
    kwargs = _shared_kwargs(views)
    # As compiled: the views of one storage. Relaid: each view its own buffer at run time
    # (a compiler may lay a tensor out otherwise), so the stretch is assembled first.
    srcs = views if lies == "as_compiled" else [v.clone() for v in views]
    span = base.numel()  # from q's first element to v's last one: the whole storage, once
    before = stats.snapshot()
    h = OPS.offload_many(srcs, **kwargs)
    OPS.offload_many_done(h, srcs)
    out = _restore_shared(h, views, span)
    after = stats.snapshot()
    assert after["offloaded_bytes"] - before["offloaded_bytes"] == span * base.element_size()
    assert after["copy_handoffs"] - before["copy_handoffs"] == 2
    for o, v in zip(out, views, strict=True):
        assert torch.equal(o, v)
    assert len({o.untyped_storage().data_ptr() for o in out}) == 1
    assert out[0].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


def test_shared_groups_with_members_of_their_own_keep_the_order_of_parts():
    _, views = _qkv()
    alone = torch.randn(5)
    srcs = [views[0], alone, views[1]]
    kwargs = {"groups": [0, 1, 0], "offsets": [0, 0, 8],
              "strides": [*views[0].stride(), 1, *views[1].stride()]}  # fmt: skip
    h = OPS.offload_many(srcs, **kwargs)
    OPS.offload_many_done(h, srcs)
    stretch, got = OPS.wait_many(h, h, [184, 5], [1, 1], [1, 1], alone.dtype, alone.device)
    assert torch.equal(got, alone)
    assert torch.equal(stretch.as_strided(views[1].shape, views[1].stride(), 8), views[1])


def test_groups_that_do_not_number_the_parts_are_a_clean_error():
    _, views = _qkv()
    with pytest.raises(RuntimeCopyError, match="must number 0, 1"):
        OPS.offload_many(views, groups=[1, 1, 1], offsets=[0, 8, 16],
                         strides=[s for v in views for s in v.stride()])  # fmt: skip
    with pytest.raises(RuntimeCopyError, match="one offset each"):
        OPS.offload_many(views, groups=[0, 0, 0], offsets=[0, 8], strides=[])


def test_opcheck_offload_many_with_shared_groups():
    _, views = _qkv()
    torch.library.opcheck(OPS.offload_many.default, (views,), _shared_kwargs(views),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
