"""One timed round trip through the host link, between two steps: what a plan whose own copies
are too few to measure the link learns of it.

A plan that recomputes everything it does not keep copies nothing, so the copy meter has no
figure to say that the link is faster than the plan assumed (:mod:`fxckpt.planning.adapt`,
"faster link, probed"). :func:`probe` moves one buffer to the host and back through the path
the plan's offloads would take, and times each way:

- CPU, with a link emulated (:mod:`fxckpt._link`): each way is one copy on that direction's
  queue, queued behind whatever copies are already on it, and timed by its window (or longer,
  where the memcpy overran it), as :class:`~fxckpt.runtime.engine.CpuEngine` times its own.
  Without an emulated link there is no link to probe (a RAM-to-RAM memcpy): None.
- CUDA: a page-locked host buffer and the copy streams the engine copies on (slots 0 and 1),
  timed by events; the calling thread waits for the second copy's event. The buffers are
  freed before it returns, so a probe holds no memory past its call.

Called by :mod:`fxckpt.adapt` at the start of a forward, before the compiled graph runs:
never inside a step. It touches no stats and no copy meter (the probe's copies are not the
plan's); the caller records its figure.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from fxckpt import _cuda, _link


@dataclass(frozen=True)
class Probe:
    """``nbytes`` moved each way, in ``d2h_seconds`` to the host and ``h2d_seconds`` back."""

    nbytes: int
    d2h_seconds: float
    h2d_seconds: float

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second, both ways together (the planner's figure is one way's)."""
        seconds = self.d2h_seconds + self.h2d_seconds
        return 2 * self.nbytes / seconds if seconds > 0 else None

    def describe(self) -> str:
        bw = self.bandwidth
        rate = "-" if bw is None else f"{bw / 1e6:.4g} MB/s"
        return (f"{self.nbytes} bytes each way in {self.d2h_seconds * 1e3:.3g} ms to the host "
                f"and {self.h2d_seconds * 1e3:.3g} ms back: {rate}")


def probe(device: torch.device, nbytes: int) -> Probe | None:
    """Time one round trip of ``nbytes`` between ``device`` and the host; None where the
    device has no host link to measure."""
    if device.type == "cpu":
        return _cpu(nbytes)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return _cuda_probe(device, nbytes)
    return None


def _cpu(nbytes: int) -> Probe | None:
    link = _link.current()
    if link is None:
        return None
    # Touched before the copies, so that page faults do not lengthen the first memcpy.
    dev, host = torch.ones(nbytes, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)
    d2h = link.copy("d2h", nbytes, lambda: host.copy_(dev))
    h2d = link.copy("h2d", nbytes, lambda: dev.copy_(host))
    return Probe(nbytes, d2h, h2d)


def _cuda_probe(device: torch.device, nbytes: int) -> Probe:
    cuda = _cuda.CUDA
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # page_locked takes whole pages
    with cuda.device(device):
        host = cuda.page_locked(size)[:nbytes]
        try:
            dev = cuda.empty(nbytes, torch.uint8, device)
            compute = cuda.current_stream(device)
            d2h, h2d = cuda.copy_stream(device, 0), cuda.copy_stream(device, 1)
            d2h.wait_stream(compute)  # ``dev`` was allocated (and may be zeroed) on compute
            a, b, c, d = (cuda.event(timing=True) for _ in range(4))
            with cuda.use_stream(d2h):
                a.record(d2h)
                cuda.copy(host, dev)
                b.record(d2h)
            h2d.wait_event(b)
            with cuda.use_stream(h2d):
                c.record(h2d)
                cuda.copy(dev, host)
                d.record(h2d)
            d.synchronize()  # both copies are done: ``dev`` and ``host`` can go
            return Probe(nbytes, a.elapsed_time(b) / 1e3, c.elapsed_time(d) / 1e3)
        finally:
            cuda.unlock(host)
