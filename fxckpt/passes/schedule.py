"""Where the offload ops go, taken from the memory simulator's schedule.

The simulator (:func:`fxckpt.planning.memory.simulate`) models the D2H and H2D copies as FIFO
channels over the estimated compute of each node, and says at which forward position each
D2H copy is done and at which backward position each prefetch must be issued to land in time
(``prefetch="auto"``) or at first use (``"jit"``). This pass turns those positions into node
names, so the graph runs the schedule the plan's figures describe.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fxckpt import _torch_compat as compat
from fxckpt._torch_compat import run_after
from fxckpt.graph import meta
from fxckpt.graph.activations import SavedActivation
from fxckpt.passes.offload import BucketPlacement, Placement
from fxckpt.planning.host import disk_storages, read_ahead
from fxckpt.planning.planner import Choice
from fxckpt.runtime.disk import DISK

if TYPE_CHECKING:
    from fxckpt.options import Options
    from fxckpt.planning.plan_round import Partition, RoundDecision


def place_offloads(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    offloaded: Sequence[tuple[SavedActivation, int, int]],
    *,
    fused: bool = False,
    ready: Mapping[str, int] | None = None,
) -> list[Placement]:
    """One placement per ``(tensor, d2h_done, prefetch_issue)``; positions as in the simulator
    (forward positions first, then backward positions offset by the forward's length).

    ``ready``: per tensor of a copy bucket, the forward position after which the bucket's
    copy starts (its last member's producer), where its offload then goes.

    ``fused``: the graphs go to a compiler that fuses runs of pointwise ops and reductions
    into few kernels (Inductor). A position inside such a run may not exist in the generated
    code, and pinning an op there would split a kernel in two. So offloads and joins move to
    the end of the run (the source lives a few short kernels longer), prefetches and waits to
    its start (the copy is issued, and waited for, a few short kernels sooner).
    """
    fw_nodes = list(fw.graph.nodes)
    bw_nodes = list(bw.graph.nodes)
    num_forward = len(fw_nodes)
    last_fw = num_forward - 2  # the last node before the output
    first_bw = next(i for i, n in enumerate(bw_nodes) if n.op != "placeholder")
    fw_runs, bw_runs = (_fusable_runs(nodes) if fused else {} for nodes in (fw_nodes, bw_nodes))
    placements = []
    for a, done, issue in offloaded:
        # The device copy must outlive the last forward use as well as the copy itself.
        done_at = min(max(done, a.last_fw_use, a.produced), last_fw)
        first_use = a.first_bw_use if a.first_bw_use >= 0 else first_bw
        pre_at = min(max(issue - num_forward, first_bw), first_use)
        start = max(a.produced, ready.get(a.name, a.produced)) if ready else a.produced
        offload_at = min(fw_runs.get(start, (start,) * 2)[1], last_fw)
        done_at = max(min(fw_runs.get(done_at, (done_at,) * 2)[1], last_fw), offload_at)
        wait_at = max(bw_runs.get(first_use, (first_use,) * 2)[0], first_bw)
        pre_at = max(min(bw_runs.get(pre_at, (pre_at,) * 2)[0], wait_at), first_bw)
        placements.append(
            Placement(
                name=a.name,
                done_after=fw_nodes[done_at].name,
                prefetch_before=bw_nodes[pre_at].name,
                offload_after=fw_nodes[offload_at].name if offload_at != a.produced else None,
                wait_before=bw_nodes[wait_at].name if wait_at != first_use else None,
            )
        )
    return placements


def coalesce(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    placements: Sequence[Placement],
    bucket_of: Mapping[str, int],
) -> list[Placement | BucketPlacement]:
    """The placements, those of each copy bucket's host-tier members merged into one.

    The bucket's offload goes where its last member's would, its join where its last one
    would, its prefetch and its wait where its first ones would (the simulator placed them
    all so: :func:`fxckpt.planning.memory.bucket_schedule`). A member sent to the disk tier, or
    left alone in its bucket, keeps a placement of its own at the bucket's positions.
    """
    fw_at = {n.name: i for i, n in enumerate(fw.graph.nodes)}
    bw_nodes = {n.name: n for n in bw.graph.nodes}
    bw_at = {n.name: i for i, n in enumerate(bw.graph.nodes)}
    groups: dict[int, list[Placement]] = {}
    out: list[Placement | BucketPlacement] = []
    for p in placements:
        g = bucket_of.get(p.name)
        if g is None or p.tier != 0:
            out.append(p)
        else:
            groups.setdefault(g, []).append(p)
    for members in groups.values():
        if len(members) == 1:
            out.extend(members)
            continue
        members.sort(key=lambda p: fw_at[p.name])

        def first_use(p: Placement) -> str:
            return p.wait_before or min(bw_nodes[p.name].users, key=lambda u: bw_at[u.name]).name

        out.append(BucketPlacement(
            names=tuple(p.name for p in members),
            offload_after=max((p.offload_after or p.name for p in members), key=fw_at.__getitem__),
            done_after=max((p.done_after for p in members), key=fw_at.__getitem__),
            prefetch_before=min((p.prefetch_before for p in members), key=bw_at.__getitem__),
            wait_before=min((first_use(p) for p in members), key=bw_at.__getitem__),
        ))  # fmt: skip
    return out


def placements(
    fw: fx.GraphModule, bw: fx.GraphModule, part: Partition, decision: RoundDecision | None,
    options: Options, inductor: bool,
) -> list[Placement | BucketPlacement]:
    """Where each offloaded tensor's ops go: the simulator's copy positions, a disk tensor's
    prefetch issued earlier by its read time, its offload marked for the disk tier, and the
    host-tier members of each copy bucket merged into one bucket's ops."""
    if decision is None:
        return []
    sim = decision.solution.sim
    buckets = decision.problem.buckets
    index = {s.key: i for i, s in enumerate(decision.storages)}
    offloaded = [
        (a, sim.d2h_done[index[a.storage]], sim.prefetch_issue[index[a.storage]])
        for a in part.saved
        if decision.kind_of(a.storage) == "offload"
    ]
    offloaded = read_ahead(offloaded, decision.choices, decision.problem, options)
    bucket_of = {a.name: buckets.of[index[a.storage]] for a, _, _ in offloaded}
    ready = {a.name: buckets.ready[bucket_of[a.name]] for a, _, _ in offloaded}
    placed = place_offloads(fw, bw, offloaded, fused=inductor, ready=ready)
    return coalesce(fw, bw, with_tiers(placed, part.saved, decision.choices), bucket_of)


def _fusable_runs(nodes: Sequence[fx.Node]) -> dict[int, tuple[int, int]]:
    """For each position inside a run of pointwise ops and reductions, the positions of the
    run's first and last op.

    A run is what Inductor fuses into one kernel or a few: compute nodes consecutive among
    the compute nodes (views and getitems may sit between them), each reading a node of the
    run or a tensor that a node of the run reads (vertical and horizontal fusion). Matmuls,
    attention and other extern kernels end a run, and so does an unrelated op; where
    Inductor splits a run anyway, treating it as one moves an op by a few short kernels.
    """
    compute = set()
    order: list[int] = []
    for i, n in enumerate(nodes):
        if _computes(n):
            compute.add(n)
            order.append(i)
    runs: dict[int, tuple[int, int]] = {}
    k = 0
    while k < len(order):
        first = last = order[k]
        node = nodes[first]
        if _fusable(node):
            members = {node}
            reads = _reach(node, "all_input_nodes", compute) | _inputs(node)
            while k + 1 < len(order) and _fusable(nxt := nodes[order[k + 1]]):
                inputs = _reach(nxt, "all_input_nodes", compute) | _inputs(nxt)
                if not inputs & (members | reads):
                    break
                members.add(nxt)
                reads |= inputs
                k += 1
                last = order[k]
        if last > first:
            for i in range(first, last + 1):
                runs[i] = (first, last)
        k += 1
    return runs


def fused_intermediates(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose values Inductor keeps inside kernels, never in memory.

    A pointwise op read by one pointwise op or reduction, wherever it sits, is inlined into
    its reader's kernel, as is an op reading no tensor (``full``, ``ones``) read only by
    such ops. A pointwise op or reduction of a run (:func:`_fusable_runs`) read only by later
    ops of that run is fused with them. A value read by the graph's output, by an extern
    kernel or by one of fxckpt's ops is a buffer. Inductor inlines more than this (a
    pointwise op with several cheap readers, say), so a timeline without these nodes is
    still an upper bound under Inductor.
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    runs = _fusable_runs(nodes)
    out: set[fx.Node] = set()
    for i, n in enumerate(nodes):
        if not (n.op == "call_function" and isinstance(n.target, compat.OpOverload)
                and not n.target.is_view and meta.ROLE not in n.meta and _tensor_val(n)):  # fmt: skip
            continue
        readers = _compute_readers(n)
        if not readers or not all(_computes(r) and _fusable(r) for r in readers):
            continue
        if not any(_tensor_val(a) for a in n.all_input_nodes):
            out.add(n)
        elif _pointwise(n) and len(readers) == 1:
            out.add(n)
        elif (run := runs.get(i)) is not None and all(i < pos[r] <= run[1] for r in readers):
            out.add(n)
    return out


def _pointwise(node: fx.Node) -> bool:
    return torch.Tag.pointwise in node.target.tags  # type: ignore[union-attr]


def _compute_readers(node: fx.Node) -> list[fx.Node] | None:
    """The nodes that read ``node``'s value, through views and getitems; None where the
    graph's output or an op of fxckpt's reads it."""
    found: list[fx.Node] = []
    todo = list(node.users)
    while todo:
        u = todo.pop()
        if u.op != "call_function" or meta.ROLE in u.meta:
            return None
        if _computes(u):
            found.append(u)
        elif u.target is operator.getitem or (isinstance(u.target, compat.OpOverload) and u.target.is_view):
            todo.extend(u.users)
        else:
            return None
    return found


def _inputs(node: fx.Node) -> set[fx.Node]:
    """The graph inputs ``node`` reads, through views."""
    found, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            found.add(n)
        elif n.op == "call_function" and not _computes(n) and meta.ROLE not in n.meta:
            todo.extend(n.all_input_nodes)
    return found


def _fusable(node: fx.Node) -> bool:
    """A pointwise op or a reduction: what Inductor fuses into one kernel with its
    neighbours (matmuls, attention and other extern kernels end a run)."""
    tags = node.target.tags  # type: ignore[union-attr]
    return torch.Tag.pointwise in tags or torch.Tag.reduction in tags


# The ops whose positions the plan fixes: each is a barrier between the compute before it and
# the compute after it in FX order.
_PINNED = (
    meta.ROLE_OFFLOAD, meta.ROLE_OFFLOAD_DONE, meta.ROLE_PREFETCH, meta.ROLE_WAIT, meta.ROLE_NOTE
)


def _tensor_val(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _output(node: fx.Node) -> fx.Node | None:
    """A tensor ``node`` produces, as a node ordered right after it: the node itself, or a
    getitem of its first tensor result (made here when the graph reads it only later)."""
    if _tensor_val(node):
        return node
    vals = node.meta.get("val") or ()
    first = next((i for i, v in enumerate(vals) if isinstance(v, torch.Tensor)), None)
    if first is None:
        return None
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == first and user.prev is node:
            return user
    with node.graph.inserting_after(node):
        item = node.graph.call_function(operator.getitem, (node, first))
    item.meta["val"] = vals[first]
    return item


def _computes(node: fx.Node) -> bool:
    """A node that lowers to kernels of its own: an aten op that is not a view, reads a
    tensor and returns tensors. Views, getitems, SymInt arithmetic and fxckpt's own ops
    lower to no kernel of their own, and an op reading no tensor (``full``, ``arange``)
    Inductor inlines into its users; none of them can carry an ordering dependency."""
    target = node.target
    val = node.meta.get("val")
    return (
        node.op == "call_function"
        and isinstance(target, compat.OpOverload)
        and not target.is_view
        and meta.ROLE not in node.meta
        and (isinstance(val, torch.Tensor) or (isinstance(val, (tuple, list)) and len(val) > 0))
        and any(_tensor_val(a) for a in node.all_input_nodes)
    )


def _reach(node: fx.Node, step: str, compute: set[fx.Node]) -> set[fx.Node]:
    """The compute nodes next to ``node`` through ``step`` ("users" or "all_input_nodes"),
    looking through the nodes that compute nothing (views, getitems)."""
    found: set[fx.Node] = set()
    todo = list(getattr(node, step))
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in compute or meta.ROLE in n.meta:
            found.add(n)
        elif n.op == "call_function":
            todo.extend(getattr(n, step))
    return found


def pin_positions(gm: fx.GraphModule) -> fx.GraphModule:
    """After this pass, every fxckpt op of ``gm`` runs after all compute that precedes it in
    FX order and before all compute that follows it, in whatever order a scheduler prefers
    to run the rest.

    Inductor reorders freely within data dependencies: ``reorder_for_peak_memory`` moves a
    join next to the last use of its source and hoists a prefetch to the top, and work that
    depends only on the inputs runs wherever it lowers peak memory. So each op is pinned
    from both sides, with dependencies no scheduler may break:

    - not earlier: the op's ``after`` argument takes the previous op's output and every
      compute node since that op with no compute user before this one (the only ones not
      already ordered before it through the others);
    - not later: each compute node that follows the op without depending on it or on later
      compute is made to depend on the op's output, through Inductor's ``control_deps``
      (:func:`fxckpt._torch_compat.run_after`).

    So consecutive ops form a chain and compute between two of them stays between them. A
    fusion across an op is no longer possible: the op's position is a kernel boundary.
    """
    nodes = list(gm.graph.nodes)
    compute = {n for n in nodes if _computes(n)}
    last: fx.Node | None = None  # the last pinned op so far
    last_out: fx.Node | None = None  # a tensor it produces
    since: list[fx.Node] = []  # compute nodes after it, in order
    deps: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        if node.meta.get(meta.ROLE) in _PINNED:
            later = set(since)
            # A node read by a later fxckpt op counts too: Inductor may compute it inline for
            # its compute users and realize it only for that op, as late as it likes.
            sinks = [
                n for n in since
                if not (_reach(n, "users", compute) & later)
                or any(meta.ROLE in u.meta and u is not node for u in _reach(n, "users", compute))
            ]
            after = [last_out] if last_out is not None else []
            after += [out for n in sinks if (out := _output(n)) is not None]
            taken = set(node.all_input_nodes)
            _set_after(node, [a for a in after if a not in taken])
            # A bucket's wait returns a list: the chain goes through its first member.
            last, last_out, since = node, _output(node), []
        elif node in compute:
            if last is not None and not (_reach(node, "all_input_nodes", compute) & {last, *since}):
                # Depends only on what ran before `last`: pin it after (through a tensor).
                deps[node] = [last_out or last]
            since.append(node)
    if deps:
        run_after(gm.graph, deps)
    gm.graph.lint()
    gm.recompile()
    return gm


def _set_after(node: fx.Node, after: list[fx.Node]) -> None:
    """Fill the ``after`` argument of a fxckpt op (the last positional one of each schema)."""
    if not after:
        return
    schema = node.target._schema  # type: ignore[union-attr]
    positional = [a for a in schema.arguments if not a.kwarg_only]
    names = [a.name for a in positional]
    # Arguments between the given ones and ``after`` take their schema defaults (offload's
    # ``tier``), passed positionally so that ``after`` can follow them. Keyword-only ones
    # (offload's ``profile``) stay keywords.
    args = list(node.args) + [
        node.kwargs.get(a.name, a.default_value) for a in positional[len(node.args) :]
    ]
    args[names.index("after")] = after
    node.args = tuple(args)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k not in names}


def with_tiers(placements: Sequence[Placement], final: Sequence[SavedActivation],
               choices: dict[str, Choice]) -> list[Placement]:
    """The placements, those of disk tensors marked for the disk tier."""
    disk = disk_storages(choices)
    names = {a.name for a in final if a.storage in disk}
    return [dataclasses.replace(p, tier=DISK) if p.name in names else p for p in placements]
