"""The models the link targets stand for, small enough to trace on meta tensors.

Only their shapes matter: :mod:`fxckpt.targets` traces a few of their blocks on the ``meta``
device and prices them with fxckpt's cost model. Nothing here is ever run on data.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class QwenBlock(nn.Module):
    """A Qwen3 decoder layer: RMSNorm, q/k norm, RoPE, grouped KV heads, SwiGLU, no biases."""

    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv_heads, head_dim
        self.norm1, self.norm2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.q = nn.Linear(d, heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(d, 2 * kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, d, bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
        self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q_norm(self.q(h).view(b, t, self.heads, self.hd)).transpose(1, 2)
        k, v = self.kv_proj(h).view(b, t, 2, self.kv, self.hd).unbind(2)
        k, v = self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k = k.repeat_interleave(self.heads // self.kv, dim=1)
        v = v.repeat_interleave(self.heads // self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, self.heads * self.hd))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class QwenStack(nn.Module):
    """``layers`` Qwen3 layers on embedded tokens; the loss is a mean of the output."""

    def __init__(self, layers: int, d: int, heads: int, kv_heads: int, head_dim: int,
                 ffn: int) -> None:
        super().__init__()
        self.hd = head_dim
        self.layers = nn.ModuleList(QwenBlock(d, heads, kv_heads, head_dim, ffn)
                                    for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        pos = torch.arange(t, device=x.device, dtype=torch.float32)
        inv = 1e6 ** (-torch.arange(0, self.hd, 2, device=x.device, dtype=torch.float32) / self.hd)
        ang = torch.outer(pos, inv).repeat(1, 2)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x.float().square().mean()


class DiTBlock(nn.Module):
    """A diffusion-transformer block: adaLN-modulated attention (bidirectional) and MLP."""

    def __init__(self, d: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.mod = nn.Linear(d, 6 * d)
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.q_norm, self.k_norm = nn.RMSNorm(d // heads, eps=1e-6), nn.RMSNorm(d // heads, eps=1e-6)
        self.proj = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, mlp), nn.Linear(mlp, d)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.mod(F.silu(c)).unsqueeze(1).chunk(6, -1)
        h = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + gate1 * self.proj(y)
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class DiTStack(nn.Module):
    """``layers`` DiT blocks on patch tokens and a conditioning vector; the loss is a mean
    squared error, as in flow matching."""

    def __init__(self, layers: int, d: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DiTBlock(d, heads, mlp) for _ in range(layers))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        y = x
        for layer in self.layers:
            y = layer(y, c)
        return (y.float() - x.float()).square().mean()
