"""Whole-graph liveness: the bytes of every live tensor at each node of a graph.

Unlike :mod:`fxckpt.graph.memory`, which counts only the saved tensors a plan decides about,
this counts everything a graph holds, from the nodes' ``meta["val"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from itertools import accumulate
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.fx

def _tensor_bytes(t: object) -> int:
    import torch

    from fxckpt.graph.sizes import concrete

    if not isinstance(t, torch.Tensor):
        return 0
    # concrete(), not int(): int() on a symbolic size installs a guard on it.
    try:
        return concrete(t.untyped_storage().nbytes())
    except Exception:  # sparse storages: the view's own extent
        return concrete(t.numel()) * t.element_size()


def span_bytes(v: object) -> int:
    """Bytes from a tensor's first element to its last: what restoring it allocates."""
    import torch

    from fxckpt.graph.sizes import concrete

    if not isinstance(v, torch.Tensor) or concrete(v.numel()) == 0:
        return 0
    last = sum((concrete(n) - 1) * concrete(st) for n, st in zip(v.shape, v.stride(), strict=True))
    return (last + 1) * v.element_size()


def storage_key(v: object) -> object | None:
    """An identity for the storage behind a tensor value (None for anything else)."""
    import torch

    if not isinstance(v, torch.Tensor):
        return None
    try:
        return v.untyped_storage()._cdata
    except Exception:
        return None


def live_bytes_timeline(
    gm: torch.fx.GraphModule,
    counted: Callable[[torch.fx.Node], bool] | None = None,
    allocated_at: Mapping[torch.fx.Node, int] | None = None,
    skip_storages: Collection[object] = (),
    fresh: Mapping[torch.fx.Node, int] | None = None,
) -> list[int]:
    """Bytes of all live tensors at each node position of ``gm`` (see :func:`live_spans`)."""
    spans = live_spans(gm, counted, allocated_at, skip_storages, fresh)
    return timeline_of(spans.values(), len(gm.graph.nodes))


def timeline_of(spans: Iterable[tuple[int, int, int, torch.fx.Node]], n: int) -> list[int]:
    """Live bytes at each of ``n`` positions, from ``(bytes, first, last, node)`` spans."""
    diff = [0] * (n + 1)
    for nbytes, first, last, _ in spans:
        diff[first] += nbytes
        diff[last + 1] -= nbytes
    return list(accumulate(diff[:n]))


def live_spans(
    gm: torch.fx.GraphModule,
    counted: Callable[[torch.fx.Node], bool] | None = None,
    allocated_at: Mapping[torch.fx.Node, int] | None = None,
    skip_storages: Collection[object] = (),
    fresh: Mapping[torch.fx.Node, int] | None = None,
) -> dict[object, tuple[int, int, int, torch.fx.Node]]:
    """Each counted storage of ``gm``: ``(bytes, first position, last position, the node
    whose output allocates it)``.

    Sizes come from ``node.meta["val"]`` (FakeTensors or tensors). Each storage is counted
    once: views share their base's storage, and it stays live from its first producer to the
    last use of any node that aliases it. Nodes without a tensor ``val`` count nothing, nor
    do nodes ``counted`` refuses (their storages stay out, whoever aliases them: memory that
    existed before the graph ran, say). ``allocated_at[node]``: the position where the
    storage of ``node``'s output is really allocated, when that is earlier than the node.
    ``skip_storages``: storages (:func:`storage_key`) never counted. ``fresh[node]``: the
    node's output is a buffer of its own of that many bytes, whatever storage its value
    names (a restored tensor); later values on that storage are views of the fresh buffer.
    """
    import torch

    nodes = list(gm.graph.nodes)
    pos = {node: k for k, node in enumerate(nodes)}
    skipped: set[object] = {("storage", k) for k in skip_storages}
    alias: dict[object, object] = {}  # a storage's key -> the fresh buffer standing for it
    span: dict[object, list[int]] = {}  # storage key -> [bytes, first, last]
    owner: dict[object, torch.fx.Node] = {}
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
            start = k if allocated_at is None else min(k, allocated_at.get(node, k))
            if fresh is not None and node in fresh:
                alias[key] = ("fresh", node.name)
                keys.append(alias[key])
                span[alias[key]] = [fresh[node], start, k]
                owner[alias[key]] = node
                continue
            key = alias.get(key, key)
            if counted is not None and not counted(node):
                skipped.add(key)
            if key in skipped:
                continue
            keys.append(key)
            if key not in span:
                span[key] = [_tensor_bytes(v), start, k]
                owner[key] = node
        keys_of[node] = keys
        last = max((pos[u] for u in node.users), default=k)
        for key in keys:
            span[key][2] = max(span[key][2], last)
    return {key: (b, first, last, owner[key]) for key, (b, first, last) in span.items()}


def peak_live_bytes(gm: torch.fx.GraphModule) -> int:
    """The whole-graph peak: the largest entry of :func:`live_bytes_timeline`."""
    return max(live_bytes_timeline(gm), default=0)
