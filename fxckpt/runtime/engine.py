"""Copy engines: who moves bytes between device and host, and how the compute side waits.

``CudaEngine`` uses side streams and events. ``CpuEngine`` stands worker threads in for the
streams and futures for the events, with the same ordering rules, so a missing wait shows up
as wrong values in CPU tests. Nothing here is created at import: engines, streams and
threads appear on first use.

An engine works on :class:`Transfer` records; the ops module owns the records, the handle
registry and the host pool buffers, and tells the engine what to copy where.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime.pool import Completion


@dataclass(eq=False)
class Transfer:
    """One offloaded tensor: how to rebuild it, and where its bytes are right now."""

    hid: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    span: int  # elements from the first to the last one the tensor reaches, inclusive
    nbytes: int
    host: torch.Tensor | None = None  # pool buffer; None when kept on the device or empty
    kept: torch.Tensor | None = None  # fallback: the span, left on the device
    src: torch.Tensor | None = None  # the source, alive until the device-to-host copy is done
    d2h: Any = None  # Event / Future of the device-to-host copy
    h2d: Any = None  # Event / Future of the latest host-to-device copy
    dev: torch.Tensor | None = None  # prefetched span on the device, until a wait takes it
    src_stream: Any = None  # CUDA stream the source was produced on
    dev_stream: Any = None  # CUDA stream ``dev`` was allocated on
    error: str | None = None  # an injected failure (CUDA has no worker to raise in)

    def describe(self) -> str:
        return (
            f"handle {self.hid} ({self.dtype}, size {list(self.size)}, stride {list(self.stride)}, "
            f"{self.nbytes} bytes, {self.device})"
        )


class Engine(Protocol):
    device: torch.device

    def start_offload(self, rec: Transfer, span: torch.Tensor, host: torch.Tensor) -> None:
        """Begin copying ``span`` (uint8, on the device) into ``host``; sets ``rec.d2h``."""

    def finish_offload(self, rec: Transfer) -> float:
        """Make compute wait for the device-to-host copy; returns seconds the caller blocked."""

    def start_prefetch(self, rec: Transfer) -> None:
        """Allocate ``rec.dev`` on compute and begin the host-to-device copy into it."""

    def finish_prefetch(self, rec: Transfer) -> tuple[torch.Tensor, float]:
        """Make compute wait for the prefetch; returns the span and seconds blocked."""

    def release(self, rec: Transfer) -> tuple[Completion, ...]:
        """Drop device references safely; returns when the host buffer may be reused."""

    def shutdown(self) -> None: ...


@dataclass
class _Config:
    copy_delay_s: float = 0.0
    copy_streams: int = 1
    fail_next_copies: int = 0
    unsafe_skip_waits: bool = False
    poison_fresh: bool = False


_config = _Config()
_config_lock = threading.Lock()


def configure(
    copy_delay_s: float = 0.0,
    copy_streams: int | None = None,
    fail_next_copies: int = 0,
    unsafe_skip_waits: bool = False,
    poison_fresh: bool = False,
) -> None:
    """Set the engines' knobs. Each call resets the testing knobs to the values given.

    ``copy_streams`` (``None``: unchanged) is the number of streams, or worker threads, per
    direction. The rest exist for tests: ``copy_delay_s`` delays every copy,
    ``fail_next_copies`` makes the next N copies fail, ``unsafe_skip_waits`` turns
    ``offload_done`` and ``wait`` into no-ops so a test can prove a missing wait is caught, and
    ``poison_fresh`` fills every fresh prefetch buffer with 0xFF bytes so that reading it
    before its copy lands cannot match the source by luck.
    """
    if copy_streams is not None and (not isinstance(copy_streams, int) or copy_streams < 1):
        raise ValueError(f"copy_streams must be an int >= 1, got {copy_streams!r}")
    if copy_delay_s < 0 or fail_next_copies < 0:
        raise ValueError("copy_delay_s and fail_next_copies must be >= 0")
    with _config_lock:
        _config.copy_delay_s = float(copy_delay_s)
        _config.fail_next_copies = int(fail_next_copies)
        _config.unsafe_skip_waits = bool(unsafe_skip_waits)
        _config.poison_fresh = bool(poison_fresh)
        if copy_streams is not None:
            _config.copy_streams = copy_streams


def set_copy_streams(n: int) -> None:
    """Streams (CPU: worker threads) per direction, leaving the testing knobs alone.

    The backend calls this at compile time; calling :func:`configure` there would reset a
    delay or failure that a test injected before compiling.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"copy_streams must be an int >= 1, got {n!r}")
    with _config_lock:
        _config.copy_streams = n


def _copy_plan() -> tuple[float, bool]:
    """This copy's delay, and whether it must fail (consumes one injected failure)."""
    with _config_lock:
        fail = _config.fail_next_copies > 0
        if fail:
            _config.fail_next_copies -= 1
        return _config.copy_delay_s, fail


def _injected(direction: str) -> str:
    return f"injected {direction} copy failure (engine.configure(fail_next_copies=...))"


def _fresh_span(rec: Transfer) -> torch.Tensor:
    # torch.empty on the current stream: the caching allocator ties the block to the compute
    # stream, which is what makes freeing it after the wait safe (pytorch#106360).
    dev = torch.empty(rec.span, dtype=rec.dtype, device=rec.device)
    if _config.poison_fresh:
        dev.view(torch.uint8).fill_(0xFF)
    return dev


class CpuEngine:
    """Worker threads as copy streams, futures as events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.Lock()
        # (workers, d2h, h2d) in one tuple so that readers outside the lock see a
        # consistent triple.
        self._state: tuple[int, ThreadPoolExecutor, ThreadPoolExecutor] | None = None

    def _executors(self) -> tuple[int, ThreadPoolExecutor, ThreadPoolExecutor]:
        n = _config.copy_streams
        state = self._state
        if state is not None and state[0] == n:
            return state
        with self._lock:
            old = self._state
            if old is None or old[0] != n:
                self._state = (
                    n,
                    ThreadPoolExecutor(n, thread_name_prefix="fxckpt-d2h"),
                    ThreadPoolExecutor(n, thread_name_prefix="fxckpt-h2d"),
                )
                if old is not None:  # queued copies still run: in-flight handles need them
                    old[1].shutdown(wait=False)
                    old[2].shutdown(wait=False)
            assert self._state is not None
            return self._state

    def start_offload(self, rec: Transfer, span: torch.Tensor, host: torch.Tensor) -> None:
        delay, fail = _copy_plan()
        views = [span, host]

        def copy() -> None:
            # The worker lets go of the views before the future completes: the executor keeps
            # a finished work item until its next one, so the worker could otherwise hold the
            # last reference to the source after compute dropped rec.src, and free device
            # memory on a thread the CPU memory meter does not see.
            try:
                if delay:
                    time.sleep(delay)
                if fail:
                    raise RuntimeError(_injected("device-to-host"))
                views[1].copy_(views[0])
            finally:
                views.clear()

        rec.d2h = self._executors()[1].submit(copy)

    def finish_offload(self, rec: Transfer) -> float:
        if _config.unsafe_skip_waits:
            return 0.0
        stalled = _block_on(rec.d2h, rec, "device-to-host")
        rec.src = None
        return stalled

    def start_prefetch(self, rec: Transfer) -> None:
        dev = _fresh_span(rec)
        out = dev.view(torch.uint8)
        assert rec.host is not None
        host = rec.host[: rec.nbytes]
        offloaded: Future[None] = rec.d2h
        delay, fail = _copy_plan()

        def copy() -> None:
            # The H2D "stream" waits for the D2H "event", like CudaEngine's wait_event.
            try:
                err = offloaded.exception()
            except BaseException as cancelled:
                err = cancelled
            if err is not None:
                raise RuntimeCopyError(
                    f"fxckpt: the device-to-host copy of offloaded {rec.describe()} failed "
                    f"earlier, so it cannot be restored: {err!r}"
                ) from err
            if delay:
                time.sleep(delay)
            if fail:
                raise RuntimeError(_injected("host-to-device"))
            out.copy_(host)

        rec.h2d = self._executors()[2].submit(copy)
        rec.dev = dev

    def finish_prefetch(self, rec: Transfer) -> tuple[torch.Tensor, float]:
        dev = rec.dev
        assert dev is not None
        stalled = 0.0 if _config.unsafe_skip_waits else _block_on(rec.h2d, rec, "host-to-device")
        rec.dev = None
        return dev, stalled

    def release(self, rec: Transfer) -> tuple[Completion, ...]:
        done = tuple(f.done for f in (rec.d2h, rec.h2d) if f is not None)
        # A failed copy's future holds the worker's traceback, whose frame holds `rec`:
        # clearing the fields breaks that cycle now instead of at the next gc pass.
        rec.dev = rec.src = rec.d2h = rec.h2d = None
        return done

    def shutdown(self) -> None:
        with self._lock:
            state, self._state = self._state, None
        if state is not None:
            for ex in state[1:]:
                ex.shutdown(wait=True, cancel_futures=True)


def _block_on(fut: Future[None], rec: Transfer, direction: str) -> float:
    """Wait for ``fut``; a failed copy becomes a RuntimeCopyError, never a hang."""
    start = None if fut.done() else time.perf_counter()
    # fut.exception(), not fut.result(): re-raising the stored exception would append this
    # thread's frames, which hold the handle, to a traceback that the future (and so the
    # handle's own record) keeps alive: the handle could then never be freed.
    try:
        err = fut.exception()
    except BaseException as cancelled:  # CancelledError: shutdown_all() dropped the copy
        err = cancelled
    if isinstance(err, RuntimeCopyError):
        raise RuntimeCopyError(str(err)) from err
    if err is not None:
        raise RuntimeCopyError(
            f"fxckpt: the {direction} copy of offloaded {rec.describe()} failed: {err!r}"
        ) from err
    return 0.0 if start is None else time.perf_counter() - start


# torch.cuda._sleep spins for a number of GPU clock cycles; ~1.5 GHz turns seconds into cycles
# closely enough for an injected delay.
_CYCLES_PER_S = 1_500_000_000


class CudaEngine:
    """Side streams and events. Streams are made once: torch hands out streams round-robin
    from a pool of 32 per priority, so making them per call would alias other users'."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._streams: dict[str, list[torch.cuda.Stream]] = {"d2h": [], "h2d": []}
        self._turn = itertools.count()

    def _stream(self, direction: str) -> torch.cuda.Stream:
        n = _config.copy_streams
        with self._lock:
            streams = self._streams[direction]
            while len(streams) < n:
                streams.append(torch.cuda.Stream(self.device))
            return streams[next(self._turn) % n]

    def _delay(self, delay: float) -> None:
        if delay:
            torch.cuda._sleep(int(delay * _CYCLES_PER_S))

    def start_offload(self, rec: Transfer, span: torch.Tensor, host: torch.Tensor) -> None:
        delay, fail = _copy_plan()
        compute = torch.cuda.current_stream(self.device)
        side = self._stream("d2h")
        side.wait_stream(compute)  # the source is written by kernels already queued on compute
        done = torch.cuda.Event()
        with torch.cuda.stream(side):
            self._delay(delay)
            if fail:
                rec.error = _injected("device-to-host")
            else:
                host.copy_(span, non_blocking=True)
            done.record(side)
        # The source stays referenced (rec.src) until compute has waited on `done`: freeing
        # it earlier would let the allocator hand its block to a kernel while the copy reads.
        rec.d2h = done
        rec.src_stream = compute

    def finish_offload(self, rec: Transfer) -> float:
        if not _config.unsafe_skip_waits:
            torch.cuda.current_stream(self.device).wait_event(rec.d2h)
        rec.src = None
        if rec.error is not None:
            raise RuntimeCopyError(f"fxckpt: offload of {rec.describe()} failed: {rec.error}")
        # The compute stream waits on the GPU; the host does not block, so nothing to count.
        return 0.0

    def start_prefetch(self, rec: Transfer) -> None:
        delay, fail = _copy_plan()
        compute = torch.cuda.current_stream(self.device)
        dev = _fresh_span(rec)
        assert rec.host is not None
        host = rec.host[: rec.nbytes]
        side = self._stream("h2d")
        # pytorch#106360: `dev` may be a block that compute freed but queued kernels still
        # use; the copy must not start before compute reaches this point.
        side.wait_stream(compute)
        side.wait_event(rec.d2h)
        done = torch.cuda.Event()
        with torch.cuda.stream(side):
            self._delay(delay)
            if fail:
                rec.error = rec.error or _injected("host-to-device")
            else:
                dev.view(torch.uint8).copy_(host, non_blocking=True)
            done.record(side)
        rec.h2d = done
        rec.dev = dev
        rec.dev_stream = compute

    def finish_prefetch(self, rec: Transfer) -> tuple[torch.Tensor, float]:
        dev = rec.dev
        assert dev is not None
        compute = torch.cuda.current_stream(self.device)
        if not _config.unsafe_skip_waits:
            compute.wait_event(rec.h2d)
        if compute != rec.dev_stream:
            dev.record_stream(compute)  # allocated on another stream: tell the allocator
        rec.dev = None
        if rec.error is not None:
            raise RuntimeCopyError(f"fxckpt: restoring {rec.describe()} failed: {rec.error}")
        return dev, 0.0

    def release(self, rec: Transfer) -> tuple[Completion, ...]:
        # Dropped without its wait (exception mid-step, backward never run): the copies may
        # still be running. Make the allocating stream wait for them before the blocks can
        # be reused; that is a queued wait, safe to issue from a GC callback.
        if rec.dev is not None and rec.h2d is not None:
            rec.dev_stream.wait_event(rec.h2d)
        if rec.src is not None and rec.d2h is not None:
            rec.src_stream.wait_event(rec.d2h)
        rec.dev = rec.src = None
        return tuple(e.query for e in (rec.d2h, rec.h2d) if e is not None)

    def shutdown(self) -> None:
        with self._lock:
            self._streams = {"d2h": [], "h2d": []}


_engines: dict[torch.device, Engine] = {}
_engines_lock = threading.Lock()


def get_engine(device: torch.device | str) -> Engine:
    """The engine for ``device`` (one per device), created on first use."""
    device = torch.device(device)
    engine = _engines.get(device)
    if engine is not None:
        return engine
    if device.type == "cuda" and device.index is None:
        return get_engine(torch.device("cuda", torch.cuda.current_device()))
    with _engines_lock:
        engine = _engines.get(device)
        if engine is None:
            if device.type == "cuda":
                engine = CudaEngine(device)
            elif device.type == "cpu":
                engine = CpuEngine(device)
            else:
                raise RuntimeCopyError(
                    f"fxckpt: offloading from {device.type!r} tensors is not supported; "
                    "only cuda and cpu have copy engines"
                )
            _engines[device] = engine
        return engine


def shutdown_all() -> None:
    """Stop every engine's threads and forget its streams; later calls start afresh."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for engine in engines:
        engine.shutdown()
