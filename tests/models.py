"""Small models the tests compile: an MLP, a tiny GPT, and Hugging Face models from configs."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(depth)
        )
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x).square().mean()


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float | None) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        if self.dropout is not None:
            att = F.dropout(att, self.dropout, self.training)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float | None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.dropout = nn.Dropout(dropout) if dropout is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    """A decoder of the small GPT kind; ``forward(idx, targets)`` returns the loss.

    ``dropout=None`` leaves dropout out of the graph. A dropout of ``p=0`` stays in it, and
    what it saves depends on the torch version: 2.15's decomposition returns its input, so
    the attention probabilities are saved once; 2.11 and 2.13 save a second copy.
    """

    def __init__(
        self, vocab: int = 64, d: int = 32, heads: int = 2, n_layers: int = 4,
        dropout: float | None = 0.0,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_inputs(vocab: int = 64, batch: int = 2, seq: int = 16, seed: int = 0) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, seq), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def hf_model(arch: str, *, dropout: float = 0.0, layers: int = 2) -> tuple[nn.Module, dict[str, Any]]:
    """A tiny Hugging Face model built from a config (no download) and its inputs."""
    import transformers as tf

    torch.manual_seed(0)
    vocab, seq = 128, 12
    if arch == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        )
        model = tf.Qwen3ForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, n_positions=64,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        )
        model = tf.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    model.config._attn_implementation = "eager" if dropout else "sdpa"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    return model, {"input_ids": ids, "labels": ids}


def hf_zoo_model(
    arch: str, *, dropout: float = 0.0, layers: int = 2, seq: int = 12
) -> tuple[nn.Module, dict[str, Any]]:
    """More tiny Hugging Face models from configs (no download), with inputs and labels.

    Encoders (``bert``, ``roberta``, ``modernbert``, ``vit``), encoder-decoders (``t5``,
    ``whisper``: speech features in, text out),
    decoders (``gpt_neox``, ``opt``, ``mistral``, ``phi3``, ``gemma2``) and a mixture of experts
    (``mixtral``). ``dropout`` sets every dropout probability the config has; attention then
    runs the eager path, whose dropout is an ordinary op (SDPA's would be fused).
    """
    import transformers as tf

    torch.manual_seed(0)
    vocab = 128
    common = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, max_position_embeddings=64,
    )
    decoder = dict(common, num_key_value_heads=2)
    p = dropout
    if arch == "bert":
        model = tf.BertForMaskedLM(
            tf.BertConfig(**common, hidden_dropout_prob=p, attention_probs_dropout_prob=p)
        )
    elif arch == "roberta":
        model = tf.RobertaForMaskedLM(
            tf.RobertaConfig(**common, hidden_dropout_prob=p, attention_probs_dropout_prob=p, pad_token_id=1)
        )
    elif arch == "modernbert":
        model = tf.ModernBertForMaskedLM(
            tf.ModernBertConfig(
                **common, pad_token_id=0, attention_dropout=p, mlp_dropout=p, embedding_dropout=p
            )
        )
    elif arch == "gpt_neox":
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common, hidden_dropout=p, attention_dropout=p))
    elif arch == "opt":
        model = tf.OPTForCausalLM(
            tf.OPTConfig(
                vocab_size=vocab, hidden_size=32, ffn_dim=64, num_hidden_layers=layers,
                num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                dropout=p, attention_dropout=p,
            )
        )
    elif arch == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**decoder, sliding_window=8))
    elif arch == "phi3":
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**decoder, pad_token_id=0))
    elif arch == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**decoder, head_dim=8, sliding_window=8))
    elif arch == "mixtral":
        model = tf.MixtralForCausalLM(
            tf.MixtralConfig(**decoder, num_local_experts=4, num_experts_per_tok=2)
        )
    elif arch == "t5":
        model = tf.T5ForConditionalGeneration(
            tf.T5Config(
                vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4,
                dropout_rate=p, decoder_start_token_id=0,
            )
        )
    elif arch == "whisper":
        model = tf.WhisperForConditionalGeneration(
            tf.WhisperConfig(
                vocab_size=vocab, d_model=32, encoder_layers=layers, decoder_layers=layers,
                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=8,
                max_target_positions=32, decoder_start_token_id=0, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, dropout=p,
            )
        )
    elif arch == "vit":
        model = tf.ViTForImageClassification(
            tf.ViTConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=4, image_size=16, patch_size=4, num_labels=3,
                hidden_dropout_prob=p, attention_probs_dropout_prob=p,
            )
        )
    else:
        raise ValueError(arch)
    # Gemma 2 soft-caps attention logits, which SDPA does not support.
    model.config._attn_implementation = "eager" if dropout or arch == "gemma2" else "sdpa"
    g = torch.Generator().manual_seed(1)
    if arch == "vit":
        return model, {"pixel_values": torch.randn(2, 3, 16, 16, generator=g), "labels": torch.tensor([0, 2])}
    ids = torch.randint(2, vocab, (2, seq), generator=g)
    if arch == "whisper":
        # Mel features: 8 bins x 16 frames (two conv layers halve them to 8 positions).
        return model, {"input_features": torch.randn(2, 8, 16, generator=g), "labels": ids[:, :6]}
    return model, {"input_ids": ids, "labels": ids}


# The conv models live with the benchmark that runs them on a GPU (one definition). Scripts
# that import this file from a subprocess put only tests/ on sys.path: add the checkout.
_CHECKOUT = str(Path(__file__).resolve().parent.parent)
if _CHECKOUT not in sys.path:
    sys.path.append(_CHECKOUT)

from benchmarks.conv_case import BasicBlock, ConvBNNet, ResNet  # noqa: E402, F401


def gpt_seq_factory(seq: int = 64) -> tuple[nn.Module, tuple[Any, ...]]:
    """``fxckpt inspect tests/models.py:gpt_seq_factory --max-seq``: a 2-layer GPT (no dropout)
    and a batch of 2 at ``seq`` tokens."""
    return GPT(vocab=64, d=32, heads=2, n_layers=2, dropout=None), gpt_inputs(seq=seq)
