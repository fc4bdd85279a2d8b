"""Measure what a compiled model's forward leaves on the device, with fxckpt's meter.

The meter reads the allocator, never a plan, so these figures can disagree with the plan:
that is what they are for.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

import fxckpt


def _call(compiled: Any, inputs: Any) -> Any:
    return compiled(**inputs) if isinstance(inputs, dict) else compiled(*inputs)


def _loss(out: Any) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out


def measure_forward(compiled: Any, inputs: Any, *, warm: bool = True) -> fxckpt.Measurement:
    """One forward of ``compiled`` measured (after a warm-up step unless ``warm=False``), then
    its backward, so nothing it saved outlives the call."""
    if warm:
        _loss(_call(compiled, inputs)).backward()
    gc.collect()  # no earlier test's garbage is collected inside the call (its finalizers run there)
    m = fxckpt.measure(lambda: _call(compiled, inputs))
    _loss(m.output).backward()
    return m


def measure_step(compiled: Any, inputs: Any, *, warm: bool = True) -> fxckpt.Measurement:
    """One whole training step (forward and backward) of ``compiled``, measured after a
    warm-up step unless ``warm=False``: its ``peak_bytes`` is the step's peak."""
    if warm:
        _loss(_call(compiled, inputs)).backward()
    gc.collect()
    return fxckpt.measure(lambda: _loss(_call(compiled, inputs)).backward())


def measure_absolute_step(compiled: Any, model: Any, inputs: Any, *, warm: int = 2
                          ) -> fxckpt.Measurement:
    """One whole training step of ``compiled`` (the compiled ``model``) as ``memory_budget``
    counts it, after ``warm`` warm-up steps: every gradient (the model's, and those of inputs
    that require one) is dropped first, so the ``absolute_peak_bytes`` is what the device held
    when the step began (the parameters, buffers and ``inputs``) plus the most the step
    allocated over its forward and backward.

    A step in which the meter saw no allocation at all is refused (a profiler session
    cancelled under it)."""

    leaves = [t for t in (inputs.values() if isinstance(inputs, dict) else inputs)
              if isinstance(t, torch.Tensor) and t.requires_grad]  # fmt: skip

    def drop_gradients() -> None:
        model.zero_grad(set_to_none=True)
        for t in leaves:
            t.grad = None

    def step() -> None:
        drop_gradients()
        _loss(_call(compiled, inputs)).backward()

    for _ in range(warm):
        step()
    drop_gradients()
    gc.collect()
    m = fxckpt.measure(lambda: _loss(_call(compiled, inputs)).backward(), holding=(model, inputs))
    assert m.peak_bytes > 0, f"the meter saw no allocation in a whole training step: {m}"
    return m
