"""The five GPU goals, measured in one run of every method they compare, and judged.

:func:`measure` runs eager, full checkpointing, ``save_on_cpu``, plain ``torch.compile`` and
three fxckpt settings on one Qwen3-shaped decoder (``benchmarks.cpu_bench.run_suite``: first
steps, warm-up, rotated timed rounds, the allocator's meter), then one more step per method,
its gradients dropped first, measured by ``fxckpt.Meter``: the step's absolute peak
(``step_peak_bytes``), what the device held when it began (on CUDA everything allocated: the
run keeps every method's model copy for its whole length, so each row starts from the same
level) plus the most the step allocated, the figure ``memory_budget`` bounds. The rows at
full checkpointing's and ``save_on_cpu``'s memory hold ``memory_budget`` to that baseline's
measured absolute step peak. :func:`judge` turns those rows into the ``goals`` object of
:mod:`benchmarks.goals`, each goal with its figure, threshold, inputs and verdict:

- ``peak_vs_simulator``: each byte-budget fxckpt row's absolute step peak against the plans'
  prediction of it (``step["total_bytes"]``; worst row), and within its ``memory_budget``;
- ``at_full_ckpt_memory``: fxckpt at full checkpointing's measured absolute step peak, step
  time over full checkpointing's, counted only where its measured peak is no higher;
- ``no_offload_overhead``: fxckpt with a budget min-cut already meets (``memory_budget=1.0``)
  over plain ``torch.compile``;
- ``vs_save_on_cpu``: ``save_on_cpu``'s step time over fxckpt's at ``save_on_cpu``'s measured
  absolute step peak, counted only where fxckpt's measured peak is no higher;
- ``exposed_copy``: the measured stall per step over the step, on a row whose plan offloads and
  says every copy is hidden.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from benchmarks.goals import THRESHOLDS, all_skipped, goal
from benchmarks.methods import (
    AT_FULL_CHECKPOINT,
    AT_SAVE_ON_CPU,
    BASELINE_SPECS,
    QWEN3_1_7B,
    DecoderConfig,
    MethodSpec,
    Runner,
    fxckpt_spec,
)

# Qwen3-1.7B's layer shapes, 4 of its 28 layers and a 32k vocabulary (the 152k one makes the
# logits most of the step), bf16, at 8k tokens. By arithmetic (not measured yet): a layer
# saves ~0.8 GB there without checkpointing and 32 MiB (its input) with it, so the layers'
# activations dominate the step and a device a few GB smaller than eager's peak needs full
# checkpointing; the rows report both measured peaks. Four Inductor compiles of it are meant
# to fit the run's minutes on an H200 beside the other checks (the deadline guards it).
GOAL_MODEL = replace(QWEN3_1_7B, name="qwen3-goals", layers=4, vocab=32000)
GOAL_SEQ = 8192
EQUAL_PEAK = 1.02  # "at equal measured peak": no more than 2 % above the baseline's
GRAD_SCALE_RTOL = 5e-2  # bf16: each gradient within 5 % of its own largest magnitude

FITS, AT_FULL, AT_SOC = "fxckpt_fits", "fxckpt_at_full_ckpt", "fxckpt_at_save_on_cpu"


def specs() -> list[MethodSpec]:
    base = {s.name: s for s in BASELINE_SPECS}
    warn = {"on_infeasible": "warn"}  # the smallest plan still gives a figure
    return [base["eager"], base["full_checkpoint"], base["save_on_cpu"], base["compiled"],
            fxckpt_spec(FITS, "memory_budget=1.0: plain compile's own step peak",
                        memory_budget=1.0),
            fxckpt_spec(AT_FULL, "memory_budget = full_checkpoint's measured absolute step peak",
                        memory_budget=AT_FULL_CHECKPOINT, **warn),
            fxckpt_spec(AT_SOC, "memory_budget = save_on_cpu's measured absolute step peak",
                        memory_budget=AT_SAVE_ON_CPU, **warn)]  # fmt: skip


def _probe(device: torch.device) -> Any:
    """One more step per method, its gradients dropped first: the step's absolute peak (what
    the device held when it began, plus the most it allocated) and (fxckpt) the plans that
    step ran, with their prediction of that peak."""
    import fxckpt

    def probe(runner: Runner, idx: torch.Tensor, tgt: torch.Tensor, row: dict[str, Any]) -> None:
        for p in runner.model.parameters():
            p.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        fxckpt.reset_stats()
        # holding: the CPU's start level (the model and the batch); CUDA's allocator knows it.
        meter = fxckpt.Meter(device, holding=(runner.model, idx, tgt))
        with meter:
            runner.call(idx, tgt).backward()
        assert meter.result is not None
        row["step_peak_bytes"] = meter.result.absolute_peak_bytes
        row["step_start_bytes"] = meter.result.start_bytes
        if runner.spec.kind == "fxckpt":
            plans = fxckpt.last_plans()
            reasons = [a.decision.reason for p in plans for a in p.activations
                       if a.decision.kind == "offload"]  # fmt: skip
            # Each plan's ``step`` is the whole step's predicted peak, with its own graph's
            # plan; the largest is the step's.
            steps = [p.step for p in plans if p.step]
            budgets = [p.budget_bytes for p in plans if p.budget_bytes is not None]
            row["plan"] = {
                "predicted_peak_bytes": max(s["total_bytes"] for s in steps) if steps else None,
                "predicted_parts": max(steps, key=lambda s: s["total_bytes"]) if steps else None,
                # The step's budget in bytes (every plan of the step has it).
                "budget_bytes": max(budgets) if budgets else None,
                "offloads": len(reasons),
                "exposed_offloads": sum("exposed" in r for r in reasons),
                "assumptions": plans[0].assumptions if plans else {},
            }

    return probe


def measure(device: torch.device, compiler: str, *, cfg: DecoderConfig = GOAL_MODEL,
            seq: int = GOAL_SEQ, repeats: int = 5, dtype: torch.dtype = torch.bfloat16,
            partial: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every method's row at one length (see the module docstring)."""
    from benchmarks.cpu_bench import run_suite

    def log(line: str) -> None:
        print(line, flush=True)
        if partial is not None:
            partial.setdefault("log", []).append(line)

    rows = run_suite(cfg, batch=1, seq=seq, specs=specs(), device=device, dtype=dtype,
                     compiler=compiler, warmup=1, repeats=repeats,
                     tolerances={"scale_rtol": GRAD_SCALE_RTOL}, log=log, probe=_probe(device))
    return rows


def _in_bytes(budget: Any) -> bool:
    """A memory_budget in bytes (an int; a float is a fraction)."""
    return isinstance(budget, int) and not isinstance(budget, bool)


def _ok(row: Mapping[str, Any] | None) -> str | None:
    """Why ``row`` gives no figure, or None."""
    if row is None:
        return "not run"
    if row.get("unavailable"):
        return f"failed: {row['unavailable']}"
    return None


def _wrong(*rows: Mapping[str, Any]) -> list[str]:
    """The fxckpt rows among ``rows`` whose gradients differ from eager's: their figure
    stands, but it cannot meet a goal."""
    return [f"{r['method']}: gradients differ from eager's: {r.get('grads_note')}" for r in rows
            if str(r["method"]).startswith("fxckpt") and not r.get("grads_match", True)]


def _time(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"step_ms": row.get("step_ms"), "step_ms_min": row.get("step_ms_min"),
            "step_ms_max": row.get("step_ms_max"), "step_peak_bytes": row.get("step_peak_bytes")}


def judge(rows: Sequence[Mapping[str, Any]], *, label: str = "measured") -> dict[str, Any]:
    """The ``goals`` object from :func:`measure`'s rows."""
    by = {str(r["method"]): r for r in rows}
    goals: dict[str, Any] = {}

    def put(key: str, figure: float | None, inputs: dict[str, Any], why: str | None = None,
            failed: str | None = None) -> None:
        threshold, better = THRESHOLDS[key]
        goals[key] = goal(figure, threshold, better=better, inputs=inputs, label=label,
                          skipped=why, failed=failed)

    # 1. The step's measured absolute peak against the plans' prediction of it, and within
    # the row's memory_budget.
    errors, inputs, broken = [], {}, []
    for name in (AT_FULL, AT_SOC):
        row = by.get(name)
        if _ok(row) or not row or "plan" not in row:
            broken.append(f"{name}: {_ok(row) or 'no plan recorded'}")
            continue
        plan, measured = row["plan"], int(row["step_peak_bytes"])
        if plan.get("predicted_peak_bytes") is None:
            broken.append(f"{name}: its plans predicted no step peak")
            continue
        predicted = int(plan["predicted_peak_bytes"])
        budget = (row.get("options") or {}).get("memory_budget")
        budget = budget if _in_bytes(budget) else plan.get("budget_bytes")
        errors.append(abs(measured - predicted) / max(predicted, 1))
        inputs[name] = {"measured_step_peak_bytes": measured, "predicted_peak_bytes": predicted,
                        "predicted_parts": plan.get("predicted_parts"), "budget_bytes": budget,
                        "relative_error": errors[-1]}
    inputs["predicted_covers"] = ("the step's absolute peak: what the device held when it "
                                  "began, gradients, activations and temporaries")
    over = [n for n, x in inputs.items() if isinstance(x, dict) and x["budget_bytes"] is not None
            and x["measured_step_peak_bytes"] > x["budget_bytes"]]
    wrong = _wrong(*[by[n] for n in (AT_FULL, AT_SOC) if n in by])
    put("peak_vs_simulator", max(errors) if errors else None, inputs,
        failed="; ".join(broken + wrong + [f"{n}: measured peak over its budget" for n in over])
        or None)

    # 2. At full checkpointing's memory, against full checkpointing.
    fx, full = by.get(AT_FULL), by.get("full_checkpoint")
    why = _ok(full) and f"full_checkpoint {_ok(full)}"
    if why:
        put("at_full_ckpt_memory", None, {}, why=why)
    elif _ok(fx):
        put("at_full_ckpt_memory", None, {}, failed=f"{AT_FULL} {_ok(fx)}")
    else:
        assert fx is not None and full is not None
        equal = fx["step_peak_bytes"] <= EQUAL_PEAK * full["step_peak_bytes"]
        why = _wrong(fx) + ([] if equal else
                            ["fxckpt's measured step peak is above full checkpointing's"])
        put("at_full_ckpt_memory", fx["step_ms"] / full["step_ms"],
            {"fxckpt": _time(fx), "full_checkpoint": _time(full)}, failed="; ".join(why) or None)

    # 3. Nothing needs offloading: over plain torch.compile.
    fx, plain = by.get(FITS), by.get("compiled")
    if _ok(plain):
        put("no_offload_overhead", None, {}, why=f"compiled {_ok(plain)}")
    elif _ok(fx):
        put("no_offload_overhead", None, {}, failed=f"{FITS} {_ok(fx)}")
    else:
        assert fx is not None and plain is not None
        put("no_offload_overhead", fx["step_ms"] / plain["step_ms"],
            {"fxckpt": _time(fx), "compiled": _time(plain),
             "paired_ratios": [a / b for a, b in zip(fx.get("step_ratios", []),
                                                     plain.get("step_ratios", []), strict=False)]},
            failed="; ".join(_wrong(fx)) or None)

    # 4. Against save_on_cpu at equal measured peak.
    fx, soc = by.get(AT_SOC), by.get("save_on_cpu")
    if _ok(soc):
        put("vs_save_on_cpu", None, {}, why=f"save_on_cpu {_ok(soc)}")
    elif _ok(fx):
        put("vs_save_on_cpu", None, {}, failed=f"{AT_SOC} {_ok(fx)}")
    else:
        assert fx is not None and soc is not None
        equal = fx["step_peak_bytes"] <= EQUAL_PEAK * soc["step_peak_bytes"]
        why = _wrong(fx) + ([] if equal else ["fxckpt's measured step peak is above save_on_cpu's"])
        put("vs_save_on_cpu", soc["step_ms"] / fx["step_ms"],
            {"fxckpt": _time(fx), "save_on_cpu": _time(soc)}, failed="; ".join(why) or None)

    # 5. Exposed copy time where the plan says every copy is hidden.
    hidden = [n for n in (AT_FULL, AT_SOC) if not _ok(by.get(n)) and "plan" in by[n]
              and by[n]["plan"]["offloads"] and not by[n]["plan"]["exposed_offloads"]]
    if not hidden:
        plans = {n: by[n].get("plan") for n in (AT_FULL, AT_SOC) if n in by}
        put("exposed_copy", None, {"plans": plans},
            why="no plan offloads with every copy hidden")
    else:
        row = by[hidden[0]]
        stall_ms = 1e3 * float(row.get("stall_s_per_step") or 0.0)
        put("exposed_copy", stall_ms / row["step_ms"],
            {"method": hidden[0], "stall_ms_per_step": stall_ms, **_time(row),
             "offloads": row["plan"]["offloads"]}, failed="; ".join(_wrong(row)) or None)
    return goals


def skipped(why: str) -> dict[str, Any]:
    return all_skipped(why)
