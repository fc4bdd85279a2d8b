"""The fxckpt:: ops: schemas, fake implementations, exact round trips, handle lifetime."""

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


def round_trip(src: torch.Tensor, prefetch: bool = True) -> torch.Tensor:
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    if prefetch:
        OPS.prefetch(h)
    return OPS.wait(h, h, src.shape, src.stride(), src.dtype, src.device)


def _base() -> torch.Tensor:
    return torch.randn(10, 8, generator=torch.Generator().manual_seed(0))


CASES = {
    "contiguous": lambda: _base(),
    "view_with_offset": lambda: _base()[3:, 1:5],
    "transposed": lambda: _base().t(),
    "expanded": lambda: torch.randn(4, 1).expand(4, 6),
    "bf16": lambda: _base().to(torch.bfloat16)[2:, ::2],
    "int64": lambda: torch.arange(60, dtype=torch.int64).view(5, 12)[:, 3:],
    "bool": lambda: _base() > 0,
    "scalar": lambda: torch.tensor(3.5),
    "empty": lambda: torch.empty(0, 7),
}


def test_schemas_are_the_contract():
    assert [str(op._schema) for op in ops.OPS] == [
        "fxckpt::offload(Tensor src, int tier=0, Tensor[]? after=None, *, str? profile=None) -> Tensor",
        "fxckpt::offload_done(Tensor handle, Tensor keepalive, Tensor[]? after=None) -> Tensor",
        "fxckpt::prefetch(Tensor handle, Tensor[]? after=None) -> Tensor",
        "fxckpt::wait(Tensor handle, Tensor ticket, SymInt[] size, SymInt[] stride, ScalarType dtype, "
        "Device device, Tensor[]? after=None) -> Tensor",
        "fxckpt::note_saved(Tensor[] saved, str plan, Tensor[]? after=None) -> ()",
        "fxckpt::offload_many(Tensor[] srcs, Tensor[]? after=None, *, str? profile=None, "
        "int[]? groups=None, SymInt[]? offsets=None, SymInt[]? strides=None) -> Tensor",
        "fxckpt::offload_many_done(Tensor handle, Tensor[] keepalive, Tensor[]? after=None) -> Tensor",
        "fxckpt::wait_many(Tensor handle, Tensor ticket, SymInt[] sizes, SymInt[] strides, "
        "int[] ranks, ScalarType dtype, Device device, Tensor[]? after=None) -> Tensor[]",
    ]


def test_every_op_runs_outside_cuda_graphs():
    # Inductor's graph partitioning keeps ops with this tag out of captured regions (and,
    # without partitioning, does not capture a graph that holds one): utils.py
    # is_cudagraph_unsafe_fx_node in torch 2.11 and 2.13.
    assert all(torch.Tag.cudagraph_unsafe in op.tags for op in ops.OPS)


def test_dead_code_elimination_keeps_every_op():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    h = g.call_function(OPS.offload.default, (x,))
    g.call_function(OPS.offload_done.default, (h, x))
    g.call_function(OPS.prefetch.default, (h,))
    g.call_function(OPS.wait.default, (h, [2], [1], torch.float32, torch.device("cpu")))
    g.call_function(OPS.note_saved.default, ([x], ""))
    hm = g.call_function(OPS.offload_many.default, ([x, x],))
    g.call_function(OPS.offload_many_done.default, (hm, [x, x]))
    g.call_function(OPS.wait_many.default, (hm, hm, [2, 2], [1, 1], [1, 1], torch.float32,
                                            torch.device("cpu")))
    g.output(x)
    g.eliminate_dead_code()
    assert [n.target for n in g.nodes if n.op == "call_function"] == list(ops.OPS)


def test_opcheck_offload():
    # test_aot_dispatch_dynamic compares values across two calls; every handle differs by
    # design, so only the checks that compare metadata apply.
    src = torch.randn(5, 6)
    torch.library.opcheck(
        OPS.offload.default,
        (src,),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


@pytest.mark.parametrize("case", ["contiguous", "view_with_offset", "transposed", "bf16"])
def test_opcheck_done_prefetch_wait(case):
    src = CASES[case]()
    h = OPS.offload(src)
    torch.library.opcheck(OPS.offload_done.default, (h, src))
    torch.library.opcheck(OPS.prefetch.default, (h,))
    args = (h, h, list(src.shape), list(src.stride()), src.dtype, src.device)
    torch.library.opcheck(OPS.wait.default, args)


def test_opcheck_note_saved():
    x = torch.randn(4, 4)
    torch.library.opcheck(OPS.note_saved.default, ([x, x[1:], torch.ones(3)], '{"p": 1}'))


@pytest.mark.parametrize(
    "case", ["contiguous", "view_with_offset", "transposed", "bf16", "expanded"]
)
def test_fake_strides_equal_real_strides(case):
    src = CASES[case]()
    h = OPS.offload(src)
    real = OPS.wait(h, h, src.shape, src.stride(), src.dtype, src.device)
    with FakeTensorMode() as mode:
        fake_src = mode.from_tensor(src)
        fake_h = OPS.offload(fake_src)
        fake = OPS.wait(fake_h, fake_h, src.shape, src.stride(), src.dtype, src.device)
    assert (fake_h.shape, fake_h.stride(), fake_h.dtype, fake_h.device) == (
        h.shape,
        h.stride(),
        h.dtype,
        h.device,
    )
    assert (fake.shape, fake.stride(), fake.dtype, fake.device) == (
        real.shape,
        real.stride(),
        real.dtype,
        real.device,
    )
    assert real.stride() == src.stride()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "wait_only"])
def test_round_trip_exact_with_delayed_copies(case, prefetch):
    engine.configure(copy_delay_s=0.01, poison_fresh=True)
    src = CASES[case]()
    out = round_trip(src, prefetch=prefetch)
    assert (out.shape, out.stride(), out.dtype) == (src.shape, src.stride(), src.dtype)
    assert torch.equal(out, src)
    if src.numel():
        assert out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()


def test_handles_are_opaque_ids_not_pointers():
    src = torch.randn(16)
    handles = [OPS.offload(src) for _ in range(3)]
    values = [int(h) for h in handles]
    assert len(set(values)) == 3 and values == sorted(values)
    assert src.data_ptr() not in values
    assert all(h.shape == () and h.dtype == torch.int64 and h.device.type == "cpu" for h in handles)


def test_handle_stays_cpu_under_a_default_device():
    with torch.device("meta"):
        h = OPS.offload(torch.randn(3, device="cpu"))
    assert h.device.type == "cpu"


def test_wait_twice_for_retain_graph_gives_fresh_equal_tensors():
    engine.configure(copy_delay_s=0.005, poison_fresh=True)
    src = CASES["view_with_offset"]()
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    first = OPS.wait(h, h, src.shape, src.stride(), src.dtype, src.device)
    first.zero_()  # a backward may reuse the output buffer in place
    second = OPS.wait(h, h, src.shape, src.stride(), src.dtype, src.device)
    assert torch.equal(second, src)
    assert second.data_ptr() != first.data_ptr()


def test_prefetch_is_idempotent():
    src = torch.randn(64)
    h = OPS.offload(src)
    OPS.prefetch(h)
    OPS.prefetch(h)
    OPS.wait(h, h, src.shape, src.stride(), src.dtype, src.device)
    assert stats.snapshot()["prefetched_bytes"] == src.nbytes


def test_wait_with_wrong_metadata_raises():
    src = torch.randn(4, 5)
    h = OPS.offload(src)
    with pytest.raises(RuntimeCopyError, match="was offloaded"):
        OPS.wait(h, h, [5, 4], [4, 1], src.dtype, src.device)
    with pytest.raises(RuntimeCopyError, match="was offloaded"):
        OPS.wait(h, h, src.shape, src.stride(), torch.float64, src.device)


def test_wait_may_restate_strides_of_size_one_dimensions():
    src = torch.randn(5, 1, 3)
    h = OPS.offload(src)
    out = OPS.wait(h, h, [5, 1, 3], [3, 99, 1], src.dtype, src.device)
    assert out.stride() == (3, 99, 1)
    assert torch.equal(out, src)


def test_unknown_handle_raises_clearly():
    with pytest.raises(RuntimeCopyError, match="names no live transfer"):
        OPS.prefetch(torch.tensor(10**12))


class _OffloadSaved(torch.autograd.Function):
    """What a compiled graph does: offload in forward, save only the handle, wait in backward."""

    @staticmethod
    def forward(ctx, x):
        y = x * 3
        h = OPS.offload(y)
        OPS.offload_done(h, y)
        ctx.save_for_backward(h)
        ctx.meta = (y.shape, y.stride(), y.dtype, y.device)
        return y * y

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        OPS.prefetch(h)
        y = OPS.wait(h, h, *ctx.meta)
        return grad * 2 * y * 3


def test_saved_handle_lives_until_the_graph_dies_and_supports_retain_graph():
    engine.configure(copy_delay_s=0.002, poison_fresh=True)
    gc.collect()
    before = ops.live_handles()
    x = torch.randn(6, 7, requires_grad=True)
    out = _OffloadSaved.apply(x)
    gc.collect()
    assert ops.live_handles() == before + 1  # only autograd holds the handle now
    out.sum().backward(retain_graph=True)
    g1 = x.grad.clone()
    x.grad = None
    out.sum().backward(retain_graph=True)
    assert torch.equal(x.grad, g1)
    assert torch.allclose(g1, 18 * x.detach())
    assert ops.live_handles() == before + 1
    del out
    assert ops.live_handles() == before


def test_handle_is_released_after_a_plain_backward():
    gc.collect()
    before = ops.live_handles()
    x = torch.randn(8, requires_grad=True)
    _OffloadSaved.apply(x).sum().backward()
    assert ops.live_handles() == before


def test_exception_mid_forward_releases_the_handle():
    x = torch.randn(32, 32)
    gc.collect()
    before = ops.live_handles(), pool.get_pool("cpu").usage()["in_use_bytes"]

    def forward():
        h = OPS.offload(x)
        OPS.offload_done(h, x)
        raise ValueError("boom")

    with pytest.raises(ValueError):
        forward()
    gc.collect()  # the traceback's frames keep the handle in a cycle until collected
    assert (ops.live_handles(), pool.get_pool("cpu").usage()["in_use_bytes"]) == before


@pytest.mark.inductor
def test_ops_survive_inductor():
    engine.configure(copy_delay_s=0.01, poison_fresh=True)

    def roundtrip(x):
        y = (x * 2).t()
        h = OPS.offload(y)
        OPS.offload_done(h, y)
        OPS.prefetch(h)
        return OPS.wait(h, h, y.shape, y.stride(), y.dtype, y.device) + 1

    def unused_results(x):
        h = OPS.offload(x)
        OPS.prefetch(h)  # its ticket is unused: DCE would drop it if it were pure
        OPS.note_saved([x], "plan-under-inductor")
        return x + 1

    x = torch.randn(6, 5)
    got = torch.compile(roundtrip, backend="inductor", fullgraph=True)(x)
    assert torch.equal(got, roundtrip(x))
    stats.reset()
    torch.compile(unused_results, backend="inductor", fullgraph=True)(x)
    snap = stats.snapshot()
    assert snap["prefetched_bytes"] == snap["offloaded_bytes"] == x.nbytes
    assert snap["graphs"]["plan-under-inductor"]["planned_kept_bytes"] == x.nbytes
    assert stats.plan_payloads() == ["plan-under-inductor"]


def test_wait_restores_into_the_requested_layout():
    # Inductor may offload a contiguous buffer where the graph's metadata says permuted.
    engine.configure(copy_delay_s=0.002, poison_fresh=True)
    src = torch.randn(2, 4, 12, 8)
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    want = src.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # strides (384, 8, 32, 1)
    out = OPS.wait(h, OPS.prefetch(h), list(want.shape), list(want.stride()), src.dtype, src.device)
    assert out.stride() == want.stride()
    assert torch.equal(out, src)
