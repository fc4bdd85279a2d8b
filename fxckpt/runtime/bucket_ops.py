"""The ``fxckpt::`` operators for a bucket: tensors produced close together, copied as one.

A bucket is one transfer: one handle, one host pool buffer holding every member's span, one
copy each way with one completion (one event on CUDA, one job for a CPU worker) and one join.
Against one transfer per tensor, that saves the op calls, events and hand-offs to the copy
engine of all but one member; the planner prices the per-copy overhead once per bucket.

Each member comes back into a device buffer of its own (not a view into one shared span), so
each is freed at its own last use in the backward, as the simulator counts it; members that
were views of one storage in the forward (the ``groups`` of ``offload_many``) come back as one
buffer again, since the simulator counts a storage once. Buckets are host-only: a tensor the
plan sends to the disk tier is offloaded on its own.

``fxckpt::prefetch`` serves buckets as it serves single tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import profiles, stats
from fxckpt.runtime.engine import Part, Transfer
from fxckpt.runtime.handles import (
    lookup,
    next_id,
    register,
    restored,
    same_device,
    same_layout,
    span_of,
)
from fxckpt.runtime.transfer import UNSAFE, as_span, join, restore, to_host, token

# Each member's bytes start at a multiple of this in the host buffer: whole cache lines, and
# any dtype's alignment.
ALIGN = 64


@torch.library.custom_op(
    "fxckpt::offload_many",
    mutates_args=(),
    schema="(Tensor[] srcs, Tensor[]? after=None, *, str? profile=None, int[]? groups=None, "
    "SymInt[]? offsets=None, SymInt[]? strides=None) -> Tensor",
    tags=UNSAFE,
)
def offload_many(srcs: Sequence[torch.Tensor], after: Sequence[torch.Tensor] | None = None, *,
                 profile: str | None = None, groups: Sequence[int] | None = None,
                 offsets: Sequence[int] | None = None, strides: Sequence[int] | None = None,
                 ) -> torch.Tensor:
    """Start copying every tensor of ``srcs`` (one dtype, one device) to one host buffer, as
    one copy; returns the handle that names the bucket. ``after`` and ``profile``: as for
    ``fxckpt::offload``.

    ``groups`` (one index per member, numbered in order of first appearance) names members
    that are views of one storage: such a group travels as one part, the stretch of that
    storage its members reach, so shared bytes cross the link once and come back as one
    buffer (``fxckpt::wait_many`` returns it 1-D; the graph takes the views). ``offsets`` and
    ``strides`` (the latter concatenated) give each member's place in that stretch, as the
    graph was compiled: where the tensors at run time lie otherwise (another memory layout,
    or no longer one storage), the members are copied into a stretch of that layout first.
    """
    if not srcs:
        raise RuntimeCopyError("fxckpt::offload_many needs at least one tensor")
    first = srcs[0]
    for src in srcs:
        if src.layout != torch.strided:
            raise RuntimeCopyError(f"fxckpt::offload_many needs strided tensors, got {src.layout}")
        if src.dtype != first.dtype or src.device != first.device:
            raise RuntimeCopyError(
                "fxckpt::offload_many needs tensors of one dtype on one device, got "
                f"{first.dtype} on {first.device} and {src.dtype} on {src.device}"
            )
    parts, spans, offset = [], [], 0
    for layout, span_t in _group_spans(srcs, groups, offsets, strides):
        span = span_t.numel() if layout is None else span_of(span_t)
        nbytes = span * first.element_size()
        size, stride = layout or ((span,), (1,))
        parts.append(Part(size, stride, span, offset, nbytes))
        spans.append(as_span(span_t, span) if layout is not None else span_t)
        offset += -(-nbytes // ALIGN) * ALIGN
    rec = Transfer(hid=next_id(), parts=tuple(parts), dtype=first.dtype, device=first.device,
                   nbytes=offset, profile=profiles.lookup(profile))  # fmt: skip
    if rec.nbytes:
        # Every source stays alive until the copy has read it (a stretch reads their storage).
        to_host(rec, list(srcs) + spans, spans)
    else:
        stats.record_offload(0)
    return register(rec)


@offload_many.register_fake
def _(srcs: Sequence[torch.Tensor], after: Sequence[torch.Tensor] | None = None, *,
      profile: str | None = None, groups: Sequence[int] | None = None,
      offsets: Sequence[int] | None = None, strides: Sequence[int] | None = None,
      ) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


Layout = tuple[tuple[int, ...], tuple[int, ...]]


def _group_spans(srcs: Sequence[torch.Tensor], groups: Sequence[int] | None,
                 offsets: Sequence[int] | None, strides: Sequence[int] | None,
                 ) -> list[tuple[Layout | None, torch.Tensor]]:
    """One entry per part: a member alone (its layout, itself), or a group's stretch
    (``None``, a 1-D tensor holding every member at its compiled offset and strides)."""
    if groups is None:
        return [((tuple(s.shape), tuple(s.stride())), s) for s in srcs]
    if offsets is None or strides is None or not (len(groups) == len(offsets) == len(srcs)):
        raise RuntimeCopyError(
            f"fxckpt::offload_many: groups {list(groups)} need one offset each and every "
            f"member's strides, for {len(srcs)} members"
        )
    members: dict[int, list[tuple[torch.Tensor, int, tuple[int, ...]]]] = {}
    at = 0
    for src, g, off in zip(srcs, groups, offsets, strict=True):
        members.setdefault(g, []).append((src, off, tuple(strides[at : at + src.dim()])))
        at += src.dim()
    if sorted(members) != list(range(len(members))) or at != len(strides):
        raise RuntimeCopyError(
            f"fxckpt::offload_many: groups {list(groups)} must number 0, 1, ... in order, and "
            f"the strides ({len(strides)}) must add up to the members' dimensions ({at})"
        )
    out: list[tuple[Layout | None, torch.Tensor]] = []
    for g in range(len(members)):
        group = members[g]
        if len(group) == 1:
            src = group[0][0]
            out.append(((tuple(src.shape), tuple(src.stride())), src))
        else:
            out.append((None, _stretch(group)))
    return out


def _reach(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a tensor's first element to its last one: :func:`span_of` of a layout."""
    if 0 in size:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))


def _stretch(group: Sequence[tuple[torch.Tensor, int, tuple[int, ...]]]) -> torch.Tensor:
    """The stretch of storage a group's members reach, as a 1-D tensor: a view of their
    storage where they lie as compiled, else a fresh copy laid out so."""
    span = max(off + _reach(tuple(src.shape), stride) for src, off, stride in group)
    base = group[0][0]
    start = min(src.storage_offset() for src, _, _ in group)
    as_compiled = all(
        src.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        and src.storage_offset() - start == off
        and same_layout(tuple(src.shape), tuple(src.stride()), tuple(src.shape), stride)
        for src, off, stride in group
    )
    if as_compiled and start + span <= base.untyped_storage().nbytes() // base.element_size():
        return base.as_strided((span,), (1,), start)
    out = torch.empty(span, dtype=base.dtype, device=base.device)
    for src, off, stride in group:
        out.as_strided(src.shape, stride, off).copy_(src)
    return out


@torch.library.custom_op(
    "fxckpt::offload_many_done",
    mutates_args=(),
    schema="(Tensor handle, Tensor[] keepalive, Tensor[]? after=None) -> Tensor",
    tags=UNSAFE,
)
def offload_many_done(handle: torch.Tensor, keepalive: Sequence[torch.Tensor],
                      after: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """The bucket's join: ``fxckpt::offload_done`` with every member as a keepalive."""
    join(lookup(handle))
    return token()


@offload_many_done.register_fake
def _(handle: torch.Tensor, keepalive: Sequence[torch.Tensor],
      after: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device="cpu")


def _split(sizes: Sequence[int], strides: Sequence[int], ranks: Sequence[int]
           ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    out, at = [], 0
    for rank in ranks:
        out.append((tuple(sizes[at : at + rank]), tuple(strides[at : at + rank])))
        at += rank
    if at != len(sizes) or at != len(strides):
        raise RuntimeCopyError(
            f"fxckpt::wait_many: ranks {list(ranks)} do not add up to {len(sizes)} sizes and "
            f"{len(strides)} strides"
        )
    return out


@torch.library.custom_op(
    "fxckpt::wait_many",
    mutates_args=(),
    schema="(Tensor handle, Tensor ticket, SymInt[] sizes, SymInt[] strides, int[] ranks, "
    "ScalarType dtype, Device device, Tensor[]? after=None) -> Tensor[]",
    tags=UNSAFE,
)
def wait_many(
    handle: torch.Tensor,
    ticket: torch.Tensor,
    sizes: Sequence[int],
    strides: Sequence[int],
    ranks: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    after: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Every member of the bucket, back on the device, each in a fresh buffer of its own with
    exactly its size and stride (``sizes`` and ``strides`` concatenated; ``ranks``: how many
    dimensions each member has). Otherwise as ``fxckpt::wait``."""
    rec = lookup(handle)
    layouts = _split(sizes, strides, ranks)
    if not (dtype == rec.dtype and same_device(device, rec.device)
            and [s for s, _ in layouts] == [p.size for p in rec.parts]):
        raise RuntimeCopyError(
            f"fxckpt::wait_many asked for {dtype} tensors of sizes {[list(s) for s, _ in layouts]} "
            f"on {device}, but {rec.describe()} was offloaded with sizes "
            f"{[list(p.size) for p in rec.parts]}"
        )
    spans = restore(rec)
    return [restored(span, size, stride, part.size, part.stride)
            for span, (size, stride), part in zip(spans, layouts, rec.parts, strict=True)]


@wait_many.register_fake
def _(
    handle: torch.Tensor,
    ticket: torch.Tensor,
    sizes: Sequence[int],
    strides: Sequence[int],
    ranks: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    after: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    return [torch.empty_strided(size, stride, dtype=dtype, device=device)
            for size, stride in _split(sizes, strides, ranks)]


WAIT_MANY = torch.ops.fxckpt.wait_many.default
OPS = (
    torch.ops.fxckpt.offload_many.default,
    torch.ops.fxckpt.offload_many_done.default,
    torch.ops.fxckpt.wait_many.default,
)
for _op in OPS:
    torch.fx.node.has_side_effect(_op)
