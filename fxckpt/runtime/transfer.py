"""Moving one transfer's bytes: to the host pool or the disk tier, back, and the joins between.

The ops (``ops.py`` for one tensor, ``bucket_ops.py`` for a bucket) build a
:class:`~fxckpt.runtime.engine.Transfer` for the runtime profile the graph names and call
these; that profile's engine does the copies, into its host pool and its disk folder.
"""

from __future__ import annotations

from typing import Any

import torch

from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import disk, stats
from fxckpt.runtime.engine import Transfer
from fxckpt.runtime.pool import PoolExhausted, warn_fallback
from fxckpt.runtime.staging import staging_of

# Every op is tagged cudagraph_unsafe: Inductor's graph partitioning (torch >= 2.11) then runs
# it between captured regions, never inside one, and without partitioning skips CUDA graphs
# for a graph holding one. Replaying a captured copy would refill a pool buffer that was
# handed to another tensor since, under a handle that no longer names the transfer.
UNSAFE = (torch.Tag.cudagraph_unsafe,)


def as_span(src: torch.Tensor, span: int) -> torch.Tensor:
    """The tensor's whole span, from storage_offset on, as it lies in memory: one contiguous
    copy serves transposed, sliced and broadcast (stride 0) tensors alike, and the restored
    tensor is the same strides over a fresh span."""
    return src.as_strided((span,), (1,), src.storage_offset())


def to_disk(rec: Transfer, src: torch.Tensor, span_t: torch.Tensor) -> bool:
    """Start ``rec`` on its way to the disk tier; False: it goes to host memory instead."""
    if rec.profile.disk is None:
        disk.warn_once(rec, "a plan sent an activation to the disk tier, but its runtime "
                       "profile has no offload_dir; it goes to host memory instead")
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


def to_host(rec: Transfer, src: Any, spans: list[torch.Tensor]) -> None:
    """Start ``rec`` on its way to the host pool (one buffer for all its parts, one copy), or
    keep its ``spans`` on the device if no buffer is left. ``src``: what must stay alive
    until the copy has read it (the source tensor, or a bucket's list of them)."""
    device = spans[0].device
    pool = rec.profile.pool(device.type)
    try:
        try:
            host = pool.acquire(rec.nbytes)
        except PoolExhausted:
            # the disk tier's writes give their buffers back
            waited = disk.wait_for_staging(staging_of(pool))
            if not waited:
                raise
            stats.add("stall_seconds", waited)
            host = pool.acquire(rec.nbytes)
    except PoolExhausted as why:
        warn_fallback(pool, str(why), rec.describe())
        stats.record_fallback(rec.nbytes)
        rec.kept = spans
        return
    rec.host = host
    rec.src = src
    try:
        copies = [(s.view(torch.uint8), h) for s, h in zip(spans, rec.host_views(host), strict=True)]
        rec.profile.engine(device).start_offload(rec, copies)
    except Exception as err:
        pool.release(host)
        raise RuntimeCopyError(
            f"fxckpt: could not start offloading {rec.describe()}: {err!r}"
        ) from err
    stats.record_offload(rec.nbytes)


def join(rec: Transfer) -> None:
    """Make compute wait until ``rec``'s device-to-host copy is done."""
    if rec.host is not None or rec.disk is not None:
        stalled = rec.profile.engine(rec.device).finish_offload(rec)
        if stalled:
            stats.add("stall_seconds", stalled)


def token() -> torch.Tensor:
    """What a join returns: an empty CPU tensor for the node after it to depend on."""
    return torch.empty(0, dtype=torch.uint8, device="cpu")


def start_prefetch(rec: Transfer) -> None:
    """Begin bringing ``rec`` back (idempotent until :func:`restore` takes it)."""
    if rec.disk is not None:
        if rec.disk.reading is None:
            disk.start_prefetch(rec)
            stats.add("prefetched_bytes", rec.nbytes)
        return
    if rec.host is None or rec.dev is not None:
        return  # kept on the device, empty, or already in flight / landed
    rec.profile.engine(rec.device).start_prefetch(rec)
    stats.add("prefetched_bytes", rec.nbytes)


def restore(rec: Transfer) -> list[torch.Tensor]:
    """Fresh device spans holding each part's bytes, once compute may read them.

    Each call yields fresh buffers and the host copy stays until the handle dies, so a
    backward run twice (retain_graph=True) restores twice.
    """
    if rec.host is not None or rec.disk is not None:
        start_prefetch(rec)
        if rec.disk is not None:
            span, stalled = disk.finish_prefetch(rec)
            spans = [span]
        else:
            spans, stalled = rec.profile.engine(rec.device).finish_prefetch(rec)
        if stalled:
            stats.add("stall_seconds", stalled)
        return spans
    spans = [torch.empty(p.span, dtype=rec.dtype, device=rec.device) for p in rec.parts]
    if rec.kept is not None:
        # Copies, not the kept spans themselves: Inductor may reuse an output buffer for
        # later kernels, which would corrupt a second backward (retain_graph=True).
        for span, kept in zip(spans, rec.kept, strict=True):
            span.copy_(kept)
    return spans
