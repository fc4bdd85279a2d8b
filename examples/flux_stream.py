"""A Flux-12B-shaped diffusion transformer with LoRA, for ``fxckpt inspect`` with streamed
weights: diffusers' ``FluxTransformer2DModel`` at its published size (19 dual-stream and 38
single-stream blocks, width 3072), bfloat16, one 1024x1024 image (4096 latent tokens) and 512
text tokens, LoRA rank 16 on the attention projections (peft). Built on the meta device by
``fxckpt inspect``: nothing is allocated.

    fxckpt inspect examples/flux_stream.py:factory --stream-weights --frozen-only \\
        --budget 24GiB --html flux.html

``small()`` is the same model at a size that trains on a CPU in seconds.
"""

from __future__ import annotations

from typing import Any

import torch


def _flux(layers: int, single: int, heads: int, head_dim: int, text_dim: int, pooled: int,
          rope: tuple[int, int, int], channels: int, side: int, text: int, rank: int,
          dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any], Any]:
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig, inject_adapter_in_model

    model = FluxTransformer2DModel(
        patch_size=1, in_channels=channels, num_layers=layers, num_single_layers=single,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=text_dim,
        pooled_projection_dim=pooled, axes_dims_rope=rope,
    ).to(dtype)  # fmt: skip
    lora = LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    model = inject_adapter_in_model(lora, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    img_ids = torch.zeros(side * side, 3)
    img_ids[:, 1] = torch.arange(side * side) // side
    img_ids[:, 2] = torch.arange(side * side) % side
    inputs = {
        "hidden_states": torch.randn(1, side * side, channels, dtype=dtype),
        "timestep": torch.tensor([0.5], dtype=dtype),
        "img_ids": img_ids, "txt_ids": torch.zeros(text, 3),
        "encoder_hidden_states": torch.randn(1, text, text_dim, dtype=dtype),
        "pooled_projections": torch.randn(1, pooled, dtype=dtype),
        "return_dict": False,
    }  # fmt: skip
    return model, inputs, lambda out: out[0].float().square().mean()


def factory() -> tuple[torch.nn.Module, dict[str, Any], Any]:
    """Flux.1 (12B) at 1024x1024."""
    return _flux(19, 38, 24, 128, 4096, 768, (16, 56, 56), 64, 64, 512, 16, torch.bfloat16)


def small() -> tuple[torch.nn.Module, dict[str, Any], Any]:
    """The same blocks, tiny: 2 + 3 blocks, width 128, 8x8 latents, float32."""
    return _flux(2, 3, 4, 32, 64, 32, (8, 12, 12), 16, 8, 8, 4, torch.float32)
