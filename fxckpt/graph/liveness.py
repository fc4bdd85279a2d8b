"""Whole-graph liveness: the bytes of every live tensor at each node of a graph.

Unlike :mod:`fxckpt.planning.memory`, which counts only the saved tensors a plan decides about,
this counts everything a graph holds, from the nodes' ``meta["val"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

from fxckpt import _torch_compat as compat
from fxckpt.graph import meta

if TYPE_CHECKING:
    import torch.fx

# CUDA's caching allocator hands out blocks in multiples of 512 bytes, and its figures
# (memory_allocated, max_memory_allocated) count the blocks; offline plans (the meta device)
# are for a GPU. The CPU allocator's figures are the bytes asked for.
_BLOCK = 512


def allocated(nbytes: int, device: object) -> int:
    """What an allocation of ``nbytes`` on ``device`` takes in the allocator's figures."""
    if getattr(device, "type", "cpu") in ("cuda", "meta") and nbytes > 0:
        return -(-nbytes // _BLOCK) * _BLOCK
    return nbytes


def _tensor_bytes(t: object) -> int:
    import torch

    from fxckpt.graph.sizes import concrete, numel_bytes

    if not isinstance(t, torch.Tensor):
        return 0
    # concrete(), not int(): int() on a symbolic size installs a guard on it.
    try:
        nbytes = concrete(t.untyped_storage().nbytes())
    except Exception:  # sparse storages: the view's own extent
        nbytes = numel_bytes(t)
    return allocated(nbytes, t.device)


def span_bytes(v: object) -> int:
    """Bytes from a tensor's first element to its last: what restoring it allocates."""
    import torch

    from fxckpt.graph.sizes import concrete

    if not isinstance(v, torch.Tensor) or concrete(v.numel()) == 0:
        return 0
    last = sum((concrete(n) - 1) * concrete(st) for n, st in zip(v.shape, v.stride(), strict=True))
    return allocated((last + 1) * v.element_size(), v.device)


def storage_key(v: object) -> object | None:
    """An identity for the storage behind a tensor value (None for anything else)."""
    import torch

    if not isinstance(v, torch.Tensor):
        return None
    try:
        return compat.storage_id(v)
    except Exception:
        return None


def live_bytes_timeline(
    gm: torch.fx.GraphModule,
    counted: Callable[[torch.fx.Node], bool] | None = None,
    allocated_at: Mapping[torch.fx.Node, int] | None = None,
    skip_storages: Collection[object] = (),
    fresh: Mapping[torch.fx.Node, int] | None = None,
) -> list[int]:
    """Bytes of all live tensors at each node position of ``gm`` (the whole-graph timeline).

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
    keys_of: dict[torch.fx.Node, list[object]] = {}
    for k, node in enumerate(nodes):
        val = node.meta.get("val")
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        keys: list[object] = []
        for j, v in enumerate(vals):
            if not isinstance(v, torch.Tensor):
                continue
            try:
                key: object = ("storage", compat.storage_id(v))
            except Exception:
                key = ("node", node.name, j)
            start = k if allocated_at is None else min(k, allocated_at.get(node, k))
            if fresh is not None and node in fresh:
                alias[key] = ("fresh", node.name)
                keys.append(alias[key])
                span[alias[key]] = [fresh[node], start, k]
                continue
            key = alias.get(key, key)
            if counted is not None and not counted(node):
                skipped.add(key)
            if key in skipped:
                continue
            keys.append(key)
            if key not in span:
                span[key] = [_tensor_bytes(v), start, k]
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


def input_storages(fw: torch.fx.GraphModule) -> set[object]:
    """Storages of the forward's inputs (parameters, buffers, the batch), whatever aliases
    them later (a saved transpose of a weight): the two graphs' values share one fake mode, so
    its storages too."""
    return {key for n in fw.graph.find_nodes(op="placeholder")
            if (key := storage_key(n.meta.get("val"))) is not None}


def restores(bw: torch.fx.GraphModule) -> tuple[set[torch.fx.Node], dict[torch.fx.Node, torch.fx.Node]]:
    """The backward's waits, and each tensor they restore with the node where the engine
    allocates its buffer: its prefetch, else its wait (a bucket's members are its getitems)."""
    waits: set[torch.fx.Node] = set()
    at: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in bw.graph.nodes:
        if n.meta.get(meta.ROLE) != meta.ROLE_WAIT:
            continue
        waits.add(n)
        ticket = n.args[1] if len(n.args) > 1 else None
        start = ticket if getattr(ticket, "meta", {}).get(meta.ROLE) == meta.ROLE_PREFETCH else n
        members = [u for u in n.users if u.op == "call_function"] if isinstance(
            n.meta.get("val"), (list, tuple)) else [n]
        at.update((m, start) for m in members)  # type: ignore[misc]
    return waits, at


# Outputs that take no new device memory: a weight's copy kept across steps, and a gradient's
# host tensor (fxckpt host memory, as the meter counts it).
_NOT_ON_DEVICE = ("fxckpt.resident_weight.default", "fxckpt.grad_host.default")
# The arguments of fxckpt's ops that name a transfer: 0-d int64 CPU tensors, host memory.
_HANDLE_ARGS = ("handle", "ticket")


def host_handles(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes of ``gm`` that are fxckpt's handles and tickets (made in ``gm`` or taken as
    inputs): what an fxckpt op takes as its ``handle`` or ``ticket`` argument."""
    found: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None or not schema.name.startswith("fxckpt::"):
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.name in _HANDLE_ARGS:
                value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
                if hasattr(value, "op"):
                    found.add(value)
    return found


@dataclass(frozen=True)
class StepLiveness:
    """Bytes live at each position of a partitioned step, what exists before the step left
    out: ``forward[k]`` at the forward's node ``k``, ``backward[k]`` at the backward's."""

    forward: list[int]
    backward: list[int]

    @property
    def peak(self) -> int:
        return max([*self.forward, *self.backward], default=0)

    @property
    def forward_peak(self) -> int:
        return max(self.forward, default=0)

    @property
    def backward_peak(self) -> int:
        return max(self.backward, default=0)


def step_liveness(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule,
                  transient: Collection[torch.fx.Node] = ()) -> StepLiveness:
    """The live bytes of one training step at every node of its partitioned forward and
    backward graphs, as fxckpt's rewrite left them (or before it: a plain partition).

    Not counted: what exists before the step (the forward's inputs: parameters, buffers, the
    batch; the backward takes the parameters it needs as inputs too; the streamed weights'
    device copies the plan keeps across steps, ``fxckpt::resident_weight``), and host memory
    (the offload handles and prefetch tickets are 0-d CPU tensors, :func:`host_handles`; a
    streamed weight's gradient from ``fxckpt::grad_host`` on). Counted in the backward: every
    other input (the saved tensors, freed at their last use; the tangents), what it computes
    and recomputes, and each restored tensor from its prefetch on, where the engine allocates
    its buffer. Exact for graphs run op by op (``compiler="eager"``). ``transient``: nodes of
    either graph whose values never reach memory (what Inductor computes inside a fused
    kernel), which count nothing.
    """
    inputs = input_storages(fw)
    transient = {*transient, *host_handles(fw), *host_handles(bw),
                 *(n for gm in (fw, bw) for n in gm.graph.nodes if str(n.target) in _NOT_ON_DEVICE)}  # fmt: skip
    fw_live = live_bytes_timeline(fw, counted=lambda n: n not in transient, skip_storages=inputs)
    pos = {n: k for k, n in enumerate(bw.graph.nodes)}
    waits, at = restores(bw)
    bw_live = live_bytes_timeline(
        # A bucket's wait names its members' storages; each member counts, as its getitem.
        bw, counted=lambda n: n not in waits and n not in transient,
        allocated_at={m: pos[a] for m, a in at.items()},
        skip_storages=inputs,
        fresh={m: span_bytes(m.meta.get("val")) for m in at},
    )
    return StepLiveness(fw_live, bw_live)


def step_peak_bytes(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule,
                    transient: Collection[torch.fx.Node] = ()) -> int:
    """The peak of the memory one training step allocates (:func:`step_liveness`), what
    exists before the step left out. Under Inductor the plan reports Inductor's own figure
    where it has one (:mod:`fxckpt.passes.inductor_peak`)."""
    return step_liveness(fw, bw, transient).peak


def held_for_backward(fw: torch.fx.GraphModule, num_fwd_outputs: int) -> int:
    """Bytes the forward leaves on the device for its backward: the storages of what it saves
    (its outputs after the first ``num_fwd_outputs``), each once, what existed before the
    step (its inputs) and host memory (handles) left out."""
    inputs = input_storages(fw)
    out = fw.graph.find_nodes(op="output")[0]
    args = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    handles = host_handles(fw)
    seen: dict[object, int] = {}
    for node in args[num_fwd_outputs:]:
        if not hasattr(node, "meta") or node in handles:
            continue
        val = node.meta.get("val")
        key = storage_key(val)
        if key is None or key in inputs:
            continue
        seen.setdefault(key, _tensor_bytes(val))
    return sum(seen.values())
