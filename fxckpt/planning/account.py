"""The step's account: what the device holds at every moment of one training step.

``memory_budget`` bounds the step's absolute device peak: what the device held when the step
started (parameters, optimizer state, inputs, anything else kept there), plus the most the
step allocates over the forward and backward of every graph one ``torch.compile`` runs, each
run of a graph counted. This module adds that up from plain numbers, one
:class:`GraphFigures` per run, in the order the runs happened:

- while run ``j``'s forward runs, the device holds the start level, what the runs before it
  hold for their backwards, the inputs ``j`` takes from them, and ``j``'s own live bytes;
- autograd runs the backwards in the reverse order, so while run ``j``'s backward runs the
  device holds the start level, what the runs before ``j`` still hold, the inputs ``j`` saved,
  the parameter gradients the runs after ``j`` already produced, and ``j``'s own live bytes.

The peak of those is the step's predicted peak (:func:`compose`). :func:`targets` turns it
around: the most a graph's own forward and backward may hold for the step to fit a budget,
given what the rest of the step holds around each of its runs. Pure numbers, no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

# Bytes every target keeps free below the budget: what a step allocates that no graph's
# liveness sees (a few bytes of the loss's seed gradient and of generator state on the CPU).
HEADROOM = 4096


@dataclass(frozen=True)
class GraphFigures:
    """One graph's part of the step, in bytes, what existed before the step left out.

    ``forward_peak`` / ``backward_peak``: the most its forward / backward has live at once
    (its saved tensors, temporaries, restored and rebuilt tensors, gradients, streamed weights'
    copies). ``held``: what its forward leaves on the device for its backward. ``gradients``:
    the parameter gradients its backward leaves behind (``.grad`` tensors it creates).
    ``inputs``: the earlier graphs' outputs it takes (live while its forward runs);
    ``saved_inputs``: of those, the bytes it saves for its backward.
    """

    forward_peak: int
    backward_peak: int
    held: int
    gradients: int = 0
    inputs: int = 0
    saved_inputs: int = 0

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)


@dataclass(frozen=True)
class Account:
    """The step's predicted peak and its parts there.

    ``start``: what the device held when the step began. ``held``: what the other runs hold
    for their backwards (and the inputs this run takes or saved). ``gradients``: the parameter
    gradients produced before the peak. ``own``: the live bytes of the run at the peak.
    ``run``: the index of that run (-1 for an empty step); ``phase``: ``"forward"`` or
    ``"backward"``.
    """

    start: int
    held: int
    gradients: int
    own: int
    run: int = -1
    phase: str = "forward"

    @property
    def peak(self) -> int:
        return self.start + self.held + self.gradients + self.own

    @property
    def activations(self) -> int:
        """Everything at the peak besides the start level and the gradients."""
        return self.held + self.own

    def parts(self) -> dict[str, int]:
        return {"start_bytes": self.start, "gradients_bytes": self.gradients,
                "activations_bytes": self.activations, "total_bytes": self.peak}


def compose(start: int, runs: Sequence[GraphFigures], gradients: int = 0) -> Account:
    """The step's peak over its runs, in forward order (see the module's docstring).

    ``gradients``: parameter gradients that no run's backward makes (eager code's: a loss's
    head or an embedding dynamo left out of every graph), counted from the backward's start."""
    best = Account(start, 0, 0, 0)
    held = 0
    before: list[int] = []
    for j, r in enumerate(runs):
        before.append(held)
        here = Account(start, held + r.inputs, 0, r.forward_peak, j, "forward")
        best = here if here.peak > best.peak else best
        held += r.held + r.saved_inputs
    grads = gradients
    for j in range(len(runs) - 1, -1, -1):
        r = runs[j]
        here = Account(start, before[j] + r.saved_inputs, grads, r.backward_peak, j, "backward")
        best = here if here.peak > best.peak else best
        grads += r.gradients
    return best


@dataclass(frozen=True)
class PeakTarget:
    """The most one graph's own forward and backward may have live (bytes, what existed
    before the step left out) for the step to fit its budget; ``held``, where set, the most
    its forward may leave for its backward (a graph that runs several times a step holds that
    once per run).

    A graph that runs several times a step also carries its runs' own rooms, ``runs``: for its
    ``k + 1``-th run, ``(k, forward room, backward room)``; that run fits while ``k`` times what
    each run keeps plus its peak is within the room. ``forward``, ``backward`` and ``held`` are
    then one point that fits them all, the one the planner aims at, and :meth:`over_by` judges
    a plan by the rooms: a plan that keeps less than ``held`` may peak above the point (the
    peak of a backward need not shrink with what its forward keeps). ``cap``: the most it may
    keep for the runs of other graphs after it."""

    forward: int
    backward: int
    held: int | None = None
    runs: tuple[tuple[int, int, int], ...] = ()
    cap: int | None = None

    @property
    def largest(self) -> int:
        return max(self.forward, self.backward)

    def met_by(self, forward_peak: int, backward_peak: int, held: int = 0) -> bool:
        return self.over_by(forward_peak, backward_peak, held) == 0

    def over_by(self, forward_peak: int, backward_peak: int, held: int = 0) -> int:
        """Bytes by which the worst of the figures overruns (0 when all fit)."""
        if self.runs:
            over = max(0, *(k * held + max(forward_peak - f, backward_peak - b)
                            for k, f, b in self.runs))
            return over if self.cap is None else max(over, held - self.cap)
        over = max(0, forward_peak - self.forward, backward_peak - self.backward)
        return over if self.held is None else max(over, held - self.held)

    def raised(self, forward: int, backward: int) -> PeakTarget:
        """Each phase's room (and each run's) that much higher; what it may keep as it was."""
        runs = tuple((k, f + forward, b + backward) for k, f, b in self.runs)
        return PeakTarget(max(1, self.forward + forward), max(1, self.backward + backward),
                          self.held, runs, self.cap)

    def lowered(self, by: int) -> PeakTarget:
        held = None if self.held is None else max(0, self.held - by)
        cap = None if self.cap is None else max(0, self.cap - by)
        runs = tuple((k, f - by, b - by) for k, f, b in self.runs)
        return PeakTarget(max(1, self.forward - by), max(1, self.backward - by), held, runs, cap)


def targets(budget: int, start: int, runs: Sequence[GraphFigures], keys: Sequence[Hashable],
            key: Hashable, own: GraphFigures | None = None, gradients: int = 0) -> PeakTarget:
    """The target of graph ``key``: what its own forward and backward may hold for the step
    to fit ``budget``, the rest of the step held at the figures in ``runs`` (``keys`` names
    the graph of each run). A graph not among ``keys`` is taken to run once more, after them.

    A graph that runs ``n`` times holds, while its ``k``-th run is in progress, what its
    ``k - 1`` earlier runs keep for their backwards too, and those shrink with its plan. So its
    target comes from the bytes its forward keeps, ``h``: a plan of the graph holds about ``h``
    plus a working set beside it (``own``'s, else its figures in ``runs``: what its peaks hold
    over what it keeps; 0 when unknown), and ``h`` is the largest for which every run fits:
    ``(k - 1) * h + h + working set <= what the rest of the step leaves``. A later run of
    another graph, after ``m`` of its runs, bounds ``h`` too (``m * h`` beside that run's own
    peak), whatever the number of its runs. Every target keeps :data:`HEADROOM` free."""
    budget -= HEADROOM
    runs = list(runs)
    keys = list(keys)
    mine = [j for j, k in enumerate(keys) if k == key]
    if own is None:
        own = runs[mine[0]] if mine else GraphFigures(0, 0, 0)
    if not mine:
        runs.append(own)
        keys.append(key)
        mine = [len(runs) - 1]
    runs = [own if k == key else r for r, k in zip(runs, keys, strict=True)]
    others, before = 0, []
    for r, k in zip(runs, keys, strict=True):
        before.append(others)
        if k != key:
            others += r.held + r.saved_inputs
    after_grads = [0] * len(runs)
    grads = gradients  # eager code's, from the backward's start (compose)
    for j in range(len(runs) - 1, -1, -1):
        after_grads[j] = grads
        grads += runs[j].gradients
    fw_set = max(0, own.forward_peak - own.held)
    bw_set = max(0, own.backward_peak - own.held)
    rooms = []  # per run of its own: (runs before it, forward room, backward room)
    for n, j in enumerate(mine, start=1):
        extra = (n - 1) * own.saved_inputs  # the inputs its earlier runs saved
        rooms.append((n - 1, budget - start - before[j] - own.inputs - extra,
                      budget - start - before[j] - own.saved_inputs - extra - after_grads[j]))
    # The other graphs' runs after its first run find what its runs keep still held: at the
    # m-th of its runs before them, m * (h + the inputs it saved) beside their own peaks.
    later = None
    for j, (r, k) in enumerate(zip(runs, keys, strict=True)):
        m = sum(1 for i in mine if i < j)
        if k == key or m == 0:
            continue
        fw_room = budget - start - before[j] - r.inputs - r.forward_peak
        bw_room = budget - start - before[j] - r.saved_inputs - after_grads[j] - r.backward_peak
        here = min(fw_room, bw_room) // m - own.saved_inputs
        later = here if later is None else min(later, here)
    if len(mine) == 1:  # one run: the two phases need not share a figure for what it keeps
        _, fw_room, bw_room = rooms[0]
        return PeakTarget(max(1, fw_room), max(1, bw_room), None if later is None else max(0, later))
    held = min(min(f - fw_set, b - bw_set) // (k + 1) for k, f, b in rooms)
    held = max(0, held if later is None else min(held, later))
    # Keeping ``held`` a run, each phase may have what its tightest run leaves it: at least
    # ``held`` and the working set beside it, more where its peak is not where it keeps most.
    forward = min(f - k * held for k, f, _ in rooms)
    backward = min(b - k * held for k, _, b in rooms)
    return PeakTarget(max(1, forward), max(1, backward), held, tuple(rooms),
                      None if later is None else max(0, later))
