"""Streamed weights in the compiled graphs (:func:`fxckpt.stream_weights`).

Two steps:

- :func:`tag_streamed`, on the joint graph before any min-cut: each ``fxckpt::stream_in`` and
  the views of its output must be recomputed, so no partition ever saves a weight's device
  copy for the backward; the backward streams the weight again from its host parameter (which
  the backward holds anyway: a parameter costs no new memory).
- :func:`schedule_streams`, on the forward and the backward after the partition: each
  ``stream_in`` becomes a ``fxckpt::weight_prefetch`` issued ahead of the use and the
  activations' ``fxckpt::wait`` at the use. A prefetch is issued right after the wait of an
  earlier weight, as far back as ``lead_bytes`` of weights in flight allow (at least the one
  before it), so the copy of one weight runs behind the compute on the weights before it. Both
  ops carry the roles :func:`fxckpt.passes.schedule.pin_positions` pins under Inductor.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fxckpt.graph import meta
from fxckpt.graph.sizes import numel_bytes
from fxckpt.passes.offload import _handle_val

STREAM_IN = torch.ops.fxckpt.stream_in.default
# Checkpoint-region id of the streamed weights' nodes, apart from any user's and any segment's.
_AC_GRAPH_ID = 3_000_000


def tag_streamed(joint: fx.GraphModule) -> int:
    """Tag every ``stream_in`` and the views of its output MUST_RECOMPUTE; returns how many
    ``stream_in`` there are."""
    count = 0
    for node in joint.graph.find_nodes(op="call_function", target=STREAM_IN):
        count += 1
        todo = [node]
        while todo:
            n = todo.pop()
            n.meta[meta.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta[meta.AC_GRAPH_ID] = _AC_GRAPH_ID
            todo += [u for u in n.users if _is_view(u) and u.meta.get(meta.RECOMPUTE) is None]
    return count


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "is_view", False)


def weight_bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return numel_bytes(val) if isinstance(val, torch.Tensor) else 0


def reserve_bytes(joint: fx.GraphModule) -> int:
    """The device bytes streamed weights take at most at once under :func:`schedule_streams`'
    default lead: the weight in use and up to twice the largest on their way, so three times the
    largest streamed weight (0 without any)."""
    sizes = [weight_bytes(n) for n in joint.graph.find_nodes(op="call_function", target=STREAM_IN)]
    return 3 * max(sizes, default=0)


def schedule_streams(gm: fx.GraphModule, profile: str | None, lead_bytes: int | None = None
                     ) -> fx.GraphModule:
    """Replace each ``stream_in`` of ``gm`` by a prefetch ahead of it and a wait at it.

    ``lead_bytes``: how many bytes of weights may be on their way at once; ``None``: twice the
    largest streamed weight of the graph."""
    streams = list(gm.graph.find_nodes(op="call_function", target=STREAM_IN))
    if not streams:
        return gm
    sizes = [weight_bytes(n) for n in streams]
    lead = 2 * max(sizes) if lead_bytes is None else lead_bytes
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    waits: list[fx.Node] = []
    last_issued: dict[fx.Node, fx.Node] = {}  # anchor -> the last prefetch issued after it
    for i, node in enumerate(streams):
        host, device = node.args
        anchor = waits[_issue_after(i, sizes, lead)] if i else placeholders[-1]
        # Copies queue in the order they are issued: after an anchor, in weight order.
        with graph.inserting_after(last_issued.get(anchor, anchor)):
            handle = graph.call_function(torch.ops.fxckpt.weight_prefetch.default, (host, device),
                                         {"profile": profile})  # fmt: skip
        last_issued[anchor] = handle
        handle.meta.update({"val": _handle_val(node.meta["val"]), meta.ROLE: meta.ROLE_PREFETCH,
                            meta.SOURCE: node.name})  # fmt: skip
        val = node.meta["val"]
        with graph.inserting_before(node):
            wait = graph.call_function(
                torch.ops.fxckpt.wait.default,
                (handle, handle, list(val.shape), list(val.stride()), val.dtype, val.device),
            )
        wait.meta.update({"val": val, meta.ROLE: meta.ROLE_WAIT, meta.SOURCE: node.name})
        node.replace_all_uses_with(wait)
        graph.erase_node(node)
        waits.append(wait)
    graph.lint()
    gm.recompile()
    return gm


def _issue_after(i: int, sizes: list[int], lead: int) -> int:
    """Whose wait weight ``i``'s prefetch goes after: the earliest weight ``j < i`` with
    ``sizes[j+1..i]`` within ``lead``, and at the latest weight ``i-1``."""
    j, ahead = i - 1, sizes[i]
    while j > 0 and ahead + sizes[j] <= lead:
        ahead += sizes[j]
        j -= 1
    return j
