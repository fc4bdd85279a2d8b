"""Process-wide runtime counters, and the registry of plans that compiled graphs report.

Every figure lives here, behind one lock, so that :func:`snapshot` is consistent and the pool
needs no back-reference to this module's readers. The pool reports its own figures through
:func:`pool_resized`, :func:`add`; nothing in this module creates a pool or an engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_COUNTERS = (
    "offloaded_bytes",
    "prefetched_bytes",
    "stall_seconds",
    "copy_seconds",
    "offload_calls",
    "fallbacks",
    "pool_hits",
    "pool_misses",
    "host_allocations",
    "resident_saved_bytes",
    "disk_bytes",
    "disk_write_seconds",
    "disk_read_seconds",
    "disk_fallbacks",
)
_SECONDS = ("stall_seconds", "copy_seconds", "disk_write_seconds", "disk_read_seconds")
# pool_bytes describes memory the process holds right now, so reset() leaves it alone; so do
# pinned_bytes and disk_files (the disk tier's files on disk now).
_LEVELS = ("pool_bytes", "pinned_bytes", "disk_files")

_lock = threading.Lock()
_values: dict[str, float | int] = dict.fromkeys(_COUNTERS + _LEVELS, 0)
_values.update(dict.fromkeys(_SECONDS, 0.0))
_high_water = 0
# Called before every snapshot: the CUDA engine counts copy and stall times only once their
# events have completed, which it checks without synchronizing.
_collectors: list[Callable[[], None]] = []
# A dict is an insertion-ordered set: membership costs one hash, and the payload string is
# the same constant object at every call of a compiled graph, so its hash is cached.
_plans: dict[str, None] = {}


def add(name: str, amount: float | int) -> None:
    """Add ``amount`` to the counter ``name``."""
    with _lock:
        _values[name] += amount


def record_offload(nbytes: int) -> None:
    """One offload call, moving ``nbytes`` to host memory (0 when kept on the device)."""
    with _lock:
        _values["offload_calls"] += 1
        _values["offloaded_bytes"] += nbytes


def set_resident_saved_bytes(nbytes: int) -> None:
    with _lock:
        _values["resident_saved_bytes"] = nbytes


def pool_resized(delta: int) -> None:
    """The host pools together now hold ``delta`` more bytes (negative when they freed some)."""
    global _high_water
    with _lock:
        now = int(_values["pool_bytes"]) + delta
        _values["pool_bytes"] = now
        if now > _high_water:
            _high_water = now


def pinned_resized(delta: int) -> None:
    """The process now holds ``delta`` more page-locked bytes (slabs of the pinned pool)."""
    with _lock:
        _values["pinned_bytes"] = int(_values["pinned_bytes"]) + delta


def add_plan_payload(s: str) -> None:
    """Remember a plan payload (a JSON string); empty strings and repeats are ignored."""
    if not s or s in _plans:
        return
    with _lock:
        _plans[s] = None


def plan_payloads() -> list[str]:
    """The distinct plan payloads reported since the last :func:`reset`, first seen first."""
    with _lock:
        return list(_plans)


def add_collector(fn: Callable[[], None]) -> None:
    """Run ``fn`` before each :func:`snapshot`, outside the lock (it may call :func:`add`)."""
    if fn not in _collectors:
        _collectors.append(fn)


def snapshot() -> dict[str, float | int]:
    """A consistent copy of every figure, including ``pool_high_water_bytes`` and
    ``host_high_water_bytes`` (the most host memory fxckpt held at once: every host pool
    buffer, pinned or not, staging for the disk tier included)."""
    for collect in list(_collectors):
        collect()
    with _lock:
        out = dict(_values)
        out["pool_high_water_bytes"] = _high_water
        out["host_high_water_bytes"] = _high_water
        return out


def reset() -> None:
    """Counters to zero, the high-water mark to the pool's present size, and no plans."""
    global _high_water
    with _lock:
        for name in _COUNTERS:
            _values[name] = 0
        _values.update(dict.fromkeys(_SECONDS, 0.0))
        _high_water = int(_values["pool_bytes"])
        _plans.clear()
