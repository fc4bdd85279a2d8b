"""When run-time measurements say a plan's assumptions were wrong: the re-planning trigger.

Pure: it reads per-step samples (plain numbers the copy meter recorded) and the figures a plan
assumed, and says whether to re-plan and with which bandwidth. :mod:`fxckpt.adapt` collects
the samples and carries the verdict out.

The rule, after ``warmup_steps`` steps of a plan (its first call measures what it holds, and
pools and caches fill), over the next ``window_steps``:

- **stall**: the median exposed stall per step is over ``stall_fraction`` of the median step
  time *and* over ``stall_floor_s``. A step's stall counts against the link only up to its
  copies' own time: while compute waits on the link, one of its queues is busy, so a stall
  longer than the copies is a thread that missed its turn (a loaded machine), not a link. The plan then hides less than it thinks. It is re-planned
  with the measured bandwidth where that differs from the assumed one by more than
  ``bandwidth_factor``; where it does not (the link is as assumed, the compute window shorter),
  with the bandwidth compute saw: bytes over copy plus stall seconds.
- **faster link**: the measured bandwidth is over ``bandwidth_factor`` times the assumed one,
  the plan recomputes something (offloading could replace it) and its copies take over
  ``copy_floor_s`` per step, so that the figure measures a link rather than a few small
  memcpys. It is re-planned with the measured bandwidth.
- **faster link, probed**: the plan recomputes something but its copies are too few to
  measure the link (it offloads nothing, or under ``copy_floor_s`` per step). The verdict
  then asks for a probe (:attr:`Verdict.wants_probe`): one timed round trip of a buffer
  through the link, between steps (:mod:`fxckpt.runtime.link_probe`), sized by
  :func:`probe_bytes`. Judged again with the probe's figure (``probed_bandwidth``), a link
  over ``bandwidth_factor`` times the assumed one is re-planned with the probed bandwidth.
  The caller runs at most one probe per graph; this module only reads its figure.

A link slower than assumed whose copies still hide is left alone: a re-plan would offload less
and recompute more, for nothing. The floors are there because a default is not a user's
constraint: on a loaded machine a thread that waits for a small copy can miss its turn for
a few milliseconds, and that is not a link to plan around.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# The most re-plans of one graph: each costs a compile, and two are enough to correct a figure
# and then the window it left (docs/options.md, ``adapt``).
MAX_REPLANS = 2

# A link probe's buffer: at most this many bytes, and at most this long each way at the
# bandwidth the plan assumed (a probe runs between two steps, once: it must cost far less
# than one), and at least enough bytes that a copy's fixed overhead does not dominate.
PROBE_MAX_BYTES = 4 << 20
PROBE_MIN_BYTES = 64 << 10
PROBE_MAX_SECONDS = 0.1


@dataclass(frozen=True)
class Policy:
    """The trigger's thresholds (module docstring)."""

    warmup_steps: int = 2
    window_steps: int = 5
    stall_fraction: float = 0.02
    bandwidth_factor: float = 1.5
    stall_floor_s: float = 0.005
    copy_floor_s: float = 0.005
    max_replans: int = MAX_REPLANS


DEFAULT_POLICY = Policy()


@dataclass(frozen=True)
class StepSample:
    """One step of one graph: from the start of its forward to the start of the next."""

    step_seconds: float
    stall_seconds: float
    copy_seconds: float
    copied_bytes: int


@dataclass(frozen=True)
class Verdict:
    """What the window showed, and whether (and with which bandwidth) to re-plan."""

    replan: bool
    reason: str
    step_seconds: float  # medians over the window
    stall_seconds: float
    copy_seconds: float
    measured_bandwidth: float | None  # bytes / copy seconds over the window
    assumed_bandwidth: float
    planning_bandwidth: float | None = None  # what a re-plan assumes
    probed_bandwidth: float | None = None  # a link probe's figure, where one was judged
    # The plan's copies were too few to measure the link, and a probe could show offload
    # replacing recompute: judge again with one (``probed_bandwidth=``).
    wants_probe: bool = False

    def describe(self) -> str:
        measured = ("no copies" if self.measured_bandwidth is None
                    else f"{self.measured_bandwidth / 1e6:.4g} MB/s")
        text = (f"{self.reason}: exposed stall {self.stall_seconds * 1e3:.3g} ms per step of "
                f"{self.step_seconds * 1e3:.4g} ms ({_share(self)}), copies "
                f"{self.copy_seconds * 1e3:.3g} ms per step at {measured}, assumed "
                f"{self.assumed_bandwidth / 1e6:.4g} MB/s")
        if self.probed_bandwidth is not None:
            text += f", probed {self.probed_bandwidth / 1e6:.4g} MB/s"
        if self.planning_bandwidth is not None:
            text += f"; re-planning with {self.planning_bandwidth / 1e6:.4g} MB/s"
        return text


def _share(v: Verdict) -> str:
    return f"{100 * v.stall_seconds / v.step_seconds:.2g} %" if v.step_seconds > 0 else "-"


def probe_bytes(recomputed_bytes: int, assumed_bandwidth: float) -> int:
    """How many bytes a link probe moves each way: what the plan recomputes (what offload
    could replace), capped at :data:`PROBE_MAX_BYTES` and at :data:`PROBE_MAX_SECONDS` of
    copy at the assumed bandwidth, and at least :data:`PROBE_MIN_BYTES` (a smaller copy
    measures its overhead, not the link)."""
    cap = min(PROBE_MAX_BYTES, int(assumed_bandwidth * PROBE_MAX_SECONDS))
    return max(PROBE_MIN_BYTES, min(int(recomputed_bytes), cap))


def judge(samples: Sequence[StepSample], assumed_bandwidth: float, *, recomputes: bool,
          probed_bandwidth: float | None = None, policy: Policy = DEFAULT_POLICY
          ) -> Verdict | None:
    """The verdict on a plan's samples (first step first), or None while the warm-up and the
    window are not complete. ``recomputes``: the plan recomputes something.
    ``probed_bandwidth``: what a link probe measured (bytes/s), where one ran."""
    if len(samples) < policy.warmup_steps + policy.window_steps:
        return None
    window = samples[policy.warmup_steps:policy.warmup_steps + policy.window_steps]
    step = statistics.median(s.step_seconds for s in window)
    exposed = [min(s.stall_seconds, s.copy_seconds) for s in window]
    stall = statistics.median(exposed)
    copy = statistics.median(s.copy_seconds for s in window)
    moved = sum(s.copied_bytes for s in window)
    busy = sum(s.copy_seconds for s in window)
    measured = moved / busy if busy > 0 and moved > 0 else None

    def verdict(replan: bool, reason: str, bandwidth: float | None = None, *,
                wants_probe: bool = False) -> Verdict:
        return Verdict(replan, reason, step, stall, copy, measured, assumed_bandwidth, bandwidth,
                       probed_bandwidth, wants_probe)

    factor = policy.bandwidth_factor
    if stall > max(policy.stall_fraction * step, policy.stall_floor_s):
        off = measured is not None and not (assumed_bandwidth / factor <= measured
                                            <= assumed_bandwidth * factor)
        if off:
            return verdict(True, "copies stall compute: the link is not as assumed", measured)
        seen = moved / (busy + sum(exposed)) if moved else None
        if seen is None:
            return verdict(False, "stalls without bytes copied")
        return verdict(True, "copies stall compute: the plan's copy windows are too short",
                       min(seen, assumed_bandwidth))
    linked = measured is not None and copy > policy.copy_floor_s  # its copies measure the link
    if linked and measured is not None and measured > factor * assumed_bandwidth and recomputes:
        return verdict(True, "the link is faster than assumed: offload could replace recompute",
                       measured)
    if not linked and recomputes:
        if probed_bandwidth is None:
            return verdict(False, "the plan's copies are too few to measure the link",
                           wants_probe=True)
        if probed_bandwidth > factor * assumed_bandwidth:
            return verdict(True, "a link probe found the link faster than assumed: offload "
                           "could replace recompute", probed_bandwidth)
    return verdict(False, "the plan's assumptions hold")
