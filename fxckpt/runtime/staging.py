"""Staging buffers: the host memory a disk-tier tensor passes through on its way to and
from its file.

They come from the host pool of the transfer's runtime profile, so its ``host_budget`` covers
them; at most ``STAGING_SLOTS`` per pool are in flight, and an offload that finds them all
taken waits for a write to end.
"""

from __future__ import annotations

import threading
import time

import torch

from fxckpt import _files
from fxckpt.runtime.pool import HostPool, PoolExhausted, pools

STAGING_SLOTS = 2


def staged_bytes(nbytes: int) -> int:
    """What a disk transfer of ``nbytes`` asks the pool for: whole pages, plus one page of
    slack to align the start for ``O_DIRECT``."""
    return _files.whole_pages(nbytes) + _files.PAGE_BYTES


class Staging:
    """At most ``STAGING_SLOTS`` staging buffers in flight, taken from ``pool``."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self._cond = threading.Condition()
        self._in_use = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor | None, float]:
        """A buffer, or None when the pool refuses and nothing in flight will give one back;
        and the seconds spent waiting for one."""
        pool = self.pool
        waited = 0.0
        with self._cond:
            while True:
                if self._in_use < STAGING_SLOTS:
                    try:
                        buf = pool.acquire_staging(staged_bytes(nbytes), STAGING_SLOTS)
                    except PoolExhausted:
                        if self._in_use == 0:
                            return None, waited
                    else:
                        self._in_use += 1
                        return buf, waited
                start = time.perf_counter()
                self._cond.wait(0.05)
                waited += time.perf_counter() - start

    def drain(self) -> float:
        """Wait until no staging buffer is in flight; returns the seconds waited."""
        start = time.perf_counter()
        with self._cond:
            if self._in_use == 0:
                return 0.0
            while self._in_use:
                self._cond.wait(0.05)
        return time.perf_counter() - start

    def give(self, held: list[torch.Tensor]) -> None:
        """Free a slot, and give the buffer in ``held`` (emptied; ``[]``: the buffer stays
        taken) back to the pool. The caller holds no other reference: a buffer the pool
        could free while someone still holds it would outlive the pool's accounting."""
        give_back(self.pool, held)
        with self._cond:
            self._in_use -= 1
            self._cond.notify_all()


def give_back(pool: HostPool, held: list[torch.Tensor]) -> None:
    """Give the buffer in ``held`` (emptied) back to ``pool``; the caller holds no other
    reference to it."""
    if held:
        pool.release(held.pop())


_of_lock = threading.Lock()


def staging_of(pool: HostPool) -> Staging:
    """The staging slots of ``pool``, made on first use."""
    found = pool.staging
    if found is None:
        with _of_lock:
            found = pool.staging
            if found is None:
                found = pool.staging = Staging(pool)
    return found


def drain_all() -> float:
    """Wait until no pool has a staging buffer in flight; returns the seconds waited."""
    return sum(p.staging.drain() for p in pools() if p.staging is not None)
