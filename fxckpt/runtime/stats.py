"""Process-wide runtime counters, per-graph figures, and the plans compiled graphs report.

Two kinds of figure, named apart:

- **counted by the runtime**: bytes it really copied (``offloaded_bytes``,
  ``prefetched_bytes``), offloads it kept on the device instead (``fallbacks``,
  ``fallback_bytes``), stalls and the host pool;
- **planned**: ``planned_*`` figures come from a graph's plan. ``planned_kept_bytes`` is the
  bytes of the saved tensors the plan keeps on the device, counted on the real tensors at the
  end of each forward; ``planned_peak_bytes`` is the plan's simulated peak of saved
  activations; ``planned_step`` the step's device peak the plan predicts, with its parts.

Neither is a measurement of device memory: ``fxckpt.measure`` is (it never reads this module).

Per graph, ``graphs[name]`` holds the figures of its latest forward; the top-level
``planned_*`` figures add up the graphs, so with graph breaks they cover the whole step.
Measured per graph since the last reset (:mod:`fxckpt.runtime.copy_meter`), over every step:
``exposed_copy_seconds`` (how long compute waited for its host copies), ``copy_seconds`` and
``copied_bytes`` (both directions), and ``measured_bandwidth_bytes_per_s`` (bytes over copy
seconds; None before a copy). ``replans`` counts the graphs fxckpt re-planned from such
measurements (:mod:`fxckpt.adapt`); ``link_probes`` the timed round trips it ran for plans
whose copies were too few to measure the link (per graph: ``link_probes`` and
``probed_bandwidth_bytes_per_s``, under the name of the plan that ran then).

Every figure lives here, behind one lock, so that :func:`snapshot` is consistent. The pool
reports its own figures through :func:`pool_resized` and :func:`add`.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from fxckpt.runtime import copy_meter

_COUNTERS = (
    "offloaded_bytes",
    "prefetched_bytes",
    "stall_seconds",
    "copy_seconds",
    "offload_calls",
    "copy_handoffs",
    "fallbacks",
    "fallback_bytes",
    "pool_hits",
    "pool_misses",
    "host_allocations",
    "disk_bytes",
    "disk_write_seconds",
    "disk_read_seconds",
    "disk_fallbacks",
    "replans",
    "link_probes",
    "weight_h2d_bytes",
    "weight_d2h_bytes",
)
_SECONDS = ("stall_seconds", "copy_seconds", "disk_write_seconds", "disk_read_seconds")
# pool_bytes describes memory the process holds right now, so reset() leaves it alone; so do
# pinned_bytes and disk_files (the disk tier's files on disk now).
_LEVELS = ("pool_bytes", "pinned_bytes", "disk_files")

_lock = threading.Lock()
_values: dict[str, float | int] = dict.fromkeys(_COUNTERS + _LEVELS, 0)
_values.update(dict.fromkeys(_SECONDS, 0.0))
_high_water = 0
# Called before every snapshot: the CUDA engine counts copy and stall times only once their
# events have completed, which it checks without synchronizing.
_collectors: list[Callable[[], None]] = []
# Called at the start of every reset: the CUDA engine's event pairs still pending belong to
# the window being closed, and read after the reset they would land in the next one.
_resetters: list[Callable[[], None]] = []
# A dict is an insertion-ordered set: membership costs one hash, and the payload string is
# the same constant object at every call of a compiled graph, so its hash is cached.
_plans: dict[str, None] = {}
# Each copy meter's totals at the last reset: the graphs' figures count from there.
_meter_base: dict[copy_meter.CopyMeter, copy_meter.CopyTotals] = {}


class BudgetOverrunWarning(UserWarning):
    """Under a memory budget, a forward left more on the device for its backward than its plan
    counts (the step's budget was planned with the plan's figure): its kept tensors at sizes
    the plan was not made for, or, measured on a graph's first training step, saved tensors
    its plan does not count."""


# Bytes a forward may keep over its plan's figure before it is called an overrun: the
# allocator's rounding and a few small tensors the plan does not see (generator states).
OVERRUN_SLACK = 4096


@dataclass
class GraphFigures:
    """One compiled graph: what its plan says, and what its latest forward did."""

    runs: int = 0
    budget_bytes: int | None = None
    planned_peak_bytes: int | None = None
    # The step's device peak the plan predicts with this graph, and its parts (start_bytes,
    # gradients_bytes, activations_bytes, total_bytes): planned, not measured.
    planned_step: dict[str, int] | None = None
    planned_kept_bytes: int = 0
    offloaded_bytes: int = 0
    fallback_bytes: int = 0
    # Measured (fxckpt.residency), not planned: what the first training call left saved for
    # the backward on the device, graph inputs left out. None until measured.
    held_bytes: int | None = None
    # Measured by the copy meter, over every step since the last reset.
    exposed_copy_seconds: float = 0.0
    copy_seconds: float = 0.0
    copied_bytes: int = 0
    measured_bandwidth_bytes_per_s: float | None = None
    # A link probe's (fxckpt.runtime.link_probe), run between two of this plan's steps.
    link_probes: int = 0
    probed_bandwidth_bytes_per_s: float | None = None


@dataclass(frozen=True)
class _PlanFacts:
    name: str
    budget_bytes: int | None
    planned_peak_bytes: int | None
    planned_held_bytes: int | None  # what the plan's forward leaves for its backward
    planned_step: dict[str, int] | None


_graphs: dict[str, GraphFigures] = {}
_facts: dict[str, _PlanFacts] = {}
_warned_overrun: set[str] = set()
_warned_held: set[str] = set()


class _Pending(threading.local):
    """Offloads of the forward running on this thread, not yet claimed by its graph's note;
    and the latest note on this thread (its plan payload, kept bytes and kept storages), which
    :mod:`fxckpt.runtime.residency` reads after a forward it measures."""

    offloaded = 0
    fallback = 0
    note: tuple[str, int, frozenset[int]] | None = None


_pending = _Pending()


def add(name: str, amount: float | int) -> None:
    """Add ``amount`` to the counter ``name``."""
    with _lock:
        _values[name] += amount


def record_offload(nbytes: int) -> None:
    """One offload call, moving ``nbytes`` to host memory."""
    _pending.offloaded += nbytes
    with _lock:
        _values["offload_calls"] += 1
        _values["offloaded_bytes"] += nbytes


def record_probe(name: str, bandwidth: float | None) -> None:
    """A link probe ran for the graph whose plan is ``name``, and measured ``bandwidth``."""
    with _lock:
        _values["link_probes"] += 1
        fig = _graphs.setdefault(name, GraphFigures())
        fig.link_probes += 1
        fig.probed_bandwidth_bytes_per_s = bandwidth


def record_fallback(nbytes: int) -> None:
    """One offload call whose ``nbytes`` stayed on the device (no host memory for them)."""
    _pending.fallback += nbytes
    with _lock:
        _values["offload_calls"] += 1
        _values["fallbacks"] += 1
        _values["fallback_bytes"] += nbytes


def _plan_facts(payload: str) -> _PlanFacts:
    facts = _facts.get(payload)
    if facts is not None:
        return facts
    try:
        plan: dict[str, Any] = json.loads(payload) if payload else {}
    except ValueError:
        plan = {}
    if not isinstance(plan, dict):
        plan = {}
    held = plan.get("held_bytes")
    facts = _PlanFacts(
        name=str(plan.get("name") or payload or "unnamed graph"),
        budget_bytes=plan.get("budget_bytes"),
        planned_peak_bytes=plan.get("resident_peak_bytes"),
        planned_held_bytes=held if isinstance(held, int) and plan.get("target") else None,
        planned_step=dict(plan["step"]) if isinstance(plan.get("step"), dict) else None,
    )
    _facts[payload] = facts
    return facts


def _figures(facts: _PlanFacts) -> GraphFigures:
    """The figures of the graph whose plan ``facts`` reads, new ones on its first call (under
    ``_lock``)."""
    fig = _graphs.get(facts.name)  # every step: build the figures only on the first
    if fig is None:
        fig = _graphs[facts.name] = GraphFigures(budget_bytes=facts.budget_bytes,
                                                 planned_peak_bytes=facts.planned_peak_bytes,
                                                 planned_step=facts.planned_step)
    return fig


def _first_overrun(facts: _PlanFacts, nbytes: int, warned: set[str]) -> bool:
    """Whether ``nbytes`` left for the backward is over what the plan counts (the figure the
    step's budget was planned with), and it is the first time for this graph (noted in
    ``warned``; under ``_lock``). Only under a budget."""
    planned = facts.planned_held_bytes
    over = (
        planned is not None
        and nbytes > planned + max(OVERRUN_SLACK, planned // 100)
        and facts.name not in warned
    )
    if over:
        warned.add(facts.name)
    return over


def note_forward(
    payload: str,
    kept_bytes: int,
    largest_shape: list[int] | None,
    *,
    kept: set[int] | frozenset[int] = frozenset(),
) -> None:
    """A forward of the graph whose plan is ``payload`` ended, keeping ``kept_bytes`` on the
    device as its plan says (``kept``: the addresses of those storages). Claims this thread's
    offloads since the previous note."""
    add_plan_payload(payload)
    facts = _plan_facts(payload)
    copy_meter.noted(facts.name, payload)
    offloaded, fallback = _pending.offloaded, _pending.fallback
    _pending.offloaded = _pending.fallback = 0
    _pending.note = (payload, kept_bytes, frozenset(kept))
    with _lock:
        fig = _figures(facts)
        fig.runs += 1
        fig.planned_kept_bytes = kept_bytes
        fig.offloaded_bytes = offloaded
        fig.fallback_bytes = fallback
        over = _first_overrun(facts, kept_bytes, _warned_overrun)
    if over:
        # Sizes the plan was not made for (a dynamic shape the compile-time guard could not
        # cover) keep more than the budget: say so with the figures instead of running over
        # in silence.
        warnings.warn(
            f"fxckpt[{facts.name}]: this forward kept {kept_bytes} bytes of saved tensors on "
            f"the device, over the {facts.planned_held_bytes} bytes its plan counts for "
            f"memory_budget={facts.budget_bytes} bytes (largest kept tensor of shape "
            f"{largest_shape}). The plan was made for smaller sizes; mark the dynamic "
            "dimension with dynamo's mark_dynamic(t, dim, max=...) so that fxckpt plans for "
            "the longest length (docs/limitations.md). (Warned once per graph.)",
            BudgetOverrunWarning,
            stacklevel=3,
        )


def take_note() -> tuple[str, int, frozenset[int]] | None:
    """The latest note on this thread since the previous call: (plan payload, kept bytes,
    kept storage addresses), or None."""
    note, _pending.note = _pending.note, None
    return note


def _figure_list(unplanned: list[tuple[int, list[int], list[int], str]]) -> str:
    top = sorted(unplanned, key=lambda u: -u[0])[:3]
    return "; ".join(f"{n} B {dtype} {shape} strides {stride}" for n, shape, stride, dtype in top)


def held_measured(
    payload: str, held_bytes: int, unplanned: list[tuple[int, list[int], list[int], str]]
) -> None:
    """The first training call of the graph whose plan is ``payload`` left ``held_bytes``
    saved for the backward on the device, measured on the tensors autograd saved;
    ``unplanned`` lists (bytes, shape, strides, dtype) of those its plan does not keep.
    Warns once per graph where that breaks a budget the plan met."""
    facts = _plan_facts(payload)
    with _lock:
        fig = _figures(facts)
        fig.held_bytes = held_bytes
        kept = fig.planned_kept_bytes
        over = _first_overrun(facts, held_bytes, _warned_held)
    if over:
        extra = sum(u[0] for u in unplanned)
        warnings.warn(
            f"fxckpt[{facts.name}]: its first training step held {held_bytes} bytes for the "
            f"backward (measured on the tensors autograd saved, graph inputs left out), over "
            f"the {facts.planned_held_bytes} bytes its plan counts for memory_budget="
            f"{facts.budget_bytes} bytes; the plan keeps {kept} bytes. "
            f"{len(unplanned)} saved tensors ({extra} bytes) are not in the plan, largest: "
            f"{_figure_list(unplanned)}. The compiler saved them after fxckpt planned (a "
            "layout or padding change, say): lower memory_budget by that much to hold the "
            "budget, and please report it with the model. (Warned once per graph.)",
            BudgetOverrunWarning,
            stacklevel=3,
        )


def pool_resized(delta: int) -> None:
    """The host pools together now hold ``delta`` more bytes (negative when they freed some)."""
    global _high_water
    with _lock:
        now = int(_values["pool_bytes"]) + delta
        _values["pool_bytes"] = now
        if now > _high_water:
            _high_water = now


def pinned_resized(delta: int) -> None:
    """The process now holds ``delta`` more page-locked bytes (slabs of the pinned pool)."""
    with _lock:
        _values["pinned_bytes"] = int(_values["pinned_bytes"]) + delta


def add_plan_payload(s: str) -> None:
    """Remember a plan payload (a JSON string); empty strings and repeats are ignored."""
    if not s or s in _plans:
        return
    with _lock:
        _plans[s] = None


def plan_payloads() -> list[str]:
    """The distinct plan payloads reported since the last :func:`reset`, first seen first."""
    with _lock:
        return list(_plans)


def add_collector(fn: Callable[[], None]) -> None:
    """Run ``fn`` before each :func:`snapshot`, outside the lock (it may call :func:`add`)."""
    if fn not in _collectors:
        _collectors.append(fn)


def add_resetter(fn: Callable[[], None]) -> None:
    """Run ``fn`` at the start of each :func:`reset`, outside the lock."""
    if fn not in _resetters:
        _resetters.append(fn)


def snapshot() -> dict[str, Any]:
    """A consistent copy of every figure (see the module docstring), including
    ``host_high_water_bytes``: the most host memory fxckpt held at once (every host pool
    buffer, pinned or not, staging for the disk tier included)."""
    for collect in list(_collectors):
        collect()
    with _lock:
        out: dict[str, Any] = dict(_values)
        out["pool_high_water_bytes"] = _high_water
        out["host_high_water_bytes"] = _high_water
        graphs = {name: asdict(fig) for name, fig in _graphs.items()}
    _add_copy_figures(graphs)
    out["graphs"] = graphs
    out["planned_kept_bytes"] = sum(g["planned_kept_bytes"] for g in graphs.values())
    peaks = [g["planned_peak_bytes"] for g in graphs.values() if g["planned_peak_bytes"] is not None]
    out["planned_peak_bytes"] = sum(peaks) if peaks else None
    # The step's predicted device peak: the largest any graph's plan predicts with the others.
    steps = [g["planned_step"] for g in graphs.values() if g.get("planned_step")]
    out["planned_step"] = max(steps, key=lambda st: st["total_bytes"]) if steps else None
    return out


def _add_copy_figures(graphs: dict[str, dict[str, Any]]) -> None:
    sums: dict[str, copy_meter.CopyTotals] = {}
    for meter in copy_meter.meters():
        if meter.name is None:
            continue
        now = meter.read()
        base = _meter_base.get(meter)
        since = now if base is None else now.minus(base)
        if meter.name not in graphs and not (since.copies or since.stall_seconds):
            continue  # a graph that has not run since the reset
        total = sums.setdefault(meter.name, copy_meter.CopyTotals())
        total.stall_seconds += since.stall_seconds
        total.copy_seconds += since.copy_seconds
        total.copied_bytes += since.copied_bytes
        total.copies += since.copies
    for name, t in sums.items():
        fig = graphs.setdefault(name, asdict(GraphFigures()))
        fig["exposed_copy_seconds"] = t.stall_seconds
        fig["copy_seconds"] = t.copy_seconds
        fig["copied_bytes"] = t.copied_bytes
        fig["measured_bandwidth_bytes_per_s"] = (
            t.copied_bytes / t.copy_seconds if t.copy_seconds > 0 and t.copied_bytes else None
        )


def reset() -> None:
    """Counters to zero, the high-water mark to the pool's present size, no plans or graphs.

    Copy and stall times still in flight are drained first: they belong to the window that
    ends here, not to the next one."""
    global _high_water
    for drain in list(_resetters):
        drain()
    with _lock:
        for name in _COUNTERS:
            _values[name] = 0
        _values.update(dict.fromkeys(_SECONDS, 0.0))
        _high_water = int(_values["pool_bytes"])
        _plans.clear()
        _graphs.clear()
        _warned_overrun.clear()
        _warned_held.clear()
    _meter_base.clear()
    _meter_base.update({m: m.read() for m in copy_meter.meters()})
    _pending.offloaded = _pending.fallback = 0
    _pending.note = None
