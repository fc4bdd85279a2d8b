"""The first training step's measured held bytes, against its plan (fxckpt.residency).

A stand-in for a compiled graph (an autograd Function that saves what a compiler might:
the tensors its plan keeps, and a copy the plan never saw) shows that the check measures
what autograd really saved, leaves the graph's inputs out, warns once with the figures where
a budget the plan met is broken, and stands aside where it would hide tensors from the
caller's own saved-tensor hooks.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch

import fxckpt
from fxckpt import residency
from fxckpt.runtime.stats import BudgetOverrunWarning

KEPT = 1024  # float32 elements the plan keeps: 4096 B
EXTRA = 2048  # float32 elements of the copy the plan does not count: 8192 B


def _payload(budget: int) -> str:
    """A plan under a budget that counts its forward leaving ``KEPT`` floats for the backward
    (its ``held_bytes``: what the step's budget was planned with)."""
    plan = {"name": "g#0", "budget_bytes": budget, "resident_peak_bytes": KEPT * 4,
            "held_bytes": KEPT * 4, "target": {"forward_bytes": budget, "backward_bytes": budget},
            "options": {"memory_budget": budget}}  # fmt: skip
    return json.dumps(plan)


class _Graph(torch.autograd.Function):
    """Saves ``w`` (an input), the activation its plan keeps, and maybe an unplanned copy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, payload: str, extra: bool) -> torch.Tensor:
        kept = x.repeat(2) * 2
        saved = [w, kept]
        if extra:
            saved.append(torch.zeros(EXTRA))
        torch.ops.fxckpt.note_saved([kept], payload)
        ctx.save_for_backward(*saved)
        return (kept.sum() * w.sum()).reshape(())

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        w, kept = ctx.saved_tensors[:2]
        return g * 4 * w.sum() * torch.ones(KEPT // 2), g * kept.sum() * torch.ones_like(w), None, None


def _compiled(payload: str, extra: bool) -> Any:
    def graph(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _Graph.apply(x, w, payload, extra)

    return residency.checked(graph)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(KEPT // 2, requires_grad=True), torch.randn(4096, requires_grad=True)


def test_an_unplanned_saved_tensor_over_the_budget_warns_once_with_the_figures() -> None:
    run = _compiled(_payload(budget=KEPT * 4 + 100), extra=True)
    with pytest.warns(BudgetOverrunWarning) as caught:
        run(*_inputs()).backward()
    (w,) = [c for c in caught if issubclass(c.category, BudgetOverrunWarning)]
    message = str(w.message)
    # Held: the kept activation and the copy; the input w is alive anyway and left out.
    assert f"held {KEPT * 4 + EXTRA * 4} bytes" in message
    assert f"the plan keeps {KEPT * 4} bytes" in message
    assert f"1 saved tensors ({EXTRA * 4} bytes) are not in the plan" in message
    assert f"{EXTRA * 4} B float32 [{EXTRA}]" in message
    assert fxckpt.stats()["graphs"]["g#0"]["held_bytes"] == KEPT * 4 + EXTRA * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetOverrunWarning)
        run(*_inputs()).backward()  # measured once: later steps go straight through


def test_what_the_plan_counted_is_measured_and_not_warned() -> None:
    run = _compiled(_payload(budget=KEPT * 4), extra=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetOverrunWarning)
        run(*_inputs()).backward()
    assert fxckpt.stats()["graphs"]["g#0"]["held_bytes"] == KEPT * 4


def test_under_no_grad_the_check_waits_for_a_training_call() -> None:
    run = _compiled(_payload(budget=KEPT * 4 + 100), extra=True)
    with torch.no_grad():
        run(*_inputs())
    with pytest.warns(BudgetOverrunWarning):
        run(*_inputs()).backward()


def test_the_callers_own_saved_tensor_hooks_see_every_tensor() -> None:
    run = _compiled(_payload(budget=KEPT * 4 + 100), extra=True)
    packed: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.shape)
        return t

    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetOverrunWarning)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(*_inputs()).backward()
    assert torch.Size([EXTRA]) in packed and len(packed) == 3
    assert fxckpt.stats()["graphs"].get("g#0", {}).get("held_bytes") is None
    with pytest.warns(BudgetOverrunWarning):
        run(*_inputs()).backward()  # the next call without hooks is the measured one
