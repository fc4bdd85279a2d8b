"""A recording stand-in for the CUDA hardware, and a race checker over what it records.

It implements the calls of ``fxckpt._cuda.TorchCuda`` and nothing of fxckpt. Streams run in
simulated time; every memory access of a copy or a kernel carries a vector clock, and an
access that conflicts with an earlier one (either writes) not ordered before it is a race.
Ordering comes only from what CUDA orders: program order within a stream, ``wait_event``
(``wait_stream`` is a record plus a wait), and the host learning that an event completed
(``query``/``synchronize``), after which every newly issued op starts later.

The caching allocator is modelled as torch documents it: a freed block goes back to the
free list of the stream that allocated it and is reused by that stream at once, unless
``record_stream`` named other streams; then it waits until events recorded on those streams
at free time have completed.

Copies really copy (at once), so values are right whatever the order; the checker, not the
values, tells a correct protocol from a racy one. Nothing completes until the test advances
the host clock (``advance``/``synchronize``): the slowest legal hardware.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

PAGE = 4096
Clock = dict[int, int]


def _join(a: Clock, b: Clock) -> None:
    for k, v in b.items():
        if a.get(k, 0) < v:
            a[k] = v


@dataclass
class Access:
    start: int
    end: int
    write: bool
    sid: int
    clock: Clock
    what: str


class Stream:
    def __init__(self, hw: FakeCuda, name: str, device: str) -> None:
        self.hw, self.name, self.device = hw, name, device
        self.sid = len(hw.streams)
        hw.streams.append(self)
        self.clock: Clock = {self.sid: 0}
        self.time = 0.0  # ms at which all work queued so far is done

    def __repr__(self) -> str:
        return self.name

    def wait_event(self, ev: Event) -> None:
        self.hw.calls.append(("wait_event", self.name, ev.name))
        if ev.clock is not None:  # waiting on a never-recorded event is a no-op, as in CUDA
            _join(self.clock, ev.clock)
            self.time = max(self.time, ev.time)

    def wait_stream(self, other: Stream) -> None:
        self.hw.calls.append(("wait_stream", self.name, other.name))
        _join(other.clock, self.hw.host_clock)
        _join(self.clock, other.clock)  # cudaStreamWaitEvent on an event recorded on `other`
        self.time = max(self.time, other.time, self.hw.now)


class Event:
    def __init__(self, hw: FakeCuda, timing: bool) -> None:
        self.hw, self.timing = hw, timing
        self.name = f"e{len(hw.events)}"
        hw.events.append(self)
        self.clock: Clock | None = None
        self.time = 0.0

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or self.hw.current_stream(self.hw.current_device)
        self.hw.calls.append(("record", self.name, stream.name))
        _join(stream.clock, self.hw.host_clock)
        self.clock, self.time = dict(stream.clock), max(stream.time, self.hw.now)

    def query(self) -> bool:
        if self.clock is None:
            return True  # cudaEventQuery of an unrecorded event: success
        done = self.time <= self.hw.now
        if done:
            _join(self.hw.host_clock, self.clock)
        return done

    def synchronize(self) -> None:
        if self.clock is not None:
            self.hw.now = max(self.hw.now, self.time)
            _join(self.hw.host_clock, self.clock)

    def elapsed_time(self, end: Event) -> float:
        assert self.timing and end.timing, "elapsed_time needs enable_timing=True events"
        assert end.clock is not None and end.time <= self.hw.now, "cudaErrorNotReady"
        return end.time - self.time


@dataclass(eq=False)
class Block:
    device: str
    stream: Stream
    nbytes: int
    mem: bytearray
    start: int = 0
    uses: set[Stream] = field(default_factory=set)
    after: list[tuple[Clock, float]] = field(default_factory=list)  # record_stream events
    live: bool = True


class FakeCuda:
    """The double. ``bandwidth`` is bytes per ms per device (``"cuda:1": ...``); default 1e6."""

    def __init__(self, bandwidth: dict[str, float] | None = None) -> None:
        self.streams: list[Stream] = []
        self.events: list[Event] = []
        self.calls: list[tuple[str, ...]] = []
        self.races: list[str] = []
        self.pageable_copies: list[str] = []
        self.accesses: list[Access] = []
        self.now = 0.0
        self.host_clock: Clock = {}
        self.current_device = "cuda:0"
        self.bandwidth = bandwidth or {}
        self._current: dict[str, Stream] = {}
        self._copy_streams: dict[tuple[str, int], Stream] = {}
        self._free: dict[tuple[int, int], list[Block]] = {}
        self.blocks: list[Block] = []
        self.locked: dict[int, int] = {}  # page-locked ranges: start -> nbytes
        self.lock_calls = 0

    # --- streams and events -------------------------------------------------------------
    def _dev(self, device: Any) -> str:
        d = torch.device(device) if not isinstance(device, torch.device) else device
        if d.type == "cuda" and d.index is None:
            return self.current_device
        return str(d)

    def current_stream(self, device: Any) -> Stream:
        key = self._dev(device)
        if key not in self._current:
            self._current[key] = Stream(self, f"compute@{key}", key)
        return self._current[key]

    def copy_stream(self, device: Any, slot: int) -> Stream:
        key = (self._dev(device), slot)
        if key not in self._copy_streams:
            self._copy_streams[key] = Stream(self, f"copy{slot}@{key[0]}", key[0])
        return self._copy_streams[key]

    def event(self, timing: bool = False) -> Event:
        return Event(self, timing)

    @contextlib.contextmanager
    def use_stream(self, stream: Stream) -> Iterator[None]:
        saved = self.current_stream(stream.device)
        self._current[stream.device] = stream
        try:
            yield
        finally:
            self._current[stream.device] = saved

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        saved, self.current_device = self.current_device, self._dev(device)
        try:
            yield
        finally:
            self.current_device = saved

    # --- time ---------------------------------------------------------------------------
    def advance(self, ms: float) -> None:
        self.now += ms

    def synchronize(self) -> None:
        """The host waits for everything queued (``torch.cuda.synchronize``)."""
        for s in self.streams:
            self.now = max(self.now, s.time)
            _join(self.host_clock, s.clock)

    # --- work ---------------------------------------------------------------------------
    def _run(self, stream: Stream, what: str, ms: float,
             reads: Sequence[torch.Tensor] = (), writes: Sequence[torch.Tensor] = ()) -> None:
        # An op issued after the host saw events complete starts after them.
        _join(stream.clock, self.host_clock)
        stream.time = max(stream.time, self.now) + ms
        stream.clock[stream.sid] += 1
        clock = dict(stream.clock)
        for t, write in [(t, False) for t in reads] + [(t, True) for t in writes]:
            start, end = _extent(t)
            if start == end:
                continue
            for a in self.accesses:
                if a.start < end and start < a.end and (write or a.write) \
                        and clock.get(a.sid, 0) < a.clock[a.sid]:
                    self.races.append(
                        f"{what} on {stream} {'writes' if write else 'reads'} "
                        f"[{start:#x}, {end:#x}) unordered with {a.what} on "
                        f"{self.streams[a.sid]} {'writing' if a.write else 'reading'} it"
                    )
            self.accesses.append(Access(start, end, write, stream.sid, clock, what))

    def kernel(self, what: str, reads: Sequence[torch.Tensor] = (),
               writes: Sequence[torch.Tensor] = (), ms: float = 1.0,
               device: Any = "cpu") -> None:
        """A compute kernel on the current stream of ``device`` (what the test's model does)."""
        self._run(self.current_stream(device), what, ms, reads, writes)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        blk = self._block_of(dst) or self._block_of(src)
        assert blk is not None, "a copy with no device side"
        host = src if self._block_of(dst) else dst
        if not self._is_locked(host):
            self.pageable_copies.append(f"{_extent(host)}")
        nbytes = dst.numel() * dst.element_size()
        ms = nbytes / self.bandwidth.get(blk.device, 1e6)
        self._run(self.current_stream(blk.device), "copy", ms, reads=[src], writes=[dst])
        dst.copy_(src)

    def sleep(self, seconds: float) -> None:
        self._run(self.current_stream(self.current_device), "sleep", seconds * 1e3)

    # --- the caching allocator --------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
        key = self._dev(device)
        stream = self.current_stream(key)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        blk = None
        for cand in self._free.get((stream.sid, nbytes), []):
            if all(t <= self.now for _, t in cand.after):
                for clock, _ in cand.after:  # the allocator queried those events: done
                    _join(self.host_clock, clock)
                blk = cand
                break
        if blk is None:
            blk = Block(key, stream, nbytes, bytearray(nbytes))
            self.blocks.append(blk)
        else:
            self._free[(stream.sid, nbytes)].remove(blk)
        blk.live, blk.uses, blk.after = True, set(), []
        view = memoryview(blk.mem)
        t = torch.frombuffer(view, dtype=dtype)
        blk.start = t.data_ptr()
        # The tensor's storage holds `view`; the view dies with the last tensor on the block.
        weakref.finalize(view, self._freed, blk)
        return t

    def _freed(self, blk: Block) -> None:
        blk.live = False
        blk.after = [(dict(s.clock), max(s.time, self.now)) for s in blk.uses]
        self._free.setdefault((blk.stream.sid, blk.nbytes), []).append(blk)

    def record_stream(self, t: torch.Tensor, stream: Stream) -> None:
        self.calls.append(("record_stream", stream.name))
        blk = self._block_of(t)
        assert blk is not None, "record_stream on memory the allocator does not own"
        if stream is not blk.stream:
            blk.uses.add(stream)

    def live_blocks(self) -> int:
        return sum(b.live for b in self.blocks)

    def _block_of(self, t: torch.Tensor) -> Block | None:
        p = t.data_ptr()
        for b in self.blocks:
            if b.live and b.start <= p < b.start + b.nbytes:
                return b
        return None

    # --- page-locked host memory ----------------------------------------------------------
    def page_locked(self, nbytes: int) -> torch.Tensor:
        assert nbytes > 0 and nbytes % PAGE == 0, f"page_locked({nbytes}): not whole pages"
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        self.locked[buf.data_ptr()] = nbytes
        self.lock_calls += 1
        return buf

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        buf = self.page_locked(max(PAGE, -(-nbytes // PAGE) * PAGE))
        return buf[:nbytes].view(dtype).view(tuple(shape))

    def unlock(self, buf: torch.Tensor) -> None:
        start = buf.data_ptr()
        end = start + self.locked.pop(start)
        for a in self.accesses:
            if a.start < end and start < a.end and self.host_clock.get(a.sid, 0) < a.clock[a.sid]:
                self.races.append(f"unlock of [{start:#x}, {end:#x}) while {a.what} may run")

    def _is_locked(self, t: torch.Tensor) -> bool:
        start, end = _extent(t)
        return any(s <= start and end <= s + n for s, n in self.locked.items())

    def locked_bytes(self) -> int:
        return sum(self.locked.values())

    def host_access(self, start: int, nbytes: int, *, write: bool, what: str) -> None:
        """The host itself reads or writes ``nbytes`` at ``start`` (a file write reads a pinned
        buffer; a file read fills one). It is ordered after exactly what the host has seen
        complete (``query``/``synchronize``); anything else touching those bytes is a race."""
        end = start + nbytes
        for a in self.accesses:
            if a.start < end and start < a.end and (write or a.write) \
                    and self.host_clock.get(a.sid, 0) < a.clock[a.sid]:
                self.races.append(
                    f"host {what} {'writes' if write else 'reads'} [{start:#x}, {end:#x}) "
                    f"unordered with {a.what} on {self.streams[a.sid]} "
                    f"{'writing' if a.write else 'reading'} it"
                )


def _extent(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + span * t.element_size()

