"""Page-locked slabs, carved into the host pool's buffers.

torch's pinned allocator rounds every request up to a power of two and page-locks each one
separately (``cudaHostAlloc`` per buffer, a driver-wide lock each time). Here a few large
slabs are page-locked once, exactly (``fxckpt._cuda.CUDA.page_locked``), and the pool's size
classes are cut out of them with a bump pointer. Page-locked bytes are then the slab bytes,
which is what ``host_budget`` caps and ``stats()["pinned_bytes"]`` reports.

A carved buffer keeps its size class for life. A slab whose buffers are all idle can be
re-carved for other classes (no driver call) or given back to the system.

Not thread-safe: the pool calls it under its own lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fxckpt import _cuda
from fxckpt._files import whole_pages

MIN_SLAB_BYTES = 64 * 2**20
MAX_SLAB_BYTES = 2**30


@dataclass(eq=False)
class Slab:
    buf: torch.Tensor  # uint8, page-locked
    api: Any  # the fxckpt._cuda object that locked it, and must unlock it
    top: int = 0  # bytes carved so far
    carved: dict[int, int] = field(default_factory=dict)  # data_ptr -> size class

    @property
    def nbytes(self) -> int:
        return self.buf.numel()


class Slabs:
    def __init__(self) -> None:
        self.slabs: list[Slab] = []
        self._owner: dict[int, Slab] = {}  # carved buffer's data_ptr -> its slab

    @property
    def bytes(self) -> int:
        return sum(s.nbytes for s in self.slabs)

    def uncarved_bytes(self) -> int:
        return sum(s.nbytes - s.top for s in self.slabs)

    def carve(self, cls: int) -> torch.Tensor | None:
        """A buffer of ``cls`` bytes from space no buffer has taken yet, or None."""
        for slab in self.slabs:
            if slab.nbytes - slab.top >= cls:
                buf = slab.buf[slab.top : slab.top + cls]
                slab.top += cls
                slab.carved[buf.data_ptr()] = cls
                self._owner[buf.data_ptr()] = slab
                return buf
        return None

    def grow(self, cls: int, room: int | None) -> int:
        """Page-lock one more slab able to hold ``cls``; returns its bytes (0: over ``room``).

        Each slab doubles what the pool holds, between 64 MiB and 1 GiB, so a small workload
        pins little and a large one is served by a few slabs.
        """
        size = max(cls, min(max(self.bytes, MIN_SLAB_BYTES), MAX_SLAB_BYTES))
        return self.lock(whole_pages(size), cls, room)

    def lock(self, size: int, cls: int, room: int | None) -> int:
        """Page-lock a slab of ``size`` bytes (whole pages), less where ``room`` is smaller;
        returns its bytes, 0 when what fits would not hold ``cls``."""
        if room is not None:
            size = min(size, room // _cuda.PAGE_BYTES * _cuda.PAGE_BYTES)
            if size < cls:
                return 0
        api = _cuda.CUDA
        self.slabs.append(Slab(api.page_locked(size), api))
        return size

    def idle(self, free: dict[int, list[torch.Tensor]]) -> list[Slab]:
        """Slabs all of whose carved buffers sit in ``free`` (no copy, no live handle)."""
        counts: dict[int, int] = {}
        for bufs in free.values():
            for b in bufs:
                slab = self._owner[b.data_ptr()]
                counts[id(slab)] = counts.get(id(slab), 0) + 1
        return [s for s in self.slabs if counts.get(id(s), 0) == len(s.carved)]

    def reset(self, slab: Slab, free: dict[int, list[torch.Tensor]]) -> None:
        """Forget an idle slab's buffers (taking them out of ``free``) so it can be re-carved."""
        for bufs in free.values():
            bufs[:] = [b for b in bufs if self._owner.get(b.data_ptr()) is not slab]
        for ptr in slab.carved:
            del self._owner[ptr]
        slab.carved.clear()
        slab.top = 0

    def release(self, slab: Slab, free: dict[int, list[torch.Tensor]]) -> int:
        """Unlock an idle slab and let it go; returns its bytes."""
        self.reset(slab, free)
        self.slabs.remove(slab)
        slab.api.unlock(slab.buf)
        return slab.nbytes

    def owns(self, buf: torch.Tensor) -> bool:
        return buf.data_ptr() in self._owner


def carving_fits(classes: list[int], cap: int, reserved: int = 0) -> bool:
    """Whether buffers of ``classes`` (taken in this order, none given back) can be carved out
    of slabs under ``cap`` page-locked bytes, ``reserved`` of them already locked elsewhere
    (the staging slabs).

    The rules of :meth:`Slabs.carve` and :meth:`Slabs.grow`, on numbers: first fit over the
    slabs' uncarved tails, else one more slab, doubling. A tail too small for what comes next
    is lost to it, so the sum of the classes alone can fit the cap while the slabs do not: the
    planner asks this instead (``planning.tiers.assign``'s ``fits``).
    """
    page = _cuda.PAGE_BYTES
    tails: list[int] = []
    locked = 0
    used = reserved
    for cls in classes:
        for k, tail in enumerate(tails):
            if tail >= cls:
                tails[k] -= cls
                break
        else:
            size = whole_pages(max(cls, min(max(locked, MIN_SLAB_BYTES), MAX_SLAB_BYTES)))
            size = min(size, (cap - used) // page * page)
            if size < cls:
                return False
            tails.append(size - cls)
            locked += size
            used += size
    return True


def unlock_all(slabs: list[Slab]) -> None:
    """Unlock every slab (the pool died)."""
    for slab in slabs:
        slab.api.unlock(slab.buf)
    slabs.clear()
