"""Compare a compiled training step with eager: loss, input gradients, every parameter gradient."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


def step(model: nn.Module, inputs: Any, runner: Callable[..., torch.Tensor]) -> tuple[Any, ...]:
    model.zero_grad(set_to_none=True)
    args = inputs if isinstance(inputs, tuple) else ()
    kwargs = inputs if isinstance(inputs, dict) else {}
    out = runner(*args, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    input_grads = [a.grad.detach().clone() for a in args if isinstance(a, torch.Tensor) and a.grad is not None]
    return loss.detach(), grads, input_grads


def assert_step_matches(
    model: nn.Module,
    inputs: Any,
    backend: Any,
    *,
    reference_backend: Any = None,
    seed: int = 0,
    steps: int = 1,
    **tol: Any,
) -> Any:
    """Train ``steps`` steps compiled with ``backend`` and with the reference, and compare.

    Returns the compiled model, warm, for measuring further steps."""
    ref_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    reference = ref_model if reference_backend is None else torch.compile(ref_model, backend=reference_backend)
    for i in range(steps):
        ins = _fresh_inputs(inputs)
        ref_ins = _fresh_inputs(inputs)
        torch.manual_seed(seed + i)
        got = step(model, ins, compiled)
        torch.manual_seed(seed + i)
        want = step(ref_model, ref_ins, reference)
        torch.testing.assert_close(got[0], want[0], **tol)
        assert got[1].keys() == want[1].keys()
        assert len(got[1]) > 0
        for name in want[1]:
            torch.testing.assert_close(got[1][name], want[1][name], msg=lambda m, n=name: f"{n}: {m}", **tol)
        assert len(got[2]) == len(want[2])
        for a, b in zip(got[2], want[2], strict=True):
            torch.testing.assert_close(a, b, **tol)
    return compiled


def _fresh_inputs(inputs: Any) -> Any:
    def clone(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            c = t.detach().clone()
            return c.requires_grad_(t.requires_grad)
        return t

    if isinstance(inputs, dict):
        return {k: clone(v) for k, v in inputs.items()}
    return tuple(clone(t) for t in inputs)
