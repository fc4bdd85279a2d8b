"""Handles: the opaque int64 tensors that name a transfer between the ``fxckpt::`` ops.

A handle is a 0-d int64 CPU tensor holding an id from a process-wide counter. Its lifetime is
the transfer's lifetime: autograd keeps the saved handle until backward has run (or the graph
is dropped), and a ``weakref.finalize`` on it then gives the host buffer back to the pool.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import disk, host_marks
from fxckpt.runtime.engine import Transfer

RECORDS: dict[int, Transfer] = {}
# Handle id -> address of its handle tensor. Handles are host memory (an explicit CPU tensor
# even when the source is on a GPU); a memory meter on the CPU leaves them out by address.
_handle_ptrs: dict[int, int] = {}
_ids = itertools.count(1)
_ids_lock = threading.Lock()  # next() on a count is only atomic while there is a GIL


def live_handles() -> int:
    """How many transfers are alive (their handle tensors not yet freed)."""
    return len(RECORDS)


def handle_ptrs() -> set[int]:
    """Addresses of the live handle tensors."""
    return set(_handle_ptrs.values())


def next_id() -> int:
    with _ids_lock:
        return next(_ids)


def span_of(t: torch.Tensor) -> int:
    """Elements from the tensor's first element to its last reachable one (strides are >= 0)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


def register(rec: Transfer) -> torch.Tensor:
    """The handle naming ``rec``; ``rec`` lives until the handle tensor is freed."""
    # An explicit CPU device: a handle must never follow torch.set_default_device.
    handle = torch.tensor(rec.hid, dtype=torch.int64, device="cpu")
    ptr = handle.data_ptr()
    host_marks.note(ptr)
    RECORDS[rec.hid] = rec
    _handle_ptrs[rec.hid] = ptr
    weakref.finalize(handle, _release, rec.hid).atexit = False
    return handle


def _release(hid: int) -> None:
    # Runs from weakref.finalize: possibly inside the garbage collector, on any thread. It
    # takes no lock that ops hold (dict.pop is atomic, HostPool.release is lock-free).
    _handle_ptrs.pop(hid, None)
    rec = RECORDS.pop(hid, None)
    if rec is None:
        return
    # The profile's engine and pool exist already (the offload used them): the lookups
    # below are dict reads.
    profile = rec.profile
    if rec.disk is not None:
        profile.engine(rec.device).release(rec)
        disk.release(rec)  # lock-free too; the file goes at the tier's next step
        return
    pending = profile.engine(rec.device).release(rec) if rec.host is not None else ()
    rec.kept = None
    if rec.borrowed:  # a streamed weight's host storage: its parameter owns it
        rec.host = None
        return
    if rec.host is not None:
        # The record lets go first: a buffer the pool could free while the record still
        # held it would outlive the pool's accounting.
        host, rec.host = rec.host, None
        profile.pool(rec.device.type).release(host, pending)


def lookup(handle: torch.Tensor) -> Transfer:
    hid = int(handle.item())
    rec = RECORDS.get(hid)
    if rec is None:
        raise RuntimeCopyError(
            f"fxckpt: handle {hid} names no live transfer. Its handle tensor was freed (or "
            "copied, and the original freed) before this op ran; the graph that inserted the "
            "op must pass the handle produced by fxckpt::offload itself."
        )
    return rec


def same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def restored(span: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...],
             rec_size: tuple[int, ...], rec_stride: tuple[int, ...]) -> torch.Tensor:
    """The tensor of ``size`` and ``stride`` over a restored ``span`` that was offloaded from
    a tensor of ``rec_size`` and ``rec_stride``."""
    if same_layout(size, stride, rec_size, rec_stride):
        return span.as_strided(size, stride)
    # Inductor may hand offload a tensor in another memory layout than the graph's metadata
    # says (it chose a contiguous buffer for a permuted view); the backward was compiled for
    # the metadata's strides, so restore into exactly those.
    out = torch.empty_strided(size, stride, dtype=span.dtype, device=span.device)
    out.copy_(span.as_strided(rec_size, rec_stride))
    return out


def same_layout(size: tuple[int, ...], stride: tuple[int, ...], rec_size: tuple[int, ...],
                 rec_stride: tuple[int, ...]) -> bool:
    # The stride of a dimension of size 0 or 1 never moves an address, and torch is free to
    # report any value there (a fake tensor and the real one can disagree).
    if size != rec_size:
        return False
    if 0 in size:
        return True
    return all(n <= 1 or a == b for n, a, b in zip(size, stride, rec_stride, strict=True))
