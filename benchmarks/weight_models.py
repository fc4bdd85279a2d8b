"""The models of the streamed-weights benchmark (:mod:`benchmarks.weights`), each a training
step on random data with its repeated blocks named, at a benchmark size and a smoke size.

- ``stack``: a LoRA decoder-shaped stack of plain linears (frozen base, rank-8 adapters);
- ``flux-lora``: diffusers' ``FluxTransformer2DModel`` (dual-stream then single-stream blocks)
  with peft's LoRA on the attention projections, its base frozen;
- ``flux-full``: the same transformer, every weight trained (its gradients go back to host);
- ``llama-lora``: transformers' ``LlamaForCausalLM`` with peft's LoRA on q, k, v and o.

Random weights from configs: nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 8) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False).requires_grad_(False)
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.up.weight, std=0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = LoRALinear(d, 4 * d), LoRALinear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@dataclasses.dataclass
class Workload:
    """A model, the step's loss on fixed inputs, and its repeated blocks."""

    model: nn.Module
    loss: Callable[[nn.Module], torch.Tensor]
    blocks: Callable[[nn.Module], list[nn.Module]]
    frozen_only: bool  # LoRA: only the frozen base streams; else every weight does
    description: str


def _lora(model: nn.Module, targets: list[str]) -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    model = inject_adapter_in_model(
        LoraConfig(r=8, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian"), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def stack(smoke: bool) -> Workload:
    d, depth, tokens = (64, 4, 16) if smoke else (256, 6, 1024)
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(1))
    return Workload(Stack(d, depth), lambda m: m(x), lambda m: list(m.blocks), True,
                    f"LoRA stack: {depth} blocks, d={d}, MLP 4x, {tokens} tokens")  # fmt: skip


def flux(smoke: bool, lora: bool) -> Workload:
    from diffusers import FluxTransformer2DModel

    layers, single, heads, side, text = (1, 1, 2, 4, 8) if smoke else (2, 4, 4, 16, 32)
    head_dim = 16 if smoke else 64
    width = heads * head_dim
    model: nn.Module = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=layers, num_single_layers=single,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=width,
        pooled_projection_dim=width // 2, axes_dims_rope=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
    )  # fmt: skip
    if lora:
        model = _lora(model, ["to_q", "to_k", "to_v", "to_out.0"])
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(side * side, 3)
    ids[:, 1], ids[:, 2] = torch.arange(side * side) // side, torch.arange(side * side) % side
    inputs = {
        "hidden_states": torch.randn(1, side * side, 16, generator=g), "timestep": torch.tensor([0.5]),
        "img_ids": ids, "txt_ids": torch.zeros(text, 3),
        "encoder_hidden_states": torch.randn(1, text, width, generator=g),
        "pooled_projections": torch.randn(1, width // 2, generator=g), "return_dict": False,
    }  # fmt: skip
    target = torch.randn(1, side * side, 16, generator=g)

    def blocks(m: nn.Module) -> list[nn.Module]:
        return [*m.transformer_blocks, *m.single_transformer_blocks]  # type: ignore[misc]

    what = "LoRA rank 8 on to_q/k/v/out, base frozen" if lora else "every weight trained"
    return Workload(model, lambda m: (m(**inputs)[0] - target).square().mean(), blocks, lora,
                    f"Flux transformer: {layers}+{single} blocks, width {width}, "
                    f"{side * side}+{text} tokens; {what}")  # fmt: skip


def llama(smoke: bool) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    d, layers, seq = (64, 2, 16) if smoke else (256, 4, 512)
    config = LlamaConfig(hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                         max_position_embeddings=seq, use_cache=False)  # fmt: skip
    model = _lora(LlamaForCausalLM(config), ["q_proj", "k_proj", "v_proj", "o_proj"])
    ids = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(1))

    def loss(m: nn.Module) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss

    return Workload(model, loss, lambda m: list(m.model.layers), True,  # type: ignore[union-attr]
                    f"Llama: {layers} layers, d={d}, {seq} tokens; LoRA rank 8 on q/k/v/o")


BUILDERS: dict[str, Callable[[bool], Workload]] = {
    "stack": stack,
    "flux-lora": lambda smoke: flux(smoke, lora=True),
    "flux-full": lambda smoke: flux(smoke, lora=False),
    "llama-lora": llama,
}


def build(name: str, smoke: bool) -> Workload:
    torch.manual_seed(0)
    work = BUILDERS[name](smoke)
    work.model.train()
    return work


def plain(name: str) -> str:
    """A parameter's name as the model had it before fxckpt.stream_weights."""
    return name.replace("parametrizations.", "").replace(".original", "")

