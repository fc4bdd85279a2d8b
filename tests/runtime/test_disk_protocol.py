"""The disk tier on the real CUDA engine against the recording double of the hardware.

The double (``tests/cuda_double.py``) reports every pair of conflicting accesses CUDA would
not order; the files double reports the host's own accesses (a file write reads the pinned
staging buffer, a file read fills one) against the copies in flight. The writer and reader
jobs run inline (the double is single-threaded), so each rule is exercised in the order a
slow GPU would make hardest: nothing completes until someone waits for it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from cuda_double import FakeCuda
from files_double import FilesDouble

from fxckpt import _files
from fxckpt.runtime import disk, disk_dir, engine, profiles, stats
from runtime.conftest import install_double

OPS = torch.ops.fxckpt
DEV = torch.device("cpu")  # the double's "device": CudaEngine runs on it unchanged


@pytest.fixture
def hw(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Iterator[FakeCuda]:
    double = install_double(monkeypatch)
    files = FilesDouble()
    files.hw = double
    monkeypatch.setattr(_files, "FILES", files)
    monkeypatch.setattr(profiles.default(), "disk", None)
    disk.configure(inline=True)
    disk.use_directory(str(tmp_path))
    stats.reset()
    yield double
    disk.configure(inline=False)
    engine.configure()
    gc.collect()
    disk.collect()
    disk_dir.close_all()


class Deferred:
    """A writer that holds its jobs until the test runs them: the slowest disk."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Future[Any], Any, tuple[Any, ...]]] = []

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self.jobs.append((fut, fn, args))
        return fut

    def run_all(self) -> None:
        while self.jobs:
            fut, fn, args = self.jobs.pop(0)
            try:
                fut.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001
                fut.set_exception(err)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self.run_all()


def produce(hw: FakeCuda, n: int, seed: int) -> torch.Tensor:
    t = hw.empty(n, torch.float32, DEV)
    t.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    hw.kernel("producer", writes=[t])
    return t


def restore(h: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    ticket = OPS.prefetch(h)
    return OPS.wait(h, ticket, like.shape, like.stride(), like.dtype, like.device)


def test_a_step_through_the_disk_is_race_free_exact_and_pinned(hw: FakeCuda) -> None:
    srcs = [produce(hw, 1024 * (i + 1), seed=i) for i in range(3)]
    want = [s.clone() for s in srcs]
    handles = [OPS.offload(s, disk.DISK) for s in srcs]  # W1: each write waits for its copy
    hw.kernel("forward rest", reads=srcs)
    for h, s in zip(handles, srcs, strict=True):
        OPS.offload_done(h, s)
    for h, w in zip(reversed(handles), reversed(want), strict=True):
        got = restore(h, w)
        hw.kernel("consumer", reads=[got])
        assert torch.equal(got, w)
    assert hw.races == []
    assert hw.pageable_copies == []  # staging comes from the page-locked pool
    assert stats.snapshot()["disk_bytes"] == sum(s.numel() * 4 for s in srcs)


def test_r2_a_staging_buffer_is_refilled_only_after_its_copy_to_the_device(hw: FakeCuda) -> None:
    # Two reads of one size class share a staging buffer: the second file read must not
    # write it while the first host-to-device copy may still read it.
    srcs = [produce(hw, 2048, seed=i) for i in range(2)]
    handles = [OPS.offload(s, disk.DISK) for s in srcs]
    for h, s in zip(handles, srcs, strict=True):
        OPS.offload_done(h, s)
    hw.synchronize()
    restored = [restore(h, s) for h, s in zip(handles, srcs, strict=True)]
    assert all(torch.equal(r, s) for r, s in zip(restored, srcs, strict=True))
    assert hw.races == []


def test_a_restored_span_is_reused_by_its_copy_stream_only_after_compute_used_it(hw: FakeCuda) -> None:
    # The reader allocates on the copy stream; compute reads the span and frees it. The next
    # restore of that size gets the same block on the copy stream: record_stream must make
    # it wait for compute's read.
    srcs = [produce(hw, 4096, seed=i) for i in range(2)]
    handles = [OPS.offload(s, disk.DISK) for s in srcs]
    for h, s in zip(handles, srcs, strict=True):
        OPS.offload_done(h, s)
    hw.synchronize()
    first = restore(handles[0], srcs[0])
    hw.kernel("consumer", reads=[first], ms=50.0)
    del first
    gc.collect()
    second = restore(handles[1], srcs[1])
    assert torch.equal(second, srcs[1])
    assert hw.races == []


def test_a_source_whose_handle_dies_before_its_write_is_reused_only_after_its_copy(
    hw: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An exception in the forward: the handle and the source die while the device-to-host
    # copy into staging may still run and no writer has waited for it yet. The source's block
    # goes back to compute's free list; the next kernel there must be ordered after the copy.
    writer = Deferred()
    monkeypatch.setitem(disk._executors, "w", writer)
    src = produce(hw, 4096, seed=0)
    h = OPS.offload(src, disk.DISK)
    del h, src
    gc.collect()
    reused = hw.empty(4096, torch.float32, DEV)  # the same block, from compute's list
    hw.kernel("next step", writes=[reused])
    writer.run_all()
    disk.collect()
    assert hw.races == []
    assert disk.current() is not None and disk.current().files() == []
