"""Where the offload ops go, taken from the memory simulator's schedule.

The simulator (:func:`fxckpt.graph.memory.simulate`) models the D2H and H2D copies as FIFO
channels over the estimated compute of each node, and says at which forward position each
D2H copy is done and at which backward position each prefetch must be issued to land in time
(``prefetch="auto"``) or at first use (``"jit"``). This pass turns those positions into node
names, so the graph runs the schedule the plan's figures describe.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from fxckpt.graph.activations import SavedActivation
from fxckpt.passes.offload import Placement


def place_offloads(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    offloaded: Sequence[tuple[SavedActivation, int, int]],
) -> list[Placement]:
    """One placement per ``(tensor, d2h_done, prefetch_issue)``; positions as in the simulator
    (forward positions first, then backward positions offset by the forward's length)."""
    fw_nodes = list(fw.graph.nodes)
    bw_nodes = list(bw.graph.nodes)
    num_forward = len(fw_nodes)
    last_fw = num_forward - 2  # the last node before the output
    first_bw = next(i for i, n in enumerate(bw_nodes) if n.op != "placeholder")
    placements = []
    for a, done, issue in offloaded:
        # The device copy must outlive the last forward use as well as the copy itself.
        done_at = min(max(done, a.last_fw_use, a.produced), last_fw)
        first_use = a.first_bw_use if a.first_bw_use >= 0 else first_bw
        pre_at = min(max(issue - num_forward, first_bw), first_use)
        placements.append(
            Placement(
                name=a.name,
                done_after=fw_nodes[done_at].name,
                prefetch_before=bw_nodes[pre_at].name,
            )
        )
    return placements
