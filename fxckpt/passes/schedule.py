"""Where the offload ops go: each ``offload_done`` late enough to hide its copy, each
``prefetch`` early enough to cover its transfer (``prefetch="auto"``) or just in time.

The leads come from estimated compute per node (:mod:`fxckpt.graph.costs`) and the
host/device bandwidth, as plain numbers; the output is a list of placements that
:func:`fxckpt.passes.offload.insert_offloads` carries out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from fxckpt.graph.activations import SavedActivation
from fxckpt.passes.offload import Placement


def done_position(produced: int, last_use: int, copy_ms: float, step_ms: Sequence[float], end: int) -> int:
    """The forward position after which the compute stream waits for the D2H copy.

    The device storage must outlive both the copy and the last forward use; waiting once the
    compute that follows production covers the copy time means the wait rarely stalls.
    """
    pos, covered = produced, 0.0
    while pos < end and covered < copy_ms:
        pos += 1
        covered += step_ms[pos]
    return min(max(pos, last_use), end)


def prefetch_position(first_use: int, copy_ms: float, step_ms: Sequence[float], start: int, *, jit: bool) -> int:
    """The backward position before which the prefetch is issued."""
    if jit:
        return first_use
    pos, covered = first_use, 0.0
    while pos > start and covered < copy_ms:
        pos -= 1
        covered += step_ms[pos]
    return pos


def place_offloads(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    offloaded: Sequence[SavedActivation],
    *,
    fw_step_ms: Sequence[float],
    bw_step_ms: Sequence[float],
    bytes_per_ms: float,
    jit: bool,
) -> list[Placement]:
    """One placement per offloaded tensor, from the estimated compute around it."""
    fw_nodes = list(fw.graph.nodes)
    bw_nodes = list(bw.graph.nodes)
    fw_end = len(fw_nodes) - 2  # the last node before the output
    bw_start = next(i for i, n in enumerate(bw_nodes) if n.op != "placeholder")
    placements = []
    for a in offloaded:
        copy_ms = a.bytes / bytes_per_ms if bytes_per_ms > 0 else 0.0
        done = done_position(a.produced, a.last_fw_use, copy_ms, fw_step_ms, fw_end)
        pre = prefetch_position(a.first_bw_use, copy_ms, bw_step_ms, bw_start, jit=jit)
        placements.append(
            Placement(name=a.name, done_after=fw_nodes[done].name, prefetch_before=bw_nodes[pre].name)
        )
    return placements
