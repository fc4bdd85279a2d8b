"""Plans as one JSON document (``fxckpt inspect --format json``); docs/cli.md describes it.

:data:`SCHEMA` is the document's JSON Schema. ``version`` changes when a field is removed or
changes meaning; new fields may appear within a version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fxckpt.planning.plan import Plan
from fxckpt.report.table import SweepRow, totals
from fxckpt.sizing import OPTIMIZERS, STRATEGIES, LongestFit, StepFit

VERSION = 1
TOTAL_KEYS = ("baseline_saved_bytes", "resident_peak_bytes", "offloaded_bytes",
              "recomputed_bytes", "recomputed_flops", "host_bytes", "disk_bytes",
              "est_overhead_ms")  # fmt: skip


def totals_dict(plans: Sequence[Plan]) -> dict[str, Any]:
    """The ``totals`` object: sums over graphs (the resident peak sum bounds the step's peak)."""
    t = totals(plans)
    out: dict[str, Any] = {key: getattr(t, key) for key in TOTAL_KEYS}
    out["over_budget"] = list(t.over_budget)
    return out


def _header(options: Mapping[str, Any], target: str) -> dict[str, Any]:
    """The fields every document starts with: its version, fxckpt's, the target and options."""
    from fxckpt import __version__

    return {
        "version": VERSION,
        "fxckpt_version": __version__,
        "target": target,
        "options": dict(options),
    }


def document(
    plans: Sequence[Plan], options: Mapping[str, Any], *, target: str = "",
    fit: StepFit | None = None, lengths: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``{"version", "fxckpt_version", "target", "options", "graphs", "totals", "step_peak"}``;
    ``step_peak`` is ``fit``'s figures (``null`` without a budget). ``lengths``: ``--max-seq``'s
    search (:func:`fit_document`), written as ``fit``."""
    doc = {
        **_header(options, target),
        "graphs": [p.to_dict() for p in plans],
        "totals": totals_dict(plans),
        "step_peak": None if fit is None else fit.to_dict(),
    }
    if lengths is not None:
        doc["fit"] = dict(lengths)
    return doc


def fit_document(fits: Sequence[LongestFit], *, limit_bytes: int, device_memory_bytes: int,
                 quantum: int, batch: int | None) -> dict[str, Any]:
    """``fit``: each strategy's longest sequence within ``limit_bytes`` (the card's usable
    memory), searched in steps of ``quantum`` tokens."""
    return {"device_memory_bytes": device_memory_bytes, "limit_bytes": limit_bytes,
            "quantum": quantum, "batch": batch,
            "strategies": [f.to_dict() for f in fits]}  # fmt: skip


def sweep_document(
    rows: Sequence[SweepRow], options: Mapping[str, Any], *, target: str = ""
) -> dict[str, Any]:
    """``--sweep --format json``: per budget, the totals and a one-line record per graph."""
    return {
        **_header(options, target),
        "sweep": [
            {
                "budget": r.budget,
                "totals": totals_dict(r.plans),
                "step_peak": None if r.fit is None else r.fit.to_dict(),
                "graphs": [
                    {k: p.to_dict()[k] for k in ("name", "budget_bytes", *TOTAL_KEYS)}
                    for p in r.plans
                ],
            }
            for r in rows
        ],
    }


_INT = {"type": "integer", "minimum": 0}
_NUM = {"type": "number", "minimum": 0}
_NAME = {"type": "string"}

ACTIVATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "module", "op", "shape", "dtype", "bytes", "decision", "reason",
                 "block", "storage", "flops"],  # fmt: skip
    "properties": {
        "name": _NAME,
        "module": _NAME,
        "op": _NAME,
        "shape": {"type": "array", "items": {"type": ["integer", "string"]}},
        "dtype": _NAME,
        "bytes": _INT,
        "decision": {"enum": ["keep", "recompute", "offload"]},
        "reason": _NAME,
        "block": {"type": ["integer", "null"]},
        "storage": _NAME,
        "flops": _NUM,
        "tier": {"enum": ["host", "disk"]},  # offload rows: where the tensor waits
    },
}

TIMELINE_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "required": ["forward_end", "baseline", "plan", "budget"],
    "properties": {
        "forward_end": _INT,
        "baseline": {"type": "array", "items": _INT},
        "plan": {"type": "array", "items": _INT},
        "budget": {"type": ["integer", "null"]},
        "compute_ms": _NUM, "forward_compute_ms": _NUM, "predicted_step_ms": _NUM,
    },
}

WEIGHT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "parameter", "shape", "dtype", "bytes", "forward_uses", "backward_uses",
                 "decision", "reason", "step_h2d_bytes"],  # fmt: skip
    "properties": {
        "name": _NAME, "parameter": {"type": "string"}, "shape": {"type": "array"},
        "dtype": _NAME, "bytes": _INT, "forward_uses": _INT, "backward_uses": _INT,
        "decision": {"enum": ["stream", "resident"]}, "reason": _NAME, "step_h2d_bytes": _INT,
    },
}

PLAN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "budget_bytes", "baseline_saved_bytes", "resident_peak_bytes",
                 "kept_bytes", "offloaded_bytes", "recomputed_bytes", "recomputed_flops",
                 "host_bytes", "est_overhead_ms", "options", "notes", "activations",
                 "timeline"],  # fmt: skip
    "properties": {
        "name": _NAME,
        "budget_bytes": {"type": ["integer", "null"]},
        "baseline_saved_bytes": _INT,
        "resident_peak_bytes": _INT,
        "kept_bytes": _INT,
        "offloaded_bytes": _INT,
        "recomputed_bytes": _INT,
        "recomputed_flops": _NUM,
        "host_bytes": _INT,
        "disk_bytes": _INT,
        "est_overhead_ms": _NUM,
        "options": {"type": "object"},
        "notes": {"type": "array", "items": _NAME},
        "activations": {"type": "array", "items": ACTIVATION_SCHEMA},
        "timeline": TIMELINE_SCHEMA,
        "step_inputs_bytes": _INT,
        "weights": {"type": "array", "items": WEIGHT_SCHEMA},
        "resident_weight_bytes": _INT,
        "weight_h2d_bytes": _INT,
    },
}

TOTALS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [*TOTAL_KEYS, "over_budget"],
    "properties": {
        **{k: _NUM if k in ("recomputed_flops", "est_overhead_ms") else _INT for k in TOTAL_KEYS},
        "over_budget": {"type": "array", "items": _NAME},
    },
}

STEP_PEAK_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "required": ["total_bytes", "parameters_bytes", "gradients_bytes", "optimizer_bytes",
                 "activations_bytes", "weights_bytes", "other_bytes", "optimizer",
                 "device_memory_bytes", "fits"],  # fmt: skip
    "properties": {
        **{k: _INT for k in ("total_bytes", "parameters_bytes", "gradients_bytes",
                             "optimizer_bytes", "activations_bytes", "weights_bytes",
                             "other_bytes")},  # fmt: skip
        "optimizer": {"enum": list(OPTIMIZERS)},
        "device_memory_bytes": {"type": ["integer", "null"]},
        "fits": {"type": ["boolean", "null"]},
    },
}

FIT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["device_memory_bytes", "limit_bytes", "quantum", "strategies"],
    "properties": {
        "device_memory_bytes": _INT, "limit_bytes": _INT, "quantum": _INT,
        "batch": {"type": ["integer", "null"]},
        "strategies": {"type": "array", "items": {
            "type": "object",
            "required": ["name", "max_seq", "predicted_step_ms"],
            "properties": {
                "name": {"enum": list(STRATEGIES)},
                "max_seq": {"type": ["integer", "null"]},
                "predicted_step_ms": {"type": ["number", "null"]},
                "total_bytes": {"type": ["integer", "null"]},
                "capped": {"type": "boolean"},
                "probed": {"type": "array", "items": _INT},
            },
        }},
    },
}  # fmt: skip

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "fxckpt inspect --format json",
    "type": "object",
    "required": ["version", "fxckpt_version", "target", "options", "graphs", "totals"],
    "properties": {
        "version": {"const": VERSION},
        "fxckpt_version": _NAME,
        "target": _NAME,
        "options": {"type": "object"},
        "graphs": {"type": "array", "items": PLAN_SCHEMA},
        "totals": TOTALS_SCHEMA,
        "step_peak": STEP_PEAK_SCHEMA,
        "fit": FIT_SCHEMA,
    },
}
