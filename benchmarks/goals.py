"""The five GPU goals, as one record shape shared by every benchmark that judges them.

``gpu_check.py`` measures them on a real GPU; ``gpu_shaped.py`` through the CPU engine's
emulated host link. Both write a ``goals`` object with exactly these keys, each a
:func:`goal` record, so a reader compares the two files key by key.
"""

from __future__ import annotations

from typing import Any

GOAL_KEYS = (
    "peak_vs_simulator",  # the whole step's measured peak within 2 % of the simulator's, <= budget
    "at_full_ckpt_memory",  # at full-checkpointing memory, step time <= 0.92x full checkpointing
    "no_offload_overhead",  # when nothing needs offloading, <= 1 % over plain torch.compile
    "vs_save_on_cpu",  # against save_on_cpu at equal measured peak, >= 1.5x faster
    "exposed_copy",  # exposed copy time < 1 % of the step where the plan says copies are hidden
)

MET, NOT_MET = "met", "not met"


def goal(
    figure: float | None,
    threshold: float,
    *,
    better: str,
    inputs: dict[str, Any] | None = None,
    label: str = "measured",
    skipped: str | None = None,
    failed: str | None = None,
) -> dict[str, Any]:
    """One goal's record: the figure, its threshold, what it came from, and the verdict.

    ``better``: ``"lower"`` (met when ``figure <= threshold``) or ``"higher"`` (met when
    ``figure >= threshold``). ``skipped``: why the goal was not measured; the verdict then
    reads ``"skipped: <why>"``. ``failed``: why the measurement does not count (fxckpt's run
    failed, or its peak was above the baseline it is compared with at equal memory); the
    verdict is then ``"not met"``, whatever the figure, and ``inputs["why"]`` says why.
    ``label``: ``"measured"`` on a GPU, ``"emulated"`` through the emulated link.
    """
    if better not in ("lower", "higher"):
        raise ValueError(f"better={better!r}; expected 'lower' or 'higher'")
    inputs = dict(inputs or {})
    if failed is not None:
        verdict = NOT_MET
        inputs["why"] = failed
    elif skipped is not None or figure is None:
        verdict = f"skipped: {skipped or 'not measured'}"
    elif better == "lower":
        verdict = MET if figure <= threshold else NOT_MET
    else:
        verdict = MET if figure >= threshold else NOT_MET
    return {
        "figure": figure,
        "threshold": threshold,
        "better": better,
        "inputs": inputs,
        "label": label,
        "verdict": verdict,
    }


def all_skipped(why: str, *, label: str = "measured") -> dict[str, dict[str, Any]]:
    """Every goal, skipped for one reason (no CUDA, say)."""
    thresholds = THRESHOLDS
    return {
        k: goal(None, thresholds[k][0], better=thresholds[k][1], label=label, skipped=why)
        for k in GOAL_KEYS
    }


# (threshold, better) per goal, in the units each goal's figure is stated in.
THRESHOLDS: dict[str, tuple[float, str]] = {
    "peak_vs_simulator": (0.02, "lower"),  # |measured - predicted| / predicted
    "at_full_ckpt_memory": (0.92, "lower"),  # fxckpt step time / full checkpointing's
    "no_offload_overhead": (1.01, "lower"),  # fxckpt step time / plain torch.compile's
    "vs_save_on_cpu": (1.5, "higher"),  # save_on_cpu step time / fxckpt's, at equal peak
    "exposed_copy": (0.01, "lower"),  # exposed copy seconds / step seconds
}
