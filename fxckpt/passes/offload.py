"""Carry out a plan's Offload decisions: offload ops in the forward, prefetch/wait in the
backward, and the note of what stays resident.

After :func:`insert_offloads`, every offloaded tensor leaves the forward as a handle, its
device storage is held (as a ``keepalive``) only until ``offload_done``, and the backward gets
it back from ``wait`` before its first use. Where each op sits comes from
:mod:`fxckpt.passes.schedule`; this pass only inserts them.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

from fxckpt.graph import meta
from fxckpt.graph.activations import storage_key
from fxckpt.graph.sizes import SYM_OPS
from fxckpt.runtime import ops as _ops  # noqa: F401  (the ops must exist before we name them)

OFFLOAD = torch.ops.fxckpt.offload.default
OFFLOAD_DONE = torch.ops.fxckpt.offload_done.default
PREFETCH = torch.ops.fxckpt.prefetch.default
WAIT = torch.ops.fxckpt.wait.default
OFFLOAD_MANY = torch.ops.fxckpt.offload_many.default
OFFLOAD_MANY_DONE = torch.ops.fxckpt.offload_many_done.default
WAIT_MANY = torch.ops.fxckpt.wait_many.default


@dataclass(frozen=True)
class Placement:
    """Where the ops for one offloaded tensor go.

    ``done_after`` names the forward node after which ``offload_done`` runs, and
    ``prefetch_before`` the backward node before which ``prefetch`` is issued. The offload
    runs after ``offload_after`` (default: the tensor's producer) and the wait before
    ``wait_before`` (default: its first use in the backward).
    """

    name: str
    done_after: str
    prefetch_before: str
    offload_after: str | None = None
    wait_before: str | None = None
    tier: int = 0  # the offload op's tier argument: 1 sends the tensor on to the disk tier


@dataclass(frozen=True)
class BucketPlacement:
    """Where the ops for one copy bucket go: one offload after ``offload_after`` (every
    member exists there), one join after ``done_after``, one prefetch before
    ``prefetch_before`` and one wait, restoring every member, before ``wait_before``."""

    names: tuple[str, ...]  # the members, in production order
    offload_after: str
    done_after: str
    prefetch_before: str
    wait_before: str


def _handle_val(like: torch.Tensor) -> torch.Tensor:
    fake_mode = getattr(like, "fake_mode", None)
    if fake_mode is None:
        return torch.empty((), dtype=torch.int64)
    with fake_mode:
        return torch.empty((), dtype=torch.int64, device="cpu")


def _token_val(like: torch.Tensor) -> torch.Tensor:
    fake_mode = getattr(like, "fake_mode", None)
    if fake_mode is None:
        return torch.empty(0, dtype=torch.uint8)
    with fake_mode:
        return torch.empty(0, dtype=torch.uint8, device="cpu")


def _output(gm: fx.GraphModule) -> fx.Node:
    return gm.graph.find_nodes(op="output")[0]


def _emit(graph: fx.Graph, expr: sympy.Expr, table: dict[sympy.Expr, fx.Node]) -> Any:
    """An int, or a node of ``graph`` that computes ``expr`` from the SymInt inputs."""
    if expr.is_Integer:
        return int(expr)
    if expr in table:
        return table[expr]
    if isinstance(expr, sympy.Pow):
        op, args = operator.mul, [expr.base] * int(expr.exp)
    else:
        op, args = SYM_OPS[type(expr)], list(expr.args)
    parts = [_emit(graph, a, table) for a in args]

    def combine(a: Any, b: Any) -> Any:
        node = graph.call_function(op, (a, b))
        vals = [x.meta["val"] if isinstance(x, fx.Node) else x for x in (a, b)]
        node.meta["val"] = op(*vals)
        return node

    result = functools.reduce(combine, parts)
    if isinstance(result, fx.Node):
        table[expr] = result
    return result


def _sizes(graph: fx.Graph, dims: Sequence[Any], table: dict[sympy.Expr, fx.Node]) -> list[Any]:
    return [_emit(graph, d.node.expr, table) if isinstance(d, torch.SymInt) else int(d) for d in dims]


def insert_offloads(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    placements: Sequence[Placement | BucketPlacement],
    profile: str | None = None,
    inductor: bool = False,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Offload each placed saved tensor (or bucket of them) of ``fw`` and restore it in ``bw``.

    ``profile``: the key of the compile's runtime settings, which each offload op carries
    (``None``, the defaults: left out, so such graphs read as they always did).
    ``inductor``: Inductor compiles the graphs; a source that is a view reaches the copy and
    its join through one copy of its own (:func:`_one_buffer`).
    """
    if not placements:
        return fw, bw
    g = _Graphs(fw, bw, {} if profile is None else {"profile": profile}, inductor)
    for p in placements:
        if isinstance(p, BucketPlacement):
            _insert_bucket(g, p)
        else:
            _insert_one(g, p)
    out = _output(fw)
    out.args = (tuple(o for o in g.outputs if o is not None),)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    return fw, bw


class _Graphs:
    """The two graphs being rewritten, with the lookups every insertion needs."""

    def __init__(self, fw: fx.GraphModule, bw: fx.GraphModule, start: dict[str, Any],
                 inductor: bool = False) -> None:
        self.fw, self.bw = fw, bw
        self.start = start  # keyword arguments of the ops that start a transfer
        self.inductor = inductor  # Inductor compiles the graphs (see _one_buffer)
        self.fw_nodes = {n.name: n for n in fw.graph.nodes}
        self.bw_nodes = {n.name: n for n in bw.graph.nodes}
        self.fw_at = {n: i for i, n in enumerate(fw.graph.nodes)}
        self.bw_at = {n: i for i, n in enumerate(bw.graph.nodes)}
        self.sym_inputs: dict[sympy.Expr, fx.Node] = {}
        for n in bw.graph.find_nodes(op="placeholder"):
            if isinstance(v := n.meta.get("val"), torch.SymInt):
                self.sym_inputs.setdefault(v.node.expr, n)
        # The forward's outputs; a bucket's members after the first become None (dropped).
        self.outputs: list[fx.Node | None] = list(_output(fw).args[0])  # type: ignore[arg-type]

    def first_use(self, ph: fx.Node) -> fx.Node:
        return min(ph.users, key=self.bw_at.__getitem__)

    def join_anchor(self, handle: fx.Node, after: str, offload_after: str) -> fx.Node:
        """The join goes after ``after``, but never before the offload it joins."""
        node = self.fw_nodes[after]
        return handle if self.fw_at[node] <= self.fw_at[self.fw_nodes[offload_after]] else node

    def layout(self, val: torch.Tensor) -> tuple[list[Any], list[Any]]:
        # Symbolic sizes become nodes over the backward's SymInt inputs (placed at the
        # insertion point, so they sit after every placeholder); a fresh table per wait
        # keeps them local.
        table = dict(self.sym_inputs)
        return _sizes(self.bw.graph, val.shape, table), _sizes(self.bw.graph, val.stride(), table)


def _one_buffer(g: _Graphs, src: fx.Node, after: fx.Node) -> fx.Node:
    """The node whose value the offload copies and its join keeps alive: ``src``, or under
    Inductor, where ``src`` is a view of another node's storage, a copy of it.

    Inductor hands a fallback op a view it cannot express over its base's buffer as a fresh
    copy, one per op (``ExternKernel.realize_input``): the copy and the join then read two
    buffers, and the one being copied, dead to Inductor after the copy starts, is reused
    for the next kernel's output while the copy still reads it. One ``clone`` gives both ops
    the same buffer, which the join then keeps alive. The copy goes after ``after``, where
    the offload is placed, so the offload follows it.
    """
    val = src.meta.get("val")
    if not g.inductor or src.op != "call_function" or not isinstance(val, torch.Tensor):
        return src
    key = storage_key(val)
    if key is None or not any(isinstance(v := a.meta.get("val"), torch.Tensor)
                              and storage_key(v) == key for a in src.all_input_nodes):  # fmt: skip
        return src
    with g.fw.graph.inserting_after(after):
        one = g.fw.graph.call_function(torch.ops.aten.clone.default, (src,))
    one.meta.update({k: v for k, v in src.meta.items() if k != "val"})
    one.meta["val"] = _in_fake_mode(val, lambda t: t.clone())
    g.fw_nodes[one.name] = one
    g.fw_at[one] = g.fw_at[after]
    return one


def _insert_one(g: _Graphs, p: Placement) -> None:
    fw, bw = g.fw, g.bw
    src = g.fw_nodes[p.name]
    val = src.meta["val"]
    anchor = g.fw_nodes[p.offload_after or p.name]
    data = _one_buffer(g, src, anchor)
    with fw.graph.inserting_after(data if data is not src else anchor):
        # The backward placeholder takes the same name, as for any saved tensor.
        # The tier argument only where it is not the default, so host-tier graphs read as
        # they always did.
        args = (data,) if p.tier == 0 else (data, p.tier)
        handle = fw.graph.create_node("call_function", OFFLOAD, args, dict(g.start),
                                      name=f"{p.name}_handle")
    handle.meta.update({"val": _handle_val(val), meta.ROLE: meta.ROLE_OFFLOAD, meta.SOURCE: p.name})
    with fw.graph.inserting_after(g.join_anchor(handle, p.done_after, p.offload_after or p.name)):
        done = fw.graph.call_function(OFFLOAD_DONE, (handle, data))
    done.meta.update({"val": _token_val(val), meta.ROLE: meta.ROLE_OFFLOAD_DONE, meta.SOURCE: p.name})
    g.outputs[g.outputs.index(src)] = handle

    ph = g.bw_nodes[p.name]
    with bw.graph.inserting_before(ph):
        new_ph = bw.graph.placeholder(handle.name)
    new_ph.meta.update({"val": handle.meta["val"], meta.SOURCE: p.name})
    first_use = g.bw_nodes[p.wait_before] if p.wait_before else g.first_use(ph)
    with bw.graph.inserting_before(g.bw_nodes[p.prefetch_before]):
        pre = bw.graph.call_function(PREFETCH, (new_ph,))
    pre.meta.update({"val": new_ph.meta["val"], meta.ROLE: meta.ROLE_PREFETCH, meta.SOURCE: p.name})
    with bw.graph.inserting_before(first_use):
        size, stride = g.layout(val)
        # wait takes prefetch's ticket, so no scheduler can put the prefetch after it.
        restored = bw.graph.call_function(WAIT, (new_ph, pre, size, stride, val.dtype, val.device))
    restored.meta.update(dict(ph.meta))
    restored.meta.update({meta.ROLE: meta.ROLE_WAIT, meta.SOURCE: p.name})
    ph.replace_all_uses_with(restored)
    bw.graph.erase_node(ph)


def _insert_bucket(g: _Graphs, p: BucketPlacement) -> None:
    srcs = [g.fw_nodes[n] for n in p.names]
    vals = [s.meta["val"] for s in srcs]
    source = ",".join(p.names)
    shared = shared_storages(vals)
    handle = _insert_bucket_offload(g, p, srcs, vals, source, shared)
    phs = [g.bw_nodes[n] for n in p.names]
    restored, part_of, parts = _insert_bucket_restore(g, p, handle, phs, vals, source, shared)
    _replace_bucket_members(g, restored, phs, vals, part_of, parts, shared)


def _insert_bucket_offload(g: _Graphs, p: BucketPlacement, srcs: list[fx.Node],
                           vals: list[torch.Tensor], source: str,
                           shared: SharedStorages | None) -> fx.Node:
    """The forward's side of a bucket: one offload, its join, and the saved slot: the handle."""
    fw = g.fw
    start = dict(g.start)
    if shared is not None:
        start.update(groups=shared.groups, offsets=shared.offsets, strides=shared.strides)
    anchor = g.fw_nodes[p.offload_after]
    data = []
    for s in srcs:
        data.append(_one_buffer(g, s, anchor))
        anchor = data[-1] if data[-1] is not s else anchor
    with fw.graph.inserting_after(anchor):
        handle = fw.graph.create_node("call_function", OFFLOAD_MANY, (data,), start,
                                      name=f"{p.names[0]}_bucket")
    handle.meta.update({"val": _handle_val(vals[0]), meta.ROLE: meta.ROLE_OFFLOAD,
                        meta.SOURCE: source})  # fmt: skip
    with fw.graph.inserting_after(g.join_anchor(handle, p.done_after, p.offload_after)):
        # Every member is a keepalive of the join, as the one source is of offload_done.
        done = fw.graph.call_function(OFFLOAD_MANY_DONE, (handle, data))
    done.meta.update({"val": _token_val(vals[0]), meta.ROLE: meta.ROLE_OFFLOAD_DONE,
                      meta.SOURCE: source})  # fmt: skip
    # The handle takes the saved slot of the member saved first; the others' slots go, and
    # the backward's placeholders follow, so both keep one order.
    slots = sorted(g.outputs.index(s) for s in srcs)
    g.outputs[slots[0]] = handle
    for k in slots[1:]:
        g.outputs[k] = None
    return handle


def _insert_bucket_restore(
    g: _Graphs, p: BucketPlacement, handle: fx.Node, phs: list[fx.Node],
    vals: list[torch.Tensor], source: str, shared: SharedStorages | None,
) -> tuple[fx.Node, list[int], list[torch.Tensor]]:
    """The backward's side of a bucket: its placeholder, prefetch and wait. Returns the wait,
    each member's part and the parts it restores."""
    bw = g.bw
    first_ph = min(phs, key=g.bw_at.__getitem__)
    with bw.graph.inserting_before(first_ph):
        new_ph = bw.graph.placeholder(handle.name)
    new_ph.meta.update({"val": handle.meta["val"], meta.SOURCE: source})
    with bw.graph.inserting_before(g.bw_nodes[p.prefetch_before]):
        pre = bw.graph.call_function(PREFETCH, (new_ph,))
    pre.meta.update({"val": new_ph.meta["val"], meta.ROLE: meta.ROLE_PREFETCH, meta.SOURCE: source})
    # One restored tensor per part: a member alone, or a shared storage's stretch (1-D).
    part_of = shared.groups if shared is not None else list(range(len(vals)))
    parts: list[torch.Tensor] = []
    for k, val in enumerate(vals):
        if part_of[k] == len(parts):
            parts.append(val if shared is None or part_of.count(part_of[k]) == 1
                         else _stretch_val(val, shared.spans[part_of[k]]))  # fmt: skip
    with bw.graph.inserting_before(g.bw_nodes[p.wait_before]):
        sizes: list[Any] = []
        strides: list[Any] = []
        for val in parts:
            size, stride = g.layout(val)
            sizes += size
            strides += stride
        ranks = [v.dim() for v in parts]
        restored = bw.graph.call_function(
            WAIT_MANY, (new_ph, pre, sizes, strides, ranks, vals[0].dtype, vals[0].device)
        )
    restored.meta.update({"val": list(parts), meta.ROLE: meta.ROLE_WAIT, meta.SOURCE: source})
    return restored, part_of, parts


def _replace_bucket_members(
    g: _Graphs, restored: fx.Node, phs: list[fx.Node], vals: list[torch.Tensor],
    part_of: list[int], parts: list[torch.Tensor], shared: SharedStorages | None,
) -> None:
    """Each member's placeholder gives way to its part of the wait (a view of it, where the
    part is a shared storage's stretch)."""
    bw = g.bw
    anchor = restored
    items: dict[int, fx.Node] = {}
    for k, ph in enumerate(phs):
        j = part_of[k]
        if j not in items:
            with bw.graph.inserting_after(anchor):
                items[j] = anchor = bw.graph.call_function(operator.getitem, (restored, j))
            items[j].meta.update({"val": parts[j], meta.SOURCE: ph.name})
        member = items[j]
        if parts[j] is not vals[k]:  # a view of its storage's stretch, as it was in the forward
            assert shared is not None
            view = (list(vals[k].shape), list(vals[k].stride()), shared.offsets[k])
            with bw.graph.inserting_after(anchor):
                member = anchor = bw.graph.call_function(torch.ops.aten.as_strided.default,
                                                         (items[j], *view))  # fmt: skip
            member.meta.update(dict(ph.meta))
            member.meta["val"] = _in_fake_mode(parts[j], lambda t, v=view: t.as_strided(*v))
        else:
            member.meta.update(dict(ph.meta))
        member.meta[meta.SOURCE] = ph.name
        ph.replace_all_uses_with(member)
        bw.graph.erase_node(ph)


@dataclass(frozen=True)
class SharedStorages:
    """Members of a bucket that are views of one storage: the ``offload_many`` arguments that
    send each such storage as one part (see :func:`fxckpt.runtime.bucket_ops.offload_many`)."""

    groups: list[int]  # per member, its part: numbered in order of first appearance
    offsets: list[int]  # per member, elements from its part's start
    strides: list[int]  # every member's strides, concatenated
    spans: list[int]  # per part, its elements


def shared_storages(vals: Sequence[torch.Tensor]) -> SharedStorages | None:
    """How ``vals`` share storages, where any two do and every layout is concrete; else None
    (each member is then its own part, as are members of symbolic layout)."""
    keys = [storage_key(v) for v in vals]
    if all(k is None or keys.count(k) == 1 for k in keys):
        return None
    given = [(*v.shape, *v.stride(), v.storage_offset()) for v in vals]
    if not all(type(x) is int for xs in given for x in xs):
        return None
    layouts = [(tuple(int(n) for n in v.shape), tuple(int(s) for s in v.stride()),
                int(v.storage_offset())) for v in vals]  # fmt: skip
    first: dict[Any, int] = {}
    groups = []
    for k, key in enumerate(keys):
        groups.append(first.setdefault(key if key is not None else ("alone", k), len(first)))
    start = {g: min(off for (_, _, off), h in zip(layouts, groups, strict=True) if h == g)
             for g in set(groups)}  # fmt: skip
    offsets = [off - start[g] for (_, _, off), g in zip(layouts, groups, strict=True)]
    spans = [0] * len(first)
    for (size, stride, _), g, off in zip(layouts, groups, offsets, strict=True):
        reach = 0 if 0 in size else 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        spans[g] = max(spans[g], off + reach)
    strides = [s for _, stride, _ in layouts for s in stride]
    return SharedStorages(groups, offsets, strides, spans)


def _in_fake_mode(like: torch.Tensor, fn: Any) -> torch.Tensor:
    fake_mode = getattr(like, "fake_mode", None)
    if fake_mode is None:
        return fn(like)
    with fake_mode:
        return fn(like)


def _stretch_val(like: torch.Tensor, span: int) -> torch.Tensor:
    return _in_fake_mode(like, lambda t: torch.empty(span, dtype=t.dtype, device=t.device))
