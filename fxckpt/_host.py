"""The host's memory, as the kernel reports it, and ``host_budget`` in bytes.

Both sides read it: the planner prices host tiers against the budget, and the runtime caps
its host pools at it (``runtime/profiles.py``), even for a graph this process did not
compile. ``"auto"`` is resolved once per process, so the two never disagree. Nothing here
imports torch.
"""

from __future__ import annotations

import os
import threading

from fxckpt.errors import OptionsError

# host_budget="auto" leaves the rest of the host for what appears after compile time and is
# not fxckpt's: the optimizer's and the data loader's host memory, checkpoint staging, and the
# page cache that buffered writes of the disk tier go through. A quarter of the available
# memory scales with the machine; the 1 GiB floor covers a small machine's fixed part.
HOST_AUTO_MARGIN = 0.25
HOST_AUTO_MARGIN_BYTES = 2**30
_AUTO_FALLBACK = "an explicit budget in bytes or a fraction"

# host_budget="auto" in bytes, once resolved: every planning round and every pool cap of the
# process uses this one figure.
_auto: list[int] = []
_auto_lock = threading.Lock()


def resolve_host_budget(budget: int | float | str | None) -> int | None:
    """A normalised ``host_budget`` in bytes, or ``None`` when there is no limit.

    A float is that fraction of the machine's RAM (``MemTotal``). ``"auto"`` is the host
    memory available (``MemAvailable``) when it is first asked for in this process, less
    ``HOST_AUTO_MARGIN`` of it and ``HOST_AUTO_MARGIN_BYTES``, never below 0; later calls
    return the same figure.
    """
    if budget is None or isinstance(budget, int):
        return budget
    if isinstance(budget, float):
        return int(budget * total_bytes())
    with _auto_lock:
        if not _auto:
            free = available_bytes("host_budget")
            _auto.append(max(0, int(free * (1 - HOST_AUTO_MARGIN)) - HOST_AUTO_MARGIN_BYTES))
        return _auto[0]


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024  # the value is in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes(option: str = "memory_budget") -> int:
    """The host memory available now; ``option`` names the ``"auto"`` that asked, in errors."""
    # MemAvailable counts reclaimable page cache; SC_AVPHYS_PAGES (the fallback) does not,
    # so it underestimates, which errs on the safe side.
    found = _meminfo("MemAvailable")
    if found is not None:
        return found
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        detail = "cannot read the host's available memory"
        raise OptionsError(option, "auto", _AUTO_FALLBACK, detail) from None


def total_bytes() -> int:
    """The machine's RAM: what a fractional ``host_budget`` is a fraction of."""
    found = _meminfo("MemTotal")
    if found is not None:
        return found
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        detail = "cannot read the machine's RAM size"
        raise OptionsError("host_budget", "a fraction", "an int number of bytes", detail) from None
