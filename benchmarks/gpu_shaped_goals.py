"""The five goals of ``benchmarks/gpu_shaped.py``, read from its rows, and its per-row checks.

Memory is the meter's absolute step peak (``absolute_peak_bytes``: what the device held when
the step began plus the most the step allocated, the figure ``memory_budget`` bounds); step
times are paired per round. Each goal is one :func:`benchmarks.goals.goal` record labelled
``"emulated"``.
"""

from __future__ import annotations

from typing import Any

from benchmarks import goals as g
from benchmarks.methods import median

# The row the no-overhead goal reads; the others choose among the planner's rows.
PLAN_FITS = "fxckpt_fits"
# memory_budget: full checkpointing's measured absolute step peak; save_on_cpu's.
PLAN_AT_FULL = "fxckpt_at_full_ckpt"
PLAN_AT_SAVE_ON_CPU = "fxckpt_at_save_on_cpu"


def planner_rows(by: dict[str, dict[str, Any]]) -> list[str]:
    """The rows where fxckpt's planner chose under a ``memory_budget``, priced at the link."""
    return [n for n, r in by.items() if n.startswith("fxckpt") and not r.get("unavailable")
            and "memory_budget" in (r.get("options") or {})
            and "bandwidth" not in r["options"] and r.get("grads_match", True)]


def paired(by: dict[str, dict[str, Any]], a: str, b: str) -> list[float]:
    """Step-time ratios of ``a`` over ``b``: from their back-to-back pairs where they ran
    some (:func:`back_to_back`), else per rotated round."""
    pairs = by[a].get("pairs") or {}
    if b in pairs:
        return list(pairs[b])
    pairs = by[b].get("pairs") or {}
    if a in pairs:
        return [1.0 / x for x in pairs[a]]
    return rotated(by, a, b)


def rotated(by: dict[str, dict[str, Any]], a: str, b: str) -> list[float]:
    """Step-time ratios of ``a`` over ``b`` per rotated round."""
    return [x / y for x, y in zip(by[a]["step_s"], by[b]["step_s"], strict=True)]


def goal_pairs(by: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """The (row, reference) pairs the step-time goals compare."""
    out = [(PLAN_FITS, "compiled")] if PLAN_FITS in by and "compiled" in by else []
    for ref in ("full_checkpoint", "save_on_cpu"):
        row = _at_peak(by, ref) if ref in by and not by[ref].get("unavailable") else None
        if row is not None:
            out.append((row, ref))
    return out


def _ok(by: dict[str, dict[str, Any]], *names: str) -> str | None:
    for n in names:
        if n not in by or by[n].get("unavailable"):
            return f"row {n} did not run" + (f": {by[n]['unavailable']}" if n in by else "")
        if not by[n].get("grads_match", True):
            return f"row {n}'s gradients differ from eager's"
    return None


def _at_peak(by: dict[str, dict[str, Any]], source: str) -> str | None:
    """The fastest planner row whose measured absolute step peak is at most ``source``'s."""
    cap = by[source]["absolute_peak_bytes"]
    fits = [n for n in planner_rows(by) if by[n]["absolute_peak_bytes"] <= cap]
    return min(fits, key=lambda n: median(rotated(by, n, source))) if fits else None


def _in_bytes(budget: Any) -> bool:
    """A memory_budget in bytes (an int; a float is a fraction, a string was parsed by fxckpt)."""
    return isinstance(budget, int) and not isinstance(budget, bool)


def goal_records(by: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The five goals from the rows. Memory is the meter's absolute step peak; step times are
    paired per round. Only the first goal reads a plan: the simulator's own prediction."""
    out: dict[str, dict[str, Any]] = {}
    th = g.THRESHOLDS

    def record(key: str, figure: float | None, inputs: dict[str, Any], skipped: str | None = None,
               failed: str | None = None) -> None:
        out[key] = g.goal(figure, th[key][0], better=th[key][1], inputs=inputs, label="emulated",
                          skipped=skipped, failed=failed)

    def decisions(n: str) -> dict[str, Any]:
        plan = by[n].get("plan") or {}
        return {"decisions": by[n].get("plan_decisions"),
                "offloaded_bytes": plan.get("offloaded_bytes"),
                "budget_bytes": plan.get("budget_bytes")}

    # 1. The step's measured peak against the plan's prediction of it, every fxckpt row that
    # has one: the absolute peak against the plans' step["total_bytes"] where a budget is set,
    # else (one graph, no budget) the peak above the step's start against the graph's own
    # predicted step peak. And every row held to a memory_budget in bytes: its measured
    # absolute step peak against that budget.
    errors: dict[str, float] = {}
    compared: dict[str, dict[str, Any]] = {}
    for n, r in by.items():
        plan = r.get("plan") or {}
        if r.get("unavailable") or not plan:
            continue
        if plan.get("predicted_absolute_peak_bytes"):
            got, pred, kind = (r["absolute_peak_bytes"], plan["predicted_absolute_peak_bytes"],
                               "absolute")
        elif plan.get("predicted_step_peak_bytes"):
            got, pred, kind = r["peak_bytes"], plan["predicted_step_peak_bytes"], "above start"
        else:
            continue
        errors[n] = (got - pred) / pred
        compared[n] = {"measured_bytes": got, "predicted_bytes": pred, "peak": kind}
    if errors:
        worst = max(errors, key=lambda n: abs(errors[n]))
        bounded = {n: (r["absolute_peak_bytes"], r["options"]["memory_budget"])
                   for n, r in by.items() if not r.get("unavailable")
                   and _in_bytes((r.get("options") or {}).get("memory_budget"))}
        over = [f"{n}'s absolute step peak ({got / 2**20:.2f} MiB) is above its memory_budget "
                f"({cap / 2**20:.2f} MiB)" for n, (got, cap) in bounded.items() if got > cap]
        record("peak_vs_simulator", abs(errors[worst]),
               {"row": worst, "relative_error_per_row": errors, "compared": compared,
                "measured_step_peak_bytes": compared[worst]["measured_bytes"],
                "predicted_step_peak_bytes": compared[worst]["predicted_bytes"],
                "budget_rows": {n: {"absolute_peak_bytes": got, "memory_budget_bytes": cap}
                                for n, (got, cap) in bounded.items()}},
               failed="; ".join(over) or (None if bounded else
                                          "no row held the step's peak to a memory_budget in bytes"))
    else:
        record("peak_vs_simulator", None, {}, skipped="no fxckpt row predicted its step peak")
    # 2. At full checkpointing's measured absolute step peak, against full checkpointing.
    why = _ok(by, "full_checkpoint")
    row = None if why else _at_peak(by, "full_checkpoint")
    if row is not None:
        ratios = paired(by, row, "full_checkpoint")
        record("at_full_ckpt_memory", median(ratios),
               {"row": row, "per_round": ratios,
                "absolute_peak_bytes": by[row]["absolute_peak_bytes"],
                "full_checkpoint_absolute_peak_bytes": by["full_checkpoint"]["absolute_peak_bytes"],
                **decisions(row)})
    else:
        record("at_full_ckpt_memory", None, {}, skipped=why or "no planner row's step peak is "
               "at or below full checkpointing's")
    # 3. A budget plain min-cut meets: no overhead over plain torch.compile.
    why = _ok(by, PLAN_FITS, "compiled")
    if why is None:
        ratios = paired(by, PLAN_FITS, "compiled")
        record("no_offload_overhead", median(ratios),
               {"row": PLAN_FITS, "per_round": ratios, **decisions(PLAN_FITS)})
    else:
        record("no_offload_overhead", None, {}, skipped=why)
    # 4. Against save_on_cpu at equal measured peak (the step's absolute one).
    why = _ok(by, "save_on_cpu")
    row = None if why else _at_peak(by, "save_on_cpu")
    if row is not None:
        ratios = paired(by, "save_on_cpu", row)
        record("vs_save_on_cpu", median(ratios),
               {"row": row, "per_round": ratios,
                "absolute_peak_bytes": by[row]["absolute_peak_bytes"],
                "save_on_cpu_absolute_peak_bytes": by["save_on_cpu"]["absolute_peak_bytes"],
                **decisions(row)})
    else:
        record("vs_save_on_cpu", None, {}, skipped=why or "no planner row's step peak is at or "
               "below save_on_cpu's")
    # 5. Exposed copy time where the plan says every copy is hidden.
    hidden = [n for n in planner_rows(by) if by[n].get("plan") and by[n]["plan"]["offloads"]
              and by[n]["plan"]["offloads"] == by[n]["plan"]["offloads_hidden"]]
    if hidden:
        shares = {n: median(by[n]["stall_shares"]) for n in hidden}
        worst = max(shares, key=shares.__getitem__)
        record("exposed_copy", shares[worst],
               {"rows": shares, "worst": worst, "stall_s_per_step": by[worst]["stall_s_per_step"],
                "step_s": median(by[worst]["step_s"])})
    else:
        record("exposed_copy", None, {}, skipped="no planner row offloads with every copy hidden")
    return out


def extras(by: dict[str, dict[str, Any]], bandwidth: float) -> dict[str, Any]:
    """Per fxckpt row: the simulator's step time against the measured one, and the link check
    (a step lasts at least its offloaded bytes over the bandwidth; the engine's copy seconds
    at least twice that)."""
    out: dict[str, Any] = {}
    for n, r in by.items():
        plan = r.get("plan")
        if r.get("unavailable") or plan is None:
            continue
        step_ms = 1e3 * median(r["step_s"])
        moved = r.get("offloaded_bytes_per_step", 0)
        # The link ran at bandwidth / scale in each round (LinkClock).
        floor_s = moved / bandwidth * min(r.get("link_scales") or [1.0])
        out[n] = {
            "step_ms": step_ms,
            "predicted_step_ms": plan.get("predicted_step_ms"),
            "offloaded_bytes_per_step": moved,
            # The plan's figures are at the compute speed the link was sized at; each round
            # ran at ``link_scales`` of it.
            "scaled_predicted_step_ms": None,
            "step_at_least_copies": min(r["step_s"]) >= floor_s,
            "copy_seconds_at_least_twice": r.get("copy_s_per_step", 0.0) >= 2 * floor_s - 1e-9,
        }
        if out[n]["predicted_step_ms"] is not None:
            scaled = out[n]["predicted_step_ms"] * median(r.get("link_scales") or [1.0])
            out[n]["scaled_predicted_step_ms"] = scaled
            out[n]["step_vs_simulator"] = (step_ms - scaled) / step_ms
    return out
