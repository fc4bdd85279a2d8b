"""Where each offloaded tensor lives: host memory, the disk tier, or, when the host budget is
short and no disk can take it, nowhere (recompute it, or keep it on the device).

Plain numbers in, one :class:`TierChoice` per offloaded storage out, each with its reason. Every
offloaded tensor is in host memory at the boundary between forward and backward (it leaves
the device during the forward and comes back during the backward), so the host needs the sum
of their buffer sizes at once; the disk tier needs staging buffers instead (``staging_slots``
of the largest one that goes to disk), also inside the host budget.

Which tensors leave host memory when it is short:

- with a disk tier, the earliest produced first: its write hides behind the most forward
  compute and its read behind the most backward compute (the backward needs the last
  produced tensors first). A tensor goes to disk unless recomputing it costs less than the
  disk time its windows cannot hide, or its staging buffer alone exceeds the budget;
- without one, those that can be recomputed first (the latest produced first among them),
  then the rest, latest produced first, kept on the device: a kept late tensor holds device
  memory for the shortest time.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from fxckpt.units import format_bytes

TierKind = Literal["host", "disk", "recompute", "keep"]


@dataclass(frozen=True)
class Item:
    """One offloaded storage, as the tier assignment sees it (production order)."""

    nbytes: int
    host_bytes: int  # the host pool buffer it takes in the host tier (its size class)
    staged_bytes: int  # the staging buffer it takes on its way to and from the disk
    write_window_ms: float  # forward compute after it is produced
    read_window_ms: float  # backward compute before its first use (0 with prefetch="jit")
    recompute_ms: float = math.inf  # math.inf: it cannot be recomputed


@dataclass(frozen=True)
class DiskRates:
    write_bytes_per_ms: float
    read_bytes_per_ms: float

    def exposed_ms(self, item: Item) -> float:
        """Disk time the item's windows cannot hide (one tensor alone on the disk)."""
        write = item.nbytes / self.write_bytes_per_ms
        read = item.nbytes / self.read_bytes_per_ms
        return max(0.0, write - item.write_window_ms) + max(0.0, read - item.read_window_ms)

    def read_ms(self, nbytes: int) -> float:
        return nbytes / self.read_bytes_per_ms


@dataclass(frozen=True)
class TierChoice:
    """Where one offloaded storage goes: host or disk, or, where neither has room, kept or
    recomputed instead."""

    kind: TierKind
    reason: str = ""  # empty for "host": the offload's own reason stands


def _rate(bytes_per_ms: float) -> str:
    return f"{bytes_per_ms * 1e3 / 1e9:.3g} GB/s"


def assign(
    items: Sequence[Item],
    host_budget: int | None,
    disk: DiskRates | None,
    *,
    allow_recompute: bool,
    staging_slots: int = 2,
    fits: Callable[[list[int], int], bool] | None = None,
) -> list[TierChoice]:
    """One tier per item (in production order) so that host memory fits ``host_budget``.

    The host then holds ``sum(host_bytes)`` of the host-tier items plus staging for the disk
    tier: ``staging_slots`` buffers of the largest disk item, as the runtime keeps them (its
    staging slabs grow to that many wherever the budget holds them), or one where the budget
    cannot hold ``staging_slots``. ``allow_recompute`` is False on the planner's last round,
    which can only keep. ``fits(host_bytes of the host-tier items in order, staging bytes)``
    says whether the host's allocator can hold them under the budget; the default is their
    sum (the pinned pool passes its slab layout, whose tails no class may fill).
    """
    n = len(items)
    tiers = [TierChoice("host")] * n
    host = sum(it.host_bytes for it in items)
    if host_budget is None:
        return tiers
    budget = host_budget
    if fits is None:
        fits = lambda classes, staging: sum(classes) + staging <= budget  # noqa: E731
    if fits([it.host_bytes for it in items], 0):
        return tiers
    host, largest, moved = _move_out(items, tiers, host, budget, disk, allow_recompute,
                                     staging_slots, fits)
    slots = (staging_slots if staging_slots * largest <= budget else 1) if largest else 0
    staging = slots * largest
    held = (f"host_budget {format_bytes(budget)} holds {format_bytes(host)} of host-tier offloads"
            + (f" and {format_bytes(staging)} of disk staging" if staging else ""))  # fmt: skip
    _explain(items, tiers, moved, held, disk, allow_recompute)
    return tiers


def _move_out(
    items: Sequence[Item], tiers: list[TierChoice], host: int, budget: int,
    disk: DiskRates | None, allow_recompute: bool, staging_slots: int,
    fits: Callable[[list[int], int], bool],
) -> tuple[int, int, list[tuple[int, str]]]:
    """Move items out of host memory (to disk in ``tiers``, or onto the returned list with why
    they could not go there) until the rest fit: ``(host bytes left, largest staging buffer,
    moved)``."""
    n = len(items)
    in_host = [True] * n
    if disk is not None:
        order: Sequence[int] = range(n)
    else:
        redo = [allow_recompute and math.isfinite(it.recompute_ms) for it in items]
        order = sorted(range(n), key=lambda i: (not redo[i], -i))
    largest = 0  # the largest staging buffer of the disk tier so far
    moved: list[tuple[int, str]] = []  # (item, why it could not go to disk)
    for i in order:
        # The runtime keeps staging_slots staging buffers where they fit in the budget (one
        # where they do not): plan for as many.
        slots = staging_slots if staging_slots * largest <= budget else 1
        if host + slots * largest <= budget and fits(
                [it.host_bytes for k, it in enumerate(items) if in_host[k]], slots * largest):
            break
        it = items[i]
        host -= it.host_bytes
        in_host[i] = False
        if disk is not None:
            exposed = disk.exposed_ms(it)
            cheaper = allow_recompute and it.recompute_ms < exposed
            if it.staged_bytes <= budget and not cheaper:
                tiers[i] = TierChoice("disk")
                largest = max(largest, it.staged_bytes)
                continue
            why = (f"recomputing ({it.recompute_ms:.3f} ms) costs less than the disk time it "
                   f"cannot hide ({exposed:.3f} ms)" if cheaper else
                   f"its staging buffer ({format_bytes(it.staged_bytes)}) alone exceeds it")  # fmt: skip
        else:
            why = "there is no disk tier (offload_dir)"
        moved.append((i, why))
    return host, largest, moved


def _explain(items: Sequence[Item], tiers: list[TierChoice], moved: list[tuple[int, str]],
             held: str, disk: DiskRates | None, allow_recompute: bool) -> None:
    """The reasons of the items that left host memory: disk, recompute or keep."""
    for i, it in enumerate(items):
        if tiers[i].kind != "disk":
            continue
        assert disk is not None
        exposed = disk.exposed_ms(it)
        tail = f"{exposed:.3f} ms exposed" if exposed > 1e-9 else "fully hidden"
        tiers[i] = TierChoice("disk", (
            f"offload → disk: {held}; the disk ({_rate(disk.write_bytes_per_ms)} write, "
            f"{_rate(disk.read_bytes_per_ms)} read) writes it behind {it.write_window_ms:.3f} ms "
            f"of forward and reads it behind {it.read_window_ms:.3f} ms of backward ({tail})"
        ))  # fmt: skip
    for i, why in moved:
        it = items[i]
        if allow_recompute and math.isfinite(it.recompute_ms):
            tiers[i] = TierChoice("recompute", f"recompute: {held}, and {why}; recomputing costs "
                                         f"{it.recompute_ms:.3f} ms")  # fmt: skip
        else:
            tiers[i] = TierChoice("keep", f"keep: {held}, {why}, and it cannot be recomputed here")


def staging_bytes(items: Sequence[Item], tiers: Sequence[TierChoice], host_budget: int | None,
                  staging_slots: int = 2) -> int:
    """The staging :func:`assign` left room for: ``staging_slots`` buffers of the largest
    disk item, one where the budget holds fewer."""
    largest = max((it.staged_bytes for it, t in zip(items, tiers, strict=True)
                   if t.kind == "disk"), default=0)  # fmt: skip
    if not largest:
        return 0
    if host_budget is not None and staging_slots * largest > host_budget:
        return largest
    return staging_slots * largest


def read_ahead(S: Sequence[float], num_forward: int, issue: int, read_ms: float) -> int:
    """The backward position at which to issue a disk tensor's prefetch: early enough that
    ``read_ms`` of compute runs between it and ``issue`` (where the host-to-device copy would
    be issued), and never before the backward starts.

    ``S`` is the prefix sum of node times (``S[t]``: when node ``t`` starts).
    """
    if read_ms <= 0:
        return issue
    start = S[issue] - read_ms
    return max(num_forward, min(issue, bisect_right(S, start) - 1))
