"""Host buffers for offloaded activations: size classes, free lists, reuse after completion.

Pinned buffers for ``cuda``, ordinary ones for ``cpu``. A buffer is a 1-D ``uint8`` CPU tensor
whose length is a size class; callers use a prefix of it.

Pools are per device type and owner. Each runtime profile with a host budget owns pools of its
own, capped at that budget, so the budgets of models compiled with different settings add up
instead of one replacing the other. The profiles without one share one uncapped pool per
device type (``SHARED``): nothing to keep apart there, and page-locked slabs are costly to make.

Size classes: requests up to 4 KiB get 4 KiB. Above that, every power-of-two interval
(2**k, 2**(k+1)] is cut into 4 equal steps of 2**(k-2), and a request rounds up to the next
step, so at most 25% of a buffer is wasted (torch's CachingHostAllocator rounds to the next
power of two: up to 100%). Sequence lengths that vary by a few percent then land in the same
class and reuse the same buffers, and the steady state makes no host allocation at all.

Pinned buffers are carved out of a few page-locked slabs (``slabs.py``), not allocated one
by one from torch's CachingHostAllocator, which would round each of them up to a power of two
once more and page-lock it separately. For the pinned pool,
``bytes`` and the cap count page-locked slab bytes. The CPU pool allocates each buffer with
``torch.empty``, as before.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from fxckpt.runtime import host_marks, stats
from fxckpt.runtime.slabs import Slabs, unlock_all, whole_pages

if TYPE_CHECKING:
    from fxckpt.runtime.staging import Staging

MIN_CLASS_BYTES = 4096
SUBCLASSES_PER_OCTAVE = 4

Completion = Callable[[], bool]


class PoolExhausted(Exception):
    """Internal: the pool cannot hand out a buffer (cap reached, or the allocation failed).

    The offload op catches it and keeps the tensor on the device instead.
    """


class HostMemoryWarning(UserWarning):
    """An activation stayed on the device because no host memory could be had for it."""


def size_class(nbytes: int) -> int:
    """The buffer size a request of ``nbytes`` is served from (see the module docstring)."""
    if nbytes <= MIN_CLASS_BYTES:
        return MIN_CLASS_BYTES
    octave = (nbytes - 1).bit_length() - 1  # 2**octave < nbytes <= 2**(octave + 1)
    step = (1 << octave) // SUBCLASSES_PER_OCTAVE
    return -(-nbytes // step) * step


class HostPool:
    """Free lists of host buffers per size class, with an optional cap on the bytes held.

    ``release`` never takes a lock: it runs from ``weakref.finalize`` callbacks, which the
    garbage collector may fire on any thread, including in the middle of ``acquire`` on this
    very thread. Returned buffers queue up and are sorted in at the next ``acquire``.
    """

    def __init__(self, pinned: bool, max_bytes: int | None = None) -> None:
        self.pinned = pinned
        self.max_bytes = max_bytes
        self._held = [0]  # a list the finalizer can read without keeping the pool alive
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._pending: list[tuple[torch.Tensor, Sequence[Completion]]] = []
        self._returned: deque[tuple[torch.Tensor, Sequence[Completion]]] = deque()
        self._slabs = Slabs() if pinned else None
        # Staging for the disk tier has slabs of its own: its buffers live for one transfer
        # and come in every size class, so carved among the host tier's (whose classes repeat
        # step after step) they would strand slab space no class can reuse, and under a
        # host_budget the host tier would fall back. Staging slabs are re-carved whenever no
        # staging buffer is out, which is every few transfers.
        self._staging = Slabs() if pinned else None
        self._staging_free: dict[int, list[torch.Tensor]] = {}
        self._staging_out = 0
        self.warned = False  # the one-time fallback warning (warn_fallback)
        self.staging: Staging | None = None  # the disk tier's slots (staging.staging_of)
        # Addresses of the buffers this pool holds, so a memory meter can tell host buffers
        # from device tensors where both are CPU memory (an unpinned pool; slabs are mmap'd
        # pages, which torch's CPU allocator never reports).
        self.ptrs: set[int] = set()
        # The process-wide pool_bytes counts this pool's buffers until the pool itself dies.
        slab_lists = [x.slabs for x in (self._slabs, self._staging) if x is not None]
        weakref.finalize(self, _forget, self._held, pinned, slab_lists).atexit = False

    @property
    def bytes(self) -> int:
        """Bytes held by this pool: in use, pending or free (pinned: page-locked slab bytes)."""
        return self._held[0]

    def set_cap(self, max_bytes: int | None) -> None:
        """Change the cap, freeing idle buffers until the pool fits under it."""
        with self._lock:
            self.max_bytes = max_bytes
            self._absorb_returned()

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes``; raises :class:`PoolExhausted` when none can be had."""
        cls = size_class(nbytes)
        with self._lock:
            self._absorb_returned()
            free = self._free.get(cls)
            if free:
                stats.add("pool_hits", 1)
                return free.pop()
            stats.add("pool_misses", 1)
            if self._slabs is not None:
                return self._carve(cls)
            self._make_room(cls)
            return self._allocate(cls)

    def acquire_staging(self, nbytes: int, slots: int) -> torch.Tensor:
        """A staging buffer of at least ``nbytes`` for the disk tier, at most ``slots`` of them
        out at once; raises :class:`PoolExhausted` when none can be had now.

        Pinned: from the staging slabs. When no staging buffer is out they are re-carved, and
        grown (within the cap) to hold ``slots`` buffers of this class, or one where the cap
        leaves room for one only. Give it back with :meth:`release`.
        """
        if self._staging is None:
            return self.acquire(nbytes)
        cls = size_class(nbytes)
        with self._lock:
            self._absorb_returned()
            st, free = self._staging, self._staging_free
            buf = free[cls].pop() if free.get(cls) else st.carve(cls)
            if buf is None and self._staging_out == 0:
                for slab in list(st.slabs):
                    st.reset(slab, free)
                buf = st.carve(cls)
                if buf is None:  # too small for this class: lock one that is not
                    for slab in list(st.slabs):
                        self._shrink(st.release(slab, free))
                    buf = self._grow_staging(cls, slots)
            if buf is None:
                raise PoolExhausted(f"no staging buffer of {cls} bytes while "
                                    f"{self._staging_out} are out")
            self._staging_out += 1
            return buf

    def _grow_staging(self, cls: int, slots: int) -> torch.Tensor | None:
        st = self._staging
        assert st is not None
        cap = self.max_bytes

        def lock() -> int:
            # ``slots`` buffers where the cap leaves room for them, else exactly one: the
            # planner counts the same (planning.tiers.assign), and the host tier the rest.
            want = whole_pages(slots * cls)
            if cap is not None and cap - self.bytes < want:
                want = whole_pages(cls)
            return st.lock(want, cls, None if cap is None else cap - self.bytes)

        try:
            grown = lock()
            if not grown:  # idle host-tier slabs go before staging fails
                host = self._slabs
                assert host is not None
                for slab in host.idle(self._free):
                    self._shrink(host.release(slab, self._free))
                grown = lock()
        except (RuntimeError, MemoryError, OSError) as err:
            raise PoolExhausted(f"page-locking a staging slab for {cls} bytes failed: {err}") from err
        if not grown:
            return None
        self._held[0] += grown
        stats.add("host_allocations", 1)
        stats.pool_resized(grown)
        stats.pinned_resized(grown)
        return st.carve(cls)

    def release(self, buf: torch.Tensor, pending: Sequence[Completion] = ()) -> None:
        """Give ``buf`` back; it is reused once every callable in ``pending`` returns True.

        On CUDA those are ``Event.query`` of the copies that touched the buffer: a copy still
        in flight would otherwise read or write a buffer that someone else now owns.
        """
        self._returned.append((buf, pending))

    def usage(self) -> dict[str, int]:
        """Bytes held, and how they split into free, pending and in use."""
        with self._lock:
            self._absorb_returned()
            free = sum(b.numel() for bufs in self._free.values() for b in bufs)
            if self._slabs is not None and self._staging is not None:
                free += self._slabs.uncarved_bytes() + self._staging.uncarved_bytes()
                free += sum(b.numel() for bufs in self._staging_free.values() for b in bufs)
            pending = sum(b.numel() for b, _ in self._pending)
            return {
                "bytes": self.bytes,
                "free_bytes": free,
                "pending_bytes": pending,
                "in_use_bytes": self.bytes - free - pending,
            }

    def trim(self) -> int:
        """Free every idle buffer; returns the bytes given back."""
        with self._lock:
            self._absorb_returned()
            if self._slabs is not None:
                before = self.bytes
                self._evict_idle(lambda: True)
                return before - self.bytes
            freed = sum(b.numel() for bufs in self._free.values() for b in bufs)
            for bufs in self._free.values():
                self.ptrs.difference_update(b.data_ptr() for b in bufs)
            self._free.clear()
            self._shrink(freed)
            return freed

    def _absorb_returned(self) -> None:
        """Sort returned buffers in (idle once their copies finished), and keep idle buffers
        under the cap."""
        while self._returned:
            self._pending.append(self._returned.popleft())
        # Check every pending entry, not just up to the first unfinished one: torch's host
        # allocator stops at the first pending event, so finished blocks queue behind a
        # slow one (cutorch#618).
        if self._pending:
            still = []
            for buf, checks in self._pending:
                if all(done() for done in checks):
                    if self._staging is not None and self._staging.owns(buf):
                        self._staging_free.setdefault(buf.numel(), []).append(buf)
                        self._staging_out -= 1
                    else:
                        self._free.setdefault(buf.numel(), []).append(buf)
                else:
                    still.append((buf, checks))
            self._pending = still
        # Over the cap (buffers in use when it was lowered, come back since): idle buffers go
        # instead of being handed out again.
        cap = self.max_bytes
        if cap is not None and self.bytes > cap:
            self._evict_idle(lambda: self.bytes > cap)

    def _make_room(self, cls: int) -> None:
        cap = self.max_bytes
        if cap is None or self.bytes + cls <= cap:
            return
        # Idle buffers of other classes are the only thing that may go: pending ones are
        # still touched by copies, and in-use ones belong to live handles.
        self._evict_idle(lambda: self.bytes + cls > cap)
        if self.bytes + cls > cap:
            raise PoolExhausted(
                f"the host pool cap of {cap} bytes (option host_budget) would be exceeded: "
                f"{self.bytes} bytes held by live offloads, {cls} more requested"
            )

    def _evict_idle(self, too_big: Callable[[], bool]) -> None:
        if self._slabs is not None:  # only a slab whose every buffer is idle can go
            st = self._staging
            assert st is not None
            for slab in st.idle(self._staging_free) if self._staging_out == 0 else []:
                if not too_big():
                    return
                self._shrink(st.release(slab, self._staging_free))
            for slab in self._slabs.idle(self._free):
                if not too_big():
                    return
                self._shrink(self._slabs.release(slab, self._free))
            return
        for size in sorted(self._free, reverse=True):
            bufs = self._free[size]
            while bufs and too_big():
                self.ptrs.discard(bufs.pop().data_ptr())
                self._shrink(size)

    def _allocate(self, cls: int) -> torch.Tensor:
        try:
            buf = torch.empty(cls, dtype=torch.uint8, pin_memory=self.pinned)
        except (RuntimeError, MemoryError) as err:
            kind = "pinned" if self.pinned else "host"
            raise PoolExhausted(f"allocating {cls} bytes of {kind} memory failed: {err}") from err
        self._held[0] += cls
        self.ptrs.add(buf.data_ptr())
        host_marks.note(buf.data_ptr())
        stats.add("host_allocations", 1)
        stats.pool_resized(cls)
        return buf

    def _carve(self, cls: int) -> torch.Tensor:
        slabs = self._slabs
        assert slabs is not None
        buf = slabs.carve(cls)
        if buf is None:  # re-carve an idle slab before page-locking more memory
            for slab in slabs.idle(self._free):
                if slab.nbytes >= cls:
                    slabs.reset(slab, self._free)
                    buf = slabs.carve(cls)
                    break
        if buf is not None:
            return buf
        cap = self.max_bytes
        try:
            grown = slabs.grow(cls, None if cap is None else cap - self.bytes)
            if not grown:  # over the cap: give idle slabs back until one fits
                for slab in slabs.idle(self._free):
                    self._shrink(slabs.release(slab, self._free))
                    assert cap is not None
                    grown = slabs.grow(cls, cap - self.bytes)
                    if grown:
                        break
        except (RuntimeError, MemoryError, OSError) as err:
            raise PoolExhausted(f"page-locking a slab for {cls} bytes failed: {err}") from err
        if not grown:
            raise PoolExhausted(
                f"the host pool cap of {cap} bytes (option host_budget) would be exceeded: "
                f"{self.bytes} bytes page-locked, a slab for {cls} more does not fit"
            )
        self._held[0] += grown
        stats.add("host_allocations", 1)
        stats.pool_resized(grown)
        stats.pinned_resized(grown)
        buf = slabs.carve(cls)
        assert buf is not None
        return buf

    def _shrink(self, nbytes: int) -> None:
        if nbytes:
            self._held[0] -= nbytes
            stats.pool_resized(-nbytes)
            if self.pinned:
                stats.pinned_resized(-nbytes)


def _forget(held: list[int], pinned: bool, slab_lists: list[list]) -> None:
    stats.pool_resized(-held[0])
    if pinned:
        stats.pinned_resized(-held[0])
        for slabs in slab_lists:
            unlock_all(slabs)


SHARED = ""  # the owner of the pools that serve every profile without a host budget
PINNED_TYPES = {"cuda"}  # device types whose host buffers are page-locked

_pools: dict[tuple[str, str], HostPool] = {}
_pools_lock = threading.Lock()
_shared_cap: int | None = None


def get_pool(device_type: str, owner: str = SHARED, cap: int | None = None) -> HostPool:
    """The pool serving offloads from ``device_type`` for ``owner`` (a runtime profile's key,
    or ``SHARED``), created on first use; an owned pool is capped at ``cap`` for life."""
    pool = _pools.get((device_type, owner))
    if pool is not None:
        return pool
    with _pools_lock:
        pool = _pools.get((device_type, owner))
        if pool is None:
            pool = HostPool(pinned=device_type in PINNED_TYPES,
                            max_bytes=_shared_cap if owner == SHARED else cap)
            _pools[(device_type, owner)] = pool
        return pool


def host_buffer_ptrs(device_type: str) -> set[int]:
    """Addresses of the host buffers every pool for ``device_type`` holds (empty if none)."""
    found: set[int] = set()
    for (kind, _), pool in list(_pools.items()):
        if kind == device_type:
            with pool._lock:  # acquire and trim change the set under this lock
                found |= pool.ptrs
    return found


def pools() -> list[HostPool]:
    """Every host pool made so far."""
    return list(_pools.values())


def trim_all() -> int:
    """Free every idle buffer of every pool; returns the bytes given back (tests and
    benchmarks: a high-water mark measured from an empty start)."""
    return sum(p.trim() for p in pools())


def set_pool_cap(max_bytes: int | None) -> None:
    """Cap the shared pools, those of the profiles without a host budget (``None``: no cap),
    and re-arm their fallback warning. For tests and benchmarks: a compile's ``host_budget``
    caps its own profile's pools instead."""
    global _shared_cap
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"pool cap must be None or a byte count >= 0, got {max_bytes!r}")
    with _pools_lock:
        _shared_cap = max_bytes
        for (_, owner), pool in _pools.items():
            if owner == SHARED:
                pool.warned = False
                pool.set_cap(max_bytes)


def warn_fallback(pool: HostPool, reason: str, what: str) -> None:
    """Warn, once per pool (and per :func:`set_pool_cap`), that an activation (``what``)
    stays on the device because ``pool`` had no buffer for it."""
    with _pools_lock:
        first, pool.warned = not pool.warned, True
    if not first:
        return
    warnings.warn(
        f"fxckpt: an activation chosen for offload, {what}, stays on the device because "
        f"{reason}. Results are unaffected, but device memory is higher than planned; raise "
        "host_budget, give an offload_dir, or lower the offload volume. fxckpt.stats() counts "
        "every such tensor in 'fallbacks' and its bytes in 'fallback_bytes'. (Warned once.)",
        HostMemoryWarning,
        stacklevel=4,
    )
