"""Marks of the host memory the runtime allocates, for the CPU memory meter.

On the CPU, fxckpt's host memory (pool buffers, handles and tickets, streamed weights' host
copies and gradients) comes from the same allocator as the "device" memory the meter counts.
The meter leaves out what the runtime still holds when a call ends, by address; host memory
allocated and freed inside the call is gone by then. So while a meter runs, each such
allocation is marked here with its address and the time just after it (``time.time_ns``, the
clock of the allocator events the meter reads): the meter leaves out the block that was live
at that address at that time.
"""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
_depth = 0
_marks: list[tuple[int, int]] = []


def note(ptr: int) -> None:
    """Mark the host block just allocated at ``ptr`` (a no-op unless a meter runs)."""
    if _depth and ptr:
        with _lock:
            _marks.append((time.time_ns(), ptr))


def start() -> int:
    """Begin marking; returns where this meter's marks begin."""
    global _depth
    with _lock:
        _depth += 1
        return len(_marks)


def stop(begin: int) -> list[tuple[int, int]]:
    """The ``(time_ns, ptr)`` marks since ``begin``; marking ends with the last meter."""
    global _depth
    with _lock:
        got = _marks[begin:]
        _depth -= 1
        if not _depth:
            _marks.clear()
        return got
