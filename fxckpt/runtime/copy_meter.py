"""What each compiled graph's copies cost at run time: exposed stalls, copy times, bytes.

A :class:`CopyMeter` belongs to one compiled graph (one plan). While that graph's forward
runs, its meter is this thread's active one (:func:`running`); every host transfer started
then carries it (``Transfer.meter``), so the copies and waits of its backward, which autograd
may run on another thread, are counted for the same graph. Per transfer the engines report:

- the copy's own duration, each way (CPU engine: the worker's time, or the emulated link's
  window; CUDA: the copy stream's timing events), and its bytes;
- the exposed stall: how long compute waited for it in ``finish_offload`` (the join) and
  ``finish_prefetch`` (the wait). On CUDA that is the compute stream's idle time between two
  timing events, read once they completed.

Totals only grow; :mod:`fxckpt.runtime.stats` shows them since its last reset, per graph, and
the re-planning controller (:mod:`fxckpt.adapt`) reads differences between steps. The disk
tier's reads and writes are not counted: they are not the host link.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

_lock = threading.Lock()


@dataclass
class CopyTotals:
    """Monotonic totals of one meter."""

    stall_seconds: float = 0.0
    copy_seconds: float = 0.0
    copied_bytes: int = 0
    copies: int = 0

    def minus(self, other: CopyTotals) -> CopyTotals:
        return CopyTotals(self.stall_seconds - other.stall_seconds,
                          self.copy_seconds - other.copy_seconds,
                          self.copied_bytes - other.copied_bytes, self.copies - other.copies)


@dataclass(eq=False)
class CopyMeter:
    """The copy figures of one compiled graph; ``name`` and ``payload`` are its plan's, set by
    the first note of its forward (:func:`noted`)."""

    name: str | None = None
    payload: str | None = None
    totals: CopyTotals = field(default_factory=CopyTotals)

    def add_copy(self, nbytes: int, seconds: float) -> None:
        with _lock:
            t = self.totals
            t.copy_seconds += seconds
            t.copied_bytes += nbytes
            t.copies += 1

    def add_stall(self, seconds: float) -> None:
        with _lock:
            self.totals.stall_seconds += seconds

    def read(self) -> CopyTotals:
        with _lock:
            t = self.totals
            return CopyTotals(t.stall_seconds, t.copy_seconds, t.copied_bytes, t.copies)


_meters: list[CopyMeter] = []  # every meter that has seen a note, first noted first


class _Active(threading.local):
    meter: CopyMeter | None = None


_active = _Active()


def active() -> CopyMeter | None:
    """The meter of the compiled forward running on this thread, if any."""
    return _active.meter


class running:
    """``with running(meter): forward(...)``: transfers started meanwhile on this thread are
    ``meter``'s. Nests (a previous meter comes back at the end)."""

    def __init__(self, meter: CopyMeter) -> None:
        self.meter = meter
        self.before: CopyMeter | None = None

    def __enter__(self) -> CopyMeter:
        self.before, _active.meter = _active.meter, self.meter
        return self.meter

    def __exit__(self, *exc: object) -> None:
        _active.meter = self.before


def noted(name: str, payload: str) -> None:
    """The forward running on this thread reported its plan (``stats.note_forward``)."""
    meter = _active.meter
    if meter is None or meter.payload == payload:
        return
    with _lock:
        if meter.payload is None:
            _meters.append(meter)
        meter.name, meter.payload = name, payload


def meters() -> list[CopyMeter]:
    """Every meter whose graph has reported its plan."""
    with _lock:
        return list(_meters)


def add_copy(meter: CopyMeter | None, nbytes: int, seconds: float) -> None:
    if meter is not None:
        meter.add_copy(nbytes, seconds)


def add_stall(meter: CopyMeter | None, seconds: float) -> None:
    if meter is not None and seconds:
        meter.add_stall(seconds)
