"""A diffusion transformer with LoRA, its frozen base streamed from host memory under a step
budget that leaves the device room for a quarter of its weight bytes: the use streamed weights
are built for.

diffusers' ``FluxTransformer2DModel`` (tiny config, random weights) with peft's LoRA adapters on
its attention projections. Three training steps match eager's loss and every adapter gradient;
the whole step's absolute device peak, from the allocator (``fxckpt.measure``), is below the
all-resident model's by more than half the weight bytes; the base weights' storage is fxckpt's
host memory; dynamo made one graph.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from test_weights import _fresh  # noqa: F401 (an autouse fixture: a fresh dynamo, stats, engine)

import fxckpt
from fxckpt.runtime import weight_ops

pytest.importorskip("diffusers")
pytest.importorskip("peft")

STEPS = 3


def _flux_with_lora() -> tuple[nn.Module, dict[str, Any], torch.Tensor]:
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32,
        axes_dims_rope=(8, 12, 12),
    )  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                      target_modules=["to_q", "to_k", "to_v", "to_out.0"])  # fmt: skip
    model = inject_adapter_in_model(lora, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    g = torch.Generator().manual_seed(1)
    batch, text, side = 2, 8, 8
    img_ids = torch.zeros(side * side, 3)
    img_ids[:, 1] = torch.arange(side * side) // side
    img_ids[:, 2] = torch.arange(side * side) % side
    inputs = {
        "hidden_states": torch.randn(batch, side * side, 16, generator=g),
        "timestep": torch.tensor([0.01, 0.5]),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text, 3),
        "encoder_hidden_states": torch.randn(batch, text, 64, generator=g),
        "pooled_projections": torch.randn(batch, 32, generator=g),
        "return_dict": False,
    }
    return model.train(), inputs, torch.randn(batch, side * side, 16, generator=g)


def _step(model: nn.Module, run: Any, inputs: dict[str, Any], target: torch.Tensor) -> fxckpt.Measurement:
    """One training step, measured whole (forward and backward) from a state with no gradients."""
    model.zero_grad(set_to_none=True)

    def step() -> torch.Tensor:
        loss = (run(**inputs)[0] - target).square().mean()
        loss.backward()
        return loss.detach()

    return fxckpt.measure(step, holding=(model, inputs, target))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    plain = {n: n.replace("parametrizations.", "").replace(".original", "") for n, _ in model.named_parameters()}
    return {plain[n]: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_flux_dit_with_lora_trains_with_its_base_streamed_keeping_under_a_quarter_of_its_weights() -> None:
    model, inputs, target = _flux_with_lora()
    weight_bytes = sum(p.nbytes for p in model.parameters())
    ref = copy.deepcopy(model)
    resident = [_step(ref, ref, inputs, target) for _ in range(STEPS)]

    # The step's budget: the all-resident step's measured peak less three quarters of the
    # weights' bytes; at most a quarter of them may stay on the device.
    resident_peak = max(m.absolute_peak_bytes for m in resident[1:])
    budget = resident_peak - 3 * weight_bytes // 4
    streamed = fxckpt.stream_weights(model, frozen_only=True)
    assert streamed.nbytes > 0.95 * weight_bytes  # the base: all but the adapters, norms, biases

    graphs: list[torch.fx.GraphModule] = []
    inner = fxckpt.backend(compiler="eager", memory_budget=budget)

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(gm)
        return inner(gm, example_inputs)

    compiled = torch.compile(model, backend=counting)
    got = [_step(model, compiled, inputs, target) for _ in range(STEPS)]

    assert len(graphs) == 1
    for mine, want in zip(got, resident, strict=True):
        torch.testing.assert_close(mine.output, want.output)
    want_grads, grads = _grads(ref), _grads(model)
    assert grads.keys() == want_grads.keys() and len(grads) == 2 * (2 * 4 + 3 * 3)
    # (A and B of to_q, to_k, to_v, to_out.0 in 2 dual-stream blocks; no to_out in 3 single ones)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, msg=lambda m, n=name: f"{n}: {m}")

    # The base weights live in fxckpt's host memory; only their copies come to the device.
    originals = [m.parametrizations[n].original for m in model.modules()
                 if hasattr(m, "parametrizations") for n in m.parametrizations]  # fmt: skip
    assert len(originals) == len(streamed.names) and all(weight_ops.is_host(t) for t in originals)
    assert fxckpt.stats()["weight_d2h_bytes"] == 0 and fxckpt.stats()["weight_h2d_bytes"] > 0
    # Measured, whole step, every byte on the device (the warm steps: the first one compiles).
    peak = max(m.absolute_peak_bytes for m in got[1:])
    assert peak <= budget, (peak, budget)
    assert resident_peak - peak >= weight_bytes / 2, (peak, resident_peak, weight_bytes)
    # What a warm step starts with: the parameters left resident (adapters, norms, biases),
    # the batch, and the base weights' copies the plan keeps across steps, within the budget.
    plan = fxckpt.last_plans()[-1]
    left = sum(p.nbytes for p in model.parameters() if not weight_ops.is_host(p))
    batch = sum(t.nbytes for t in (*inputs.values(), target) if isinstance(t, torch.Tensor))
    assert got[-1].start_bytes == left + batch + plan.resident_weight_bytes
    assert 0 <= plan.resident_weight_bytes < weight_bytes // 4
