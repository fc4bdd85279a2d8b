"""The ``fxckpt::`` operators for a bucket: tensors produced close together, copied as one.

A bucket is one transfer: one handle, one host pool buffer holding every member's span, one
copy each way with one completion (one event on CUDA, one job for a CPU worker) and one join.
Against one transfer per tensor, that saves the op calls, events and hand-offs to the copy
engine of all but one member; the planner prices the per-copy overhead once per bucket.

Each member comes back into a device buffer of its own (not a view into one shared span), so
each is freed at its own last use in the backward, as the simulator counts it. Buckets are
host-only: a tensor the plan sends to the disk tier is offloaded on its own.

``fxckpt::prefetch`` serves buckets as it serves single tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import profiles, stats
from fxckpt.runtime.engine import Part, Transfer
from fxckpt.runtime.handles import lookup, next_id, register, restored, same_device, span_of
from fxckpt.runtime.transfer import UNSAFE, as_span, join, restore, to_host, token

# Each member's bytes start at a multiple of this in the host buffer: whole cache lines, and
# any dtype's alignment.
ALIGN = 64


@torch.library.custom_op(
    "fxckpt::offload_many",
    mutates_args=(),
    schema="(Tensor[] srcs, Tensor[]? after=None, *, str? profile=None) -> Tensor",
    tags=UNSAFE,
)
def offload_many(srcs: Sequence[torch.Tensor], after: Sequence[torch.Tensor] | None = None, *,
                 profile: str | None = None) -> torch.Tensor:
    """Start copying every tensor of ``srcs`` (one dtype, one device) to one host buffer, as
    one copy; returns the handle that names the bucket. ``after`` and ``profile``: as for
    ``fxckpt::offload``."""
    if not srcs:
        raise RuntimeCopyError("fxckpt::offload_many needs at least one tensor")
    first = srcs[0]
    parts, offset = [], 0
    for src in srcs:
        if src.layout != torch.strided:
            raise RuntimeCopyError(f"fxckpt::offload_many needs strided tensors, got {src.layout}")
        if src.dtype != first.dtype or src.device != first.device:
            raise RuntimeCopyError(
                "fxckpt::offload_many needs tensors of one dtype on one device, got "
                f"{first.dtype} on {first.device} and {src.dtype} on {src.device}"
            )
        span = span_of(src)
        nbytes = span * src.element_size()
        parts.append(Part(tuple(src.shape), tuple(src.stride()), span, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    rec = Transfer(hid=next_id(), parts=tuple(parts), dtype=first.dtype, device=first.device,
                   nbytes=offset, profile=profiles.lookup(profile))  # fmt: skip
    if rec.nbytes:
        spans = [as_span(src, part.span) for src, part in zip(srcs, parts, strict=True)]
        to_host(rec, list(srcs), spans)
    else:
        stats.record_offload(0)
    return register(rec)


@offload_many.register_fake
def _(srcs: Sequence[torch.Tensor], after: Sequence[torch.Tensor] | None = None, *,
      profile: str | None = None) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


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
