"""The tensors a partitioned forward saves for its backward, one record each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from fxckpt import _torch_compat as compat
from fxckpt.graph.blocks import BlockFacts, node_module
from fxckpt.graph.sizes import concrete


def tensor_val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def storage_bytes(val: torch.Tensor) -> int:
    """Bytes of the whole storage behind ``val`` (a view counts its base)."""
    try:
        return concrete(val.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        numel = 1
        for s in val.shape:
            numel *= concrete(s)
        return numel * val.element_size()


def storage_key(val: torch.Tensor) -> int | None:
    try:
        return StorageWeakRef(val.untyped_storage()).cdata
    except (NotImplementedError, RuntimeError):
        return None


def saved_nodes(fw: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """The forward's saved tensor outputs, in order (saved SymInts are left out)."""
    out = fw.graph.find_nodes(op="output")[0]
    values = out.args[0]
    return [
        v
        for v in values[num_fwd_outputs:]
        if isinstance(v, fx.Node) and tensor_val(v) is not None
    ]


def _is_input_storage(node: fx.Node, inputs: set[int]) -> bool:
    val = tensor_val(node)
    key = storage_key(val) if val is not None else None
    return key is not None and key in inputs


@dataclass(frozen=True)
class SavedActivation:
    """One saved tensor of a partitioned graph and the facts the planner needs about it."""

    name: str
    op: str
    module: str
    block: int | None
    shape: tuple[Any, ...]
    dtype: str
    bytes: int  # of its storage; tensors sharing a storage share ``storage``
    storage: str  # name of the first saved node on the same storage
    produced: int  # position of its producer in the forward
    last_fw_use: int  # position of its last forward use (== produced if none)
    first_bw_use: int  # position, in the backward, of its first use (-1 if none)
    last_bw_use: int  # position, in the backward, of its last use (-1 if none)
    is_view: bool
    contiguous: bool


def op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, compat.OpOverload):
        return f"{target._schema.name.split('::')[-1]}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def saved_activations(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    blocks: BlockFacts,
) -> list[SavedActivation]:
    """Every saved tensor of ``fw`` that is an activation.

    Graph inputs (parameters, buffers, user inputs) and views of them are not activations:
    they stay alive whatever the plan says, so they are left out.
    """
    fw_nodes = list(fw.graph.nodes)
    position = {n: i for i, n in enumerate(fw_nodes)}
    input_storages = {
        k
        for n in fw_nodes
        if n.op == "placeholder"
        and (v := tensor_val(n)) is not None
        and (k := storage_key(v)) is not None
    }
    bw_nodes = list(bw.graph.nodes)
    bw_position = {n: i for i, n in enumerate(bw_nodes)}
    bw_by_name = {n.name: n for n in bw_nodes if n.op == "placeholder"}

    result: list[SavedActivation] = []
    storage_owner: dict[int, str] = {}
    for node in saved_nodes(fw, num_fwd_outputs):
        if node.op == "placeholder" or _is_input_storage(node, input_storages):
            continue
        val = tensor_val(node)
        assert val is not None
        key = storage_key(val)
        owner = storage_owner.setdefault(key, node.name) if key is not None else node.name
        fw_uses = [position[u] for u in node.users if u.op != "output"]
        bw_node = bw_by_name.get(node.name)
        bw_uses = sorted(bw_position[u] for u in bw_node.users) if bw_node is not None else []
        target = node.target
        is_view = isinstance(target, compat.OpOverload) and target.is_view
        result.append(
            SavedActivation(
                name=node.name,
                op=op_name(node),
                module=node_module(node),
                block=blocks.block_of(node),
                shape=tuple(val.shape),
                dtype=str(val.dtype).removeprefix("torch."),
                bytes=storage_bytes(val),
                storage=owner,
                produced=position[node],
                last_fw_use=max(fw_uses, default=position[node]),
                first_bw_use=bw_uses[0] if bw_uses else -1,
                last_bw_use=bw_uses[-1] if bw_uses else -1,
                is_view=is_view,
                contiguous=bool(val.is_contiguous()),
            )
        )
    return result


def hoist_saved_views(fw: fx.GraphModule) -> int:
    """Move each view that only the forward's output reads to right after its input.

    min-cut emits some saved aliases (the ``detach`` of an attention output, say) at the end
    of the forward graph. Where they sit is where the forward last uses their storage, so an
    offload of that storage could not start, and a bucket holding it could not be released,
    before the forward ends. A view computes nothing, so moving it changes no value. Returns
    how many moved.
    """
    nodes = list(fw.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    moved = 0
    for node in nodes:
        target = node.target
        if not (node.op == "call_function" and isinstance(target, compat.OpOverload)
                and target.is_view and node.users
                and all(u.op == "output" for u in node.users)):  # fmt: skip
            continue
        inputs = node.all_input_nodes
        if not inputs or any(n.op != "call_function" for n in inputs):
            continue
        latest = max(inputs, key=position.__getitem__)
        if position[node] > position[latest] + 1:
            latest.append(node)
            moved += 1
    if moved:
        fw.graph.lint()
        fw.recompile()
    return moved


def device_of(gm: fx.GraphModule) -> torch.device:
    """The accelerator a graph computes on: the first non-CPU tensor value, else the CPU."""
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type != "cpu":
            return val.device
    return torch.device("cpu")


def bytes_per_storage(acts: list[SavedActivation]) -> int:
    """Total bytes of ``acts``, each storage counted once."""
    seen: dict[str, int] = {}
    for a in acts:
        seen.setdefault(a.storage, a.bytes)
    return sum(seen.values())


def saved_inputs(fw: fx.GraphModule, num_fwd_outputs: int,
                 produced: Sequence[tuple[int, tuple[int, ...]]]) -> int:
    """Bytes the forward ``fw`` saves of the inputs at ``produced`` (index, shape): outputs of
    earlier graphs. The forward's placeholders are the graph's inputs in order; an input
    whose shape does not match (dynamo dropped or added one) is left out."""
    if not produced:
        return 0
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    wanted: dict[int, int] = {}  # storage -> bytes; a saved view of an input counts too
    for i, shape in produced:
        val = tensor_val(placeholders[i]) if i < len(placeholders) else None
        if val is not None and tuple(val.shape) == shape and (k := storage_key(val)) is not None:
            wanted[k] = storage_bytes(val)
    seen = {
        k for node in saved_nodes(fw, num_fwd_outputs)
        if (val := tensor_val(node)) is not None and (k := storage_key(val)) in wanted
    }  # fmt: skip
    return sum(wanted[k] for k in seen)
