"""The link probe (``fxckpt.runtime.link_probe``): the CPU's through the emulated link, the
CUDA one against the recording double (each ordering rule). No test asserts a duration
beyond what the emulated link guarantees (a window lasts at least bytes / bandwidth)."""

from __future__ import annotations

import torch

import fxckpt
from fxckpt.runtime import link_probe

DEV = torch.device("cpu")  # the double's "device" (tests/runtime/conftest.py)


def test_the_cpu_probe_times_each_way_on_the_emulated_link() -> None:
    n = 1 << 20
    with fxckpt.emulate_link(bandwidth="100MB/s"):
        got = link_probe.probe(torch.device("cpu"), n)
    assert got is not None and got.nbytes == n
    # Each way takes its window at least (less a clock's rounding: 6e-14 s was seen).
    window = n / 100e6 * (1 - 1e-9)
    assert got.d2h_seconds >= window and got.h2d_seconds >= window
    assert got.bandwidth is not None and got.bandwidth <= 100e6 * (1 + 1e-9)


def test_no_probe_without_a_link() -> None:
    with fxckpt.emulate_link(None):
        assert link_probe.probe(torch.device("cpu"), 1 << 16) is None
    assert link_probe.probe(torch.device("meta"), 1 << 16) is None


def test_the_cuda_probe_is_race_free_page_locked_and_holds_nothing_after(hw) -> None:
    before = hw.live_blocks()
    got = link_probe._cuda_probe(DEV, 1 << 16)
    assert hw.races == [] and hw.pageable_copies == []
    assert got.nbytes == 1 << 16 and got.d2h_seconds > 0 and got.h2d_seconds > 0
    assert hw.locked_bytes() == 0  # the page-locked buffer was unlocked
    assert hw.live_blocks() == before  # and the device buffer freed


def test_the_cuda_probe_waits_for_kernels_still_using_its_device_block(hw) -> None:
    # A block that queued kernels on compute still use, freed: the allocator hands it to the
    # probe's device buffer, which the copy streams then read and write.
    t = hw.empty(1 << 14, torch.float32, DEV)
    hw.kernel("producer", writes=[t])
    hw.kernel("consumer", reads=[t])
    del t
    link_probe._cuda_probe(DEV, 1 << 16)
    assert hw.races == []
