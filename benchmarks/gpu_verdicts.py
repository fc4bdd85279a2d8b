"""The judgements ``gpu_check.py`` makes, as plain functions over numbers and tensors.

Nothing here needs CUDA, so every verdict the GPU script can reach is unit-tested on the CPU
(``tests/test_gpu_check.py``): the noise floor and the gradient verdict against it, memory
against the simulator, copy/kernel overlap in a profiler trace, and the time budget.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# A gradient may differ from eager's by this many times eager's own run-to-run (or plain
# torch.compile's) difference, plus this share of the gradient's magnitude: reordered
# reductions move the last bits, a race moves far more.
FLOOR_FACTOR = 4.0
FLOOR_EPS = 1e-6
MEMORY_REL = 0.05


def grad_diffs(ref: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Largest absolute difference per parameter (inf where shapes or presence differ,
    NaN propagates to inf)."""
    out: dict[str, float] = {}
    for name in ref.keys() | got.keys():
        a, b = ref.get(name), got.get(name)
        if a is None or b is None or a.shape != b.shape:
            out[name] = float("inf")
            continue
        d = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        out[name] = float("inf") if d != d else d
    return out


def noise_floor(*pairs: Mapping[str, float]) -> dict[str, float]:
    """Per parameter, the largest of several measured difference sets (eager vs eager, plain
    compile vs eager)."""
    floor: dict[str, float] = {}
    for diffs in pairs:
        for name, d in diffs.items():
            floor[name] = max(floor.get(name, 0.0), d)
    return floor


def within_floor(
    diffs: Mapping[str, float],
    floor: Mapping[str, float],
    scale: Mapping[str, float],
    factor: float = FLOOR_FACTOR,
) -> tuple[bool, str]:
    """Every parameter's difference within ``factor`` x its floor + ``FLOOR_EPS`` x its scale.

    Returns (ok, the worst parameter and its figures).
    """
    worst, worst_ratio, ok = "", 0.0, True
    for name, d in diffs.items():
        allowed = factor * floor.get(name, 0.0) + FLOOR_EPS * max(scale.get(name, 0.0), 1e-30)
        ratio = d / allowed
        if ratio > worst_ratio or ratio != ratio:
            worst, worst_ratio = name, ratio
        if not d <= allowed:
            ok = False
    note = f"worst {worst}: {worst_ratio:.3g} of the allowed difference" if worst else ""
    return ok, note


def grad_scale(grads: Mapping[str, torch.Tensor]) -> dict[str, float]:
    return {n: g.double().abs().max().item() if g.numel() else 0.0 for n, g in grads.items()}


# Below this many bytes a memory difference is the allocator's own: it rounds every block up
# to 512 bytes (CUDA) and keeps small blocks apart, so a plan that keeps ~nothing (offload
# everything) would read as an error of several times its prediction.
MEMORY_FLOOR_BYTES = 2 * 2**20


def memory_verdict(measured: int, predicted: int, reference: int,
                   rel: float = MEMORY_REL, floor: int = MEMORY_FLOOR_BYTES) -> dict[str, Any]:
    """``measured`` against ``predicted``: within ``rel`` of ``reference`` (the larger of
    the two when ``reference`` is 0), or within ``floor`` bytes."""
    ref = reference or max(measured, predicted, 1)
    diff = abs(measured - predicted)
    err = diff / ref
    return {"measured_bytes": measured, "predicted_bytes": predicted, "reference_bytes": ref,
            "relative_error": err, "floor_bytes": floor, "ok": err <= rel or diff <= floor}


@dataclass(frozen=True)
class TraceEvent:
    """One device activity from a profiler trace: a kernel or a memcpy, on a stream."""

    name: str
    stream: int
    start_us: float
    end_us: float

    @property
    def is_copy(self) -> bool:
        return "memcpy" in self.name.lower()


def copy_overlap(events: Iterable[TraceEvent], min_share: float = 0.05) -> dict[str, Any]:
    """How much of the device-host copy time ran while a kernel ran on another stream.

    ``ok`` when copies exist on a stream with no kernels (a side stream) and at least
    ``min_share`` of their time overlaps kernels elsewhere.
    """
    evs = sorted(events, key=lambda e: e.start_us)
    copies = [e for e in evs if e.is_copy]
    kernels = [e for e in evs if not e.is_copy]
    kernel_streams = {e.stream for e in kernels}
    side = [c for c in copies if c.stream not in kernel_streams]
    total = sum(c.end_us - c.start_us for c in side)
    overlapped = 0.0
    for c in side:
        spans = sorted((max(c.start_us, k.start_us), min(c.end_us, k.end_us))
                       for k in kernels if k.stream != c.stream
                       and k.start_us < c.end_us and c.start_us < k.end_us)
        covered, reach = 0.0, c.start_us
        for a, b in spans:  # union of the kernels' intervals inside the copy
            a = max(a, reach)
            if b > a:
                covered += b - a
                reach = b
        overlapped += covered
    share = overlapped / total if total else 0.0
    return {"side_stream_copies": len(side), "copy_us": total, "overlapped_us": overlapped,
            "overlap_share": share, "ok": bool(side) and share >= min_share}


def trace_events(prof: Any) -> list[TraceEvent]:
    """Device events of a ``torch.profiler.profile`` run, with their stream ids."""
    out = []
    for e in prof.events():
        stream = getattr(e, "device_resource_id", None)
        kind = str(getattr(e, "device_type", ""))
        if stream is None or "CUDA" not in kind:
            continue
        start = e.time_range.start
        out.append(TraceEvent(e.name, int(stream), float(start), float(e.time_range.end)))
    return out


def hidden_share(stall_s: float, copy_s: float) -> float | None:
    """Share of the copy time compute did not wait for (None without copies)."""
    if copy_s <= 0:
        return None
    return max(0.0, 1.0 - stall_s / copy_s)


@dataclass
class Deadline:
    """The script's time budget: a check runs only if its estimate fits in what is left."""

    seconds: float
    started: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)

    def allows(self, estimate_s: float) -> bool:
        return estimate_s <= self.left()


@dataclass
class Report:
    """One record per check: passed, failed or skipped, with why and the figures."""

    checks: list[dict[str, Any]] = field(default_factory=list)

    def add(self, name: str, status: str, why: str = "", **figures: Any) -> dict[str, Any]:
        assert status in ("passed", "failed", "skipped"), status
        record = {"check": name, "status": status, "why": why, **figures}
        self.checks.append(record)
        print(f"[{status:>7}] {name}" + (f": {why}" if why else ""), flush=True)
        return record

    def failures(self) -> list[str]:
        return [f"{c['check']}: {c['why']}" for c in self.checks if c["status"] == "failed"]

    def skipped(self) -> list[str]:
        return [f"{c['check']}: {c['why']}" for c in self.checks if c["status"] == "skipped"]


def summarize(rows: Sequence[Mapping[str, Any]], baselines: Sequence[str]) -> list[dict[str, Any]]:
    """fxckpt's rows against each baseline of the same sequence length: peak, step time and
    exposed copy time as ratios."""
    out = []
    by_seq: dict[int, dict[str, Mapping[str, Any]]] = {}
    for r in rows:
        if not r.get("unavailable"):
            by_seq.setdefault(int(r["seq"]), {})[str(r["method"])] = r
    for seq, methods in sorted(by_seq.items()):
        for name, r in methods.items():
            if not name.startswith("fxckpt"):
                continue
            for base in baselines:
                b = methods.get(base)
                if b is None:
                    continue
                out.append({
                    "seq": seq, "method": name, "baseline": base,
                    "peak_ratio": r["peak_bytes"] / b["peak_bytes"] if b.get("peak_bytes") else None,
                    "step_time_ratio": r["step_ms"] / b["step_ms"] if b.get("step_ms") else None,
                    "exposed_copy_ms": 1e3 * float(r.get("stall_s_per_step") or 0.0),
                })
    return out
