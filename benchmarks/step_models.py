"""The models of the step-budget matrix (``benchmarks/step_budget.py``), each with its inputs
and a step function, built small enough for a 2-core CPU.

Every case returns a :class:`Case`: the model, a ``step(compiled)`` that runs one forward and
backward and returns the loss, and the tensors the step is given (for the meter's start level).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.conv_case import ConvBNNet
from benchmarks.methods import Decoder, DecoderConfig, make_batch

DECODER = DecoderConfig("decoder", vocab=256, d=64, heads=4, layers=4, ffn=256)


@dataclass
class Case:
    """One model of the matrix: ``step(fn)`` runs a forward and backward of ``fn`` (the model,
    compiled or not) and returns the loss."""

    name: str
    model: nn.Module
    step: Callable[[Any], torch.Tensor]
    given: tuple[Any, ...] = ()
    inductor_only: bool = False
    reference: nn.Module | None = None  # the eager model to compare with (default: a copy)
    notes: list[str] = field(default_factory=list)


def _hf_llama(layers: int = 4, **cfg: Any) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=128, **cfg)  # fmt: skip
    model = tf.LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def _ids(vocab: int = 128, batch: int = 2, seq: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


class _BreakInside(nn.Module):
    """A decoder layer with a graph break inside its forward: dynamo compiles the layer in two
    graphs, each run once per layer, and runs the loop around them eagerly."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        hidden_states = hidden_states * 1.0
        torch._dynamo.graph_break()
        return self.layer(hidden_states, *args, **kwargs)


def decoder() -> Case:
    torch.manual_seed(0)
    model = Decoder(DECODER)
    idx, tgt = make_batch(DECODER, batch=2, seq=128, device=torch.device("cpu"))
    return Case("decoder (one graph)", model, lambda fn: fn(idx, tgt), (idx, tgt))


def gpt2_loss_after_break() -> Case:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=128,
                           resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    lm = tf.GPT2LMHeadModel(config)
    lm.config._attn_implementation = "eager"

    class LossAfterBreak(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            logits = self.lm(input_ids=ids).logits
            torch._dynamo.graph_break()
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    model = LossAfterBreak()
    ids = _ids()
    return Case("GPT-2, dropout, loss after a graph break", model, lambda fn: fn(ids), (ids,))


def llama_breaks(use_cache: bool) -> Case:
    model = _hf_llama(use_cache=use_cache)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = _BreakInside(layer)
    ids = _ids()

    def step(fn: Any) -> torch.Tensor:
        return fn(input_ids=ids, labels=ids, use_cache=use_cache).loss

    return Case(f"Llama, a graph break in every layer, use_cache={use_cache}", model, step, (ids,))


def llama_hf_checkpointing() -> Case:
    model = _hf_llama()
    model.gradient_checkpointing_enable()
    model.train()
    ids = _ids()
    return Case("Llama under gradient_checkpointing_enable()", model,
                lambda fn: fn(input_ids=ids, labels=ids).loss, (ids,))


def moe() -> Case:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=128, num_local_experts=4,
                              num_experts_per_tok=2)  # fmt: skip
    model = tf.MixtralForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    ids = _ids()
    return Case("Mixtral-style MoE", model, lambda fn: fn(input_ids=ids, labels=ids).loss, (ids,))


def lora_streamed() -> Case:
    import copy

    import peft

    import fxckpt

    base = _hf_llama()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    reference = copy.deepcopy(model)
    fxckpt.stream_weights(model, frozen_only=True, min_bytes=0)
    ids = _ids()
    return Case("LoRA Llama, base weights streamed", model,
                lambda fn: fn(input_ids=ids, labels=ids).loss, (ids,), reference=reference)


def conv_bn() -> Case:
    torch.manual_seed(0)
    model = ConvBNNet(channels=16, depth=4)
    x = torch.randn(4, 16, 32, 32, generator=torch.Generator().manual_seed(1))
    return Case("conv net with BatchNorm", model, lambda fn: fn(x), (x,),
                inductor_only=True)


CASES: dict[str, Callable[[], Case]] = {
    "decoder": decoder,
    "gpt2_break": gpt2_loss_after_break,
    "llama_breaks": lambda: llama_breaks(False),
    "llama_breaks_cache": lambda: llama_breaks(True),
    "llama_hf_ckpt": llama_hf_checkpointing,
    "moe": moe,
    "lora_stream": lora_streamed,
    "conv_bn": conv_bn,
}
