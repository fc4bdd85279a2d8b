"""The step peak as Inductor allocates it, read from Inductor's own schedule of the two graphs.

Graph liveness (:func:`fxckpt.graph.liveness.step_peak_bytes`) cannot see two things
Inductor decides after the partition: which values stay inside kernels (a pointwise op with
several readers is recomputed in each of them unless it reads more than a few buffers or, on
a CPU, computes exp or sigmoid: Inductor's ``StorageBox.mark_reuse``) and the
order its scheduler runs the kernels in (``reorder_for_peak_memory``). On the 6-block test GPT
it read 4-7 % above the meter's peak; Inductor's model of its fused schedule reads within 2 %.

So each graph fxckpt partitions for Inductor carries a :class:`Tag` on its output node, and
:class:`StepPeakPass`, run by Inductor on each fused schedule, reads the buffers and the
order of a tagged graph (``compat.scheduled_buffers``: what Inductor's ``memory`` module
computes), takes the peak without what exists before the step, and records it under the
plan's key. Once a plan's forward and backward are both in, :func:`step_peak` has the step's
figure, and :func:`fxckpt.last_plans` reports it as ``predicted_step_peak_bytes``. The pass
changes nothing, and its ``uuid`` keys Inductor's caches, which it therefore keeps.

Not yet understood: on a 3-block test GPT that offloads every saved tensor one by one
(``offload="all", coalesce="never"``), Inductor's model reads 23 % above the meter (graph
liveness: 8 % under it); bucketed, and with early prefetches, it reads 0-2 % above.

A graph loaded from Inductor's caches is not scheduled again: its figure comes from the file
the compile that scheduled it wrote, beside those caches. Where there is none (a torch
without a scheduler pass the caches accept; a forward compiled anew with a backward from the
cache), the plan keeps the liveness figure, an upper bound under Inductor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch.fx as fx

from fxckpt import _torch_compat as compat
from fxckpt.graph import meta
from fxckpt.graph.liveness import input_storages, restores, storage_key
from fxckpt.planning.plan import Plan
from fxckpt.units import format_bytes

log = logging.getLogger(__name__)

_figures: dict[str, dict[str, int]] = {}  # plan key -> {"fw": peak, "bw": peak}
_lock = threading.Lock()


@dataclass(frozen=True)
class Tag:
    """What the pass needs of one graph: its plan's key, which graph it is, the inputs that
    exist before the step (never counted), and each restored tensor with the node where the
    engine allocates its buffer (its prefetch), by FX name."""

    key: str
    part: str  # "fw" or "bw"
    before_step: tuple[str, ...]
    allocated_at: tuple[tuple[str, str], ...] = ()


def plan_key(payload: str) -> str:
    """A plan's identity across processes: its payload travels inside the compiled forward."""
    return hashlib.sha256(f"{payload}|{compat.TORCH_VERSION}".encode()).hexdigest()[:32]


def tag_graphs(fw: fx.GraphModule, bw: fx.GraphModule, payload: str) -> None:
    """After this, both graphs carry the :class:`Tag` :class:`StepPeakPass` reads (node meta,
    which the FX graph cache's key does not read)."""
    key = plan_key(payload)
    inputs = input_storages(fw)
    fw_in = tuple(n.name for n in fw.graph.find_nodes(op="placeholder"))
    bw_in = tuple(n.name for n in bw.graph.find_nodes(op="placeholder")
                  if storage_key(n.meta.get("val")) in inputs)
    waits, at = restores(bw)
    moved = tuple((m.name, a.name) for m, a in at.items() if a is not m)
    moved += tuple((w.name, at[next(iter(w.users))].name) for w in waits
                   if w not in at and w.users and next(iter(w.users)) in at)
    for gm, tag in ((fw, Tag(key, "fw", fw_in)), (bw, Tag(key, "bw", bw_in, moved))):
        gm.graph.find_nodes(op="output")[0].meta[meta.STEP_PEAK] = tag


def scheduled_peak(steps: list[set[str]], buffers: list[tuple[Any, ...]], tag: Tag) -> int:
    """The peak over a schedule of the bytes its buffers hold, from Inductor's figures:
    ``steps`` names the FX nodes each step computes, ``buffers`` holds (bytes allocated,
    bytes freed, first step, last step or -1 for a graph output, input name or "")."""
    first: dict[str, int] = {}
    for k, names in enumerate(steps):
        for name in names:
            first.setdefault(name, k)
    # A restored tensor's buffer exists from its prefetch, not from the wait that returns it.
    early = {first[w]: first[a] for w, a in tag.allocated_at if w in first and a in first}
    skip = set(tag.before_step)
    delta = [0] * (len(steps) + 1)
    for alloc, free, start, last, name in buffers:
        if name and name in skip:
            continue
        delta[min(start, early.get(start, start)) if not name else start] += alloc
        if last != -1:
            delta[last + 1] -= free
    return max(accumulate(delta[: len(steps)]), default=0)


def _output_tag(gm: Any) -> Tag | None:
    outputs = gm.graph.find_nodes(op="output") if isinstance(gm, fx.GraphModule) else []
    tag = outputs[0].meta.get(meta.STEP_PEAK) if outputs else None
    return tag if isinstance(tag, Tag) else None


class StepPeakPass(compat.CustomSchedulerPass or object):  # type: ignore[misc]
    """Inductor's post-fusion pass: records the peak of each tagged graph's schedule and
    returns the schedule unchanged. Stateless, so it pickles into the caches' key."""

    def __call__(self, nodes: list[Any]) -> list[Any]:
        try:
            gm, steps, buffers = compat.scheduled_buffers(nodes)
            if (tag := _output_tag(gm)) is not None:
                record(tag.key, tag.part, scheduled_peak(steps, buffers, tag))
        except Exception:  # a figure missing only leaves the liveness figure in place
            log.debug("fxckpt: no step peak from Inductor's schedule", exc_info=True)
        return nodes

    def uuid(self) -> str:
        from fxckpt import __version__

        # The pass changes no compiled code. A changed fxckpt misses the caches anyway (the
        # partitioner's uuid hashes its source), so every figure is then scheduled again.
        return f"fxckpt-step-peak-{__version__}"


def settings() -> dict[str, Any]:
    """The Inductor setting that runs :class:`StepPeakPass` (none where torch has no
    cache-keyed scheduler pass, or the user set a post-fusion pass of their own)."""
    return compat.step_peak_settings(StepPeakPass() if compat.CustomSchedulerPass else None)[0]


def _file(key: str) -> Path:
    return Path(compat.step_peak_settings(None)[1]) / "fxckpt_step_peak" / f"{key}.json"


def record(key: str, part: str, peak: int) -> None:
    """Remember one graph's scheduled peak; with both graphs in, write the plan's file."""
    with _lock:
        parts = _figures.setdefault(key, {})
        parts[part] = peak
        both = dict(parts) if len(parts) == 2 else None
    if both is not None:
        try:
            path = _file(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(both))
            os.replace(tmp, path)
        except OSError:
            log.debug("fxckpt: could not keep the step peak of %s", key, exc_info=True)


def step_peak(payload: str) -> int | None:
    """The step peak Inductor's schedules give the plan of ``payload``, or None."""
    key = plan_key(payload)
    with _lock:
        parts = dict(_figures.get(key, {}))
    if len(parts) < 2:
        try:
            parts = json.loads(_file(key).read_text())
        except (OSError, ValueError):
            return None
        with _lock:
            _figures.setdefault(key, {}).update(parts)
    return max(int(parts["fw"]), int(parts["bw"])) if {"fw", "bw"} <= parts.keys() else None


def step_peak_parts(payload: str) -> tuple[int, int] | None:
    """The forward's and the backward's peak in Inductor's schedules of the plan of
    ``payload``, or None until both are known (the backward compiles at its first run)."""
    key = plan_key(payload)
    with _lock:
        parts = dict(_figures.get(key, {}))
    if len(parts) < 2:
        if step_peak(payload) is None:
            return None
        with _lock:
            parts = dict(_figures.get(key, {}))
    return int(parts["fw"]), int(parts["bw"])


def corrected(plan: Plan, payload: str) -> Plan:
    """``plan`` with Inductor's step peak in place of the graphs' liveness, where it has one."""
    peak = step_peak(payload)
    if peak is not None:
        plan.notes.append(f"step peak from Inductor's schedules: {format_bytes(peak)} (graph "
                          f"liveness: {format_bytes(plan.predicted_step_peak_bytes or 0)})")
        plan.predicted_step_peak_bytes = peak
    return plan
