"""From saved-tensor facts to the solver's numbers, and from its answer to choices with reasons.

One candidate per storage: tensors that share a storage are kept, offloaded or recomputed
together, since evicting one view of a storage another view keeps frees nothing.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxckpt._torch_compat import OFFLOAD_POLICIES
from fxckpt.graph import meta
from fxckpt.graph.activations import SavedActivation
from fxckpt.graph.blocks import BlockFacts
from fxckpt.graph.costs import is_random, is_view_like, node_cost_ms, node_flops, random_output
from fxckpt.graph.sizes import bound_symbols, restorable
from fxckpt.options import Options
from fxckpt.planning.account import PeakTarget
from fxckpt.planning.layouts import Blocks
from fxckpt.planning.memory import Candidates, Problem, Timeline, simulate
from fxckpt.planning.planner import Choice
from fxckpt.planning.solve import Solution
from fxckpt.units import format_bytes


@dataclass(frozen=True)
class StorageGroup:
    """The saved tensors on one storage, as one candidate."""

    key: str
    members: tuple[SavedActivation, ...]

    @property
    def bytes(self) -> int:
        return self.members[0].bytes


def group_by_storage(acts: Sequence[SavedActivation]) -> list[StorageGroup]:
    groups: dict[str, list[SavedActivation]] = {}
    for a in acts:
        groups.setdefault(a.storage, []).append(a)
    return [StorageGroup(k, tuple(v)) for k, v in groups.items()]


def _recompute_cost(
    s: StorageGroup, fw_nodes: dict[str, fx.Node], saved: set[str], cost_model: str, device: torch.device
) -> tuple[float, float]:
    """(ms, FLOPs) to rebuild a storage in the backward, or inf when it can't be.

    Only one op deep: the producer's tensor inputs must already be saved or be graph inputs,
    so recomputing it frees its bytes without making min-cut save something else instead.
    """
    ms = flops = 0.0
    for a in s.members:
        node = fw_nodes[a.name]
        if node.op != "call_function" or is_random(node):
            return math.inf, 0.0
        for inp in node.all_input_nodes:
            if inp.op != "placeholder" and inp.name not in saved:
                return math.inf, 0.0
        ms += node_cost_ms(node, cost_model, device)
        flops += node_flops(node) if cost_model != "unit" else 0.0
    return ms, flops


def build_problem(
    storages: Sequence[StorageGroup],
    fw: fx.GraphModule,
    fw_step_ms: Sequence[float],
    bw_step_ms: Sequence[float],
    bytes_per_ms: float,
    *,
    offloadable: set[str],
    forced: dict[str, str],
    allow_recompute: bool,
    cost_model: str,
    device: torch.device,
    not_recomputable: Set[str] = frozenset(),
    copy_overhead_ms: float = 0.0,
    link_overhead_ms: float = 0.0,
) -> tuple[Problem, dict[str, float]]:
    """The solver's view of one graph: a timeline of node costs and one row per storage.

    ``not_recomputable``: activation names that min-cut would not recompute when asked.
    ``copy_overhead_ms``: the engine's fixed host cost per offloaded tensor;
    ``link_overhead_ms``: each copy's fixed time on its queue.
    """
    F = len(fw_step_ms)
    T = F + len(bw_step_ms)
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    saved = {a.name for s in storages for a in s.members}
    # One column per Candidates field, one row per storage.
    cols: dict[str, list] = {k: [] for k in ("bytes", "produced", "last_fw_use", "first_bw_use",
                                             "last_bw_use", "recompute_ms", "can_offload", "forced")}
    flops: dict[str, float] = {}
    for s in storages:
        bw_first = [a.first_bw_use for a in s.members if a.first_bw_use >= 0]
        bw_last = [a.last_bw_use for a in s.members if a.last_bw_use >= 0]
        first = F + (min(bw_first) if bw_first else 0)
        r_ms, r_flops = (
            _recompute_cost(s, fw_nodes, saved - {a.name for a in s.members}, cost_model, device)
            if allow_recompute and not any(a.name in not_recomputable for a in s.members)
            else (math.inf, 0.0)
        )
        for a in s.members:
            flops[a.name] = r_flops / len(s.members)
        cols["bytes"].append(s.bytes)
        cols["produced"].append(min(a.produced for a in s.members))
        cols["last_fw_use"].append(max(a.last_fw_use for a in s.members))
        cols["first_bw_use"].append(first)
        cols["last_bw_use"].append(max(F + (max(bw_last) if bw_last else 0), first))
        cols["recompute_ms"].append(r_ms)
        cols["can_offload"].append(all(a.name in offloadable for a in s.members))
        cols["forced"].append(forced.get(s.key))
    timeline = Timeline(
        step_ms=[*fw_step_ms, *bw_step_ms],
        num_forward=F,
        bandwidth_bytes_per_ms=max(bytes_per_ms, 1e-9),
        copy_overhead_ms=copy_overhead_ms,
        link_overhead_ms=link_overhead_ms,
    )
    candidates = Candidates(
        bytes=cols["bytes"],
        produced=cols["produced"],
        last_fw_use=cols["last_fw_use"],
        first_bw_use=cols["first_bw_use"],
        last_bw_use=cols["last_bw_use"],
        recompute_ms=cols["recompute_ms"],
        can_offload=cols["can_offload"],
        forced=cols["forced"] if any(f is not None for f in cols["forced"]) else None,
    )
    assert T == timeline.num_positions
    return Problem(timeline, candidates), flops


def in_the_step(problem: Problem, forward_live: Sequence[int], backward_live: Sequence[int],
                target: PeakTarget | None) -> tuple[Problem, int]:
    """``problem`` with every byte of the step at each position, and the one budget that holds
    ``target``'s two limits.

    The simulator counts the candidates; ``forward_live`` / ``backward_live`` are everything
    the partition has live at each of its forward's and backward's positions, the candidates
    (kept) included. What they hold besides the kept candidates (the forward's working set,
    the tangents, gradients, temporaries, what min-cut rebuilds) becomes the timeline's fixed
    bytes, so the simulated resident bytes are the graph's own live bytes under any choices.
    A target's limits differ by position (its forward's and its backward's; at the forward's
    end, what it may keep for the backward beside its outputs): the largest is the budget, and
    every other position carries the difference as fixed bytes too. Without a target the
    budget is 0 and nothing is added."""
    tl, c = problem.timeline, problem.candidates
    F, T = tl.num_forward, tl.num_positions
    if len(forward_live) != F or len(forward_live) + len(backward_live) != T:
        raise ValueError(f"live bytes for {len(forward_live)} + {len(backward_live)} positions, "
                         f"the problem has {F} + {T - F}")
    kept = simulate(Problem(dataclasses.replace(tl, fixed_resident=None), c),
                    ["keep"] * len(c)).resident
    live = [*forward_live, *backward_live]
    base = list(tl.fixed_resident) if tl.fixed_resident is not None else [0] * T
    other = [b + max(0, v - k) for b, v, k in zip(base, live, kept, strict=True)]
    if target is None:
        return Problem(dataclasses.replace(tl, fixed_resident=other), c), 0
    limit = [target.forward] * F + [target.backward] * (T - F)
    if target.held is not None and F > 0:  # what the forward's end keeps beside its outputs
        limit[F - 1] = min(limit[F - 1], target.held + other[F - 1])
    budget = max(limit, default=0)
    fixed = [o + budget - cap for o, cap in zip(other, limit, strict=True)]
    return Problem(dataclasses.replace(tl, fixed_resident=fixed), c), budget


def backward_blocks(bw: fx.GraphModule, block_of: Callable[[fx.Node], int | None]) -> list[int | None]:
    """Per position of the backward graph, the block whose backward runs there: the block of
    the latest node at or before it that autograd made (it carries the forward's module stack).
    A forward op that the partitioner recomputes carries its own forward block instead, which
    says nothing of where the backward is (the first layer's causal mask, expanded again at the
    start of the backward for the last layer's attention)."""
    out: list[int | None] = []
    running: int | None = None
    for node in bw.graph.nodes:
        if node.meta.get(meta.FWD_NN_MODULE_STACK) and not node.meta.get(meta.NN_MODULE_STACK):
            running = block_of(node)
        out.append(running)
    return out


def copy_buckets(
    storages: Sequence[StorageGroup], fw: fx.GraphModule, bw: fx.GraphModule,
    block_of: Callable[[fx.Node], int | None], can_offload: Sequence[bool],
) -> list[int]:
    """A bucket id per storage: offloadable storages of one dtype produced in one block, whose
    forward uses end in one block and whose backward uses begin in one block, share an id
    (they are copied together, so each is held until the bucket's last forward use, and all
    come back for the bucket's first backward use); every other storage has an id of its own.

    Grouping by the block of the last forward use keeps a block's output, which the next
    block reads, out of its producer block's bucket: in it, every member would stay on the
    device until the next block ends. Grouping by the block of the first backward use keeps a
    tensor that later blocks' backwards read (a causal mask the first layer builds and every
    layer's attention uses) out of it too: with it, the whole bucket would come back at the
    start of the backward and stay there to the end.
    """
    nodes = list(fw.graph.nodes)
    running = backward_blocks(bw, block_of)
    keys: dict[tuple, int] = {}
    out = []
    for i, s in enumerate(storages):
        blocks = {a.block for a in s.members}
        dtypes = {a.dtype for a in s.members}
        block = blocks.pop() if len(blocks) == 1 else None
        if not can_offload[i] or block is None or len(dtypes) != 1:
            out.append(-1 - i)  # alone
            continue
        last = nodes[max(a.last_fw_use for a in s.members)]
        uses = [a.first_bw_use for a in s.members if a.first_bw_use >= 0]
        first = running[min(uses)] if uses else None
        key = (block, block_of(last), first, dtypes.pop())
        out.append(keys.setdefault(key, len(keys)))
    return out


def reasons(
    problem: Problem,
    solution: Solution,
    storages: Sequence[StorageGroup],
    flops: dict[str, float],
    forced_why: dict[str, str],
    budget: int | None,
) -> dict[str, Choice]:
    """One choice per storage, with the numbers behind it."""
    c = problem.candidates
    out: dict[str, Choice] = {}
    for i, s in enumerate(storages):
        kind = solution.choices[i]
        if s.key in forced_why and c.forced_of(i) == kind:
            out[s.key] = Choice(kind, forced_why[s.key])
            continue
        if kind == "offload":
            copy = problem.copy_ms(i)
            exposed = solution.exposed_ms[i]
            tail = f"{exposed:.3f} ms exposed" if exposed > 1e-9 else "fully hidden"
            out[s.key] = Choice(
                "offload",
                f"offload: {format_bytes(s.bytes)}, copies {2 * copy:.3f} ms against "
                f"{solution.hide_ms[i]:.3f} ms of compute ({tail})",
            )
        elif kind == "recompute":
            f = sum(flops.get(a.name, 0.0) for a in s.members)
            out[s.key] = Choice(
                "recompute",
                f"recompute: {format_bytes(s.bytes)} for {f / 1e6:.2f} MFLOP "
                f"({c.recompute_ms[i]:.3f} ms), cheaper than offloading it",
            )
        else:
            if budget is None:
                why = "keep: no memory_budget asks to evict it"
            elif c.allowed(i) == ("keep",):
                why = "keep: neither offloadable nor recomputable here"
            elif not solution.feasible:
                why = "keep: evicting it would not lower the resident peak"
            else:
                why = f"keep: fits the budget ({format_bytes(solution.peak)} of {format_bytes(budget)})"
            out[s.key] = Choice("keep", why)
    return out


def held_by_outputs(
    storages: Sequence[StorageGroup], fw: fx.GraphModule, num_fwd_outputs: int
) -> dict[str, str]:
    """Storages the forward also returns to its caller (a view of a saved tensor among the
    model's outputs: a key/value cache's entries, a hidden state): the caller holds them, so
    neither an offload nor a recompute frees them. Each is kept, and why."""
    from fxckpt.graph.liveness import storage_key

    out = fw.graph.find_nodes(op="output")[0]
    args = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    returned = {storage_key(n.meta.get("val")) for n in args[:num_fwd_outputs] if isinstance(n, fx.Node)}
    returned.discard(None)
    nodes = {n.name: n for n in fw.graph.nodes}
    kept: dict[str, str] = {}
    for s in storages:
        if any(storage_key(nodes[a.name].meta.get("val")) in returned for a in s.members):
            kept[s.key] = "keep: the forward also returns it (its caller holds it whatever the plan)"
    return kept


def forced_offloads(
    storages: list[StorageGroup], offloadable: Set[str], requested: Set[str], options: Options
) -> tuple[dict[str, str], dict[str, str]]:
    """Storages that ``offload="all"`` or a user's checkpoint policy asks to offload, and why."""
    forced: dict[str, str] = {}
    why: dict[str, str] = {}
    for s in storages:
        if not all(a.name in offloadable for a in s.members):
            continue
        if options.offload == "all":
            forced[s.key], why[s.key] = "offload", "offload: offload='all' asks for it"
        elif any(a.name in requested for a in s.members):
            forced[s.key], why[s.key] = "offload", "offload: the checkpoint policy asks for it"
    return forced, why


def offload_candidates(
    final: list[SavedActivation], fw: fx.GraphModule, num_fwd_outputs: int, options: Options
) -> list[SavedActivation]:
    """Saved activations the runtime may offload.

    Never model outputs (the user holds them), never tensors below ``min_offload_bytes``,
    and tensors with symbolic sizes only when the backward can rebuild every size and stride
    from the SymInts it receives (the restore op, ``wait``, takes them as arguments).
    """
    if options.offload == "never":
        return []
    out = fw.graph.find_nodes(op="output")[0]
    user_outputs = {v.name for v in out.args[0][:num_fwd_outputs] if isinstance(v, fx.Node)}
    bound = bound_symbols(out.args[0][num_fwd_outputs:])
    nodes = {n.name: n for n in fw.graph.nodes}
    result = []
    for a in final:
        val = nodes[a.name].meta["val"]
        if a.name in user_outputs or a.first_bw_use < 0 or a.bytes < options.min_offload_bytes:
            continue
        if not restorable(val, bound):
            continue
        result.append(a)
    return result


def user_offload_requests(joint: fx.GraphModule) -> set[str]:
    """Names of nodes a user's selective-checkpoint policy asked to offload.

    torch defines ``MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD`` but no torch partitioner reads
    them; fxckpt does.
    """
    return {
        n.name for n in joint.graph.nodes if n.meta.get(meta.RECOMPUTE) in OFFLOAD_POLICIES
    }


def step_costs(gm: fx.GraphModule, cost_model: str, device: torch.device) -> list[float]:
    """Estimated compute milliseconds of each node of ``gm``, in graph order."""
    return [
        node_cost_ms(n, cost_model, device) if n.op == "call_function" else 0.0
        for n in gm.graph.nodes
    ]


def segment_recompute_ms(tagged: fx.GraphModule, cost_model: str, device: torch.device) -> float:
    """Estimated time the backward spends recomputing segment interiors."""
    return sum(
        node_cost_ms(n, cost_model, device)
        for n in tagged.graph.nodes
        if n.op == "call_function" and meta.SEGMENT in n.meta
    )


def block_facts(
    blocks: BlockFacts, fw: fx.GraphModule, storages: list[StorageGroup], fw_ms: list[float]
) -> Blocks | None:
    """What recomputing each block would free and cost, from one partition's forward.

    A storage belongs to a block when all its tensors do and none comes from a random op
    (those stay saved inside a segment). Its users are the later blocks whose forward reads it.
    """
    if not blocks.index_of:
        return None
    nodes = list(fw.graph.nodes)
    ms = dict.fromkeys(blocks.blocks, 0.0)
    for pos, node in enumerate(nodes):
        b = blocks.index_of.get(node.name)
        if b is not None:
            ms[b] += fw_ms[pos]
    by_name = {n.name: n for n in nodes}
    ms_of = dict(zip(nodes, fw_ms, strict=True))
    member: list[int | None] = []
    users: list[tuple[int, ...]] = []
    own: list[float] = []
    for s in storages:
        own.append(max(_made_ms(by_name[a.name], ms_of) for a in s.members))
        owners = {a.block for a in s.members}
        b = owners.pop() if len(owners) == 1 else None
        if b is not None and any(random_output(by_name[a.name]) for a in s.members):
            b = None
        reads = {
            c
            for a in s.members
            for u in by_name[a.name].users
            if (c := blocks.index_of.get(u.name)) is not None
        }
        member.append(b)
        users.append(tuple(sorted(c for c in reads if b is not None and c > b)))
    return Blocks(blocks.blocks, ms, member, users, own)


def _made_ms(node: fx.Node, ms_of: dict[fx.Node, float]) -> float:
    """Forward ms of the op that makes ``node``'s storage: ``node``'s own, through views (not
    through ``getitem``: a multi-output op is spared only where all its outputs are saved)."""
    spent = ms_of.get(node, 0.0)
    while (is_view_like(node) and node.target is not operator.getitem and node.args
           and isinstance(node.args[0], fx.Node)):
        node = node.args[0]
        spent += ms_of.get(node, 0.0)
    return spent
