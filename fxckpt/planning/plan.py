"""Decisions and plans: what happens to each saved activation, and why.

A :class:`Plan` is pure data. The planner makes it, the passes carry it out, and the report,
the logs and :func:`fxckpt.last_plans` display it. It round-trips through :meth:`Plan.to_dict`
and :meth:`Plan.from_dict`, which is how a graph loaded from the compile cache still knows its
plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

DecisionKind = Literal["keep", "recompute", "offload"]
OffloadTier = Literal["host", "disk"]


@dataclass(frozen=True)
class Keep:
    """The tensor stays on the device from the forward to the backward."""

    reason: str
    kind: DecisionKind = field(default="keep", init=False)


@dataclass(frozen=True)
class Recompute:
    """The backward recomputes the tensor instead of the forward saving it."""

    reason: str
    kind: DecisionKind = field(default="recompute", init=False)


@dataclass(frozen=True)
class Offload:
    """The forward copies the tensor to host memory; the backward prefetches it back.

    ``tier`` is where it waits: ``"host"`` (the host pool) or ``"disk"`` (a file in
    ``offload_dir``, staged through host memory on the way).
    """

    reason: str
    kind: DecisionKind = field(default="offload", init=False)
    tier: OffloadTier = "host"


Decision = Keep | Recompute | Offload
_BY_KIND: dict[str, type[Keep] | type[Recompute] | type[Offload]] = {
    "keep": Keep,
    "recompute": Recompute,
    "offload": Offload,
}


def decision_from(kind: str, reason: str, tier: str = "host") -> Decision:
    """Build the Decision named by ``kind`` (``tier``: where an offload waits)."""
    if kind == "offload":
        if tier not in ("host", "disk"):
            raise ValueError(f"an offload's tier is 'host' or 'disk', not {tier!r}")
        return Offload(reason, tier=tier)  # type: ignore[arg-type]
    return _BY_KIND[kind](reason)


@dataclass(frozen=True)
class PlannedActivation:
    """One tensor that plain min-cut or the final plan saves for the backward."""

    name: str
    module: str
    op: str
    shape: tuple[Any, ...]
    dtype: str
    bytes: int
    decision: Decision
    block: int | None = None
    storage: str = ""  # name of the node owning the storage; equal storages count once
    flops: float = 0.0  # FLOPs to recompute it (recomputed rows only)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "module": self.module,
            "op": self.op,
            "shape": [str(s) if not isinstance(s, int) else s for s in self.shape],
            "dtype": self.dtype,
            "bytes": self.bytes,
            "decision": self.decision.kind,
            "reason": self.decision.reason,
            "block": self.block,
            "storage": self.storage,
            "flops": self.flops,
        }
        if isinstance(self.decision, Offload):
            out["tier"] = self.decision.tier
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> PlannedActivation:
        return PlannedActivation(
            name=d["name"],
            module=d["module"],
            op=d["op"],
            shape=tuple(d["shape"]),
            dtype=d["dtype"],
            bytes=int(d["bytes"]),
            decision=decision_from(d["decision"], d["reason"], d.get("tier", "host")),
            block=d.get("block"),
            storage=d.get("storage", ""),
            flops=float(d.get("flops", 0.0)),
        )


WeightDecision = Literal["stream", "resident"]


@dataclass(frozen=True)
class PlannedWeight:
    """One streamed weight of the graph (:func:`fxckpt.stream_weights`) and where it lives.

    ``stream``: copied to the device ahead of each use, forward and backward, and freed after
    it. ``resident``: one device copy kept across steps (made again only after the host weight
    is written), in the room the device budget leaves."""

    name: str  # the host weight's input to the graph
    parameter: str  # its path in the model, as named before fxckpt.stream_weights
    shape: tuple[Any, ...]
    dtype: str
    bytes: int
    forward_uses: int
    backward_uses: int
    decision: WeightDecision
    reason: str

    @property
    def step_h2d_bytes(self) -> int:
        """Bytes this weight moves to the device in a step (a resident copy's first fill and
        its refills after the optimizer's writes are not counted)."""
        return 0 if self.decision == "resident" else self.bytes * (self.forward_uses + self.backward_uses)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "parameter": self.parameter,
            "shape": [str(s) if not isinstance(s, int) else s for s in self.shape],
            "dtype": self.dtype, "bytes": self.bytes, "forward_uses": self.forward_uses,
            "backward_uses": self.backward_uses, "decision": self.decision, "reason": self.reason,
            "step_h2d_bytes": self.step_h2d_bytes,
        }  # fmt: skip

    @staticmethod
    def from_dict(d: dict[str, Any]) -> PlannedWeight:
        return PlannedWeight(
            name=d["name"], parameter=d["parameter"], shape=tuple(d["shape"]), dtype=d["dtype"],
            bytes=int(d["bytes"]), forward_uses=int(d["forward_uses"]),
            backward_uses=int(d["backward_uses"]), decision=d["decision"], reason=d["reason"],
        )  # fmt: skip


def _bytes_per_storage(rows: list[PlannedActivation], kind: str, tier: str | None = None) -> int:
    seen: set[str] = set()
    total = 0
    for r in rows:
        key = r.storage or r.name
        if tier is not None and getattr(r.decision, "tier", None) != tier:
            continue
        if r.decision.kind == kind and key not in seen:
            seen.add(key)
            total += r.bytes
    return total


@dataclass
class Plan:
    """The decisions for one compiled graph, with the figures that justify them."""

    name: str
    activations: list[PlannedActivation]
    budget_bytes: int | None = None
    baseline_saved_bytes: int = 0
    resident_peak_bytes: int = 0
    est_overhead_ms: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timeline: dict[str, Any] | None = None  # from the memory simulator, for reports
    # What the cost model assumed, by name (``bandwidth_bytes_per_s``, ``compute_flops_per_s``,
    # ``copy_overhead_ms``, ...): each ``{"value": float, "source": str}``, the source one of
    # "measured", "option", "default" or "emulated".
    assumptions: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The whole training step's peak, predicted from the rewritten graphs' liveness
    # (graph.liveness.step_peak_bytes): saved, recomputed, restored and every other tensor.
    predicted_step_peak_bytes: int | None = None
    # Under a step budget: bytes of earlier graphs' outputs this graph saves. The step counts
    # them (in this graph's baseline and peak), this plan's figures do not; written only
    # where nonzero.
    step_inputs_bytes: int = 0
    # Streamed weights (fxckpt.stream_weights): each one's uses and where it lives.
    weights: list[PlannedWeight] = field(default_factory=list)
    # The graph's own figures, from the rewritten graphs' liveness (what existed before the
    # step left out): the most its forward and its backward hold at once, and what its
    # forward leaves for its backward.
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    held_bytes: int = 0
    # What memory_budget leaves the graph's own forward and backward ({"forward_bytes",
    # "backward_bytes"}, and for a graph that runs several times "held_bytes" and "runs", each
    # run's [runs before it, forward room, backward room]), where a budget is set.
    target: dict[str, Any] | None = None
    # The step's predicted peak with this graph's plan, and its parts at the peak
    # (planning.account.Account.parts: start_bytes, gradients_bytes, activations_bytes,
    # total_bytes), where a budget is set.
    step: dict[str, int] | None = None

    @property
    def resident_weight_bytes(self) -> int:
        """Device bytes of the streamed weights' copies kept across steps."""
        return sum(w.bytes for w in self.weights if w.decision == "resident")

    @property
    def weight_h2d_bytes(self) -> int:
        """Bytes of weights copied to the device per step."""
        return sum(w.step_h2d_bytes for w in self.weights)

    @property
    def kept_bytes(self) -> int:
        return _bytes_per_storage(self.activations, "keep")

    @property
    def offloaded_bytes(self) -> int:
        return _bytes_per_storage(self.activations, "offload")

    @property
    def recomputed_bytes(self) -> int:
        return _bytes_per_storage(self.activations, "recompute")

    @property
    def recomputed_flops(self) -> float:
        return sum(r.flops for r in self.activations if r.decision.kind == "recompute")

    @property
    def host_bytes(self) -> int:
        """Bytes of the offloaded tensors that wait in host memory (the host tier)."""
        return _bytes_per_storage(self.activations, "offload", tier="host")

    @property
    def disk_bytes(self) -> int:
        """Bytes of the offloaded tensors that wait in files (``offload → disk``)."""
        return _bytes_per_storage(self.activations, "offload", tier="disk")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "budget_bytes": self.budget_bytes,
            "baseline_saved_bytes": self.baseline_saved_bytes,
            "resident_peak_bytes": self.resident_peak_bytes,
            "kept_bytes": self.kept_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "recomputed_bytes": self.recomputed_bytes,
            "recomputed_flops": self.recomputed_flops,
            "host_bytes": self.host_bytes,
            "disk_bytes": self.disk_bytes,
            "est_overhead_ms": self.est_overhead_ms,
            "options": dict(self.options),
            "notes": list(self.notes),
            "activations": [a.to_dict() for a in self.activations],
            "timeline": self.timeline,
            "assumptions": {k: dict(v) for k, v in self.assumptions.items()},
            "predicted_step_peak_bytes": self.predicted_step_peak_bytes,
            "forward_peak_bytes": self.forward_peak_bytes,
            "backward_peak_bytes": self.backward_peak_bytes,
            "held_bytes": self.held_bytes,
            "target": dict(self.target) if self.target is not None else None,
            "step": dict(self.step) if self.step is not None else None,
        } | ({"step_inputs_bytes": self.step_inputs_bytes} if self.step_inputs_bytes else {}) | (
            {"weights": [w.to_dict() for w in self.weights],
             "resident_weight_bytes": self.resident_weight_bytes,
             "weight_h2d_bytes": self.weight_h2d_bytes} if self.weights else {}
        )  # fmt: skip

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Plan:
        return Plan(
            name=d["name"],
            activations=[PlannedActivation.from_dict(a) for a in d["activations"]],
            budget_bytes=d.get("budget_bytes"),
            baseline_saved_bytes=int(d.get("baseline_saved_bytes", 0)),
            resident_peak_bytes=int(d.get("resident_peak_bytes", 0)),
            est_overhead_ms=float(d.get("est_overhead_ms", 0.0)),
            options=dict(d.get("options", {})),
            notes=list(d.get("notes", [])),
            timeline=d.get("timeline"),
            assumptions={k: dict(v) for k, v in d.get("assumptions", {}).items()},
            predicted_step_peak_bytes=d.get("predicted_step_peak_bytes"),
            step_inputs_bytes=int(d.get("step_inputs_bytes", 0)),
            weights=[PlannedWeight.from_dict(w) for w in d.get("weights", [])],
            forward_peak_bytes=int(d.get("forward_peak_bytes") or 0),
            backward_peak_bytes=int(d.get("backward_peak_bytes") or 0),
            held_bytes=int(d.get("held_bytes") or 0),
            target=dict(d["target"]) if d.get("target") else None,
            step=dict(d["step"]) if d.get("step") else None,
        )

    def summary(self) -> str:
        """One line a user can read in a log."""

        def mib(n: int) -> str:
            return f"{n / 2**20:.2f} MiB"

        budget = "no budget" if self.budget_bytes is None else f"budget {mib(self.budget_bytes)}"
        if self.step:
            st = self.step
            peak = (f"step peak {mib(st['total_bytes'])} predicted ({budget}): start "
                    f"{mib(st['start_bytes'])}, gradients {mib(st['gradients_bytes'])}, "
                    f"activations {mib(st['activations_bytes'])}")
            if st.get("weights_bytes"):
                peak += f", weights {mib(st['weights_bytes'])}"
        else:
            peak = f"own step peak {mib(self.predicted_step_peak_bytes or 0)} predicted ({budget})"
        return (
            f"{self.name}: {peak}; saved: baseline {mib(self.baseline_saved_bytes)}, "
            f"kept {mib(self.kept_bytes)}, offloaded {mib(self.offloaded_bytes)}"
            + (f" ({mib(self.disk_bytes)} to disk)" if self.disk_bytes else "")
            + f", recomputed {mib(self.recomputed_bytes)}"
            + (f"; weights: {sum(w.decision == 'stream' for w in self.weights)} streamed "
               f"({mib(self.weight_h2d_bytes)} per step), "
               f"{sum(w.decision == 'resident' for w in self.weights)} resident "
               f"({mib(self.resident_weight_bytes)})" if self.weights else "")
        )


def plan_payload(plan: Plan) -> str:
    """The JSON text a plan travels as (in the compiled forward's note, and to
    :func:`fxckpt.last_plans`)."""
    return json.dumps(plan.to_dict(), sort_keys=True)


def describe_assumptions(assumed: dict[str, dict[str, Any]]) -> str:
    """One line for logs and reports: ``bandwidth 25.0 GB/s (measured), ...``."""
    units = {
        "bandwidth_bytes_per_s": ("bandwidth", 1e9, "GB/s"),
        "compute_flops_per_s": ("compute", 1e12, "TFLOP/s"),
        "memory_bytes_per_s": ("memory traffic", 1e9, "GB/s"),
        "copy_overhead_ms": ("per-copy overhead", 1.0, "ms"),
        "link_overhead_ms": ("link overhead", 1.0, "ms"),
        "copy_margin": ("copy margin", 0.01, "%"),
    }
    parts = []
    for key, fig in assumed.items():
        label, scale, unit = units.get(key, (key, 1.0, ""))
        value = fig.get("value")
        text = f"{value / scale:.3g} {unit}".strip() if isinstance(value, (int, float)) else str(value)
        parts.append(f"{label} {text} ({fig.get('source', '?')})")
    return ", ".join(parts)
