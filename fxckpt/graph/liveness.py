"""Whole-graph liveness: the bytes of every live tensor at each node of a graph.

Unlike :mod:`fxckpt.graph.memory`, which counts only the saved tensors a plan decides about,
this counts everything a graph holds, from the nodes' ``meta["val"]``.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.fx

def _tensor_bytes(t: object) -> int:
    import torch

    if not isinstance(t, torch.Tensor):
        return 0
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # sparse / symbolic sizes: fall back to the view's own extent
        return int(t.numel()) * t.element_size()


def live_bytes_timeline(gm: torch.fx.GraphModule) -> list[int]:
    """Bytes of all live tensors at each node position of ``gm`` (the whole-graph timeline).

    Sizes come from ``node.meta["val"]`` (FakeTensors or tensors). Each storage is counted
    once: views share their base's storage, and it stays live from its first producer to the
    last use of any node that aliases it. Nodes without a tensor ``val`` count nothing.
    """
    import torch

    nodes = list(gm.graph.nodes)
    pos = {node: k for k, node in enumerate(nodes)}
    span: dict[object, list[int]] = {}  # storage key -> [bytes, first, last]
    keys_of: dict[torch.fx.Node, list[object]] = {}
    for k, node in enumerate(nodes):
        val = node.meta.get("val")
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        keys: list[object] = []
        for j, v in enumerate(vals):
            if not isinstance(v, torch.Tensor):
                continue
            try:
                key: object = ("storage", v.untyped_storage()._cdata)
            except Exception:
                key = ("node", node.name, j)
            keys.append(key)
            if key not in span:
                span[key] = [_tensor_bytes(v), k, k]
        keys_of[node] = keys
        last = max((pos[u] for u in node.users), default=k)
        for key in keys:
            span[key][2] = max(span[key][2], last)
    diff = [0] * (len(nodes) + 1)
    for nbytes, first, last in span.values():
        diff[first] += nbytes
        diff[last + 1] -= nbytes
    return list(accumulate(diff[: len(nodes)]))


def peak_live_bytes(gm: torch.fx.GraphModule) -> int:
    """The whole-graph peak: the largest entry of :func:`live_bytes_timeline`."""
    return max(live_bytes_timeline(gm), default=0)
