"""Random models for the fuzz tests, built from a menu of operations.

A :class:`Spec` names the operations of one block; the model stacks ``n_blocks`` copies of
that block (each with its own parameters) under ``layers``, so fxckpt's block detection and
segment strides apply. Every operation maps a ``(batch, seq, d)`` float32 tensor to another
one, so any sequence of them composes. The menu covers what saved activations look like in
real models: views with storage offsets, transposed (non-contiguous) tensors, slices, ``cat``,
in-place ops on clones, bf16 tensors next to fp32 ones, and dropout's random masks.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

MENU: tuple[str, ...] = (
    "linear",  # nn.Linear(d, d)
    "gelu",
    "layernorm",
    "softmax",  # over the feature dim
    "attention",  # causal, two heads, its own qkv and projection
    "heads",  # view into heads, transpose, scale per head, transpose back, reshape
    "transpose",  # (b, t, d) -> (b, d, t) @ (t, t) -> back: matmul on a transposed tensor
    "slice_cat",  # cat of slices with offsets along seq and features; mul of two offset views
    "inplace",  # clone, then in-place ops on the clone and on a slice of it
    "bf16",  # cast to bf16, linear and gelu in bf16, cast back
    "dropout",
)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One random model: ``ops`` is one block's operations, in order."""

    ops: tuple[str, ...]
    n_blocks: int = 2
    d: int = 16
    batch: int = 2
    seq: int = 8
    offset: int = 1  # slice offset, 1 <= offset < min(seq, d)
    residual: bool = True
    dropout: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.ops) - set(MENU)
        assert not unknown, unknown
        assert self.d % 2 == 0 and 1 <= self.offset < min(self.seq, self.d)

    @property
    def random(self) -> bool:
        """Whether the model draws random numbers (then compare against aot_eager)."""
        return "dropout" in self.ops and self.dropout > 0

    @property
    def low_precision(self) -> bool:
        return "bf16" in self.ops


class Op(nn.Module):
    def __init__(self, name: str, spec: Spec) -> None:
        super().__init__()
        self.name = name
        self.spec = spec
        d, t = spec.d, spec.seq
        if name in ("linear", "bf16"):
            self.lin = nn.Linear(d, d)
        elif name == "layernorm":
            self.ln = nn.LayerNorm(d)
        elif name == "attention":
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
        elif name == "heads":
            self.scale = nn.Parameter(torch.randn(2, 1, d // 2))
        elif name == "transpose":
            self.mix = nn.Parameter(torch.randn(t, t) / math.sqrt(t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name, s = self.name, self.spec
        b, t, d = x.shape
        if name == "linear":
            return self.lin(x)
        if name == "gelu":
            return F.gelu(x)
        if name == "layernorm":
            return self.ln(x)
        if name == "softmax":
            return x.softmax(dim=-1)
        if name == "attention":
            q, k, v = self.qkv(x).split(d, dim=-1)
            q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // 2)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        if name == "heads":
            h = x.view(b, t, 2, d // 2).transpose(1, 2)  # (b, 2, t, d/2), not contiguous
            return (h.tanh() * self.scale).transpose(1, 2).reshape(b, t, d)
        if name == "transpose":
            return (x.transpose(1, 2).sigmoid() @ self.mix).transpose(1, 2)
        if name == "slice_cat":
            o = s.offset
            rows = torch.cat([x[:, o:].tanh(), x[:, :o] * 2.0], dim=1)
            # Both factors are views of `rows` with storage offsets; mul saves both.
            mixed = rows[..., o:] * rows[..., : d - o]
            return torch.cat([mixed, rows[..., :o]], dim=-1)
        if name == "inplace":
            y = x.clone()
            y.mul_(1.5)
            y[..., : s.offset].sin_()
            return y.relu_() + x
        if name == "bf16":
            y = x.to(torch.bfloat16)
            y = F.gelu(F.linear(y, self.lin.weight.to(torch.bfloat16), self.lin.bias.to(torch.bfloat16)))
            return y.float()
        if name == "dropout":
            return F.dropout(x, s.dropout, self.training)
        raise AssertionError(name)


class Block(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        # Names end in the op's name, not an index: block detection reads module paths
        # ending in an integer as repeated blocks, and these must not look like blocks.
        self.ops = nn.ModuleDict({f"s{i}_{name}": Op(name, spec) for i, name in enumerate(spec.ops)})
        self.residual = spec.residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for op in self.ops.values():
            y = op(y)
        return x + y if self.residual else y


class FuzzModel(nn.Module):
    """``forward(x)`` returns a scalar loss of ``n_blocks`` blocks of ``spec.ops``."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        torch.manual_seed(spec.seed)
        self.spec = spec
        self.inp = nn.Linear(spec.d, spec.d)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.n_blocks))
        self.head = nn.Linear(spec.d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def build(spec: Spec) -> tuple[FuzzModel, tuple[torch.Tensor]]:
    """The model and its input (which requires grad, so the input gradient is compared too)."""
    model = FuzzModel(spec)
    g = torch.Generator().manual_seed(spec.seed + 1)
    x = torch.randn(spec.batch, spec.seq, spec.d, generator=g).requires_grad_(True)
    return model, (x,)
