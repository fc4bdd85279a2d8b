"""The CUDA copy engine: dedicated copy streams, events, and stall figures read lazily.

Every CUDA call goes through ``fxckpt._cuda.CUDA``, so the tests can run this exact code
against a recording double of the hardware and check each ordering rule below
(``tests/runtime/test_cuda_protocol.py``):

1. the device-to-host copy starts after the kernels that produced its source
   (``side.wait_stream(compute)`` in :meth:`start_offload`);
2. the source's memory is reused only after that copy has read it: compute waits on the
   copy's event before the source is dropped (:meth:`finish_offload`, and :meth:`release`
   when the handle dies first), and ``rec.src`` keeps the source alive until then;
3. the host-to-device copy starts after the device-to-host copy
   (``side.wait_event(rec.d2h)``) and after compute reached the prefetch, whose buffer may be
   a block that queued kernels still use (``side.wait_stream(compute)``, pytorch#106360);
4. compute reads the restored tensor only after its copy (``compute.wait_event(rec.h2d)``),
   and the allocator learns of a compute stream other than the allocating one
   (``record_stream``);
5. a pinned buffer is reused only after every copy that touched it completed (the
   ``Event.query`` callables :meth:`release` hands the pool).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fxckpt import _cuda
from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import copy_meter, stats
from fxckpt.runtime.engine import Transfer, _config, _copy_plan, _injected
from fxckpt.runtime.pool import Completion

_D2H, _H2D = 0, 1


class CudaEngine:
    """Side streams and events for one device, ``streams`` copy streams per direction.

    Engines of one device with different stream counts share the lower slots' streams
    (``fxckpt._cuda`` makes each slot once per process): the ordering rules hold per transfer,
    whatever stream another engine queues on.
    """

    def __init__(self, device: torch.device, streams: int = 1) -> None:
        self.device = device
        self.streams = streams
        self._lock = threading.Lock()
        self._turn = [0, 0]
        # Timing event pairs not read yet: (start, end) of each copy, and (reached, released)
        # around each compute-side wait, each with the graph's copy meter and the bytes
        # copied. Each deque holds pairs of one stream kind, which complete in order, so
        # reading stops at the first pair still in flight.
        self._timed: dict[str, deque[tuple[Any, Any, Any, int]]] = {
            "copy_seconds": deque(),
            "stall_seconds": deque(),
        }
        self._reading = threading.Lock()

    def _stream(self, direction: int) -> Any:
        n = self.streams
        with self._lock:
            turn = self._turn[direction]
            self._turn[direction] = turn + 1
        # Slots 0, 2, 4... copy to the host, 1, 3, 5... back: one engine per direction each.
        return _cuda.CUDA.copy_stream(self.device, 2 * (turn % n) + direction)

    def _copy(self, side: Any, rec: Transfer, copies: Iterable[tuple[torch.Tensor, torch.Tensor]],
              delay: float, fail: bool, direction: str) -> tuple[Any, Any]:
        """Queue each ``(destination, source)`` copy on ``side`` between two timing events,
        ``(start, done)``: the offload's and the prefetch's copies alike (a bucket: its copies,
        then one event for them all). An injected failure copies nothing and is noted in
        ``rec.error`` (the first one kept: an offload starts with none)."""
        cuda = _cuda.CUDA
        start, done = cuda.event(timing=True), cuda.event(timing=True)
        with cuda.use_stream(side):
            start.record(side)
            if delay:
                cuda.sleep(delay)
            if fail:
                rec.error = rec.error or _injected(direction)
            else:
                for dst, src in copies:
                    cuda.copy(dst, src)
            done.record(side)
        return start, done

    def start_offload(self, rec: Transfer, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]
                      ) -> None:
        cuda = _cuda.CUDA
        self.read_timings()
        delay, fail = _copy_plan()
        compute = cuda.current_stream(self.device)
        side = self._stream(_D2H)
        side.wait_stream(compute)  # the source is written by kernels already queued on compute
        start, done = self._copy(side, rec, ((host, span) for span, host in copies), delay, fail,
                                 "device-to-host")
        # The source stays referenced (rec.src) until compute has waited on `done`: freeing
        # it earlier would let the allocator hand its block to a kernel while the copy reads.
        rec.d2h = done
        rec.src_stream = compute
        self._timed["copy_seconds"].append((start, done, rec.meter, rec.nbytes))
        stats.add("copy_handoffs", 1)

    def finish_offload(self, rec: Transfer) -> float:
        if not _config.unsafe_skip_waits:
            self._join(_cuda.CUDA.current_stream(self.device), rec.d2h, rec.meter)
        rec.src = None
        if rec.error is not None:
            raise RuntimeCopyError(f"fxckpt: offload of {rec.describe()} failed: {rec.error}")
        # The host never blocks here; the compute stream's wait is timed by events and
        # counted when read (read_timings).
        return 0.0

    def start_prefetch(self, rec: Transfer) -> None:
        cuda = _cuda.CUDA
        self.read_timings()
        delay, fail = _copy_plan()
        compute = cuda.current_stream(self.device)
        # Allocated on compute: the caching allocator ties each block to the stream that will
        # read it, so freeing it after the wait is safe (pytorch#106360). A bucket's members
        # get a block each, so each is freed at its own last use.
        devs = [cuda.empty(part.span, rec.dtype, self.device) for part in rec.parts]
        if _config.poison_fresh:
            for dev in devs:
                dev.view(torch.uint8).fill_(0xFF)
        assert rec.host is not None
        hosts = rec.host_views(rec.host)
        side = self._stream(_H2D)
        # `dev` may be a block that compute freed but queued kernels still use; the copy must
        # not start before compute reaches this point.
        side.wait_stream(compute)
        if not rec.borrowed:  # a streamed weight's bytes were on the host from the start
            side.wait_event(rec.d2h)
        start, done = self._copy(side, rec, ((dev.view(torch.uint8), host) for dev, host
                                             in zip(devs, hosts, strict=True)), delay, fail,
                                 "host-to-device")
        rec.h2d = done
        rec.dev = devs
        rec.dev_stream = compute
        self._timed["copy_seconds"].append((start, done, rec.meter, rec.nbytes))
        stats.add("copy_handoffs", 1)

    def finish_prefetch(self, rec: Transfer) -> tuple[list[torch.Tensor], float]:
        cuda = _cuda.CUDA
        devs = rec.dev
        assert devs is not None
        compute = cuda.current_stream(self.device)
        if not _config.unsafe_skip_waits:
            self._join(compute, rec.h2d, rec.meter)
        if compute != rec.dev_stream:
            for dev in devs:  # allocated on another stream: tell the allocator
                cuda.record_stream(dev, compute)
        rec.dev = None
        if rec.error is not None:
            raise RuntimeCopyError(f"fxckpt: restoring {rec.describe()} failed: {rec.error}")
        return devs, 0.0

    def wait_copied(self, d2h: Any, rec: Transfer) -> None:
        # The disk tier's writer thread reads the pinned buffer next: the host must see the
        # copy complete (disk.py, rule W1).
        d2h.synchronize()
        if rec.error is not None:
            raise RuntimeCopyError(f"fxckpt: offload of {rec.describe()} failed: {rec.error}")

    def restore_sync(self, rec: Transfer, host: torch.Tensor) -> torch.Tensor:
        # Runs on the disk tier's reader thread, whose current stream is not compute's. The
        # span is allocated on the copy stream that fills it, so the caching allocator
        # orders its reuse there; adopt() then names compute with record_stream.
        cuda = _cuda.CUDA
        delay, fail = _copy_plan()
        with cuda.device(self.device):
            side = self._stream(_H2D)
            with cuda.use_stream(side):
                dev = cuda.empty(rec.parts[0].span, rec.dtype, self.device)
                if _config.poison_fresh:
                    dev.view(torch.uint8).fill_(0xFF)
                start, done = cuda.event(timing=True), cuda.event(timing=True)
                start.record(side)
                if delay:
                    cuda.sleep(delay)
                if fail:
                    raise RuntimeCopyError(f"fxckpt: restoring {rec.describe()} failed: "
                                           f"{_injected('host-to-device')}")
                cuda.copy(dev.view(torch.uint8), host)
                done.record(side)
        # The host buffer is given back when this returns (disk.py, rule R2), and compute
        # takes the span without another wait: both need the copy complete now.
        done.synchronize()
        self._timed["copy_seconds"].append((start, done, None, rec.nbytes))
        return dev

    def adopt(self, rec: Transfer, dev: torch.Tensor) -> torch.Tensor:
        cuda = _cuda.CUDA
        # Allocated on a copy stream: compute's use must hold the block until compute is done.
        cuda.record_stream(dev, cuda.current_stream(self.device))
        return dev

    def release(self, rec: Transfer) -> tuple[Completion, ...]:
        # Dropped without its wait (exception mid-step, backward never run): the copies may
        # still be running. Make the allocating stream wait for them before the blocks can
        # be reused; that is a queued wait, safe to issue from a GC callback.
        if rec.dev is not None and rec.h2d is not None:
            rec.dev_stream.wait_event(rec.h2d)
        if rec.src is not None and rec.d2h is not None:
            rec.src_stream.wait_event(rec.d2h)
        rec.dev = rec.src = None
        if rec.borrowed:  # a streamed weight's: no pool buffer waits on its copies
            return ()
        return tuple(e.query for e in (rec.d2h, rec.h2d) if e is not None)

    def _join(self, compute: Any, copied: Any, meter: Any = None) -> None:
        """``compute.wait_event(copied)``, timed when the copy may still be running.

        The pair of timing events brackets the wait on the compute stream: the time between
        them is how long compute sat idle for the copy. A copy the host has seen complete
        (``query`` does not synchronize) needs neither: work issued from now on starts after
        it anyway.
        """
        if copied.query():
            return
        cuda = _cuda.CUDA
        reached, released = cuda.event(timing=True), cuda.event(timing=True)
        reached.record(compute)
        compute.wait_event(copied)
        released.record(compute)
        self._timed["stall_seconds"].append((reached, released, meter, 0))

    def read_timings(self) -> None:
        """Count the copy and stall times whose events have completed; never blocks."""
        if not self._reading.acquire(blocking=False):
            return  # another thread is reading them
        try:
            for name, pairs in self._timed.items():
                total = 0.0
                while pairs and pairs[0][1].query():
                    first, last, meter, nbytes = pairs.popleft()
                    seconds = first.elapsed_time(last) / 1e3
                    total += seconds
                    if name == "copy_seconds":
                        copy_meter.add_copy(meter, nbytes, seconds)
                    else:
                        copy_meter.add_stall(meter, seconds)
                if total:
                    stats.add(name, total)
        finally:
            self._reading.release()

    def drop_timings(self) -> None:
        """Forget the event pairs not read yet (:func:`fxckpt.runtime.stats.reset`): they
        time copies and stalls issued before the reset. Nothing waits for them."""
        with self._reading:
            for pairs in self._timed.values():
                pairs.clear()

    def shutdown(self) -> None:
        # Streams are the process's (fxckpt._cuda keeps them): nothing to tear down, and the
        # pending timings are counted if they are done.
        self.read_timings()


def _drop_pending_timings() -> None:
    from fxckpt.runtime.engine import _engines

    for engine in list(_engines.values()):
        if isinstance(engine, CudaEngine):
            engine.drop_timings()


stats.add_resetter(_drop_pending_timings)
