"""The emulated host link: one FIFO copy queue per direction, shared by every copy stream.

On the CPU, "offload" is a RAM-to-RAM memcpy, hundreds of times cheaper relative to compute
than a GPU's host link. With a link emulated, the CPU engine makes every copy occupy its
direction's queue for ``overhead + bytes / bandwidth`` of wall time, and the copy completes
only once that window has closed; the planner prices copies with the same figures. The
runtime (``runtime/engine.py``) and the cost model (``graph/costs.py``) both read the link
here, the one place that also reads ``FXCKPT_EMULATE_LINK``; :func:`fxckpt.emulate_link`
sets it.

The model is a GPU's copy engines: one per direction (full duplex), each running the copies
queued on it one after another, in the order they were queued, whatever stream queued them.
A copy's window opens when it is queued, the queue is free, and (host to device) the bytes
it reads have reached the host. Nothing here runs at import; the environment variable is read
on first use.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

ENV_VAR = "FXCKPT_EMULATE_LINK"
DIRECTIONS = ("d2h", "h2d")
_ENV_ACCEPTED = ('a bandwidth such as "12MB/s", optionally followed by a per-copy overhead: '
                 '"12MB/s,0.05ms"; empty or unset: no emulation')


@dataclass(frozen=True)
class LinkSpec:
    """An emulated link: ``bandwidth`` bytes per second each way, ``overhead_s`` per copy."""

    bandwidth: float
    overhead_s: float = 0.0
    source: str = "emulate_link"  # who set it: "emulate_link", ENV_VAR, or a target's name
    # How much longer this machine's compute takes than fxckpt's CPU cost model assumes, as
    # measured when a target's link was derived: the planner scales its compute estimates by
    # it, so that it sees the same copy-to-compute ratio the link was sized for.
    compute_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.bandwidth < float("inf")):
            raise ValueError(f"an emulated link needs a positive, finite bandwidth, got {self.bandwidth!r}")
        if not (0 <= self.overhead_s < float("inf")):
            raise ValueError(f"an emulated link's overhead must be >= 0 s, got {self.overhead_s!r}")
        if not (0 < self.compute_scale < float("inf")):
            raise ValueError(f"compute_scale must be positive and finite, got {self.compute_scale!r}")

    def copy_seconds(self, nbytes: int) -> float:
        """How long one copy of ``nbytes`` occupies its queue."""
        return self.overhead_s + nbytes / self.bandwidth

    def describe(self) -> str:
        scale = f", compute x{self.compute_scale:.3g}" if self.compute_scale != 1.0 else ""
        return (f"{self.bandwidth / 1e6:.6g} MB/s each way, {self.overhead_s * 1e3:.3g} ms per "
                f"copy{scale} ({self.source})")


class Link:
    """The two queues of one emulated link, and the windows handed out on them."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self._lock = threading.Lock()
        self._free_at = dict.fromkeys(DIRECTIONS, 0.0)  # perf_counter time each queue frees up
        self.scale = 1.0  # copies queued from now on take ``scale`` times their emulated time
        # Real memcpy speed seen so far (bytes/s): a copy's bytes move as late in its window as
        # that allows, so that reading them before the window closes sees stale bytes.
        self._memcpy_rate = 1e9

    def occupy(self, direction: str, nbytes: int, not_before: float = 0.0) -> tuple[float, float]:
        """Queue one copy of ``nbytes`` on ``direction``: its window ``(start, end)``.

        The window opens when the queue is free, and not before ``now`` or ``not_before``.
        """
        with self._lock:
            start = max(time.perf_counter(), self._free_at[direction], not_before)
            end = start + self.spec.copy_seconds(nbytes) * self.scale
            self._free_at[direction] = end
        return start, end

    def rescale(self, factor: float) -> None:
        """Copies queued from now on take ``factor`` times ``spec.copy_seconds``: a benchmark
        that measures this machine's compute slowing down (other processes' load) slows the
        link with it, so that the copy-to-compute ratio stays the one the link stands for."""
        if not (0 < factor < float("inf")):
            raise ValueError(f"a link's time scale must be positive and finite, got {factor!r}")
        self.scale = float(factor)

    def overran(self, direction: str, until: float) -> None:
        """A copy's real memcpy ended after its window: the queue was busy until ``until``."""
        global _overruns
        with self._lock:
            self._free_at[direction] = max(self._free_at[direction], until)
            _overruns += 1

    def land_at(self, start: float, end: float, nbytes: int) -> float:
        """When to begin the memcpy of a copy with window ``(start, end)``: late enough that its
        bytes land near the end, early enough (a quarter of the window, or four times the
        memcpy's expected time, whichever is more) that it rarely overruns."""
        expected = nbytes / self._memcpy_rate
        return max(start, end - max((end - start) / 4, 4 * expected))

    def saw_memcpy(self, nbytes: int, seconds: float) -> None:
        if nbytes >= 4096 and seconds > 0:
            self._memcpy_rate = 0.5 * self._memcpy_rate + 0.5 * (nbytes / seconds)

    def copy(self, direction: str, nbytes: int, move: object, not_before: float = 0.0) -> float:
        """Run ``move()`` (the memcpy) as one copy on ``direction`` and return when its window
        closed; the calling thread sleeps until then. Returns the seconds the copy occupied
        the queue: the window, or longer when the memcpy overran it."""
        start, end = self.occupy(direction, nbytes, not_before)
        return self.run_window(direction, nbytes, move, start, end)

    def run_window(self, direction: str, nbytes: int, move: object, start: float, end: float
                   ) -> float:
        """:meth:`copy` for a window already handed out by :meth:`occupy`."""
        sleep_until(self.land_at(start, end, nbytes))
        began = time.perf_counter()
        move()  # type: ignore[operator]
        done = time.perf_counter()
        self.saw_memcpy(nbytes, done - began)
        if done > end:
            self.overran(direction, done)
            return done - start
        sleep_until(end)
        return end - start


_overruns = 0  # copies whose memcpy ended after their window, in this process


def overruns() -> int:
    """How many copies so far ended after their window (a loaded machine's threads started
    them late): those copies took longer than the link, and the next copy in their direction
    may have finished before them."""
    return _overruns


def sleep_until(deadline: float) -> None:
    """Sleep (never spin) until ``time.perf_counter()`` reaches ``deadline``."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


_state_lock = threading.Lock()
_link: Link | None = None
_set = False  # whether emulate_link() has spoken; until then the environment decides


def parse_env(text: str) -> LinkSpec | None:
    """The link ``FXCKPT_EMULATE_LINK`` asks for: ``"12MB/s"`` or ``"12MB/s,0.05ms"``."""
    from fxckpt.errors import OptionsError
    from fxckpt.units import parse_bandwidth, parse_duration_ms

    text = text.strip()
    if not text:
        return None
    head, _, tail = text.partition(",")
    try:
        rate = parse_bandwidth(head.strip(), ENV_VAR)
        overhead_ms = parse_duration_ms(tail.strip(), ENV_VAR) if tail.strip() else 0.0
    except OptionsError as e:
        raise OptionsError(ENV_VAR, text, _ENV_ACCEPTED, e.detail) from None
    assert rate is not None
    return LinkSpec(rate, overhead_ms / 1e3, ENV_VAR)


def current() -> Link | None:
    """The emulated link in force, or None (copies run at memcpy speed)."""
    global _link, _set
    if _set:
        return _link
    with _state_lock:
        if not _set:
            spec = parse_env(os.environ.get(ENV_VAR, ""))
            _link = None if spec is None else Link(spec)
            _set = True
        return _link


def install(spec: LinkSpec | None) -> LinkSpec | None:
    """Emulate ``spec`` from now on (None: no emulation); returns the spec it replaces.

    Copies already queued finish on the link they were queued on.
    """
    global _link, _set
    before = current()
    with _state_lock:
        _link = None if spec is None else Link(spec)
        _set = True
    return None if before is None else before.spec


def spec() -> LinkSpec | None:
    link = current()
    return None if link is None else link.spec
