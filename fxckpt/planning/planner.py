"""Turn facts about saved tensors and the solver's choices into a Plan with reasons."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fxckpt.graph.activations import SavedActivation, bytes_per_storage
from fxckpt.planning.plan import Decision, Keep, Offload, Plan, PlannedActivation, Recompute


def _kib(n: int) -> str:
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


@dataclass(frozen=True)
class Choice:
    """What the planner chose for one saved storage, and the reason in words."""

    kind: str  # "keep", "offload", "recompute"
    reason: str
    tier: str = "host"  # an offload's: "host" or "disk"


def _row(a: SavedActivation, decision: Decision, flops: float = 0.0) -> PlannedActivation:
    return PlannedActivation(
        name=a.name,
        module=a.module,
        op=a.op,
        shape=a.shape,
        dtype=a.dtype,
        bytes=a.bytes,
        decision=decision,
        block=a.block,
        storage=a.storage,
        flops=flops,
    )


def recompute_reason(a: SavedActivation, segment_of_block: Mapping[int, int]) -> str:
    """Why a tensor that plain min-cut saves is no longer saved."""
    if a.block is not None and a.block in segment_of_block:
        seg = segment_of_block[a.block]
        if seg < 0:
            return f"recompute: block {a.block} is recomputed to meet the memory budget"
        return f"recompute: interior of segment {seg} (block {a.block})"
    return "recompute: rebuilt in the backward from tensors the plan saves"


def build_plan(
    name: str,
    baseline: Sequence[SavedActivation],
    final: Sequence[SavedActivation],
    choices: Mapping[str, Choice],
    *,
    segment_of_block: Mapping[int, int],
    recompute_reasons: Mapping[str, str] | None = None,
    keep_reasons: Mapping[str, str] | None = None,
    flops: Mapping[str, float] | None = None,
    budget_bytes: int | None = None,
    resident_peak_bytes: int | None = None,
    est_overhead_ms: float = 0.0,
    options: Mapping[str, object] | None = None,
    notes: Sequence[str] = (),
) -> Plan:
    """A Plan covering every tensor that plain min-cut or the final partition saves.

    ``choices`` maps a storage name of ``final`` to its decision; storages without one are
    kept. Tensors that the baseline saves and the final partition does not are recomputed.
    ``keep_reasons``: why a kept tensor is kept, where an earlier round said it (a tensor
    saved inside a recomputed block).
    """
    rows: list[PlannedActivation] = []
    final_names = {a.name for a in final}
    for a in final:
        choice = choices.get(a.storage)
        if choice is None or choice.kind == "keep":
            reason = choice.reason if choice is not None else "keep: no budget asks to evict it"
            reason = (keep_reasons or {}).get(a.name, reason)
            rows.append(_row(a, Keep(reason)))
        elif choice.kind == "offload":
            rows.append(_row(a, Offload(choice.reason, tier=choice.tier)))  # type: ignore[arg-type]
        else:
            raise ValueError(f"saved tensor {a.name} cannot be {choice.kind!r}")
    reasons = recompute_reasons or {}
    for a in baseline:
        if a.name in final_names:
            continue
        reason = reasons.get(a.name) or recompute_reason(a, segment_of_block)
        rows.append(_row(a, Recompute(reason), (flops or {}).get(a.name, 0.0)))
    peak = resident_peak_bytes
    if peak is None:
        # Without the simulator, the resident peak is what stays on the device at the end
        # of the forward: every saved tensor that is not offloaded.
        peak = bytes_per_storage(
            [a for a in final if choices.get(a.storage, Choice("keep", "")).kind == "keep"]
        )
    return Plan(
        name=name,
        activations=rows,
        budget_bytes=budget_bytes,
        baseline_saved_bytes=bytes_per_storage(list(baseline)),
        resident_peak_bytes=peak,
        est_overhead_ms=est_overhead_ms,
        options=dict(options or {}),
        notes=list(notes),
    )


__all__ = ["Choice", "build_plan", "recompute_reason", "_kib"]
