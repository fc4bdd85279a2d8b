"""The ``fxckpt::`` operators that compiled graphs call, registered at import.

Cached compiled graphs call these without running the partitioner, so registering them must
need nothing but this package. Registration creates no stream, thread, CUDA context or
pinned buffer; those appear at the first real call.

A handle is a 0-d int64 CPU tensor holding an id from a process-wide counter. Its lifetime is
the transfer's lifetime: autograd keeps the saved handle until backward has run (or the graph
is dropped), and a ``weakref.finalize`` on it then gives the host buffer back to the pool.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence

import torch

from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import disk, stats
from fxckpt.runtime.engine import Transfer, get_engine
from fxckpt.runtime.pool import PoolExhausted, get_pool, warn_fallback

_records: dict[int, Transfer] = {}
# Handle id -> address of its handle tensor. Handles are host memory (an explicit CPU tensor
# even when the source is on a GPU); a memory meter on the CPU leaves them out by address.
_handle_ptrs: dict[int, int] = {}
_ids = itertools.count(1)
_ids_lock = threading.Lock()  # next() on a count is only atomic while there is a GIL


def live_handles() -> int:
    """How many transfers are alive (their handle tensors not yet freed)."""
    return len(_records)


def _span(t: torch.Tensor) -> int:
    """Elements from the tensor's first element to its last reachable one (strides are >= 0)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


def handle_ptrs() -> set[int]:
    """Addresses of the live handle tensors."""
    return set(_handle_ptrs.values())


def _release(hid: int) -> None:
    # Runs from weakref.finalize: possibly inside the garbage collector, on any thread. It
    # takes no lock that ops hold (dict.pop is atomic, HostPool.release is lock-free).
    _handle_ptrs.pop(hid, None)
    rec = _records.pop(hid, None)
    if rec is None:
        return
    if rec.disk is not None:
        get_engine(rec.device).release(rec)
        disk.release(rec)  # lock-free too; the file goes at the tier's next step
        return
    pending = get_engine(rec.device).release(rec) if rec.host is not None else ()
    rec.kept = None
    if rec.host is not None:
        # The record lets go first: a buffer the pool could free while the record still
        # held it would outlive the pool's accounting.
        host, rec.host = rec.host, None
        get_pool(rec.device.type).release(host, pending)


def _lookup(handle: torch.Tensor) -> Transfer:
    hid = int(handle.item())
    rec = _records.get(hid)
    if rec is None:
        raise RuntimeCopyError(
            f"fxckpt: handle {hid} names no live transfer. Its handle tensor was freed (or "
            "copied, and the original freed) before this op ran; the graph that inserted the "
            "op must pass the handle produced by fxckpt::offload itself."
        )
    return rec


# Every op is tagged cudagraph_unsafe: Inductor's graph partitioning (torch >= 2.11) then runs
# it between captured regions, never inside one, and without partitioning skips CUDA graphs
# for a graph holding one. Replaying a captured copy would refill a pool buffer that was
# handed to another tensor since, under a handle that no longer names the transfer.
_UNSAFE = (torch.Tag.cudagraph_unsafe,)


def _to_disk(rec: Transfer, src: torch.Tensor, span_t: torch.Tensor) -> bool:
    """Start ``rec`` on its way to the disk tier; False: it goes to host memory instead."""
    if disk.current() is None:
        disk.warn_once("a plan sent an activation to the disk tier, but no offload_dir is set "
                       "in this process; it goes to host memory instead")
        return False
    rec.src = src
    try:
        if disk.start_offload(rec, span_t):
            return True
    except Exception as err:
        rec.src = None
        raise RuntimeCopyError(
            f"fxckpt: could not start offloading {rec.describe()} to disk: {err!r}"
        ) from err
    rec.src = None
    return False


@torch.library.custom_op(
    "fxckpt::offload",
    mutates_args=(),
    schema="(Tensor src, int tier=0, Tensor[]? after=None) -> Tensor",
    tags=_UNSAFE,
)
def offload(
    src: torch.Tensor, tier: int = 0, after: Sequence[torch.Tensor] | None = None
) -> torch.Tensor:
    """Start copying ``src`` to host memory; returns the handle that names the copy.

    ``tier`` 1 sends it on to a file in ``offload_dir`` (the plan's ``offload → disk``).
    ``after``, here and in every op below: tensors the op must run after, for ordering only
    (see :func:`fxckpt.passes.schedule.pin_positions`); the op does not read them.
    """
    if src.layout != torch.strided:
        raise RuntimeCopyError(f"fxckpt::offload needs a strided tensor, got {src.layout}")
    span = _span(src)
    with _ids_lock:
        hid = next(_ids)
    rec = Transfer(
        hid=hid,
        size=tuple(src.shape),
        stride=tuple(src.stride()),
        dtype=src.dtype,
        device=src.device,
        span=span,
        nbytes=span * src.element_size(),
    )
    if rec.nbytes:
        # The whole span, from storage_offset on, as it lies in memory: one contiguous copy
        # serves transposed, sliced and broadcast (stride 0) tensors alike, and the restored
        # tensor is the same strides over a fresh span.
        span_t = src.as_strided((span,), (1,), src.storage_offset())
        if tier == disk.DISK and _to_disk(rec, src, span_t):
            stats.record_offload(rec.nbytes)
        else:
            _to_host(rec, src, span_t)
    else:
        stats.record_offload(0)
    # An explicit CPU device: a handle must never follow torch.set_default_device.
    handle = torch.tensor(rec.hid, dtype=torch.int64, device="cpu")
    _records[rec.hid] = rec
    _handle_ptrs[rec.hid] = handle.data_ptr()
    weakref.finalize(handle, _release, rec.hid).atexit = False
    return handle


def _to_host(rec: Transfer, src: torch.Tensor, span_t: torch.Tensor) -> None:
    """Start ``rec`` on its way to the host pool, or keep it on the device if none is left."""
    try:
        try:
            host = get_pool(src.device.type).acquire(rec.nbytes)
        except PoolExhausted:
            waited = disk.wait_for_staging()  # the disk tier's writes give their buffers back
            if not waited:
                raise
            stats.add("stall_seconds", waited)
            host = get_pool(src.device.type).acquire(rec.nbytes)
    except PoolExhausted as why:
        warn_fallback(str(why), rec.describe())
        stats.record_fallback(rec.nbytes)
        rec.kept = span_t
        return
    rec.host = host
    rec.src = src
    try:
        get_engine(src.device).start_offload(rec, span_t.view(torch.uint8), host[: rec.nbytes])
    except Exception as err:
        get_pool(src.device.type).release(host)
        raise RuntimeCopyError(
            f"fxckpt: could not start offloading {rec.describe()}: {err!r}"
        ) from err
    stats.record_offload(rec.nbytes)


@offload.register_fake
def _(
    src: torch.Tensor, tier: int = 0, after: Sequence[torch.Tensor] | None = None
) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


def _token() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device="cpu")


@torch.library.custom_op(
    "fxckpt::offload_done",
    mutates_args=(),
    schema="(Tensor handle, Tensor keepalive, Tensor[]? after=None) -> Tensor",
    tags=_UNSAFE,
)
def offload_done(
    handle: torch.Tensor, keepalive: torch.Tensor, after: Sequence[torch.Tensor] | None = None
) -> torch.Tensor:
    """Make compute wait until the handle's device-to-host copy is done (the join).

    ``keepalive`` is the source tensor: as an argument of a side-effecting op it stops
    Inductor from reusing the source's buffer in place before the copy has read it.
    ``after`` holds the output of the node the plan put the join after: the data dependency
    keeps any scheduler from running the join earlier. The returned token (an empty CPU
    tensor) is what the node after the join depends on, which keeps it from running later.
    """
    rec = _lookup(handle)
    if rec.host is not None or rec.disk is not None:
        stalled = get_engine(rec.device).finish_offload(rec)
        if stalled:
            stats.add("stall_seconds", stalled)
    return _token()


@offload_done.register_fake
def _(
    handle: torch.Tensor, keepalive: torch.Tensor, after: Sequence[torch.Tensor] | None = None
) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device="cpu")


def _prefetch(rec: Transfer) -> None:
    if rec.disk is not None:
        if rec.disk.reading is None:
            disk.start_prefetch(rec)
            stats.add("prefetched_bytes", rec.nbytes)
        return
    if rec.host is None or rec.dev is not None:
        return  # kept on the device, empty, or already in flight / landed
    get_engine(rec.device).start_prefetch(rec)
    stats.add("prefetched_bytes", rec.nbytes)


@torch.library.custom_op(
    "fxckpt::prefetch",
    mutates_args=(),
    schema="(Tensor handle, Tensor[]? after=None) -> Tensor",
    tags=_UNSAFE,
)
def prefetch(handle: torch.Tensor, after: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Allocate the device buffer and start copying the handle's bytes into it (idempotent).

    Returns a ticket naming the same transfer. The graph passes the ticket to ``wait``: that
    data dependency is what stops Inductor's scheduler from moving the prefetch after the
    wait (both would otherwise depend only on the handle). ``after``: outputs of the node the
    plan issues the prefetch after, so that it is not issued earlier.
    """
    rec = _lookup(handle)
    _prefetch(rec)
    return torch.tensor(rec.hid, dtype=torch.int64, device="cpu")


@prefetch.register_fake
def _(handle: torch.Tensor, after: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _same_layout(size: tuple[int, ...], stride: tuple[int, ...], rec: Transfer) -> bool:
    # The stride of a dimension of size 0 or 1 never moves an address, and torch is free to
    # report any value there (a fake tensor and the real one can disagree).
    if size != rec.size:
        return False
    if 0 in size:
        return True
    return all(n <= 1 or a == b for n, a, b in zip(size, stride, rec.stride, strict=True))


@torch.library.custom_op(
    "fxckpt::wait",
    mutates_args=(),
    schema="(Tensor handle, Tensor ticket, SymInt[] size, SymInt[] stride, ScalarType dtype, "
    "Device device, Tensor[]? after=None) -> Tensor",
    tags=_UNSAFE,
)
def wait(
    handle: torch.Tensor,
    ticket: torch.Tensor,
    size: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    after: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The offloaded tensor, back on the device, with exactly ``size`` and ``stride``.

    ``ticket`` is what ``prefetch`` returned (or the handle itself): taking it orders the
    prefetch first. Taking the handle too keeps the transfer alive until here, because
    AOTAutograd hands the backward its saved tensors without holding them itself. ``after``:
    outputs of the node before the first use, so that compute does not wait for the copy
    earlier than it must.

    The result is always a fresh allocation (offset 0), so it is as aligned as any buffer
    the allocator returns; Inductor is told it may assume so (``_torch_compat``).

    Each call yields a fresh buffer and the host copy stays until the handle dies, so a
    backward run twice (retain_graph=True) restores twice.
    """
    rec = _lookup(handle)
    size, stride = tuple(size), tuple(stride)
    if not (dtype == rec.dtype and size == rec.size and _same_device(device, rec.device)):
        raise RuntimeCopyError(
            f"fxckpt::wait asked for {dtype}, size {list(size)}, stride {list(stride)} on "
            f"{device}, but {rec.describe()} was offloaded"
        )
    if rec.host is not None or rec.disk is not None:
        _prefetch(rec)
        if rec.disk is not None:
            span, stalled = disk.finish_prefetch(rec)
        else:
            span, stalled = get_engine(rec.device).finish_prefetch(rec)
        if stalled:
            stats.add("stall_seconds", stalled)
    else:
        span = torch.empty(rec.span, dtype=dtype, device=rec.device)
        if rec.kept is not None:
            # A copy, not the kept tensor itself: Inductor may reuse the output buffer for
            # later kernels, which would corrupt a second backward (retain_graph=True).
            span.copy_(rec.kept)
    if _same_layout(size, stride, rec):
        return span.as_strided(size, stride)
    # Inductor may hand offload a tensor in another memory layout than the graph's metadata
    # says (it chose a contiguous buffer for a permuted view); the backward was compiled for
    # the metadata's strides, so restore into exactly those.
    out = torch.empty_strided(size, stride, dtype=dtype, device=rec.device)
    out.copy_(span.as_strided(rec.size, rec.stride))
    return out


@wait.register_fake
def _(
    handle: torch.Tensor,
    ticket: torch.Tensor,
    size: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    after: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


@torch.library.custom_op(
    "fxckpt::note_saved",
    mutates_args=(),
    schema="(Tensor[] saved, str plan, Tensor[]? after=None) -> ()",
    tags=_UNSAFE,
)
def note_saved(
    saved: Sequence[torch.Tensor], plan: str, after: Sequence[torch.Tensor] | None = None
) -> None:
    """Record, for the graph whose plan this is, the bytes of the saved tensors its plan keeps
    on the device (counted on the real tensors, each storage once), and the plan itself.

    ``after``: the forward's last compute output and every join's token, so that the note
    runs once this step's copies are joined, at the end of the forward.
    """
    seen: set[tuple[torch.device, int]] = set()
    total = 0
    largest: torch.Tensor | None = None
    for t in saved:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
            if largest is None or storage.nbytes() > largest.untyped_storage().nbytes():
                largest = t
    stats.note_forward(plan, total, list(largest.shape) if largest is not None else None)


@note_saved.register_fake
def _(saved: Sequence[torch.Tensor], plan: str, after: Sequence[torch.Tensor] | None = None) -> None:
    return None


WAIT = torch.ops.fxckpt.wait.default
OPS = (
    torch.ops.fxckpt.offload.default,
    torch.ops.fxckpt.offload_done.default,
    torch.ops.fxckpt.prefetch.default,
    torch.ops.fxckpt.wait.default,
    torch.ops.fxckpt.note_saved.default,
)
# FX dead-code elimination and Inductor's scheduler both drop unused pure ops, and the
# outputs of offload_done / prefetch / note_saved may go unused (TORCH_NOTES.md).
for _op in OPS:
    torch.fx.node.has_side_effect(_op)
