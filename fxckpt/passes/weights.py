"""Streamed weights in the compiled graphs (:func:`fxckpt.stream_weights`).

The steps:

- :func:`tag_streamed`, on the joint graph before any min-cut: each ``fxckpt::stream_in`` and
  the views of its output must be recomputed, so no partition ever saves a weight's device
  copy for the backward; the backward streams the weight again from its host parameter (which
  the backward holds anyway: a parameter costs no new memory).
- :func:`plan_weights`, after the activations' plan: under ``memory_budget``, the room the
  graph's target leaves beside its own peak (streamed copies in flight included) holds weights
  whose device copy the plan keeps across steps (``resident``); every other weight streams.
  One row per weight.
- :func:`schedule_streams`, on the forward and the backward after the partition: a resident
  weight's ``stream_in`` becomes ``fxckpt::resident_weight``; every other ``stream_in`` becomes a ``fxckpt::weight_prefetch`` issued ahead of the use and the
  activations' ``fxckpt::wait`` at the use. A prefetch is issued right after the wait of an
  earlier weight, as far back as ``lead_bytes`` of weights in flight allow (at least the one
  before it), so the copy of one weight runs behind the compute on the weights before it. Both
  ops carry the roles :func:`fxckpt.passes.schedule.pin_positions` pins under Inductor.
- :func:`fxckpt.passes.weight_grads.schedule_grads`, on the backward: a trainable weight's
  gradient is copied to the host behind the compute after it, instead of on the compute side.
"""

from __future__ import annotations

import re
import warnings

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fxckpt.graph import meta
from fxckpt.graph.blocks import node_module
from fxckpt.graph.sizes import numel_bytes
from fxckpt.passes.offload import _handle_val
from fxckpt.passes.weight_grads import schedule_grads
from fxckpt.planning.plan import PlannedWeight

STREAM_IN = torch.ops.fxckpt.stream_in.default
RESIDENT = torch.ops.fxckpt.resident_weight.default
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


def largest_streamed(joint: fx.GraphModule) -> int:
    """Bytes of the largest streamed weight of ``joint`` (0 without any)."""
    sizes = [weight_bytes(n) for n in joint.graph.find_nodes(op="call_function", target=STREAM_IN)]
    return max(sizes, default=0)


def plan_weights(fw: fx.GraphModule, bw: fx.GraphModule, room: int | None, in_flight: int = 2
                 ) -> list[PlannedWeight]:
    """Where each streamed weight of the partitioned graphs lives: ``room`` (``None``: no
    budget) is what the graph's target leaves beside its own planned peak, in which each
    streamed weight's copy is counted at its use. A weight is kept resident while its copy,
    the copies kept before it and the streamed copies on their way ahead of their uses
    (``in_flight`` times the largest still streamed) fit in it: the weights used most often
    first (forward and backward before forward only), then the larger ones (each saves that
    many bytes of copies per step), then the earlier in the forward (the first copy of each
    pass has no compute to hide behind)."""
    found: dict[str, dict] = {}
    for gm, side in ((fw, "forward"), (bw, "backward")):
        for node in gm.graph.find_nodes(op="call_function", target=STREAM_IN):
            host = node.args[0]
            assert isinstance(host, fx.Node)
            row = found.setdefault(host.name, {"node": node, "forward": 0, "backward": 0})
            row[side] += 1
    sizes = {name: weight_bytes(row["node"]) for name, row in found.items()}
    rank = {name: k for k, name in enumerate(found)}  # forward order: found walks fw first
    order = sorted(found, key=lambda n: (-(found[n]["forward"] + found[n]["backward"]), -sizes[n], rank[n]))
    resident: list[str] = []
    streamed = set(found)
    if room is not None:
        for name in order:
            rest = [sizes[n] for n in streamed if n != name]
            if sum(sizes[n] for n in resident) + sizes[name] + in_flight * max(rest, default=0) <= room:
                resident.append(name)
                streamed.discard(name)
    kept = sum(sizes[n] for n in resident)
    rows = []
    for name in found:
        node, val = found[name]["node"], found[name]["node"].meta["val"]
        if name in streamed:
            reason = ("no memory_budget: streamed, as fxckpt.stream_weights chose" if room is None else
                      f"streamed: the {max(room, 0)} bytes the target leaves beside the plan's peak "
                      f"hold {kept} bytes of resident copies and the streamed ones on their way")  # fmt: skip
        else:
            reason = (f"resident: its copy fits in the {room} bytes the target leaves beside the "
                      f"plan's peak; saves {sizes[name] * (found[name]['forward'] + found[name]['backward'])} "
                      "bytes of copies per step")  # fmt: skip
        rows.append(PlannedWeight(
            name=name, parameter=_parameter_path(node), shape=tuple(val.shape), dtype=str(val.dtype).removeprefix("torch."),
            bytes=sizes[name], forward_uses=found[name]["forward"], backward_uses=found[name]["backward"],
            decision="stream" if name in streamed else "resident", reason=reason,
        ))  # fmt: skip
    return rows


def place_weights(fw: fx.GraphModule, bw: fx.GraphModule, profile: str | None, room: int | None,
                  graph_name: str = "") -> tuple[fx.GraphModule, fx.GraphModule, list[PlannedWeight], str]:
    """:func:`plan_weights`, then :func:`schedule_streams` on both graphs and
    :func:`~fxckpt.passes.weight_grads.schedule_grads` on the backward: the graphs, the plan's
    weight rows, and its note.

    By default a weight's copy is issued two largest weights ahead of its use (two copies on
    their way beside the one in use). A ``room`` too small for that is served one weight
    ahead, with a warning: the default lead is not the user's constraint."""
    largest = max(largest_streamed(fw), largest_streamed(bw))
    lead_bytes = None
    if room is not None and room < 2 * largest:
        lead_bytes = largest
        warnings.warn(
            f"fxckpt[{graph_name}]: memory_budget leaves no room for two streamed weights' "
            f"copies on their way ({2 * largest} bytes) beside the plan's peak; each weight's "
            "copy is issued one weight ahead of its use instead, and less of it hides behind "
            "compute", stacklevel=2,
        )  # fmt: skip
    rows = plan_weights(fw, bw, room, in_flight=2 if lead_bytes is None else 1)
    resident = frozenset(w.name for w in rows if w.decision == "resident")
    fw = schedule_streams(fw, profile, lead_bytes, resident=resident)
    bw = schedule_grads(schedule_streams(bw, profile, lead_bytes, resident=resident), profile, lead_bytes)
    kept = sum(w.bytes for w in rows if w.decision == "resident")
    h2d = sum(w.step_h2d_bytes for w in rows)
    note = (f"{len(rows)} streamed weight(s): {len(rows) - len(resident)} copied to the device "
            f"ahead of each use, in the forward and again in the backward ({h2d} bytes per "
            f"step); {len(resident)} kept on the device across steps ({kept} bytes)")
    return fw, bw, rows, note


def _parameter_path(stream: fx.Node) -> str:
    """The streamed parameter's path in the model: the parametrization's module path
    (``blocks.0.fc.parametrizations.weight.0``) as the parameter it stands for."""
    return _PARAMETRIZATION.sub(r".\1", node_module(stream))


_PARAMETRIZATION = re.compile(r"\.parametrizations\.(\w+)\.\d+$")


def schedule_streams(gm: fx.GraphModule, profile: str | None, lead_bytes: int | None = None,
                     resident: frozenset[str] = frozenset()) -> fx.GraphModule:
    """Replace each ``stream_in`` of ``gm`` by a prefetch ahead of it and a wait at it, or, for
    a host weight named in ``resident``, by ``fxckpt::resident_weight``.

    ``lead_bytes``: how many bytes of weights may be on their way at once; ``None``: twice the
    largest streamed weight of the graph."""
    streams = []
    for node in list(gm.graph.find_nodes(op="call_function", target=STREAM_IN)):
        if getattr(node.args[0], "name", None) in resident:
            node.target = RESIDENT
        else:
            streams.append(node)
    if not streams:
        gm.recompile()
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
