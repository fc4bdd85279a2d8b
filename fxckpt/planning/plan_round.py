"""One planning round: the facts of one partition in, a decision out.

The partitioner alternates deciding and rewriting. A round reads the saved tensors of one
partition, builds the solver's problem (:mod:`fxckpt.planning.problem`), searches block layouts
when the user left ``segment_stride`` unset (:mod:`fxckpt.planning.layouts`), and returns a
:class:`RoundDecision`: keep / offload / recompute per storage with a reason each, the blocks
to recompute, and the single ops to rebuild. It never changes a graph; carrying a decision out
(tagging the joint graph, running min-cut again) is :mod:`fxckpt.passes.partition`'s job, and
:func:`settle` is what follows the last round.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fxckpt.errors import BudgetError
from fxckpt.graph.activations import SavedActivation
from fxckpt.graph.blocks import BlockFacts
from fxckpt.graph.liveness import StepLiveness
from fxckpt.options import Options
from fxckpt.planning.account import PeakTarget
from fxckpt.planning.host import HostReport, place_tiers, warn_host_short
from fxckpt.planning.layouts import (
    NONE,
    Blocks,
    Layout,
    LayoutsAtLowest,
    Pick,
    lowest_peak,
    search,
    within_reach,
)
from fxckpt.planning.memory import Problem, simulate
from fxckpt.planning.planner import Choice
from fxckpt.planning.problem import (
    StorageGroup,
    block_facts,
    build_problem,
    copy_buckets,
    forced_offloads,
    group_by_storage,
    held_by_outputs,
    in_the_step,
    offload_candidates,
    reasons,
    step_costs,
)
from fxckpt.planning.solve import Solution


@dataclass(frozen=True)
class Partition:
    """One min-cut's forward and backward graphs and the tensors the forward saves.

    ``memo``: what planning derives from them and asks for more than once (the solver's
    problem, the block facts, each layout at its lowest), kept for the partition's life, which
    is one compile's planning; its graphs do not change while it is planned."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    saved: list[SavedActivation]
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class RoundDecision:
    """What one round decided about one partition."""

    storages: list[StorageGroup]
    problem: Problem  # as the chosen layout leaves it
    solution: Solution
    choices: dict[str, Choice]  # storage key -> choice and reason
    layout: Layout  # blocks to recompute on top of the partition's own
    recompute: frozenset[str]  # saved tensors to rebuild one op at a time
    recompute_ms: dict[str, float]  # storage key -> ms, for those single ops
    flops: dict[str, float]  # activation name -> FLOPs to rebuild it
    blocks_ms: float
    host: HostReport | None = None  # what host_budget moved: offloads to disk, recompute, keep
    host_capped: bool = False  # the plan met the budget before host_budget kept offloads
    # What each position of the problem carries besides the graph's own bytes, so that one
    # budget holds a target's limits (planning.problem.in_the_step, layouts.within_reach).
    offsets: tuple[int, ...] = ()
    # Bytes by which the budget was raised where no plan meets it (layouts.within_reach).
    raised: int = 0
    saved: frozenset[str] = frozenset()  # tensors of recomputed blocks to save all the same

    @property
    def reached(self) -> bool:
        """Whether the plan meets the target everywhere, in the planner's model."""
        return self.feasible and self.raised == 0

    @property
    def feasible(self) -> bool:
        return self.solution.feasible

    @property
    def rewrites(self) -> bool:
        """Whether carrying it out needs another partition."""
        return bool(self.layout.blocks or self.recompute)

    def kind_of(self, storage: str) -> str:
        choice = self.choices.get(storage)
        return "keep" if choice is None else choice.kind


def choose(problem: Problem, blocks: Blocks | None, budget: int | None, prefetch: str,
           low: LayoutsAtLowest | None = None) -> Pick:
    """The solver's answer for one round (benchmarks wrap this to capture problems).
    ``low``: ``problem``'s layouts at their lowest, where already simulated."""
    if budget is None:
        from fxckpt.planning.solve import solve

        return Pick(NONE, problem, solve(problem, None, prefetch=prefetch), 0.0, {})
    return search(problem, blocks, budget, prefetch, low=low)


def _low(part: Partition, problem: Problem, facts: Blocks | None, prefetch: str) -> LayoutsAtLowest:
    """``problem``'s layouts at their lowest, shared by every problem of ``part`` that counts
    the same bytes at each position (a fraction's target adds none): the plan range and the
    first round's search simulate each layout once between them."""
    fixed = problem.timeline.fixed_resident
    key = ("lowest", id(problem.candidates), None if fixed is None else tuple(fixed), id(facts), prefetch)
    if (got := part.memo.get(key)) is None:
        got = part.memo[key] = LayoutsAtLowest(problem, facts, prefetch)
    return got


class RoundPlanner:
    """Decides one partition at a time for one graph, under fixed options and budget."""

    def __init__(
        self,
        options: Options,
        target: PeakTarget | None,
        device: torch.device,
        blocks: BlockFacts,
        num_fwd_outputs: int,
        requests: Set[str],
        assumed: dict[str, dict[str, Any]],
    ) -> None:
        self.options, self.target, self.device = options, target, device
        self.blocks, self.num_fwd_outputs, self.requests = blocks, num_fwd_outputs, requests
        # What copies cost (graph.costs.assumptions): the plan records these very figures.
        # Copies are planned as taking 1 + copy_margin times the link's figures, so that one
        # the plan calls hidden still lands in time when compute runs faster than estimated.
        slower = 1.0 + float(assumed.get("copy_margin", {}).get("value", 0.0))
        self.bytes_per_ms = float(assumed["bandwidth_bytes_per_s"]["value"]) / 1e3 / slower
        self.copy_overhead_ms = float(assumed["copy_overhead_ms"]["value"])
        self.link_overhead_ms = float(assumed.get("link_overhead_ms", {}).get("value", 0.0)) * slower

    def problem(self, part: Partition, live: StepLiveness | None, *, allow_recompute: bool = True,
                stuck: Set[str] = frozenset()) -> tuple[Problem, dict[str, float], list[StorageGroup],
                                                         dict[str, str], list[float]]:
        """The solver's problem for ``part`` in the step (``live``: the partition's own live
        bytes at every position), the FLOPs to rebuild each tensor, the storages, why each
        forced one is forced, and the forward's node costs."""
        key = ("problem", allow_recompute, frozenset(stuck))
        if (got := part.memo.get(key)) is not None:
            return got
        part.memo[key] = got = self._problem(part, allow_recompute=allow_recompute, stuck=stuck)
        return got

    def _problem(self, part: Partition, *, allow_recompute: bool, stuck: Set[str]
                 ) -> tuple[Problem, dict[str, float], list[StorageGroup], dict[str, str], list[float]]:
        opts = self.options
        offloadable = {
            a.name for a in offload_candidates(part.saved, part.fw, self.num_fwd_outputs, opts)
        }
        storages = group_by_storage(part.saved)
        forced, forced_why = forced_offloads(storages, offloadable, self.requests, opts)
        for key, why in held_by_outputs(storages, part.fw, self.num_fwd_outputs).items():
            forced[key], forced_why[key] = "keep", why
        fw_ms = step_costs(part.fw, opts.cost_model, self.device)
        bw_ms = step_costs(part.bw, opts.cost_model, self.device)
        problem, flops = build_problem(
            storages,
            part.fw,
            fw_ms,
            bw_ms,
            self.bytes_per_ms,
            offloadable=offloadable,
            forced=forced,
            allow_recompute=allow_recompute,
            cost_model=opts.cost_model,
            device=self.device,
            not_recomputable=stuck,
            copy_overhead_ms=self.copy_overhead_ms,
            link_overhead_ms=self.link_overhead_ms,
        )
        # Buckets pay the per-copy overhead once; where none is priced (cost_model="unit")
        # a bucket would only hold its members longer, so each tensor is copied alone. Under
        # a host budget too: the host tiers are decided tensor by tensor, and a bucket's one
        # pool slot (all its members, until its wait) is not what they count.
        if (opts.coalesce == "auto" and problem.timeline.copy_overhead_ms > 0
                and opts.host_budget is None):
            c = problem.candidates
            ids = copy_buckets(storages, part.fw, part.bw, self.blocks.block_of, c.can_offload)
            problem = Problem(problem.timeline, dataclasses.replace(c, bucket=ids))
        return problem, flops, storages, forced_why, fw_ms

    def plan_range(self, part: Partition, live: StepLiveness, *, search_blocks: bool
                   ) -> tuple[int, int]:
        """``(plain, floor)``: the own step peak of ``part`` keeping every saved tensor, and
        the lowest the planner reaches on it (the block layouts it may search included), in
        the planner's model."""
        problem, _, storages, _, fw_ms = self.problem(part, live)
        problem, _ = in_the_step(problem, live.forward, live.backward, None)
        facts = self._facts(part, storages, fw_ms) if search_blocks else None
        plain = max(simulate(problem, ["keep"] * len(problem)).resident, default=0)
        return plain, lowest_peak(problem, facts, self.options.prefetch,
                                  low=_low(part, problem, facts, self.options.prefetch))

    def _facts(self, part: Partition, storages: list[StorageGroup], fw_ms: list[float]) -> Blocks | None:
        if "facts" not in part.memo:
            part.memo["facts"] = block_facts(self.blocks, part.fw, storages, fw_ms)
        return part.memo["facts"]

    def decide(
        self,
        part: Partition,
        live: StepLiveness | None = None,
        *,
        search_blocks: bool = False,
        allow_recompute: bool = True,
        keep_first: bool = False,
        stuck: Set[str] = frozenset(),
    ) -> RoundDecision | None:
        """Decide ``part``; ``None`` when there is nothing to decide (no budget, nothing forced).

        ``search_blocks``: may recompute more blocks. ``allow_recompute``: may rebuild single
        ops (only while another partition can carry it out). ``keep_first``: take a plan that
        keeps or offloads only when one meets the budget, so a round that follows a recompute
        does not ask for another. ``stuck``: tensors min-cut would not rebuild when asked.
        """
        opts, target = self.options, self.target
        problem, flops, storages, forced_why, fw_ms = self.problem(
            part, live, allow_recompute=target is not None and allow_recompute, stuck=stuck)
        forced = problem.candidates.forced is not None and any(problem.candidates.forced)
        if target is None and not forced:
            return None
        budget: int | None = None
        own: list[int] = []
        if target is not None:
            assert live is not None, "a step target needs the partition's live bytes"
            own = list(in_the_step(problem, live.forward, live.backward, None)[0].timeline.fixed_resident or [])
            problem, budget = in_the_step(problem, live.forward, live.backward, target)
        # Blocks, like single ops, only while another partition can carry them out.
        recompute = search_blocks and allow_recompute and budget is not None
        facts = self._facts(part, storages, fw_ms) if recompute else None
        raised = 0
        low = None

        def keeping() -> Pick | None:  # a plan that keeps or offloads and meets the budget
            c = problem.candidates
            plain = Problem(problem.timeline, dataclasses.replace(c, recompute_ms=[math.inf] * len(c)))
            pick = choose(plain, None, budget, opts.prefetch)
            return pick if pick.feasible else None

        # Where one meets the budget as it stands, no layout needs the budget raised: the
        # layouts' lowest peaks are not needed.
        pick = keeping() if keep_first and budget is not None else None
        if budget is not None and pick is None:
            low = _low(part, problem, facts, opts.prefetch)
            problem, budget, raised = within_reach(problem, budget, facts, opts.prefetch, low=low)
            pick = keeping() if keep_first and raised else None
        offsets: tuple[int, ...] = ()
        if budget is not None:
            fixed = problem.timeline.fixed_resident or [0] * problem.timeline.num_positions
            offsets = tuple(f - o for f, o in zip(fixed, own, strict=True))
        if pick is None:
            # The layouts at their lowest, as within_reach found them, where it left the problem.
            same = low is not None and raised == 0
            pick = choose(problem, facts, budget, opts.prefetch, low=low if same else None)
        decision = _decision(pick, storages, flops, forced_why, budget)
        decision = dataclasses.replace(decision, offsets=offsets, raised=raised)
        pinned = self.device.type in ("cuda", "meta")  # meta: offline, for a GPU
        return _host_tiers(decision, opts, budget, allow_recompute=allow_recompute, pinned=pinned)


def _host_tiers(
    decision: RoundDecision, options: Options, budget: int | None, *, allow_recompute: bool,
    pinned: bool = False,
) -> RoundDecision:
    """The decision with every offload given a tier under ``host_budget``: host memory, the
    disk tier, or (the host being short and no disk taking it) a single-op recompute or a
    keep, simulated again when that changed a choice."""
    before = [decision.kind_of(s.key) for s in decision.storages]
    host, changed = place_tiers(
        decision.problem, decision.storages, decision.choices, options,
        allow_recompute=allow_recompute and budget is not None, report=None, pinned=pinned,
    )  # fmt: skip
    if not changed:
        return dataclasses.replace(decision, host=host)
    c = decision.problem.candidates
    picked = [decision.kind_of(s.key) for s in decision.storages]
    sim = simulate(decision.problem, picked, prefetch=options.prefetch)  # type: ignore[arg-type]
    solution = dataclasses.replace(
        decision.solution, choices=picked, peak=sim.peak, peak_at=sim.peak_at,
        cost_ms=sim.cost_ms, sim=sim, feasible=budget is None or sim.peak <= budget,
    )  # fmt: skip
    single, single_ms = set(decision.recompute), dict(decision.recompute_ms)
    for i, s in enumerate(decision.storages):
        if picked[i] == "recompute" and before[i] == "offload":
            single |= {a.name for a in s.members}
            single_ms[s.key] = c.recompute_ms[i]
    return dataclasses.replace(
        decision, solution=solution, recompute=frozenset(single), recompute_ms=single_ms,
        host=host, host_capped=decision.solution.feasible and not solution.feasible,
    )  # fmt: skip


def _decision(
    pick: Pick, storages: list[StorageGroup], flops: dict[str, float], forced_why: dict[str, str],
    budget: int | None,
) -> RoundDecision:
    choices = reasons(pick.problem, pick.solution, storages, flops, forced_why, budget)
    single: set[str] = set()
    single_ms: dict[str, float] = {}
    saved: set[str] = set()
    for i, s in enumerate(storages):
        if i in pick.freed:
            block = s.members[0].block
            choices[s.key] = Choice("recompute", f"recompute: block {block} is recomputed to meet the memory budget")
        elif i in pick.kept:
            block = s.members[0].block
            saved |= {a.name for a in s.members}
            choices[s.key] = Choice("keep", f"keep: block {block} is recomputed around it; "
                                            "saving it spares its op within the memory budget")
        elif choices[s.key].kind == "recompute":
            single |= {a.name for a in s.members}
            single_ms[s.key] = pick.problem.candidates.recompute_ms[i]
    return RoundDecision(
        storages, pick.problem, pick.solution, choices, pick.layout, frozenset(single),
        single_ms, flops, pick.blocks_ms, saved=frozenset(saved),
    )


def settle(
    decision: RoundDecision, saved: list[SavedActivation], options: Options, budget: int | None,
    graph_name: str, *, sizes: str = "", step: bool = False,
) -> Solution:
    """What follows the last round: an unmet budget raises (or warns), naming
    ``host_budget`` where the host tiers kept offloads that the device budget needed gone,
    and one warning says what the host budget moved. ``step``: a miss is judged elsewhere:
    the budget is the graph's share of a step's (:mod:`fxckpt.planning.step_budget`), or a
    cap that :mod:`fxckpt.passes.peak_fit` set."""
    solution = decision.solution
    if budget is not None and not solution.feasible and not step:
        infeasible(graph_name, budget, solution.peak, options, pool_capped=decision.host_capped,
                   sizes=sizes)  # fmt: skip
    warn_host_short(graph_name, decision.host, disk=options.offload_dir is not None)
    return solution


def infeasible(
    graph_name: str, budget: int, smallest: int, options: Options, *, pool_capped: bool = False,
    sizes: str = "",
) -> None:
    """Raise :class:`BudgetError` (or warn) naming the smallest figure and what would go lower.

    Every hint names an option the user set: the planner already relaxed the defaults.
    """
    error = BudgetError(graph_name, budget, smallest, hints(options, pool_capped), sizes)
    if options.on_infeasible == "raise":
        raise error
    warnings.warn(f"{error.summary} Running the smallest plan instead.", stacklevel=3)


def hints(options: Options, pool_capped: bool = False) -> list[str]:
    """The options the user set that would let the planner go lower."""
    out = ["a larger host_budget or an offload_dir"] if pool_capped else []
    if options.offload == "never":
        out.append("offload='auto'")
    if options.segment_stride == 0 and options.is_explicit("segment_stride"):
        out.append("segment_stride unset (the planner then recomputes blocks as needed)")
    elif options.segment_width is not None and options.segment_width < options.segment_stride:
        out.append(f"segment_width={options.segment_stride}")
    if options.min_offload_bytes > 0 and options.offload != "never":
        out.append("a smaller min_offload_bytes")
    return out


def timeline(problem: Problem, resident: list[int], budget: int | None, added_ms: float = 0.0,
             points: int = 1200, offsets: Sequence[int] = ()) -> dict[str, Any]:
    """The graph's own live bytes over the step, max-pooled to at most ``points`` points, for
    reports; ``added_ms``: what the solution's copies add to the step (its ``cost_ms``);
    ``offsets``: what each position carries besides the graph's own bytes (taken off again
    here; ``budget`` is then the target's largest limit)."""
    keep_all = simulate(problem, ["keep"] * len(problem.candidates)).resident
    F, T = problem.timeline.num_forward, len(resident)
    if offsets:
        keep_all = [b - o for b, o in zip(keep_all, offsets, strict=True)]
        resident = [b - o for b, o in zip(resident, offsets, strict=True)]
        budget = None if budget is None else budget - min(offsets)
    step_ = max(1, math.ceil(T / points))
    pool = lambda xs: [max(xs[i : i + step_]) for i in range(0, T, step_)]  # noqa: E731
    compute_ms = float(sum(problem.timeline.step_ms))
    return {
        "forward_end": F // step_,
        "positions": T,
        # The cost model's compute for the step's graphs as partitioned, with the recompute
        # min-cut carries out in the backward, and the forward's part of it. (est_overhead_ms
        # is against the baseline's graphs: adding it to this would count recompute twice.)
        "compute_ms": compute_ms,
        "forward_compute_ms": float(sum(problem.timeline.step_ms[:F])),
        # The step's predicted time: those graphs plus what the solution adds.
        "predicted_step_ms": compute_ms + added_ms,
        "stride": step_,
        "baseline": pool(keep_all),
        "plan": pool(resident),
        "budget": budget,
    }
