"""The ``fxckpt::`` operators that compiled graphs call, registered at import.

Cached compiled graphs call these without running the partitioner, so registering them must
need nothing but this package. Registration creates no stream, thread, CUDA context or
pinned buffer; those appear at the first real call.

Each op names its transfer by a handle (:mod:`fxckpt.runtime.handles`). The ops that start a
transfer also name the runtime profile of the graph's compile (:mod:`fxckpt.runtime.profiles`:
its copy streams, host pool and disk folder), by a key the graph carries as a constant; the
later ops find it on the handle's record. The ops for a bucket of tensors copied together live
in :mod:`fxckpt.runtime.bucket_ops`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import bucket_ops, disk, host_marks, profiles, stats
from fxckpt.runtime.engine import Part, Transfer
from fxckpt.runtime.handles import (
    RECORDS as _records,  # noqa: F401  (tests read records by handle id)
)
from fxckpt.runtime.handles import (
    handle_ptrs,  # noqa: F401  (the meter's import)
    live_handles,  # noqa: F401
    lookup,
    next_id,
    register,
    restored,
    same_device,
    span_of,
)
from fxckpt.runtime.transfer import (
    UNSAFE,
    as_span,
    join,
    restore,
    start_prefetch,
    to_disk,
    to_host,
    token,
)


@torch.library.custom_op(
    "fxckpt::offload",
    mutates_args=(),
    schema="(Tensor src, int tier=0, Tensor[]? after=None, *, str? profile=None) -> Tensor",
    tags=UNSAFE,
)
def offload(
    src: torch.Tensor, tier: int = 0, after: Sequence[torch.Tensor] | None = None, *,
    profile: str | None = None,
) -> torch.Tensor:
    """Start copying ``src`` to host memory; returns the handle that names the copy.

    ``tier`` 1 sends it on to a file in ``offload_dir`` (the plan's ``offload → disk``).
    ``after``, here and in every op below: tensors the op must run after, for ordering only
    (see :func:`fxckpt.passes.schedule.pin_positions`); the op does not read them.
    ``profile``: the key of the compile's runtime settings (``None``: the defaults).
    """
    if src.layout != torch.strided:
        raise RuntimeCopyError(f"fxckpt::offload needs a strided tensor, got {src.layout}")
    span = span_of(src)
    nbytes = span * src.element_size()
    rec = Transfer(
        hid=next_id(),
        parts=(Part(tuple(src.shape), tuple(src.stride()), span, 0, nbytes),),
        dtype=src.dtype,
        device=src.device,
        nbytes=nbytes,
        profile=profiles.lookup(profile),
    )
    if rec.nbytes:
        span_t = as_span(src, span)
        if tier == disk.DISK and to_disk(rec, src, span_t):
            stats.record_offload(rec.nbytes)
        else:
            to_host(rec, src, [span_t])
    else:
        stats.record_offload(0)
    return register(rec)


@offload.register_fake
def _(
    src: torch.Tensor, tier: int = 0, after: Sequence[torch.Tensor] | None = None, *,
    profile: str | None = None,
) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op(
    "fxckpt::offload_done",
    mutates_args=(),
    schema="(Tensor handle, Tensor keepalive, Tensor[]? after=None) -> Tensor",
    tags=UNSAFE,
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
    join(lookup(handle))
    return token()


@offload_done.register_fake
def _(
    handle: torch.Tensor, keepalive: torch.Tensor, after: Sequence[torch.Tensor] | None = None
) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device="cpu")


@torch.library.custom_op(
    "fxckpt::prefetch",
    mutates_args=(),
    schema="(Tensor handle, Tensor[]? after=None) -> Tensor",
    tags=UNSAFE,
)
def prefetch(handle: torch.Tensor, after: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Allocate the device buffer and start copying the handle's bytes into it (idempotent).

    Returns a ticket naming the same transfer. The graph passes the ticket to ``wait``: that
    data dependency is what stops Inductor's scheduler from moving the prefetch after the
    wait (both would otherwise depend only on the handle). ``after``: outputs of the node the
    plan issues the prefetch after, so that it is not issued earlier.
    """
    rec = lookup(handle)
    start_prefetch(rec)
    ticket = torch.tensor(rec.hid, dtype=torch.int64, device="cpu")
    host_marks.note(ticket.data_ptr())
    return ticket


@prefetch.register_fake
def _(handle: torch.Tensor, after: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op(
    "fxckpt::wait",
    mutates_args=(),
    schema="(Tensor handle, Tensor ticket, SymInt[] size, SymInt[] stride, ScalarType dtype, "
    "Device device, Tensor[]? after=None) -> Tensor",
    tags=UNSAFE,
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
    rec = lookup(handle)
    size, stride = tuple(size), tuple(stride)
    if not (dtype == rec.dtype and size == rec.size and same_device(device, rec.device)):
        raise RuntimeCopyError(
            f"fxckpt::wait asked for {dtype}, size {list(size)}, stride {list(stride)} on "
            f"{device}, but {rec.describe()} was offloaded"
        )
    (span,) = restore(rec)
    return restored(span, size, stride, rec.size, rec.stride)


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
    tags=UNSAFE,
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
    stats.note_forward(
        plan, total, list(largest.shape) if largest is not None else None,
        kept={ptr for _, ptr in seen},
    )  # fmt: skip


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
    *bucket_ops.OPS,
)
# FX dead-code elimination and Inductor's scheduler both drop unused pure ops, and the
# outputs of offload_done / prefetch / note_saved may go unused: each op is registered as having a side effect.
for _op in OPS:
    torch.fx.node.has_side_effect(_op)
