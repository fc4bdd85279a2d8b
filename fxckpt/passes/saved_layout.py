"""Keep the graph inputs a forward saves in their own layout under Inductor's layout
optimization, so that what the backward holds is what the plan counted.

Inductor lays out a forward graph's saved 4-D outputs channels-last when a convolution
prefers that layout (``GraphLowering.run_node``: a dense 4-D output in
``nodes_prefer_channels_last`` that the user does not see). For a tensor Inductor computes
itself this costs nothing: it is produced channels-last. A graph input (a conv weight, the
model's input) already exists in its own layout, so Inductor saves a channels-last *copy*
for the backward: new memory, held until the backward, that no partitioner sees. On a
ResNet this is about every conv weight again (43 MB held at a 411 KB budget on ResNet18).

fxckpt counts graph inputs as free (they are alive whatever the plan says), so it saves them
as they are: each such input leaves the forward as a zero-copy ``unsqueeze(x, 0)``, which
Inductor's rule does not touch (it re-lays out 4-D outputs only), and the backward takes
``squeeze(x, 0)`` back. The forward's convolutions still run channels-last (Inductor makes
the same copy for them, as a temporary); the backward re-lays out a weight where its
``convolution_backward`` wants to, for the length of that call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxckpt._torch_compat import inductor_channels_last_nodes, non_overlapping_and_dense
from fxckpt.graph.activations import saved_nodes, storage_key, tensor_val
from fxckpt.graph.sizes import numel_bytes
from fxckpt.units import format_bytes

aten = torch.ops.aten


@dataclass(frozen=True)
class KeptLayouts:
    """What :func:`keep_input_layouts` did: the saved inputs it kept in their own layout,
    and the bytes of the channels-last copies Inductor would otherwise have saved."""

    names: tuple[str, ...] = ()
    copy_bytes: int = 0

    def note(self) -> list[str]:
        if not self.names:
            return []
        return [
            f"Inductor's layout optimization: {len(self.names)} saved graph inputs stay in "
            f"their own layout ({format_bytes(self.copy_bytes)} of channels-last copies not saved)"
        ]


def _would_copy(node: fx.Node, prefer: set[fx.Node]) -> bool:
    """Whether Inductor saves a channels-last copy of this saved graph input (or view of
    one), by the rule ``GraphLowering.run_node`` applies to non-user-visible outputs."""
    val = tensor_val(node)
    if val is None or val.dim() != 4 or node not in prefer:
        return False
    if not non_overlapping_and_dense(val):
        return False
    return not val.is_contiguous(memory_format=torch.channels_last)


def _fake_context(val: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    mode = getattr(val, "fake_mode", None)
    return mode if mode is not None else contextlib.nullcontext()


def keep_input_layouts(
    fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int
) -> KeptLayouts:
    """After this pass no graph input that the forward saves is a 4-D output Inductor would
    copy into channels-last: each leaves as ``unsqueeze(x, 0)`` and the backward squeezes it.

    Changes nothing where Inductor's layout optimization is off for ``fw``.
    """
    prefer = inductor_channels_last_nodes(fw)
    if not prefer:
        return KeptLayouts()
    inputs = {
        k for n in fw.graph.find_nodes(op="placeholder")
        if (v := tensor_val(n)) is not None and (k := storage_key(v)) is not None
    }  # fmt: skip
    out = fw.graph.find_nodes(op="output")[0]
    outputs = list(out.args[0])  # type: ignore[arg-type]
    bw_placeholders = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    bw_at = {n: i for i, n in enumerate(bw.graph.nodes)}
    names: list[str] = []
    copied: dict[int | None, int] = {}
    for node in saved_nodes(fw, num_fwd_outputs):
        val = tensor_val(node)
        assert val is not None
        key = storage_key(val)
        ph = bw_placeholders.get(node.name)
        if key not in inputs or not _would_copy(node, prefer) or ph is None or not ph.users:
            continue
        # At the end, among the saved outputs: a view of an input computes nothing, and the
        # forward's placeholders stay together.
        with fw.graph.inserting_before(out):
            flat = fw.graph.call_function(aten.unsqueeze.default, (node, 0))
        with _fake_context(val):
            flat.meta["val"] = val.unsqueeze(0)
        for i in range(num_fwd_outputs, len(outputs)):
            if outputs[i] is node:
                outputs[i] = flat
        with bw.graph.inserting_before(ph):
            new_ph = bw.graph.placeholder(flat.name)
        new_ph.meta.update(dict(ph.meta))
        new_ph.meta["val"] = flat.meta["val"]
        first_use = min(ph.users, key=bw_at.__getitem__)
        with bw.graph.inserting_before(first_use):
            back = bw.graph.call_function(aten.squeeze.dim, (new_ph, 0))
        back.meta.update(dict(ph.meta))
        ph.replace_all_uses_with(back)
        bw.graph.erase_node(ph)
        names.append(node.name)
        copied.setdefault(key, numel_bytes(val))
    if not names:
        return KeptLayouts()
    out.args = (tuple(outputs),)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    return KeptLayouts(tuple(names), sum(copied.values()))
