"""Copy engines: who moves bytes between device and host, and how the compute side waits.

``CudaEngine`` (``cuda_engine.py``) uses side streams and events. ``CpuEngine`` stands worker
threads in for the streams and futures for the events, with the same ordering rules, so a
missing wait shows up as wrong values in CPU tests. Nothing here is created at import: engines, streams and
threads appear on first use.

An engine works on :class:`Transfer` records; the ops module owns the records, the handle
registry and the host pool buffers, and tells the engine what to copy where. There is one
engine per device and stream count: each runtime profile (``profiles.py``) copies on the
engine of its ``copy_streams``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fxckpt import _link
from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import copy_meter, stats
from fxckpt.runtime.pool import Completion


@dataclass(frozen=True)
class Part:
    """One tensor of a transfer: how to rebuild it, and where its bytes sit in the host buffer."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    span: int  # elements from the first to the last one the tensor reaches, inclusive
    offset: int  # bytes from the start of the transfer's host buffer
    nbytes: int


@dataclass(eq=False)
class Transfer:
    """One offload: one tensor, or a bucket of them copied together (one host buffer, one
    copy each way, one event), and where their bytes are right now."""

    hid: int
    parts: tuple[Part, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int  # of the host buffer the parts share
    host: torch.Tensor | None = None  # pool buffer; None when kept on the device or empty
    kept: Any = None  # fallback: the span (a list of spans for a bucket), left on the device
    src: Any = None  # the source(s), alive until the device-to-host copy is done
    d2h: Any = None  # Event / Future of the device-to-host copy
    h2d: Any = None  # Event / Future of the latest host-to-device copy
    dev: list[torch.Tensor] | None = None  # prefetched spans on the device, until a wait takes them
    src_stream: Any = None  # CUDA stream the source was produced on
    dev_stream: Any = None  # CUDA stream ``dev`` was allocated on
    error: str | None = None  # an injected failure (CUDA has no worker to raise in)
    disk: Any = None  # the disk tier's DiskCopy, for a tensor that goes to a file
    d2h_end: float = 0.0  # emulated link: when the device-to-host copy's window closes
    # The runtime profile (profiles.Profile) of the graph that started the transfer: its
    # engine, host pool and disk folder serve every later op on this handle.
    profile: Any = None
    # The copy meter (runtime.copy_meter) of the compiled graph whose forward started it.
    meter: Any = None
    # ``host`` is a streamed weight's own storage (no device-to-host copy came first) or its
    # gradient's host tensor, not a pool buffer: nothing goes back to the pool
    # (runtime/weight_ops.py).
    borrowed: bool = False
    # A streamed weight's gradient (``fxckpt::grad_offload``): the host tensor its copy fills,
    # handed to autograd by ``fxckpt::grad_host``.
    landing: torch.Tensor | None = None

    @property
    def size(self) -> tuple[int, ...]:
        return self.parts[0].size

    @property
    def stride(self) -> tuple[int, ...]:
        return self.parts[0].stride

    @property
    def span(self) -> int:
        return self.parts[0].span

    def describe(self) -> str:
        if len(self.parts) > 1:
            return (f"handle {self.hid} (a bucket of {len(self.parts)} {self.dtype} tensors, "
                    f"{self.nbytes} bytes, {self.device})")
        return (
            f"handle {self.hid} ({self.dtype}, size {list(self.size)}, stride {list(self.stride)}, "
            f"{self.nbytes} bytes, {self.device})"
        )

    def host_views(self, host: torch.Tensor) -> list[torch.Tensor]:
        """Each part's bytes in the host buffer ``host``."""
        return [host[p.offset : p.offset + p.nbytes] for p in self.parts]


class Engine(Protocol):
    device: torch.device

    def start_offload(self, rec: Transfer, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]
                      ) -> None:
        """Begin copying each ``(span, host)`` pair (uint8; the span on the device) as one copy
        with one completion; sets ``rec.d2h``."""

    def finish_offload(self, rec: Transfer) -> float:
        """Make compute wait for the device-to-host copy; returns seconds the caller blocked."""

    def start_prefetch(self, rec: Transfer) -> None:
        """Allocate ``rec.dev`` (one span per part) on compute and begin the host-to-device
        copy into it."""

    def finish_prefetch(self, rec: Transfer) -> tuple[list[torch.Tensor], float]:
        """Make compute wait for the prefetch; returns the spans and seconds blocked."""

    def release(self, rec: Transfer) -> tuple[Completion, ...]:
        """Drop device references safely; returns when the host buffer may be reused."""

    def wait_copied(self, d2h: Any, rec: Transfer) -> None:
        """Block the calling (worker) thread until the device-to-host copy ``d2h`` is complete."""

    def restore_sync(self, rec: Transfer, host: torch.Tensor) -> torch.Tensor:
        """On a worker thread: a fresh device span holding ``host``'s bytes, copied completely
        before this returns (``host`` may be reused at once)."""

    def adopt(self, rec: Transfer, dev: torch.Tensor) -> torch.Tensor:
        """Hand compute a span :meth:`restore_sync` made on another thread."""

    def shutdown(self) -> None: ...


@dataclass
class _Config:
    copy_delay_s: float = 0.0
    fail_next_copies: int = 0
    unsafe_skip_waits: bool = False
    poison_fresh: bool = False


_config = _Config()
_config_lock = threading.Lock()


def configure(
    copy_delay_s: float = 0.0,
    fail_next_copies: int = 0,
    unsafe_skip_waits: bool = False,
    poison_fresh: bool = False,
) -> None:
    """Set the engines' testing knobs; each call resets them all to the values given.

    ``copy_delay_s`` delays every copy, ``fail_next_copies`` makes the next N copies fail,
    ``unsafe_skip_waits`` turns ``offload_done`` and ``wait`` into no-ops so a test can prove a
    missing wait is caught, and ``poison_fresh`` fills every fresh prefetch buffer with 0xFF
    bytes so that reading it before its copy lands cannot match the source by luck. (The
    stream count is a runtime profile's: ``copy_streams``.)
    """
    if copy_delay_s < 0 or fail_next_copies < 0:
        raise ValueError("copy_delay_s and fail_next_copies must be >= 0")
    with _config_lock:
        _config.copy_delay_s = float(copy_delay_s)
        _config.fail_next_copies = int(fail_next_copies)
        _config.unsafe_skip_waits = bool(unsafe_skip_waits)
        _config.poison_fresh = bool(poison_fresh)


def _copy_plan() -> tuple[float, bool]:
    """This copy's delay, and whether it must fail (consumes one injected failure)."""
    with _config_lock:
        fail = _config.fail_next_copies > 0
        if fail:
            _config.fail_next_copies -= 1
        return _config.copy_delay_s, fail


def _injected(direction: str) -> str:
    return f"injected {direction} copy failure (engine.configure(fail_next_copies=...))"


def _fresh_span(rec: Transfer, part: Part) -> torch.Tensor:
    dev = torch.empty(part.span, dtype=rec.dtype, device=rec.device)
    if _config.poison_fresh:
        dev.view(torch.uint8).fill_(0xFF)
    return dev


_DIRECTIONS = {"d2h": "device-to-host", "h2d": "host-to-device"}


def _copy_job(tensors: list[tuple[torch.Tensor, torch.Tensor]], direction: str, nbytes: int,
              link: Any, window: Any, meter: Any, delay: float, fail: bool
              ) -> Callable[[], None]:
    """A worker's copy of each ``(source, destination)`` pair of ``tensors``, in the link's
    ``window`` where one is emulated, timed into ``meter``. Each pair is let go of as soon as
    it has copied; a failed copy lets go of them all."""

    def move() -> None:
        while tensors:
            src, dst = tensors.pop()
            dst.copy_(src)
            del src, dst

    def copy() -> None:
        started = time.perf_counter()
        if delay:
            time.sleep(delay)
        if fail:
            tensors.clear()
            raise RuntimeError(_injected(_DIRECTIONS[direction]))
        if link is None or window is None:
            move()
            took = time.perf_counter() - started
        else:
            took = link.run_window(direction, nbytes, move, *window)
        stats.add("copy_seconds", took)
        copy_meter.add_copy(meter, nbytes, took)

    return copy


class CpuEngine:
    """Worker threads as copy streams, futures as events.

    With a link emulated (:mod:`fxckpt._link`), each copy takes a window on its direction's
    queue when it is handed to a worker, moves its bytes late in that window, and completes
    (its future resolves) only once the window has closed; ``copy_seconds`` then counts the
    windows. Threads that wait for a copy sleep on its future.
    """

    def __init__(self, device: torch.device, streams: int = 1) -> None:
        self.device = device
        self.streams = streams  # worker threads per direction
        self._lock = threading.Lock()
        # (d2h, h2d) in one tuple so that readers outside the lock see a consistent pair.
        self._state: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None

    def _executors(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        state = self._state
        if state is not None:
            return state
        with self._lock:
            if self._state is None:
                n = self.streams
                self._state = (ThreadPoolExecutor(n, thread_name_prefix=f"fxckpt-d2h-{n}"),
                               ThreadPoolExecutor(n, thread_name_prefix=f"fxckpt-h2d-{n}"))
            return self._state

    def start_offload(self, rec: Transfer, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]
                      ) -> None:
        delay, fail = _copy_plan()
        # The job lets go of every tensor as soon as it has copied: the executor keeps a done
        # job alive until its thread next runs. Held then, a source could be freed on the
        # worker's thread, which the CPU memory meter does not see, and a host buffer could
        # outlive the pool's accounting of it (the pool may already have freed and replaced it).
        tensors = list(copies)
        del copies
        nbytes = sum(dst.numel() for _, dst in tensors)
        # An emulated link queues the copy now, as a copy stream would: the window is fixed
        # in submission order, whichever worker thread runs it.
        link = _link.current()
        window = link.occupy("d2h", nbytes) if link is not None else None
        if window is not None:
            rec.d2h_end = window[1]
        copy = _copy_job(tensors, "d2h", nbytes, link, window, rec.meter, delay, fail)
        stats.add("copy_handoffs", 1)
        rec.d2h = self._executors()[0].submit(copy)

    def finish_offload(self, rec: Transfer) -> float:
        if _config.unsafe_skip_waits:
            return 0.0
        stalled = _block_on(rec.d2h, rec, "device-to-host")
        rec.src = None
        return stalled

    def start_prefetch(self, rec: Transfer) -> None:
        dev = [_fresh_span(rec, part) for part in rec.parts]
        assert rec.host is not None
        # (host bytes, device span) pairs, let go of after the copy
        tensors = [(h, d.view(torch.uint8)) for d, h in zip(dev, rec.host_views(rec.host),
                                                             strict=True)]
        offloaded: Future[None] = rec.d2h
        delay, fail = _copy_plan()
        nbytes = sum(host.numel() for host, _ in tensors)
        link = _link.current()
        # Queued behind the copies before it on the H2D queue, and not before the bytes have
        # reached the host (the D2H window's end).
        window = link.occupy("h2d", nbytes, rec.d2h_end) if link is not None else None
        restore = _copy_job(tensors, "h2d", nbytes, link, window, rec.meter, delay, fail)

        def copy() -> None:
            # The H2D "stream" waits for the D2H "event", like CudaEngine's wait_event.
            try:
                err = offloaded.exception()
            except BaseException as cancelled:
                err = cancelled
            if err is not None:
                tensors.clear()
                raise RuntimeCopyError(
                    f"fxckpt: the device-to-host copy of offloaded {rec.describe()} failed "
                    f"earlier, so it cannot be restored: {err!r}"
                ) from err
            restore()

        stats.add("copy_handoffs", 1)
        rec.h2d = self._executors()[1].submit(copy)
        rec.dev = dev

    def finish_prefetch(self, rec: Transfer) -> tuple[list[torch.Tensor], float]:
        dev = rec.dev
        assert dev is not None
        stalled = 0.0 if _config.unsafe_skip_waits else _block_on(rec.h2d, rec, "host-to-device")
        rec.dev = None
        return dev, stalled

    def wait_copied(self, d2h: Any, rec: Transfer) -> None:
        _block_on(d2h, rec, "device-to-host")

    def restore_sync(self, rec: Transfer, host: torch.Tensor) -> torch.Tensor:
        delay, fail = _copy_plan()
        started = time.perf_counter()
        if delay:
            time.sleep(delay)
        if fail:
            raise RuntimeError(_injected("host-to-device"))
        dev = _fresh_span(rec, rec.parts[0])
        link = _link.current()
        if link is None:
            dev.view(torch.uint8).copy_(host)
            stats.add("copy_seconds", time.perf_counter() - started)
        else:
            busy = link.copy("h2d", host.numel(), lambda: dev.view(torch.uint8).copy_(host))
            stats.add("copy_seconds", busy)
        return dev

    def adopt(self, rec: Transfer, dev: torch.Tensor) -> torch.Tensor:
        return dev

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
            for ex in state:
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


_engines: dict[tuple[torch.device, int], Engine] = {}
_engines_lock = threading.Lock()


def get_engine(device: torch.device | str, streams: int = 1) -> Engine:
    """The engine for ``device`` with ``streams`` copy streams (CPU: worker threads) per
    direction, created on first use."""
    device = torch.device(device)
    engine = _engines.get((device, streams))
    if engine is not None:
        return engine
    if device.type == "cuda" and device.index is None:
        return get_engine(torch.device("cuda", torch.cuda.current_device()), streams)
    with _engines_lock:
        engine = _engines.get((device, streams))
        if engine is None:
            engine = new_engine(device, streams)
            _engines[(device, streams)] = engine
        return engine


def new_engine(device: torch.device, streams: int) -> Engine:
    """A fresh engine of the kind ``device`` needs (tests replace this to run the CUDA engine
    against a recording double)."""
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"copy_streams must be an int >= 1, got {streams!r}")
    if device.type == "cuda":
        from fxckpt.runtime.cuda_engine import CudaEngine  # imports fxckpt._cuda

        return CudaEngine(device, streams)
    if device.type == "cpu":
        return CpuEngine(device, streams)
    raise RuntimeCopyError(
        f"fxckpt: offloading from {device.type!r} tensors is not supported; "
        "only cuda and cpu have copy engines"
    )


def read_timings() -> None:
    """Count the CUDA copy and stall times whose events completed (no synchronization)."""
    for engine in list(_engines.values()):
        reader = getattr(engine, "read_timings", None)
        if reader is not None:
            reader()


stats.add_collector(read_timings)


def shutdown_all() -> None:
    """Stop every engine's threads and forget its streams; later calls start afresh."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for engine in engines:
        engine.shutdown()
