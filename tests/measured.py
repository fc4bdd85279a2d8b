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


def _step_accounts_measuring() -> bool:
    """Whether a step account (fxckpt.planning.step_budget) measures a step of its own now, or
    will at the next step: it reads the same profiler the CPU meter does, so a measurement
    around that step would read nothing (or be refused). Only a budget in bytes measures."""
    from fxckpt.planning import step_budget

    gc.collect()  # the accounts of compiled models gone with earlier tests go with them

    def pending(s: Any) -> bool:
        in_bytes = s.options.memory_budget is not None and not isinstance(s.options.memory_budget, float)
        return getattr(s, "measuring", None) is not None or (in_bytes and not getattr(s, "calibrated", True))

    return any(pending(s) for s in list(step_budget._steps.values()))


def measure_absolute_step(compiled: Any, model: Any, inputs: Any, *, warm: int = 2
                          ) -> fxckpt.Measurement:
    """One whole training step of ``compiled`` (the compiled ``model``) as ``memory_budget``
    counts it, after ``warm`` warm-up steps: every gradient is dropped first, so the
    ``absolute_peak_bytes`` is what the device held when the step began (the parameters,
    buffers and ``inputs``) plus the most the step allocated over its forward and backward.

    The step account measures one quiet step of its own after the compile (its calibration,
    with the profiler the CPU meter reads): more warm-up steps run until it has (at most four),
    and a step that allocated nothing is refused here."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        _loss(_call(compiled, inputs)).backward()

    for _ in range(warm):
        step()
    for _ in range(4):
        if not _step_accounts_measuring():
            break
        step()
    model.zero_grad(set_to_none=True)
    gc.collect()
    m = fxckpt.measure(lambda: _loss(_call(compiled, inputs)).backward(), holding=(model, inputs))
    assert m.peak_bytes > 0, f"the meter saw no allocation in a whole training step: {m}"
    return m
