"""The step's peak under Inductor, from Inductor's own memory planning facts.

The fx liveness (:func:`fxckpt.graph.liveness.step_peak_bytes`) counts every node's output,
which is exact when the graphs run op by op. Inductor fuses pointwise chains, so their
intermediates are never allocated, and writes some outputs into the buffer of an input that
dies there: on a 6-block GPT the fx liveness came out 17 % over the allocator's peak. So
under ``compiler="inductor"`` the step's peak is composed from each compiled graph's buffers
as Inductor scheduled them (sizes, first and last step, in its final order), with its in-place
reuses taken out.

A compile records what it needs while Inductor runs (:class:`Capture`); a graph the FX graph
cache serves is not scheduled again, so each graph's timeline is also kept on disk beside that
cache, under the cache's own key. Where neither is there, the plan keeps the fx figure and
says so (``step_peak_source``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fxckpt import _torch_compat as compat

log = logging.getLogger(__name__)

SOURCE_FX = "fx liveness"
SOURCE_INDUCTOR = "inductor schedule"

# (name, is a graph input, bytes allocated, bytes freed, first step, last step or -1)
Row = tuple[str, bool, int, int, int, int]


@dataclass(frozen=True)
class GraphTimeline:
    """One compiled graph's buffers, as Inductor's scheduler ordered them."""

    steps: int
    rows: list[Row]
    reuses: dict[str, str]

    def live(self, skip_inputs: Callable[[str], bool]) -> list[int]:
        """Bytes live at each step; graph inputs for which ``skip_inputs`` holds stay out
        (memory that existed before the step)."""
        # name -> [allocated at step 0 (a graph input), alloc, free, first, last]
        bufs: dict[str, list[int]] = {
            name: [int(is_input), alloc, free, first, last]
            for name, is_input, alloc, free, first, last in self.rows
            if not (is_input and skip_inputs(name))
        }
        # An output written into a dying input's buffer allocates nothing; the input's
        # buffer lives on as the output, until the output's own last use.
        owner: dict[str, str] = {}
        for out, inp in sorted(self.reuses.items(), key=lambda kv: bufs.get(kv[0], [0] * 5)[3]):
            src = owner.get(inp, inp)
            if out not in bufs or src not in bufs:
                continue
            o, s = bufs[out], bufs[src]
            s[4] = -1 if -1 in (o[4], s[4]) else max(s[4], o[4])
            o[1] = o[2] = 0
            owner[out] = src
        delta = [0] * (self.steps + 1)
        for is_input, alloc, free, first, last in bufs.values():
            delta[0 if is_input else first] += alloc
            if last != -1:
                delta[last + 1] -= free
        live: list[int] = []
        held = 0
        for d in delta[: self.steps]:
            held += d
            live.append(held)
        return live

    def to_json(self) -> str:
        return json.dumps({"steps": self.steps, "rows": self.rows, "reuses": self.reuses})

    @classmethod
    def from_json(cls, s: str) -> GraphTimeline:
        d = json.loads(s)
        return cls(int(d["steps"]), [tuple(r) for r in d["rows"]], dict(d["reuses"]))  # type: ignore[misc]


@dataclass
class Pending:
    """What the partitioner left for the step's peak: the fx figure, and which backward
    inputs are the forward's inputs (parameters and their views), never allocated by it."""

    fx_peak: int
    bw_pre_existing: frozenset[str]
    amend: Callable[[int, str], None]


@dataclass
class Capture:
    """One ``compile_fx`` call's facts: its partition's :class:`Pending`, and the timelines
    of the graphs Inductor compiled for it."""

    pending: list[Pending] = field(default_factory=list)
    scheduled: list[Any] = field(default_factory=list)  # GraphLowering objects, this call
    fw: GraphTimeline | None = None
    bw: GraphTimeline | None = None


_local = threading.local()


def _current() -> Capture | None:
    return getattr(_local, "capture", None)


@contextlib.contextmanager
def _active(cap: Capture) -> Iterator[None]:
    prev = _current()
    _local.capture = cap
    try:
        yield
    finally:
        _local.capture = prev


def record_scheduled(nodes: Sequence[Any]) -> Sequence[Any]:
    """Inductor's post-fusion pass: note the graph being scheduled; the nodes pass as they are."""
    cap = _current()
    if cap is not None:
        cap.scheduled.append(compat.inductor_graph())
    return nodes


def add_pending(p: Pending) -> bool:
    """Register a partition's figures with the compile in progress (False: none is)."""
    cap = _current()
    if cap is None:
        return False
    cap.pending.append(p)
    return True


def _cache_path(key: str) -> str:
    return os.path.join(compat.inductor_cache_dir(), "fxckpt_peaks", f"{key}.json")


def _store(key: str | None, t: GraphTimeline) -> None:
    if key is None:
        return
    path = _cache_path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(t.to_json())
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: the next hit falls back to the fx figure
        log.debug("fxckpt: could not keep a graph's timeline in %s: %s", path, e)


def _load(key: str | None) -> GraphTimeline | None:
    if key is None:
        return None
    try:
        with open(_cache_path(key)) as f:
            return GraphTimeline.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def inner_compile(cap: Capture, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's per-graph compiler, then the graph's timeline taken from its scheduler (a
    cache miss) or from the copy kept beside the FX graph cache (a hit).

    AOTAutograd compiles the backward when it first runs (on an autograd thread, on CUDA),
    so ``cap`` is bound to this function, and the plan is amended after the backward's
    compile."""
    cap.scheduled.clear()
    with _active(cap):
        compiled = compat.compile_fx_inner(gm, example_inputs, **kwargs)
    if kwargs.get("is_inference"):
        cap.scheduled.clear()
        return compiled
    key = compat.fx_graph_cache_key(compiled)
    timeline = None
    # Subgraphs (control_deps' wrapped nodes) are scheduled first; the graph itself last.
    graphs = [g for g in cap.scheduled if getattr(g, "scheduler", None) is not None]
    if graphs:
        try:
            timeline = GraphTimeline(*compat.inductor_buffer_timeline(graphs[-1]))
        except Exception as e:  # another torch's internals: keep the fx figure
            log.debug("fxckpt: Inductor's memory facts unreadable: %r", e)
        if timeline is not None:
            _store(key, timeline)
    else:
        timeline = _load(key)
    cap.scheduled.clear()
    if kwargs.get("is_backward"):
        cap.bw = timeline
        finish(cap)
    else:
        cap.fw = timeline
    return compiled


@contextlib.contextmanager
def capturing() -> Iterator[Callable[..., Any]]:
    """Collect the facts of one ``compile_fx`` call: the partition registers its plan here;
    yields the ``inner_compile`` to give Inductor."""
    cap = Capture()
    with _active(cap):
        yield functools.partial(inner_compile, cap)


def finish(cap: Capture) -> None:
    """Each pending plan gets the peak composed from Inductor's two timelines, where both
    were had; otherwise it keeps the fx figure."""
    pending, cap.pending = cap.pending, []
    for p in pending:
        if cap.fw is None or cap.bw is None or len(pending) != 1:
            p.amend(p.fx_peak, SOURCE_FX)
            continue
        fw = cap.fw.live(lambda _name: True)  # the forward's inputs all exist before the step
        bw = cap.bw.live(p.bw_pre_existing.__contains__)
        p.amend(max([*fw, *bw], default=0), SOURCE_INDUCTOR)
