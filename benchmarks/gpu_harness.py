"""How ``gpu_check.py`` runs its checks: a hard deadline, faulthandler per check, estimates it
measures, and ``DIR/gpu_check.json`` rewritten after every check.

A lent GPU gives one try of about ten minutes, and whatever is not in the folder that comes
back when it ends is lost. So:

- the JSON is rewritten (atomically) before each check, naming the check that is running,
  and after it, with its record;
- at ``--deadline-s`` a ``SIGALRM`` raises :class:`DeadlineExceeded` in whatever check runs:
  it stops there, its record keeps what it measured so far (``ctx.partial``), and the file is
  written; if the process is stuck in C code past ``deadline + GRACE_S``, a watchdog thread
  writes the file, dumps every thread's stack and exits;
- ``faulthandler`` writes a crash's stack to ``DIR/faulthandler.log``, and every thread's
  stack there when a check runs past three times its estimate;
- a check starts only when its estimate fits what is left. Estimates are measured: a check's
  ``--estimates`` seconds from an earlier run's JSON where given, else its compile count times
  the pre-flight's measured compile, scaled by how far the checks so far ran from theirs.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_verdicts as v

GRACE_S = 30.0
JSON_NAME = "gpu_check.json"
FAULT_LOG = "faulthandler.log"


class DeadlineExceeded(BaseException):
    """The run's deadline passed: not an ``Exception``, so no check's handler swallows it."""


@dataclass(frozen=True)
class Check:
    name: str
    needs_cuda: bool
    compiles: float  # Inductor compiles of a small decoder it runs (the estimate's unit)
    run: Callable[[Ctx], None]
    needs_state: bool = False  # the gradients check's compiled model
    cpu_compiles: float | None = None  # without CUDA, where it differs (goals: none)
    # Starts whenever time is left, whatever its estimate: the deadline stops it and keeps
    # what it measured (the goals: a partial answer beats none).
    always_start: bool = False


@dataclass
class Ctx:
    device: torch.device
    compiler: str
    args: argparse.Namespace
    report: v.Report
    deadline: v.Deadline
    out: Path
    state: dict[str, Any] = field(default_factory=dict)
    partial: dict[str, Any] = field(default_factory=dict)  # what the running check measured
    doc: dict[str, Any] = field(default_factory=dict)  # the JSON's other top-level keys
    compile_s: float | None = None  # the pre-flight's measured compile
    ratios: list[float] = field(default_factory=list)  # measured / estimated, per check
    previous: dict[str, float] = field(default_factory=dict)  # --estimates: seconds per check
    running: str | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def estimate(self, check: Check) -> float:
        if check.name in self.previous:
            return self.previous[check.name]
        unit = self.compile_s if self.compile_s is not None else (30.0 if self.cuda else 10.0)
        scale = statistics.median(self.ratios) if self.ratios else 1.0
        return max(1.0, self.compiles(check) * unit * scale)

    def compiles(self, check: Check) -> float:
        return check.compiles if self.cuda or check.cpu_compiles is None else check.cpu_compiles

    def write(self) -> None:
        """``DIR/gpu_check.json`` as it stands now (atomically: a kill leaves the last one)."""
        doc = {
            **self.doc,
            "wall_s": round(self.deadline.seconds - self.deadline.left(), 1),
            "running": self.running,
            "checks": self.report.checks,
            "failures": self.report.failures(),
            "skipped": self.report.skipped(),
        }
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / (JSON_NAME + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        os.replace(tmp, self.out / JSON_NAME)


def load_estimates(path: str | None) -> dict[str, float]:
    """Seconds per check from an earlier run's JSON (its ``wall_s`` per record)."""
    if not path:
        return {}
    doc = json.loads(Path(path).read_text())
    return {c["check"]: float(c["wall_s"]) for c in doc.get("checks", [])
            if c.get("status") != "skipped" and isinstance(c.get("wall_s"), (int, float))}


def _on_alarm(signum: int, frame: Any) -> None:
    raise DeadlineExceeded()


class Watchdog:
    """Arms the deadline: ``SIGALRM`` at the deadline, a thread that exits the process
    ``GRACE_S`` later if the main thread never got back to Python to handle it."""

    def __init__(self, ctx: Ctx, fault_file: Any) -> None:
        self.ctx, self.fault_file = ctx, fault_file
        self._done = threading.Event()

    def __enter__(self) -> Watchdog:
        left = self.ctx.deadline.left()
        if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.01))
        threading.Thread(target=self._last_resort, args=(left + GRACE_S,), daemon=True,
                         name="gpu_check-watchdog").start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _last_resort(self, after: float) -> None:
        if self._done.wait(after):
            return
        ctx = self.ctx
        ctx.report.add(ctx.running or "gpu_check", "failed",
                       f"stuck past the deadline by {GRACE_S:.0f} s; process exited",
                       partial=dict(ctx.partial))
        try:
            ctx.write()
            faulthandler.dump_traceback(file=self.fault_file, all_threads=True)
        finally:
            os._exit(3)


def run_one(ctx: Ctx, check: Check, fault_file: Any) -> None:
    """Run one check with faulthandler armed; a crash is a failed check, the deadline a
    stopped one. Re-raises :class:`DeadlineExceeded` after recording it."""
    estimate = ctx.estimate(check)
    if check.needs_cuda and not ctx.cuda:
        ctx.report.add(check.name, "skipped", "needs CUDA")
        return
    if check.needs_state and "fxckpt" not in ctx.state:
        ctx.report.add(check.name, "skipped", "needs the gradients check's compiled model")
        return
    if estimate > ctx.deadline.left() and not (check.always_start and ctx.deadline.left() > 0):
        ctx.report.add(check.name, "skipped", f"deadline: {ctx.deadline.left():.0f} s left, "
                       f"about {estimate:.0f} s needed", estimate_s=round(estimate, 1))
        return
    ctx.running, ctx.partial = check.name, {}
    ctx.write()
    print(f"[ running] {check.name} (about {estimate:.0f} s, {ctx.deadline.left():.0f} s left)",
          flush=True)
    faulthandler.dump_traceback_later(max(60.0, 3 * estimate), file=fault_file)
    start = time.perf_counter()
    before = len(ctx.report.checks)
    stopped = False
    try:
        check.run(ctx)
    except DeadlineExceeded:
        stopped = True
        ctx.report.add(check.name, "skipped", "deadline: stopped while running; figures so "
                       "far under 'partial'", partial=dict(ctx.partial))
    except Exception as e:  # a crash is a failed check, and the others still run
        ctx.report.add(check.name, "failed", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                       if str(e) else type(e).__name__,
                       traceback=traceback.format_exc(limit=8)[-3000:], partial=dict(ctx.partial))
    finally:
        faulthandler.cancel_dump_traceback_later()
        wall = time.perf_counter() - start
        for record in ctx.report.checks[before:]:
            record.setdefault("wall_s", round(wall, 1))
            record.setdefault("estimate_s", round(estimate, 1))
        if not stopped and ctx.compiles(check) and check.name not in ctx.previous:
            ctx.ratios.append(wall / max(estimate, 1e-3))  # how far off the unit was
        ctx.running, ctx.partial = None, {}
        ctx.write()
    if stopped:
        raise DeadlineExceeded()


def run_all(ctx: Ctx, checks: list[Check], only: list[str]) -> None:
    """Every check in order, until the deadline; the JSON is current after each."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    with open(ctx.out / FAULT_LOG, "w") as fault_file:
        faulthandler.enable(file=fault_file, all_threads=True)
        try:
            with Watchdog(ctx, fault_file):
                for i, check in enumerate(checks):
                    if only and check.name not in only:
                        continue
                    try:
                        run_one(ctx, check, fault_file)
                    except DeadlineExceeded:
                        for rest in checks[i + 1:]:
                            if not only or rest.name in only:
                                ctx.report.add(rest.name, "skipped", "deadline: not started")
                        break
        except DeadlineExceeded:  # the alarm fired between two checks
            pass
        finally:
            faulthandler.disable()
            ctx.write()
            sys.stdout.flush()
