"""Golden lists of the saved activations of a small GPT and their decisions.

Rows are normalised (no node names), so they change only when behaviour changes. One text
holds on every supported torch (2.11 to 2.15): the model has no dropout op, whose ``p=0``
decomposition differs between versions (2.15 saves the attention probabilities once, older
versions a copy too).
"""

from __future__ import annotations

import torch
from expecttest import TestCase
from models import GPT, gpt_inputs

import fxckpt


def rows(stride: int, width: int | None = None) -> str:
    torch._dynamo.reset()
    fxckpt.reset_stats()
    torch.manual_seed(0)
    model = GPT(n_layers=2, d=16, heads=2, dropout=None)
    backend = fxckpt.backend(compiler="eager", segment_stride=stride, segment_width=width)
    torch.compile(model, backend=backend)(*gpt_inputs(seq=8)).backward()
    (plan,) = fxckpt.last_plans()
    lines = [
        f"{'-' if r.block is None else r.block} {r.module or '-'} {r.op} "
        f"{list(r.shape)} {r.dtype} {r.decision.kind}"
        for r in sorted(plan.activations, key=lambda r: (r.decision.kind, -1 if r.block is None else r.block, r.module, r.op, str(r.shape)))
    ]
    return "\n".join(lines)


class TestGoldenPlans(TestCase):
    def test_stride_0(self) -> None:
        self.assertExpectedInline(rows(0), """\
- - _log_softmax.default [16, 64] float32 keep
- - getitem [] float32 keep
- head view.default [16, 16] float32 keep
- ln_f getitem [2, 8, 1] float32 keep
- ln_f getitem [2, 8, 1] float32 keep
- wte embedding.default [2, 8, 16] float32 keep
0 layers.0 add.Tensor [2, 8, 16] float32 keep
0 layers.0 add.Tensor [2, 8, 16] float32 keep
0 layers.0.attn _softmax.default [2, 2, 8, 8] float32 keep
0 layers.0.attn transpose.int [4, 8, 8] float32 keep
0 layers.0.attn transpose.int [4, 8, 8] float32 keep
0 layers.0.attn transpose.int [4, 8, 8] float32 keep
0 layers.0.attn tril.default [8, 8] bool keep
0 layers.0.attn.proj view.default [16, 16] float32 keep
0 layers.0.attn.qkv view.default [16, 16] float32 keep
0 layers.0.fc1 addmm.default [16, 64] float32 keep
0 layers.0.fc1 view.default [16, 16] float32 keep
0 layers.0.fc2 view.default [16, 64] float32 keep
0 layers.0.ln1 getitem [2, 8, 1] float32 keep
0 layers.0.ln1 getitem [2, 8, 1] float32 keep
0 layers.0.ln2 getitem [2, 8, 1] float32 keep
0 layers.0.ln2 getitem [2, 8, 1] float32 keep
1 layers.1 add.Tensor [2, 8, 16] float32 keep
1 layers.1 add.Tensor [2, 8, 16] float32 keep
1 layers.1.attn _softmax.default [2, 2, 8, 8] float32 keep
1 layers.1.attn transpose.int [4, 8, 8] float32 keep
1 layers.1.attn transpose.int [4, 8, 8] float32 keep
1 layers.1.attn transpose.int [4, 8, 8] float32 keep
1 layers.1.attn.proj view.default [16, 16] float32 keep
1 layers.1.attn.qkv view.default [16, 16] float32 keep
1 layers.1.fc1 addmm.default [16, 64] float32 keep
1 layers.1.fc1 view.default [16, 16] float32 keep
1 layers.1.fc2 view.default [16, 64] float32 keep
1 layers.1.ln1 getitem [2, 8, 1] float32 keep
1 layers.1.ln1 getitem [2, 8, 1] float32 keep
1 layers.1.ln2 getitem [2, 8, 1] float32 keep
1 layers.1.ln2 getitem [2, 8, 1] float32 keep""")

    def test_stride_1(self) -> None:
        self.assertExpectedInline(rows(1), """\
- - _log_softmax.default [16, 64] float32 keep
- - getitem [] float32 keep
- head view.default [16, 16] float32 keep
- ln_f getitem [2, 8, 1] float32 keep
- ln_f getitem [2, 8, 1] float32 keep
- wte embedding.default [2, 8, 16] float32 keep
0 layers.0 add.Tensor [2, 8, 16] float32 keep
0 layers.0.attn bitwise_not.default [8, 8] bool keep
0 layers.0 add.Tensor [2, 8, 16] float32 recompute
0 layers.0.attn _softmax.default [2, 2, 8, 8] float32 recompute
0 layers.0.attn transpose.int [4, 8, 8] float32 recompute
0 layers.0.attn transpose.int [4, 8, 8] float32 recompute
0 layers.0.attn transpose.int [4, 8, 8] float32 recompute
0 layers.0.attn tril.default [8, 8] bool recompute
0 layers.0.attn.proj view.default [16, 16] float32 recompute
0 layers.0.attn.qkv view.default [16, 16] float32 recompute
0 layers.0.fc1 addmm.default [16, 64] float32 recompute
0 layers.0.fc1 view.default [16, 16] float32 recompute
0 layers.0.fc2 view.default [16, 64] float32 recompute
0 layers.0.ln1 getitem [2, 8, 1] float32 recompute
0 layers.0.ln1 getitem [2, 8, 1] float32 recompute
0 layers.0.ln2 getitem [2, 8, 1] float32 recompute
0 layers.0.ln2 getitem [2, 8, 1] float32 recompute
1 layers.1 add.Tensor [2, 8, 16] float32 recompute
1 layers.1 add.Tensor [2, 8, 16] float32 recompute
1 layers.1.attn _softmax.default [2, 2, 8, 8] float32 recompute
1 layers.1.attn transpose.int [4, 8, 8] float32 recompute
1 layers.1.attn transpose.int [4, 8, 8] float32 recompute
1 layers.1.attn transpose.int [4, 8, 8] float32 recompute
1 layers.1.attn.proj view.default [16, 16] float32 recompute
1 layers.1.attn.qkv view.default [16, 16] float32 recompute
1 layers.1.fc1 addmm.default [16, 64] float32 recompute
1 layers.1.fc1 view.default [16, 16] float32 recompute
1 layers.1.fc2 view.default [16, 64] float32 recompute
1 layers.1.ln1 getitem [2, 8, 1] float32 recompute
1 layers.1.ln1 getitem [2, 8, 1] float32 recompute
1 layers.1.ln2 getitem [2, 8, 1] float32 recompute
1 layers.1.ln2 getitem [2, 8, 1] float32 recompute""")

    def test_stride_2(self) -> None:
        self.assertExpectedInline(rows(2), """\
- - _log_softmax.default [16, 64] float32 keep
- - getitem [] float32 keep
- head view.default [16, 16] float32 keep
- ln_f getitem [2, 8, 1] float32 keep
- ln_f getitem [2, 8, 1] float32 keep
- wte embedding.default [2, 8, 16] float32 keep
0 layers.0 add.Tensor [2, 8, 16] float32 recompute
0 layers.0 add.Tensor [2, 8, 16] float32 recompute
0 layers.0.attn _softmax.default [2, 2, 8, 8] float32 recompute
0 layers.0.attn transpose.int [4, 8, 8] float32 recompute
0 layers.0.attn transpose.int [4, 8, 8] float32 recompute
0 layers.0.attn transpose.int [4, 8, 8] float32 recompute
0 layers.0.attn tril.default [8, 8] bool recompute
0 layers.0.attn.proj view.default [16, 16] float32 recompute
0 layers.0.attn.qkv view.default [16, 16] float32 recompute
0 layers.0.fc1 addmm.default [16, 64] float32 recompute
0 layers.0.fc1 view.default [16, 16] float32 recompute
0 layers.0.fc2 view.default [16, 64] float32 recompute
0 layers.0.ln1 getitem [2, 8, 1] float32 recompute
0 layers.0.ln1 getitem [2, 8, 1] float32 recompute
0 layers.0.ln2 getitem [2, 8, 1] float32 recompute
0 layers.0.ln2 getitem [2, 8, 1] float32 recompute
1 layers.1 add.Tensor [2, 8, 16] float32 recompute
1 layers.1 add.Tensor [2, 8, 16] float32 recompute
1 layers.1.attn _softmax.default [2, 2, 8, 8] float32 recompute
1 layers.1.attn transpose.int [4, 8, 8] float32 recompute
1 layers.1.attn transpose.int [4, 8, 8] float32 recompute
1 layers.1.attn transpose.int [4, 8, 8] float32 recompute
1 layers.1.attn.proj view.default [16, 16] float32 recompute
1 layers.1.attn.qkv view.default [16, 16] float32 recompute
1 layers.1.fc1 addmm.default [16, 64] float32 recompute
1 layers.1.fc1 view.default [16, 16] float32 recompute
1 layers.1.fc2 view.default [16, 64] float32 recompute
1 layers.1.ln1 getitem [2, 8, 1] float32 recompute
1 layers.1.ln1 getitem [2, 8, 1] float32 recompute
1 layers.1.ln2 getitem [2, 8, 1] float32 recompute
1 layers.1.ln2 getitem [2, 8, 1] float32 recompute""")

    def test_stride_2_width_1(self) -> None:
        self.assertExpectedInline(rows(2, 1), """\
- - _log_softmax.default [16, 64] float32 keep
- - getitem [] float32 keep
- head view.default [16, 16] float32 keep
- ln_f getitem [2, 8, 1] float32 keep
- ln_f getitem [2, 8, 1] float32 keep
- wte embedding.default [2, 8, 16] float32 keep
1 layers.1 add.Tensor [2, 8, 16] float32 keep
1 layers.1 add.Tensor [2, 8, 16] float32 keep
1 layers.1.attn _softmax.default [2, 2, 8, 8] float32 keep
1 layers.1.attn transpose.int [4, 8, 8] float32 keep
1 layers.1.attn transpose.int [4, 8, 8] float32 keep
1 layers.1.attn transpose.int [4, 8, 8] float32 keep
1 layers.1.attn.proj view.default [16, 16] float32 keep
1 layers.1.attn.qkv view.default [16, 16] float32 keep
1 layers.1.fc1 addmm.default [16, 64] float32 keep
1 layers.1.fc1 view.default [16, 16] float32 keep
1 layers.1.fc2 view.default [16, 64] float32 keep
1 layers.1.ln1 getitem [2, 8, 1] float32 keep
1 layers.1.ln1 getitem [2, 8, 1] float32 keep
1 layers.1.ln2 getitem [2, 8, 1] float32 keep
1 layers.1.ln2 getitem [2, 8, 1] float32 keep
0 layers.0 add.Tensor [2, 8, 16] float32 recompute
0 layers.0 add.Tensor [2, 8, 16] float32 recompute
0 layers.0.attn _softmax.default [2, 2, 8, 8] float32 recompute
0 layers.0.attn transpose.int [4, 8, 8] float32 recompute
0 layers.0.attn transpose.int [4, 8, 8] float32 recompute
0 layers.0.attn transpose.int [4, 8, 8] float32 recompute
0 layers.0.attn tril.default [8, 8] bool recompute
0 layers.0.attn.proj view.default [16, 16] float32 recompute
0 layers.0.attn.qkv view.default [16, 16] float32 recompute
0 layers.0.fc1 addmm.default [16, 64] float32 recompute
0 layers.0.fc1 view.default [16, 16] float32 recompute
0 layers.0.fc2 view.default [16, 64] float32 recompute
0 layers.0.ln1 getitem [2, 8, 1] float32 recompute
0 layers.0.ln1 getitem [2, 8, 1] float32 recompute
0 layers.0.ln2 getitem [2, 8, 1] float32 recompute
0 layers.0.ln2 getitem [2, 8, 1] float32 recompute""")
