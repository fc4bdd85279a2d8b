"""The memory meter: the allocator's own figures, never a plan's.

The CPU meter records only the allocator's reports to the profiler; the full profiler (ops
recorded too) is the reference it must agree with exactly. The CUDA arithmetic runs against a
fake of CUDA's memory statistics.
"""

from __future__ import annotations

import gc

import pytest
import torch
from models import GPT, gpt_inputs

import fxckpt
from fxckpt.meter import CudaCounters, Meter, net_allocations
from fxckpt.runtime.pool import get_pool


@pytest.fixture(autouse=True)
def _collected() -> None:
    # An earlier test's model in a reference cycle would keep its weights' device copies, which
    # the absolute figures rightly count.
    gc.collect()


def _profiler_net_and_peak(fn) -> tuple[int, int]:
    """What torch.profiler.profile(profile_memory=True) says: net bytes and running peak."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    del out
    return now, peak


@pytest.mark.parametrize("offload", ["never", "all"])
def test_cpu_meter_agrees_with_the_profilers_memory_events_on_a_compiled_forward(offload: str) -> None:
    torch.manual_seed(0)
    backend = fxckpt.backend(compiler="eager", memory_budget=0.5, offload=offload, min_offload_bytes=0)
    model = torch.compile(GPT(n_layers=2), backend=backend)
    idx, tgt = gpt_inputs(seq=32)
    model(idx, tgt).backward()  # compile, fill the host pool
    model(idx, tgt).backward()
    held: list[torch.Tensor] = []

    def forward() -> torch.Tensor:
        loss = model(idx, tgt)
        held.append(loss)  # keep the graph (and its saved tensors) alive past the call
        return loss

    want_net, want_peak = _profiler_net_and_peak(forward)
    held.pop().backward()
    calls = fxckpt.stats()["offload_calls"]
    got = fxckpt.measure(forward)
    handles = fxckpt.stats()["offload_calls"] - calls
    held.pop().backward()
    # The meter leaves out the 8-byte offload handles (host memory on a GPU); the profiler
    # counts every allocation.
    assert got.resident_bytes == want_net - 8 * handles > 0
    assert (handles > 0) == (offload == "all")
    if offload == "never":  # handles come and go during the call, so only here is the peak equal
        assert got.peak_bytes == want_peak
    assert got.output_bytes == 4  # the float32 loss
    assert got.held_bytes == got.resident_bytes - 4


def test_cpu_meter_counts_what_the_call_leaves_and_its_temporaries() -> None:
    kept: list[torch.Tensor] = []

    def fn() -> torch.Tensor:
        a = torch.ones(1000)  # 4000 B, a temporary
        kept.append(a * 2)  # 4000 B, left behind
        return torch.zeros(10)  # 40 B, returned

    m = fxckpt.measure(fn)
    assert (m.resident_bytes, m.output_bytes, m.held_bytes) == (4040, 40, 4000)
    assert m.peak_bytes == 8040
    assert m.device == "cpu" and m.output.shape == (10,)


def test_frees_of_blocks_older_than_the_call_are_not_counted() -> None:
    old = torch.ones(5000)

    def fn() -> torch.Tensor:
        nonlocal old
        old = None  # type: ignore[assignment]
        return torch.ones(10)

    assert fxckpt.measure(fn).resident_bytes == 40


def test_host_pool_buffers_are_host_memory_not_device() -> None:
    pool = get_pool("cpu")
    bufs: list[torch.Tensor] = []

    def fn() -> torch.Tensor:
        bufs.append(pool.acquire(3 * 2**20 + 123))  # a size class no other test uses
        return torch.ones(256)

    m = fxckpt.measure(fn)
    pool.release(bufs.pop())
    assert m.resident_bytes == 1024


def test_the_absolute_peak_counts_what_the_device_held_at_the_start_each_storage_once() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Linear(50, 100))
    model[1].weight = torch.nn.Parameter(model[0].weight.t())  # a view: its storage counts once
    x = torch.randn(8, 100)
    model(x).sum().backward()  # gradients held at the start count too
    params = (100 * 50 + 50 + 100) * 4  # the shared weight's storage once, the two biases
    grads = params + 100 * 50 * 4  # the tied weight's two .grad tensors are two storages
    m = fxckpt.measure(model, x)
    assert m.start_bytes == params + grads + x.nbytes
    assert m.absolute_peak_bytes == m.start_bytes + m.peak_bytes
    # A closure reaches nothing: the model is named with ``holding``.
    assert fxckpt.measure(lambda: model(x)).start_bytes == 0
    assert fxckpt.measure(lambda: model(x), holding=[model]).start_bytes == params + grads


def test_streamed_weights_are_host_memory_in_the_absolute_figure() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    x = torch.randn(4, 256)
    resident = fxckpt.measure(model, x).start_bytes
    fxckpt.stream_weights(model, min_bytes=2**11)  # both weights; the 1 KiB biases stay
    m = fxckpt.measure(model, x)
    assert resident - m.start_bytes == 2 * 256 * 256 * 4
    assert m.start_bytes == 2 * 256 * 4 + x.nbytes


def test_net_allocations_pairs_frees_with_allocations_by_address() -> None:
    events = [
        (1, 0xA, 100, "cpu"),
        (2, 0xB, 50, "cpu"),
        (3, 0xA, -100, "cpu"),
        (4, 0xC, -70, "cpu"),  # allocated before the events began: not credited
        (5, 0xD, 30, "cuda"),  # another device
        (6, 0xE, 500, "cpu"),  # excluded address (a host buffer)
        (7, 0xA, 20, "cpu"),  # the address reused
    ]
    live, peak = net_allocations(events, "cpu", exclude={0xE})
    assert live == {0xB: 50, 0xA: 20}
    assert peak == 150


def test_an_excluded_address_leaves_out_only_the_host_block_allocated_there_last() -> None:
    # The allocator hands a freed device block's address to a host buffer (an offload
    # handle, say) later in the call: the device block still counted towards the peak.
    events = [
        (1, 0xA, 100, "cpu"),
        (2, 0xF, 64, "cpu"),  # a device temporary
        (3, 0xF, -64, "cpu"),
        (4, 0xF, 8, "cpu"),  # a host buffer at the same address, live at the end
        (5, 0xB, 40, "cpu"),
    ]
    live, peak = net_allocations(events, "cpu", exclude={0xF})
    assert live == {0xA: 100, 0xB: 40}
    assert peak == 164


class FakeCuda(CudaCounters):
    """CUDA's counters as a script: an earlier peak of 5000 bytes stays until reset."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.level = 100
        self.peak = 5000
        self.synced = True

    def synchronize(self, device: torch.device) -> None:
        self.calls.append("sync")
        self.synced = True

    def reset_peak(self, device: torch.device) -> None:
        self.calls.append("reset")
        self.peak = self.level

    def allocated(self, device: torch.device) -> int:
        self.calls.append("allocated")
        # Kernels still queued have not freed or allocated yet: reading unsynced is wrong.
        return self.level if self.synced else -1

    def max_allocated(self, device: torch.device) -> int:
        self.calls.append("max")
        return self.peak

    def run(self, grow: int, transient: int) -> None:
        self.synced = False
        self.peak = max(self.peak, self.level + grow + transient)
        self.level += grow


def test_cuda_meter_arithmetic_resets_the_peak_and_synchronizes_before_reading() -> None:
    fake = FakeCuda()
    meter = Meter("cuda:0", cuda=fake)
    with meter:
        fake.run(grow=250, transient=650)
        meter.set_output(None)
    m = meter.result
    assert m is not None
    assert (m.resident_bytes, m.peak_bytes) == (250, 900)
    assert fake.calls == ["sync", "reset", "allocated", "sync", "allocated", "max"]
    # The level the call began at is the allocator's own (FakeCuda starts at 100 bytes).
    assert (m.start_bytes, m.absolute_peak_bytes) == (100, 1000)


def test_measuring_inside_a_profiler_session_is_refused() -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]), pytest.raises(fxckpt.FxckptError, match="profiler"):
        fxckpt.measure(torch.ones, 3)


def test_a_device_without_a_meter_is_refused_by_name() -> None:
    with pytest.raises(fxckpt.FxckptError, match="'meta'.*'cpu' or 'cuda'"):
        fxckpt.measure(torch.ones, 3, device="meta")


def test_host_memory_allocated_and_freed_inside_the_call_is_not_device_memory() -> None:
    # fxckpt's host memory is left out by address where it is live at the call's end, and by
    # its marks where it was freed inside the call; a device tensor that the allocator gives
    # the same address afterwards, or gave it before, still counts.
    from fxckpt.runtime.weight_ops import adopt_host

    n = 1 << 20  # 4 MiB of float32

    def host_only() -> None:
        host = adopt_host(torch.empty(n))
        del host

    def device_around_host() -> torch.Tensor:
        before = torch.empty(n)  # device memory, freed before the host block is allocated
        del before
        host = adopt_host(torch.empty(n))  # very likely the same address
        del host
        return torch.empty(n)  # device memory again, likely the same address, returned

    assert fxckpt.measure(host_only).peak_bytes == 0
    m = fxckpt.measure(device_around_host)
    assert (m.peak_bytes, m.resident_bytes, m.output_bytes) == (4 * n, 4 * n, 4 * n)


def test_a_mark_leaves_out_the_block_live_at_its_address_at_its_time() -> None:
    # One address used three times: a device block, then a host block (marked just after its
    # allocation), then a device block left live. Only the host block is left out.
    p = 0x1000
    events = [(100, p, 8, "cpu"), (200, p, -8, "cpu"), (300, p, 64, "cpu"), (400, p, -64, "cpu"),
              (500, p, 16, "cpu")]  # fmt: skip
    assert net_allocations(events, "cpu") == ({p: 16}, 64)
    assert net_allocations(events, "cpu", marks=[(310, p)]) == ({p: 16}, 16)
    # The two clocks may disagree by a little: a mark just before an allocation takes it.
    assert net_allocations(events, "cpu", marks=[(299, p)]) == ({p: 16}, 16)
    # A mark where no block of these events lived (another thread's) leaves out nothing.
    assert net_allocations(events, "cpu", marks=[(350, 0x2000)]) == ({p: 16}, 64)
