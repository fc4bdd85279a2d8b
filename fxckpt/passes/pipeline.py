"""The partitioner as data: named stages that run in order over one context.

A stage is a name and a function of the context. :func:`run` times each one, logs it at
DEBUG (``TORCH_LOGS="+fxckpt"``) and tells every listener (:func:`listening`) that it is done:
``fxckpt inspect``'s progress lines are such a listener. A stage that applies only to some
graphs says when (``when``), and is then neither run nor reported. A stage whose own steps
report themselves (the planning rounds), or that only does bookkeeping, has ``report=False``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from fxckpt._torch_compat import trace_plan_artifact
from fxckpt.planning.plan import Plan, describe_assumptions
from fxckpt.units import format_bytes

log = logging.getLogger("fxckpt.passes.partition")

C = TypeVar("C")


@dataclasses.dataclass(frozen=True)
class StageDone:
    """One stage of one graph's partition has run: what a listener hears."""

    graph: str
    name: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class Stage(Generic[C]):
    """One named step of the pipeline: ``run(context)``, where ``when(context)`` holds."""

    name: str
    run: Callable[[C], None]
    when: Callable[[C], bool] | None = None
    report: bool = True


Listener = Callable[[StageDone], None]
_listeners = threading.local()


def _current() -> list[Listener]:
    if not hasattr(_listeners, "fns"):
        _listeners.fns = []
    return _listeners.fns  # type: ignore[no-any-return]


@contextlib.contextmanager
def listening(fn: Listener) -> Iterator[None]:
    """Call ``fn`` after every stage that runs on this thread, until the block ends."""
    fns = _current()
    fns.append(fn)
    try:
        yield
    finally:
        fns.remove(fn)


@contextlib.contextmanager
def timed(graph: str, name: str) -> Iterator[None]:
    """Time one step of ``graph``'s partition, log it, and tell the listeners."""
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    log.debug("fxckpt[%s] %-18s %.1f ms", graph, name, seconds * 1e3)
    done = StageDone(graph, name, seconds)
    for fn in list(_current()):
        fn(done)


def run(context: C, graph: str, stages: Sequence[Stage[C]]) -> C:
    """Run each stage of ``stages`` that applies, in order, on ``context``."""
    for stage in stages:
        if stage.when is not None and not stage.when(context):
            continue
        with timed(graph, stage.name) if stage.report else contextlib.nullcontext():
            stage.run(context)
    return context


def decision_block(plan: Plan) -> str:
    """Every saved tensor's decision, one aligned line each: one log record for the lot."""
    rows = [(a.name, a.module or "-", format_bytes(a.bytes), a.decision.reason)
            for a in plan.activations]  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"  {n:<{widths[0]}}  {m:<{widths[1]}}  {b:>{widths[2]}}  {why}"
                     for n, m, b, why in rows)  # fmt: skip


def log_plan(plan: Plan) -> None:
    """The plan, to the log (its summary and notes at INFO, every decision at DEBUG, as one
    aligned block) and the
    structured trace."""
    log.info("fxckpt %s", plan.summary())
    if plan.activations and log.isEnabledFor(logging.DEBUG):
        log.debug("fxckpt[%s] %d saved tensors (name, module, size, reason):\n%s", plan.name,
                  len(plan.activations), decision_block(plan))
    for note in plan.notes:
        log.info("fxckpt[%s] %s", plan.name, note)
    if plan.assumptions:
        log.info("fxckpt[%s] assumed: %s", plan.name, describe_assumptions(plan.assumptions))
    trace_plan_artifact(plan.name, json.dumps(plan.to_dict()))
