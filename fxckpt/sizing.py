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

from collections.abc import Sequence
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
        return None if self.device_memory_bytes is None else self.device_memory_bytes - self.total_bytes

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
        """"fits on 79 GiB, 12 GiB to spare" or "does not fit on 23.5 GiB, by 3 GiB"."""
        room = self.room
        if room is None or self.device_memory_bytes is None:
            return "no --device-memory given"
        card = format_bytes(self.device_memory_bytes)
        if room >= 0:
            return f"fits on {card}, {format_bytes(room)} to spare"
        return f"does not fit on {card}, by {format_bytes(-room)}"

    def parts(self) -> str:
        """The peak and its parts, in one line."""
        optimizer = (f"optimizer state {format_bytes(self.optimizer_bytes)} ({self.optimizer})"
                     if self.optimizer != "none" else "optimizer state not counted (--optimizer)")
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


def step_fit(plans: Sequence[Plan], *, optimizer: str = "none",
             device_memory_bytes: int | None = None) -> StepFit | None:
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
