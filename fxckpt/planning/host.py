"""The host budget and the disk tier, applied to one graph's plan.

:func:`place_tiers` turns the plan's offloads into the plain numbers of
:mod:`fxckpt.planning.tiers`, asks where each one lives, and writes the answer into the
choices: an offload's tier (``host`` or ``disk``), or a recompute / keep with its reason when
the host is short and no disk takes it. :func:`read_ahead` issues a disk tensor's prefetch
earlier by the disk's read time; :func:`disk_storages` names the storages the plan sends to
disk (``passes.schedule.with_tiers`` marks their offload ops).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fxckpt import _files
from fxckpt.graph.activations import SavedActivation, concrete
from fxckpt.graph.costs import DEFAULT_COSTS, CostTable
from fxckpt.options import Options
from fxckpt.planning import tiers
from fxckpt.planning.memory import Problem
from fxckpt.planning.planner import Choice
from fxckpt.planning.problem import StorageGroup
from fxckpt.runtime.pool import size_class
from fxckpt.runtime.slabs import carving_fits, whole_pages
from fxckpt.runtime.staging import STAGING_SLOTS, staged_bytes
from fxckpt.units import format_bytes


@dataclass
class HostReport:
    """What the host budget did to one graph's offloads, for the warning."""

    budget: int
    recomputed: int = 0
    kept: int = 0
    to_disk: int = 0


def disk_rates(options: Options, table: CostTable = DEFAULT_COSTS) -> tiers.DiskRates | None:
    """The disk tier's bandwidth, or None when there is no disk tier.

    ``offload_dir_bandwidth`` when given (both directions); else, under ``cost_model="unit"``,
    ``table``'s :attr:`~fxckpt.graph.costs.CostTable.unit_disk_bytes_per_ms`; else measured
    once per directory and process (:func:`fxckpt._files.measure_bandwidth`).
    """
    if options.offload_dir is None and options.offload_dir_bandwidth is None:
        return None
    if options.offload_dir_bandwidth is not None:
        rate = options.offload_dir_bandwidth / 1e3
        return tiers.DiskRates(rate, rate)
    if options.cost_model == "unit":
        return tiers.DiskRates(table.unit_disk_bytes_per_ms, table.unit_disk_bytes_per_ms)
    assert options.offload_dir is not None
    return tiers.DiskRates(*_files.measure_bandwidth(options.offload_dir))


def copied_bytes(a: SavedActivation) -> int:
    """Bytes the offload op of ``a`` copies: the runtime moves each saved tensor's own span,
    so two views of one storage take two host buffers. A contiguous tensor's span is its
    elements; any other view is counted as its whole storage (an upper bound)."""
    dtype = getattr(torch, str(a.dtype).removeprefix("torch."), None)
    if not a.contiguous or not isinstance(dtype, torch.dtype):
        return a.bytes
    numel = 1
    for n in a.shape:
        numel *= concrete(n)
    return min(a.bytes, numel * dtype.itemsize)


def _item(problem: Problem, i: int, s: StorageGroup, prefetch: str) -> tiers.Item:
    c, S, F = problem.candidates, problem.prefix_ms(), problem.timeline.num_forward
    spans = [copied_bytes(a) for a in s.members]
    return tiers.Item(
        nbytes=sum(spans),
        host_bytes=sum(size_class(n) for n in spans),
        staged_bytes=max(size_class(staged_bytes(n)) for n in spans),
        write_window_ms=S[F] - S[c.produced[i] + 1],
        read_window_ms=S[c.first_bw_use[i]] - S[F] if prefetch == "auto" else 0.0,
        recompute_ms=c.recompute_ms[i],
    )


def place_tiers(
    problem: Problem,
    storages: Sequence[StorageGroup],
    choices: dict[str, Choice],
    options: Options,
    *,
    allow_recompute: bool,
    report: HostReport | None,
    pinned: bool = False,
) -> tuple[HostReport | None, bool]:
    """Give every offload in ``choices`` a tier under ``host_budget`` (``storages[i]`` is the
    problem's candidate ``i``).

    ``pinned``: the host pool is page-locked slabs (a CUDA device, or offline planning for one).
    Returns the report (``report`` updated, or a new one, once the budget moved an offload)
    and whether any choice changed kind (offload to recompute or keep).
    """
    budget = options.resolve_host_budget()
    c = problem.candidates
    keys = [s.key for s in storages]
    offloaded = sorted((i for i, k in enumerate(keys) if choices[k].kind == "offload"),
                       key=lambda i: (c.produced[i], i))  # fmt: skip
    if budget is None or not offloaded:
        return report, False
    items = [_item(problem, i, storages[i], options.prefetch) for i in offloaded]
    fits = None
    if pinned:  # page-locked slabs lose their tails: ask their layout, not the sum

        def fits(classes: list[int], staging: int) -> bool:
            return carving_fits(classes, budget, whole_pages(staging))

    placed = tiers.assign(items, budget, disk_rates(options), allow_recompute=allow_recompute,
                          staging_slots=STAGING_SLOTS, fits=fits)  # fmt: skip
    if all(t.kind == "host" for t in placed):
        return report, False
    report = report or HostReport(budget)
    for i, tier in zip(offloaded, placed, strict=True):
        key = keys[i]
        if tier.kind == "disk":
            choices[key] = Choice("offload", tier.reason, tier="disk")
            report.to_disk += 1
        elif tier.kind != "host":
            choices[key] = Choice(tier.kind, tier.reason)
            report.recomputed += tier.kind == "recompute"
            report.kept += tier.kind == "keep"
    return report, any(t.kind in ("recompute", "keep") for t in placed)


def warn_host_short(graph_name: str, report: HostReport | None, disk: bool = False) -> None:
    """One warning per graph when the host budget turned offloads into recompute or keep.
    ``disk``: an ``offload_dir`` is given, so the advice is not to give one."""
    if report is None or not (report.recomputed or report.kept):
        return
    moved = [f"{n} {what}" for n, what in ((report.recomputed, "recomputed"),
                                           (report.kept, "kept on the device")) if n]  # fmt: skip
    advice = ("The disk tier took what it can hide behind compute; raise host_budget to "
              "offload the rest." if disk else
              "Give an offload_dir (a disk tier) or raise host_budget to offload them.")
    warnings.warn(
        f"fxckpt[{graph_name}]: host_budget={format_bytes(report.budget)} cannot hold every "
        f"offload; {' and '.join(moved)} instead. {advice}",
        stacklevel=3,
    )


def disk_storages(choices: dict[str, Choice]) -> set[str]:
    return {k for k, ch in choices.items() if ch.kind == "offload" and ch.tier == "disk"}


def read_ahead(
    offloaded: Sequence[tuple[SavedActivation, int, int]],
    choices: dict[str, Choice],
    problem: Problem | None,
    options: Options,
) -> list[tuple[SavedActivation, int, int]]:
    """``(tensor, d2h_done, prefetch_issue)`` with each disk tensor's prefetch issued earlier
    by its read time (``prefetch="auto"`` only: ``"jit"`` asks for use-time prefetch)."""
    disk = disk_storages(choices)
    rates = disk_rates(options) if disk else None
    if rates is None or problem is None or options.prefetch != "auto":
        return list(offloaded)
    S, F = problem.prefix_ms(), problem.timeline.num_forward
    return [
        (a, done, tiers.read_ahead(S, F, issue, rates.read_ms(copied_bytes(a))) if a.storage in disk
         else issue)
        for a, done, issue in offloaded
    ]  # fmt: skip
