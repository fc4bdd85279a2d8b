"""Will the step fit on a card? The card's capacity, the optimizer's state, and the verdict.

``fxckpt inspect --device-memory 80GiB --optimizer adamw`` plans one training step offline
and says whether its predicted step peak fits the card, with its parts: the parameters (and
buffers), their gradients, the optimizer's state, the activations at the peak, streamed
weights on the device, and the rest of what the step is given (the batch).

The optimizer's state is what torch's optimizer allocates at its first ``step()``, made here
as meta tensors on the meta model's trainable parameters: AdamW two moments per parameter in
the parameter's dtype, SGD with momentum one buffer (their ``step`` counters live in host
memory). Mixed precision that keeps float32 master weights and float32 moments beside
bfloat16 parameters holds 12 bytes a parameter more than bfloat16 AdamW's 4: plan it with
``--dtype float32`` (torch's autocast trains float32 parameters) for that figure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxckpt.errors import OptionsError
from fxckpt.planning.plan import Plan
from fxckpt.units import format_bytes, parse_bytes

GiB = 2**30

# Named cards: the total memory CUDA reports for each (torch.cuda.get_device_properties(0)
# .total_memory), rounded down to the GiB below, or half of one.
CARDS: dict[str, int] = {
    "h100-80gb": 79 * GiB,
    "h100": 79 * GiB,
    "h200": 139 * GiB,
    "a100-80gb": 79 * GiB,
    "a100-40gb": 39 * GiB,
    "l40s": 44 * GiB,
    "rtx4090": 23 * GiB + GiB // 2,
    "rtx3090": 23 * GiB + GiB // 2,
}

OPTIMIZERS = ("none", "adamw", "sgd")


def device_memory(text: str, option: str = "--device-memory") -> int:
    """A size ("80GiB", bytes) or a named card (:data:`CARDS`), in bytes."""
    card = CARDS.get(text.strip().lower())
    if card is not None:
        return card
    try:
        value = parse_bytes(text, option)
    except OptionsError:
        raise OptionsError(option, text, 'a size such as "80GiB", or a card: '
                           + ", ".join(CARDS)) from None  # fmt: skip
    if not value:
        raise OptionsError(option, text, 'a positive size such as "80GiB"', "zero bytes")
    return value


def optimizer_state(model: nn.Module, kind: str) -> torch.optim.Optimizer | None:
    """A torch optimizer over ``model``'s trainable parameters whose state is already what its
    first ``step()`` allocates (on the parameters' device: the meta device offline)."""
    if kind not in OPTIMIZERS:
        raise OptionsError("--optimizer", kind, " or ".join(OPTIMIZERS))
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "none" or not params:
        return None
    host_step = torch.zeros((), dtype=torch.float32, device="cpu")
    opt: torch.optim.Optimizer
    if kind == "adamw":
        opt = torch.optim.AdamW(params)
        for p in params:
            opt.state[p] = {"step": host_step.clone(), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}  # fmt: skip
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        for p in params:
            opt.state[p] = {"momentum_buffer": torch.zeros_like(p)}
    return opt


def state_bytes(opt: torch.optim.Optimizer | None) -> int:
    """Device bytes of an optimizer's state (host-side step counters left out)."""
    if opt is None:
        return 0
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.device.type != "cpu")  # fmt: skip


def parameter_bytes(model: nn.Module) -> int:
    """Device bytes of a module's parameters and buffers (streamed weights, in host memory,
    left out), each tensor once."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != "cpu":
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


@dataclass(frozen=True)
class StepFit:
    """The step's predicted peak, its parts, and whether it fits ``device_memory_bytes``."""

    total_bytes: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    weights_bytes: int
    other_bytes: int  # the rest of what the step is given: the batch
    optimizer: str
    device_memory_bytes: int | None

    @property
    def room(self) -> int | None:
        """What the card has left at the step's peak (negative: short by that much)."""
        return (
            None
            if self.device_memory_bytes is None
            else self.device_memory_bytes - self.total_bytes
        )

    @property
    def fits(self) -> bool | None:
        return None if self.room is None else self.room >= 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total_bytes, "parameters_bytes": self.parameters_bytes,
            "gradients_bytes": self.gradients_bytes, "optimizer_bytes": self.optimizer_bytes,
            "activations_bytes": self.activations_bytes, "weights_bytes": self.weights_bytes,
            "other_bytes": self.other_bytes, "optimizer": self.optimizer,
            "device_memory_bytes": self.device_memory_bytes, "fits": self.fits,
        }  # fmt: skip

    def verdict(self) -> str:
        """ "fits on 79 GiB, 12 GiB to spare" or "does not fit on 23.5 GiB, by 3 GiB"."""
        room = self.room
        if room is None or self.device_memory_bytes is None:
            return "no --device-memory given"
        card = format_bytes(self.device_memory_bytes)
        if room >= 0:
            return f"fits on {card}, {format_bytes(room)} to spare"
        return f"does not fit on {card}, by {format_bytes(-room)}"

    def parts(self) -> str:
        """The peak and its parts, in one line."""
        optimizer = (
            f"optimizer state {format_bytes(self.optimizer_bytes)} ({self.optimizer})"
            if self.optimizer != "none"
            else "optimizer state not counted (--optimizer)"
        )
        text = (f"{format_bytes(self.total_bytes)}: parameters {format_bytes(self.parameters_bytes)}, "
                f"gradients {format_bytes(self.gradients_bytes)}, {optimizer}, activations "
                f"{format_bytes(self.activations_bytes)}")  # fmt: skip
        if self.weights_bytes:
            text += f", weights in flight {format_bytes(self.weights_bytes)}"
        if self.other_bytes:
            text += f", batch and the rest {format_bytes(self.other_bytes)}"
        return text


def top_step(plans: Sequence[Plan]) -> dict[str, int] | None:
    """The ``step`` account of the plan with which the step peaks highest (``None`` without a
    budget)."""
    steps = [p.step for p in plans if p.step]
    return max(steps, key=lambda st: st["total_bytes"]) if steps else None


def step_fit(
    plans: Sequence[Plan], *, optimizer: str = "none", device_memory_bytes: int | None = None
) -> StepFit | None:
    """The step's figure where its plans peak highest (``None`` without a budget: plans then
    carry no step account). The parameters' and the optimizer's bytes are those
    :func:`fxckpt.inspect.plan_workload` wrote into each plan's ``step``."""
    top = top_step(plans)
    if top is None:
        return None
    start = int(top.get("start_bytes", 0))
    parameters_bytes = int(top.get("parameters_bytes", 0))
    optimizer_bytes = int(top.get("optimizer_bytes", 0))
    return StepFit(
        total_bytes=int(top["total_bytes"]), parameters_bytes=parameters_bytes,
        gradients_bytes=int(top.get("gradients_bytes", 0)), optimizer_bytes=optimizer_bytes,
        activations_bytes=int(top.get("activations_bytes", 0)),
        weights_bytes=int(top.get("weights_bytes", 0)),
        other_bytes=max(0, start - parameters_bytes - optimizer_bytes), optimizer=optimizer,
        device_memory_bytes=device_memory_bytes,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The longest sequence that fits
# --------------------------------------------------------------------------------------------

# The strategies ``--max-seq`` compares, as the JSON names them: plain torch.compile (min-cut
# alone), per-block checkpointing (segment_stride=1, nothing offloaded) and fxckpt's planner.
STRATEGIES = ("none", "full_checkpointing", "fxckpt")
MAX_PROBES = 8  # plans per strategy in the search


@dataclass(frozen=True)
class Probe:
    """One plan of the step at one sequence length: its predicted peak and time."""

    length: int
    total_bytes: int
    start_bytes: int  # what the step starts with (the part that does not grow with the length)
    step_ms: float
    fits: bool


@dataclass(frozen=True)
class LongestFit:
    """A strategy's longest sequence that fits, found by :func:`longest_fit`."""

    name: str
    max_seq: int | None  # None: not even the shortest length searched fits
    predicted_step_ms: float | None
    total_bytes: int | None  # the predicted step peak at max_seq
    capped: bool  # max_seq is the search's ceiling: a longer one may fit
    probes: tuple[Probe, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "max_seq": self.max_seq,
                "predicted_step_ms": self.predicted_step_ms, "total_bytes": self.total_bytes,
                "capped": self.capped, "probed": [p.length for p in self.probes]}  # fmt: skip


def seq_quantum(seq: int) -> int:
    """The search's resolution: the largest power of two at most ``seq / 32`` (at least 1)."""
    q = 1
    while q * 2 <= seq / 32:
        q *= 2
    return q


def _root(points: Sequence[Probe], limit: int, lo: int, hi: int) -> float | None:
    """Where the curve through ``points`` (up to three: a line or a parabola in the length)
    reaches ``limit`` bytes between ``lo`` and ``hi``; None where it does not."""
    xs = [float(p.length) for p in points]
    ys = [float(p.total_bytes) for p in points]

    def at(x: float) -> float:  # Lagrange's form through the points
        total = 0.0
        for i, (xi, yi) in enumerate(zip(xs, ys, strict=True)):
            term = yi
            for j, xj in enumerate(xs):
                if j != i:
                    term *= (x - xj) / (xi - xj)
            total += term
        return total

    a, b = float(lo), float(hi)
    fa, fb = at(a) - limit, at(b) - limit
    if fa > 0 or fb <= 0:
        return None
    for _ in range(60):  # bisection on the fitted curve: cheap, and needs no formula
        m = (a + b) / 2
        if at(m) - limit <= 0:
            a = m
        else:
            b = m
    return a


def longest_fit(
    probe: Callable[[int], Probe],
    *,
    limit: int,
    start: int,
    quantum: int,
    ceiling: int,
    say: Callable[[str], None] = lambda _m: None,
    max_probes: int = MAX_PROBES,
) -> tuple[Probe | None, list[Probe], bool]:
    """The longest multiple of ``quantum`` up to ``ceiling`` whose probe fits ``limit``.

    Returns (the longest probe that fits, every probe, whether the ceiling was reached).
    The predicted peak grows with the length as a line or a parabola (attention's scores are
    quadratic), so each next length is where the curve through the nearest probes reaches the
    limit: from one probe, its growth above the start level; from two, a line; from three, a
    parabola. The search stops when a length that fits and one a ``quantum`` longer that does
    not are known, or after ``max_probes`` plans with the longest that fitted.
    """
    top = max(quantum, ceiling // quantum * quantum)
    seen: dict[int, Probe] = {}

    def snap(x: float) -> int:
        return int(min(top, max(quantum, x // quantum * quantum)))

    length = snap(start)
    while len(seen) < max_probes:
        p = seen[length] = probe(length)
        say(f"{p.length} tokens: {format_bytes(p.total_bytes)}, "
            f"{'fits' if p.fits else 'does not fit'}")  # fmt: skip
        fit = [q for q in seen.values() if q.fits]
        over = [q for q in seen.values() if not q.fits]
        lo = max(fit, key=lambda q: q.length) if fit else None
        hi = min(over, key=lambda q: q.length) if over else None
        if lo is not None and lo.length >= top:
            return lo, list(seen.values()), True
        if hi is not None and hi.length <= quantum:
            return None, list(seen.values()), False
        if lo is not None and hi is not None and hi.length - lo.length <= quantum:
            return lo, list(seen.values()), False
        near = sorted(seen.values(), key=lambda q: abs(q.total_bytes - limit))[:3]
        a = lo.length if lo is not None else quantum
        b = hi.length if hi is not None else top
        guess: float | None
        if len(near) == 1:  # from the start level: what grows, grows with the length
            grows = max(1, p.total_bytes - p.start_bytes)
            guess = p.length * max(0.0, limit - p.start_bytes) / grows
        else:
            guess = _root(near, limit, a, b) if hi is not None else None
            if guess is None:
                guess = _root(near[:2], limit, a, b if hi is not None else 64 * b)
        if lo is not None and hi is None:  # growing: at most 4x, at least one step
            guess = min(guess if guess is not None else 2 * lo.length, 4 * lo.length)
        elif hi is not None and lo is None:
            guess = max(guess if guess is not None else hi.length / 2, hi.length / 4)
        elif guess is None:
            guess = (a + b) / 2
        nxt = snap(guess)
        if lo is not None:
            nxt = max(nxt, lo.length + quantum)
        if hi is not None:
            nxt = min(nxt, hi.length - quantum)
        if nxt in seen:  # the curve keeps pointing at a probed length: halve the bracket
            nxt = snap((a + b) / 2)
            if nxt in seen:
                return lo, list(seen.values()), False
        length = nxt
    fit = [q for q in seen.values() if q.fits]
    return (max(fit, key=lambda q: q.length) if fit else None), list(seen.values()), False
