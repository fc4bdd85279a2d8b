"""The forward's note: at its end, the saved tensors left on the device and the plan it runs
(``fxckpt::note_saved``), so a graph loaded from cache still knows its plan."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fxckpt.graph import meta
from fxckpt.graph.activations import SavedActivation
from fxckpt.runtime import ops as _ops  # noqa: F401  (the ops must exist before we name them)

if TYPE_CHECKING:
    from fxckpt.planning.plan_round import RoundDecision

NOTE_SAVED = torch.ops.fxckpt.note_saved.default


def _empty_val(gm: fx.GraphModule, device: torch.device) -> torch.Tensor:
    for n in gm.graph.nodes:
        fake_mode = getattr(n.meta.get("val"), "fake_mode", None)
        if fake_mode is not None:
            with fake_mode:
                return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.empty(0, dtype=torch.uint8, device="meta")


def resident_names(fw: fx.GraphModule, saved: Sequence[SavedActivation],
                   decision: RoundDecision | None) -> list[str]:
    """Kept saved tensors the note reports. RNG states the partitioner saves to replay a
    recomputed op (``run_and_save_rng_state``) carry real tensors as meta values, which
    Inductor's fake-tensor lowering of the note would refuse; they are a few KiB."""
    nodes = {n.name: n for n in fw.graph.nodes}
    return [
        a.name
        for a in saved
        if (decision is None or decision.kind_of(a.storage) == "keep")
        and not _is_rng_state(nodes[a.name])
    ]


def _is_rng_state(node: fx.Node) -> bool:
    rng = torch.ops.higher_order.run_and_save_rng_state
    parent = node.args[0] if node.target is operator.getitem and node.args else None
    return node.target is rng or (isinstance(parent, fx.Node) and parent.target is rng)


def insert_note(
    fw: fx.GraphModule,
    resident: Sequence[str],
    plan_payload: str,
    *,
    anchor_device: torch.device | None = None,
) -> fx.GraphModule:
    """After this pass the forward reports, at its end, the saved tensors left on the device
    and the plan it runs (so a graph loaded from cache still knows its plan).

    With ``anchor_device`` and nothing resident, the note also takes a zero-element tensor on
    that device (0 bytes): Inductor's scheduler flushes pending C++ kernels only before an
    extern op that has a device, and ``note_saved([])`` has none, so a kernel fused across it
    read a buffer the note had already freed (UnboundLocalError in the generated code).
    """
    nodes = {n.name: n for n in fw.graph.nodes}
    out = fw.graph.find_nodes(op="output")[0]
    saved = [nodes[n] for n in resident]
    with fw.graph.inserting_before(out):
        if not saved and anchor_device is not None:
            empty = fw.graph.call_function(
                torch.ops.aten.empty.memory_format,
                ([0],),
                {"dtype": torch.uint8, "device": anchor_device},
            )
            empty.meta["val"] = _empty_val(fw, anchor_device)
            saved = [empty]
        note = fw.graph.call_function(NOTE_SAVED, (saved, plan_payload))
    note.meta[meta.ROLE] = meta.ROLE_NOTE
    fw.recompile()
    return fw
