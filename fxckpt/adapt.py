"""Measured copies correct the plan: a compiled graph that re-plans itself, bounded.

The backend returns an :class:`Adaptive` for every graph it compiles. It runs the compiled
graph with its copy meter active (:mod:`fxckpt.runtime.copy_meter`), so ``fxckpt.stats()``
shows each graph's exposed stall, copy time and bandwidth. At the start of each call it closes
the previous step's sample (a step runs from one forward's start to the next: the backward of
the previous forward is in it), and :func:`fxckpt.planning.adapt.judge` reads the samples.

With ``adapt="auto"`` a verdict to re-plan re-runs the backend's own compile of the same
dynamo graph (a :class:`Recipe`: the graph, fake copies of its inputs with their symbolic
sizes, the shape environment's fake mode), with the measured bandwidth replacing the
assumed one (source ``"measured at run time"``), and later calls run the new callable. At
most :data:`~fxckpt.planning.adapt.MAX_REPLANS` re-plans per graph. ``"measure"`` warns
instead (:class:`AdaptWarning`, once per graph); ``"never"`` only measures.

Why the swap is safe between two forwards, even with a backward of the old plan still to
run: every forward's autograd node holds its own compiled backward, its saved tensors and
its offload handles, so a backward always runs the plan its forward ran. The swap changes
which compiled forward the next call runs, nothing else. A re-plan whose compile would add
guards on the shape environment (dynamo installed its guards at the first compile and would
not check new ones) is thrown away, and the plan kept.

A plan that recomputes something but whose copies are too few to measure the link (it may
offload nothing: the plan was made for a link slower than the real one) gets one link probe
per graph (:mod:`fxckpt.runtime.link_probe`) when the trigger asks for it: a timed round trip
of a buffer, at the start of a forward, before the compiled graph runs. Its figure goes to
the trigger, which stays pure; it is logged at INFO and counted (``stats()["link_probes"]``).
``"never"`` judges nothing and so never probes.

What is not re-planned: plans with neither offload nor recompute (nothing to trade), plans
that offload nothing where no probe can run, plans under ``cost_model="unit"`` (its costs
are not times, so measured times cannot correct them: measured and logged only), graphs
whose inputs are tensor subclasses (no fake copies to re-compile from), and CPU graphs
without an emulated link (:func:`has_link`: a RAM-to-RAM memcpy on a loaded machine is slow
for reasons no plan can fix; measured and logged only, and never probed).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxckpt import _link
from fxckpt import _torch_compat as compat
from fxckpt.options import Options
from fxckpt.planning import adapt as rules
from fxckpt.planning.adapt import Policy, StepSample, Verdict, judge
from fxckpt.runtime import copy_meter, link_probe, stats
from fxckpt.runtime.engine import read_timings

log = logging.getLogger(__name__)


class AdaptWarning(UserWarning):
    """``adapt="measure"``: a graph's measured copies contradict its plan (a re-plan would
    have been made under ``adapt="auto"``)."""


@dataclass
class Recipe:
    """What re-running the backend's compile of one dynamo graph takes."""

    gm: fx.GraphModule
    fake_mode: Any
    inputs: list[Any]
    options: Options
    mode: str | None
    device: str  # "cpu", "cuda", ...: where the graph's tensors live
    # Under a step budget, the ticket the graph was first compiled under: a re-plan keeps
    # the share of the step's budget the graph holds (planning.step_budget.keeping_share).
    ticket: Any = None

    @property
    def has_link(self) -> bool:
        return has_link(self.device)

    @classmethod
    def capture(cls, gm: fx.GraphModule, example_inputs: Sequence[Any], options: Options,
                mode: str | None) -> Recipe | None:
        """Called in the backend, before its compile; None where no re-plan is possible."""
        if options.adapt != "auto" or options.cost_model == "unit":
            return None
        got = compat.fake_inputs(list(example_inputs))
        if got is None:
            log.debug("fxckpt: a graph with tensor-subclass inputs is measured, not re-planned")
            return None
        from fxckpt.planning import step_budget

        return cls(gm, got[0], got[1], options, mode, graph_device(got[1]).type,
                   step_budget.current())

    def compile(self, measured: dict[str, float], name: str) -> tuple[Any, int]:
        """The graph compiled anew with ``measured`` figures, and how many shape guards that
        compile added."""
        from fxckpt.backend import FxckptPartitioner, compile_partitioned
        from fxckpt.planning import step_budget

        before = compat.shape_guard_count(self.fake_mode)
        with compat.recompiling(self.fake_mode), step_budget.keeping_share(self.ticket, name):
            compiled = compile_partitioned(
                self.gm, self.inputs, FxckptPartitioner(self.options, measured, name), self.mode
            )
        return compiled, compat.shape_guard_count(self.fake_mode) - before


def graph_device(inputs: Sequence[Any]) -> torch.device:
    """Where a graph's tensors live: its first input off the CPU, else the CPU."""
    devices = [x.device for x in inputs if isinstance(x, torch.Tensor)]
    return next((d for d in devices if d.type not in ("cpu", "meta")), torch.device("cpu"))


def has_link(device: torch.device | str) -> bool:
    """Whether a graph's copies cross a host link: a GPU's, or one emulated on the CPU. A CPU
    memcpy without emulation shares the cores compute runs on; how long it takes says nothing
    about a link, and nothing a plan could fix."""
    return torch.device(device).type != "cpu" or _link.current() is not None


@dataclass(frozen=True)
class _Facts:
    name: str
    assumed_bandwidth: float | None
    offloads: int
    recomputes: int
    recomputed_bytes: int


def _facts(payload: str, name: str) -> _Facts:
    try:
        plan = json.loads(payload)
    except ValueError:
        plan = {}
    kinds = [a.get("decision") for a in plan.get("activations", [])]
    bandwidth = (plan.get("assumptions") or {}).get("bandwidth_bytes_per_s", {}).get("value")
    recomputed = plan.get("recomputed_bytes")
    return _Facts(name, float(bandwidth) if bandwidth else None, kinds.count("offload"),
                  kinds.count("recompute"), recomputed if isinstance(recomputed, int) else 0)


class Adaptive:
    """One compiled graph, measured, and re-planned when its measurements say so."""

    def __init__(self, compiled: Any, recipe: Recipe | None, options: Options,
                 policy: Policy | None = None, device: torch.device | None = None) -> None:
        self._fn = compiled
        self._recipe = recipe
        self.mode = options.adapt
        self.policy = policy or rules.DEFAULT_POLICY  # read at compile time (tests set it)
        self.meter = copy_meter.CopyMeter()
        self.replans = 0
        self.verdicts: list[Verdict] = []  # every window judged, oldest first
        self._samples: list[StepSample] = []
        self._mark: tuple[float, copy_meter.CopyTotals] | None = None
        self._facts: _Facts | None = None
        self._base: str | None = None  # the first plan's name; re-plans are named after it
        self._judging = mode_judges(options)
        self._warned = False
        self._lock = threading.Lock()
        self.device = device or torch.device("cpu")
        self.probes = 0  # link probes run for this graph: at most one
        self._probed: float | None = None  # the probe's bandwidth, kept across re-plans

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._judging and self._lock.acquire(blocking=False):
            try:
                self._step()
            finally:
                self._lock.release()
        with copy_meter.running(self.meter):
            return self._fn(*args, **kwargs)

    @property
    def plan_name(self) -> str | None:
        """The name of the plan the next call runs (None before its first forward)."""
        return self.meter.name

    def _step(self) -> None:
        read_timings()  # CUDA: the copy and stall times whose events completed
        now, totals = time.perf_counter(), self.meter.read()
        if self._mark is not None:
            then, before = self._mark
            d = totals.minus(before)
            self._samples.append(StepSample(now - then, d.stall_seconds, d.copy_seconds,
                                            d.copied_bytes))
        self._mark = (now, totals)
        facts = self._plan_facts()
        if facts is None:
            return
        if facts.assumed_bandwidth is None or (facts.offloads == 0 and not (
                facts.recomputes and self._may_probe())):
            self._judging = False  # nothing is copied, and no probe could say more
            return
        verdict = judge(self._samples, facts.assumed_bandwidth, recomputes=facts.recomputes > 0,
                        probed_bandwidth=self._probed, policy=self.policy)
        if verdict is None:
            return
        if verdict.wants_probe and self._may_probe():
            self._probe(facts)
            verdict = judge(self._samples, facts.assumed_bandwidth,
                            recomputes=facts.recomputes > 0, probed_bandwidth=self._probed,
                            policy=self.policy)
            assert verdict is not None
        self.verdicts.append(verdict)
        # The next window starts after this one: the warm-up is not repeated.
        self._samples = self._samples[: self.policy.warmup_steps]
        if not verdict.replan:
            log.debug("fxckpt[%s] %s", facts.name, verdict.describe())
            if facts.offloads == 0 and self.probes:
                self._judging = False  # probed, and the link is as slow as assumed
            return
        if self.mode == "auto" and self._recipe is not None and self._recipe.has_link:
            self._replan(facts, verdict)
        else:
            self._warn(facts, verdict)

    def _may_probe(self) -> bool:
        """Whether a link probe may run for this graph: one per graph, where it could change
        something (a re-plan under ``"auto"``, a warning under ``"measure"``), on a link."""
        if self.probes or self.mode == "never" or not has_link(self.device):
            return False
        return self.mode == "measure" or self._recipe is not None

    def _probe(self, facts: _Facts) -> None:
        assert facts.assumed_bandwidth is not None
        self.probes += 1
        nbytes = rules.probe_bytes(facts.recomputed_bytes, facts.assumed_bandwidth)
        try:
            got = link_probe.probe(self.device, nbytes)
        except Exception as err:  # a failed probe must not end the training run
            log.warning("fxckpt[%s] link probe failed: %r", facts.name, err)
            return
        self._probed = None if got is None else got.bandwidth
        stats.record_probe(facts.name, self._probed)
        log.info("fxckpt[%s] link probe (the plan's copies are too few to measure the link): "
                 "%s; the plan assumed %.4g MB/s", facts.name,
                 "no link" if got is None else got.describe(), facts.assumed_bandwidth / 1e6)

    def _plan_facts(self) -> _Facts | None:
        name, payload = self.meter.name, self.meter.payload
        if name is None or payload is None:
            return None
        if self._facts is None or self._facts.name != name:
            self._facts = _facts(payload, name)
            self._base = self._base or name
        return self._facts

    def _replan(self, facts: _Facts, verdict: Verdict) -> None:
        assert self._recipe is not None and verdict.planning_bandwidth is not None
        k = self.replans + 1
        log.info("fxckpt[%s] re-plan %d of at most %d: %s", facts.name, k,
                 self.policy.max_replans, verdict.describe())
        name = f"{self._base}~r{k}"
        try:
            compiled, added = self._recipe.compile(
                {"bandwidth_bytes_per_s": verdict.planning_bandwidth}, name
            )
        except Exception as err:  # a failed re-plan must not end the training run
            log.warning("fxckpt[%s] re-plan failed, the plan stays: %r", facts.name, err)
            self._stop()
            return
        if added:
            log.info("fxckpt[%s] re-plan dropped: its compile added %d shape guards that "
                     "dynamo would not check; the plan stays", facts.name, added)
            self._stop()
            return
        self._fn = compiled
        self.replans = k
        stats.add("replans", 1)
        self.meter = copy_meter.CopyMeter()
        self._samples, self._mark, self._facts = [], None, None
        if k >= self.policy.max_replans:
            log.info("fxckpt[%s] reached the re-plan bound (%d): the plan stays", name, k)
            self._stop()

    def _warn(self, facts: _Facts, verdict: Verdict) -> None:
        log.info("fxckpt[%s] would re-plan (adapt=%r): %s", facts.name, self.mode,
                 verdict.describe())
        if self.mode == "measure" and not self._warned:
            self._warned = True
            warnings.warn(
                f"fxckpt[{facts.name}]: {verdict.describe()}. adapt='auto' would re-plan this "
                "graph with the measured figures; pass bandwidth= with the link's real rate "
                "to plan for it. (Warned once per graph.)",
                AdaptWarning,
                stacklevel=3,
            )

    def _stop(self) -> None:
        """No more re-plans: the meter keeps measuring, the recipe goes."""
        self._recipe = None
        self._judging = self.mode == "measure"


def mode_judges(options: Options) -> bool:
    """Whether samples are judged at all: not under ``adapt="never"``."""
    return options.adapt != "never"
