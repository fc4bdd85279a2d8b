"""The whole training step's device memory, from a partition's forward and backward graphs.

This is the measure ``memory_budget`` bounds (on static shapes): at every position of the
step, the bytes of every tensor the step has allocated and not yet freed, above what existed
before it (the forward's inputs: parameters, buffers, the batch). It is what an allocator
meter reads over ``loss.backward()`` with gradients set to ``None`` before the step.

Two uses:

- :func:`step_peak` reads it off the graphs fxckpt's rewrite produced (offload and wait ops
  in place), with the peak's position and what it is made of;
- :func:`rest_of_step` gives the planner, per position of one partition, everything the
  step holds *besides* the saved tensors it decides about, so that the simulator's resident
  bytes (:mod:`fxckpt.graph.memory`) plus this are the step's bytes. Gradients, tangents,
  the backward's temporaries, what a recomputed segment rebuilds, and the forward's own
  working set (a saved tensor up to its last forward use included) all land here.

Both are exact for graphs run op by op (``compiler="eager"``); under Inductor, which fuses
ops and reuses buffers, they are upper bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fxckpt.graph import meta
from fxckpt.graph.liveness import live_spans, span_bytes, storage_key, timeline_of

if TYPE_CHECKING:
    import torch.fx

    from fxckpt.graph.activations import SavedActivation

# The parts a step's peak is made of, in the order reports list them.
PARTS = ("forward", "saved", "restored", "tangents", "gradients", "computed")


@dataclass(frozen=True)
class StepPeak:
    """Where the step's predicted peak falls and what is live there."""

    bytes: int
    graph: str  # "forward" or "backward"
    position: int  # node index in that graph
    node: str  # the node running there
    parts: dict[str, int] = field(default_factory=dict)  # PARTS -> bytes live at the peak

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "graph": self.graph, "position": self.position,
                "node": self.node, "parts": dict(self.parts)}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {_mib(v)}" for k, v in self.parts.items() if v)
        return f"{_mib(self.bytes)} in the {self.graph} at {self.node} ({parts})"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _inputs(fw: torch.fx.GraphModule) -> set[object]:
    # Storages of the forward's inputs, whatever aliases them later (a saved transpose of a
    # weight): the two graphs' values share one fake mode, so its storages too.
    return {key for n in fw.graph.find_nodes(op="placeholder")
            if (key := storage_key(n.meta.get("val"))) is not None}


def _restored(bw: torch.fx.GraphModule) -> tuple[dict[Any, int], dict[Any, int], set[Any]]:
    """Per restored tensor of ``bw``: its prefetch's position and its buffer's bytes; and the
    wait nodes (a bucket's wait names its members' storages; each member counts, as its
    getitem)."""
    pos = {n: k for k, n in enumerate(bw.graph.nodes)}
    early: dict[Any, int] = {}
    fresh: dict[Any, int] = {}
    waits = set()
    for n in bw.graph.nodes:
        if n.meta.get(meta.ROLE) != meta.ROLE_WAIT:
            continue
        waits.add(n)
        ticket = n.args[1] if len(n.args) > 1 else None
        at = pos[ticket] if getattr(ticket, "meta", {}).get(meta.ROLE) == meta.ROLE_PREFETCH else pos[n]  # type: ignore[index]
        members = [u for u in n.users if u.op == "call_function"] if isinstance(
            n.meta.get("val"), (list, tuple)) else [n]
        for m in members:
            early[m], fresh[m] = at, span_bytes(m.meta.get("val"))
    return early, fresh, waits


def _part(node: torch.fx.Node, fresh: dict[Any, int], grads: set[Any]) -> str:
    if node in fresh:
        return "restored"
    if node.op == "placeholder":
        return "tangents" if node.name.startswith("tangents") else "saved"
    return "gradients" if node in grads else "computed"


def step_peak(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> StepPeak:
    """The peak of the memory one training step allocates, predicted from the liveness of its
    partitioned forward and backward graphs as fxckpt's rewrite left them.

    Not counted: what exists before the step (the forward's inputs; the backward takes the
    parameters it needs as inputs too), and host memory (the offload handles are 0-d CPU
    tensors). Counted in the backward: every other input (the saved tensors, freed at their
    last use; the tangents), what it computes and recomputes, and each restored tensor from
    its prefetch on, where the engine allocates its buffer.
    """
    inputs = _inputs(fw)
    fw_spans = live_spans(fw, skip_storages=inputs)
    early, fresh, waits = _restored(bw)
    bw_spans = live_spans(bw, counted=lambda n: n not in waits, allocated_at=early,
                          skip_storages=inputs, fresh=fresh)
    out = bw.graph.find_nodes(op="output")[0]
    grads = set(out.all_input_nodes)
    best: StepPeak | None = None
    for graph, gm, spans in (("forward", fw, fw_spans), ("backward", bw, bw_spans)):
        nodes = list(gm.graph.nodes)
        live = timeline_of(spans.values(), len(nodes))
        if not live:
            continue
        at = max(range(len(live)), key=live.__getitem__)
        if best is not None and live[at] <= best.bytes:
            continue
        parts = dict.fromkeys(PARTS, 0)
        for nbytes, first, last, node in spans.values():
            if first <= at <= last:
                parts["forward" if graph == "forward" else _part(node, fresh, grads)] += nbytes
        best = StepPeak(live[at], graph, at, nodes[at].name, parts)
    return best or StepPeak(0, "forward", -1, "", {})


def step_peak_bytes(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> int:
    """:func:`step_peak`'s bytes."""
    return step_peak(fw, bw).bytes


def rest_of_step(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule,
                 saved: Sequence[SavedActivation]) -> list[int]:
    """Per position of the planner's timeline (forward nodes, then backward nodes): the step's
    bytes that are not the saved tensors' residency as the simulator counts it.

    The simulator counts a saved storage from after its last forward use; before that it is
    the forward's working set, whatever the plan decides, so it is counted here.
    """
    inputs = _inputs(fw)
    names = {a.name for a in saved}
    keys = {storage_key(n.meta.get("val")) for n in fw.graph.nodes if n.name in names}
    keys |= {storage_key(n.meta.get("val")) for n in bw.graph.find_nodes(op="placeholder")
             if n.name in names}
    skip = inputs | {k for k in keys if k is not None}
    F = len(fw.graph.nodes)
    rest_fw = timeline_of(live_spans(fw, skip_storages=skip).values(), F)
    groups: dict[str, list[SavedActivation]] = {}
    for a in saved:
        groups.setdefault(a.storage, []).append(a)
    diff = [0] * (F + 1)
    for members in groups.values():
        lo, hi = min(b.produced for b in members), max(b.last_fw_use for b in members)
        diff[lo] += members[0].bytes
        diff[hi + 1] -= members[0].bytes
    own = 0
    for k in range(F):
        own += diff[k]
        rest_fw[k] += own
    early, fresh, waits = _restored(bw)
    rest_bw = timeline_of(live_spans(bw, counted=lambda n: n not in waits, allocated_at=early,
                                     skip_storages=skip, fresh=fresh).values(),
                          len(bw.graph.nodes))
    return [*rest_fw, *rest_bw]


def step_floor(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule,
               saved: Sequence[SavedActivation]) -> int:
    """The step's peak with every saved tensor present only while the backward uses it (from
    its first backward use to its last): what no plan of this partition goes below, since a
    tensor is on the device while it is used, however it got there. The floor a fractional
    ``memory_budget`` starts from."""
    rest = rest_of_step(fw, bw, saved)
    F = len(fw.graph.nodes)
    diff = [0] * (len(rest) + 1)
    groups: dict[str, list[SavedActivation]] = {}
    for a in saved:
        groups.setdefault(a.storage, []).append(a)
    for members in groups.values():
        uses = [(b.first_bw_use, b.last_bw_use) for b in members if b.first_bw_use >= 0]
        if not uses:
            continue
        lo, hi = F + min(u[0] for u in uses), F + max(u[1] for u in uses)
        diff[lo] += members[0].bytes
        diff[hi + 1] -= members[0].bytes
    out, now = 0, 0
    for k, r in enumerate(rest):
        now += diff[k]
        out = max(out, r + now)
    return out
