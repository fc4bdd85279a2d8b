"""Segment stride: SimpleTuner's semantics, checked on the plans and on the measured saved bytes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from equality import step
from measured import measure_forward

import fxckpt
from fxckpt.passes.segment import segment_of

D, B, T = 16, 2, 8
ACT_BYTES = B * T * D * 4  # one block output, fp32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class Stack(nn.Module):
    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def plan_and_held(stride: int, width: int | None = None, n: int = 8) -> tuple[fxckpt.Plan, int]:
    """The plan, and the bytes a warm forward left for the backward, measured by the meter."""
    torch._dynamo.reset()
    fxckpt.reset_stats()
    torch.manual_seed(0)
    model = Stack(n)
    x = torch.randn(B, T, D, requires_grad=True)
    compiled = torch.compile(
        model, backend=fxckpt.backend(segment_stride=stride, segment_width=width, compiler="eager")
    )
    loss = compiled(x)
    loss.backward()
    torch.testing.assert_close(loss, model(x))
    (plan,) = fxckpt.last_plans()
    return plan, measure_forward(compiled, (x,), warm=False).held_bytes


def plan_for(stride: int, width: int | None = None, n: int = 8) -> fxckpt.Plan:
    return plan_and_held(stride, width, n)[0]


@pytest.mark.parametrize(
    "stride,width,expected",
    [
        (2, 2, [0, 0, 1, 1, 2, 2, 3, 3]),
        (2, 1, [0, None, 1, None, 2, None, 3, None]),
        (3, 1, [0, None, None, 1, None, None, 2, None]),
        (1, 1, [0, 1, 2, 3, 4, 5, 6, 7]),
        (0, 0, [None] * 8),
    ],
)
def test_segment_of_follows_simpletuner(stride: int, width: int, expected: list[int | None]) -> None:
    assert [segment_of(i, stride, width) for i in range(8)] == expected


def test_stride_2_saves_only_segment_inputs_inside_blocks() -> None:
    plan = plan_for(2)
    kept = [r for r in plan.activations if r.decision.kind == "keep" and r.block is not None]
    # Segment 0's input is the graph input x, which is not an activation; segments 1..3 start
    # at the outputs of blocks 1, 3 and 5.
    assert sorted(r.block for r in kept) == [1, 3, 5]
    assert all(r.bytes == ACT_BYTES for r in kept)
    assert all(r.op.startswith("add") for r in kept)
    recomputed = [r for r in plan.activations if r.decision.kind == "recompute"]
    assert recomputed and all("interior of segment" in r.decision.reason for r in recomputed if r.block is not None)


def test_recomputed_rows_carry_the_flops_of_their_op() -> None:
    """A segment interior's row names the FLOPs its recompute runs: a matmul's 2·m·n·k (the
    fc layers' outputs), nothing for the pointwise ops FlopCounterMode does not count."""
    plan = plan_for(1)
    rows = [r for r in plan.activations if r.decision.kind == "recompute" and r.block is not None]
    mm = [r for r in rows if r.op.startswith(("addmm", "mm"))]
    assert mm, [r.op for r in rows]
    for r in mm:
        m, n = r.shape[0], r.shape[-1]
        k = 4 * D if n == D else D
        assert r.flops == 2 * m * n * k, (r.name, r.op, r.shape, r.flops)
    assert plan.recomputed_flops == sum(r.flops for r in rows) > 0


def test_stride_2_width_1_keeps_odd_interiors_only() -> None:
    baseline = plan_for(0)
    plan = plan_for(2, 1)
    by_block = lambda p, kind: {  # noqa: E731
        b: sorted(r.name for r in p.activations if r.block == b and r.decision.kind == kind)
        for b in range(8)
    }
    kept = by_block(plan, "keep")
    base_kept = by_block(baseline, "keep")
    for b in range(8):
        if b % 2 == 0:
            assert kept[b] == [], f"block {b} is a segment interior"
        else:
            assert kept[b] == base_kept[b] and kept[b], f"block {b} keeps what min-cut keeps"


def test_saved_bytes_fall_with_segments() -> None:
    runs = {s: plan_and_held(s) for s in (0, 1, 2)}
    planned = {s: plan.resident_peak_bytes for s, (plan, _) in runs.items()}
    held = {s: h for s, (_, h) in runs.items()}  # measured: the allocator's figures
    assert held[0] == planned[0] == runs[0][0].baseline_saved_bytes
    assert held[2] < held[1] < held[0]
    # stride 1 keeps each block's output but the last (7 tensors); stride 2 keeps 3.
    assert held[1] == planned[1] == 7 * ACT_BYTES
    assert held[2] == planned[2] == 3 * ACT_BYTES


def test_graph_without_blocks_says_so() -> None:
    model = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, 1))
    x = torch.randn(B, D)
    compiled = torch.compile(model, backend=fxckpt.backend(segment_stride=2, compiler="eager"))
    compiled(x).sum().backward()
    (plan,) = fxckpt.last_plans()
    assert any("no repeated blocks" in n for n in plan.notes)
    assert all(r.decision.kind == "keep" for r in plan.activations)


def test_blocks_regex_overrides_detection() -> None:
    torch.manual_seed(0)
    model = Stack(4)
    x = torch.randn(B, T, D, requires_grad=True)
    # Only blocks 2 and 3 match, so only they can form segments.
    backend = fxckpt.backend(segment_stride=1, blocks=r"layers\.([23])$", compiler="eager")
    torch.compile(model, backend=backend)(x).backward()
    (plan,) = fxckpt.last_plans()
    blocks = {r.block for r in plan.activations if r.block is not None}
    assert blocks <= {2, 3} and blocks
    block2 = [r.decision.kind for r in plan.activations if r.block == 2]
    # Block 2 is a one-block segment: its interior is recomputed and only its output, the
    # input of segment 3, stays.
    assert block2.count("keep") == 1 and block2.count("recompute") >= 3


def test_block_index_applies_the_stride_to_blocks_compiled_one_by_one() -> None:
    # Per-block compile (FSDP2's recipe): each graph holds one block, so detection finds no
    # repeated blocks; block_index says which block a graph is, and the stride follows it.
    torch.manual_seed(0)
    model = Stack(4)
    ref = copy.deepcopy(model)
    x = torch.randn(B, T, D, requires_grad=True)
    for i, layer in enumerate(model.layers):
        layer.compile(backend=fxckpt.backend(
            segment_stride=2, segment_width=1, block_index=i, compiler="eager"))
    got = step(model, (x,), model)
    want = step(ref, (x.detach().clone().requires_grad_(),), ref)
    torch.testing.assert_close(got[0], want[0])
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(got[2], want[2])
    plans = fxckpt.last_plans()
    assert len(plans) == 4  # dynamo keeps one graph per backend: none is shared
    kinds = {}
    for plan in plans:
        (block,) = {r.block for r in plan.activations}
        kinds[block] = {r.decision.kind for r in plan.activations}
        assert plan.notes == [f"the graph is block {block} (block_index)"]
    assert kinds == {0: {"recompute"}, 1: {"keep"}, 2: {"recompute"}, 3: {"keep"}}


class SdpaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, T, 3, 2, D // 2).unbind(2)
        y = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True
        )
        return x + self.o(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize(
    "compiler", ["eager", pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.inductor])]
)
def test_sdpa_without_dropout_is_recomputed_inside_segments(compiler: str) -> None:
    # torch tags SDPA nondeterministic_seeded even at dropout_p=0; fxckpt must not keep it.
    torch.manual_seed(0)
    model = nn.Sequential(*(SdpaBlock() for _ in range(3)))
    wrapped = nn.ModuleDict({"layers": model})
    x = torch.randn(B, T, D, requires_grad=True)
    compiled = torch.compile(
        lambda t: wrapped["layers"](t).sum(),
        backend=fxckpt.backend(segment_stride=1, compiler=compiler),
    )
    compiled(x).backward()
    got = x.grad.clone()
    x.grad = None
    wrapped["layers"](x).sum().backward()
    torch.testing.assert_close(got, x.grad)
    (plan,) = fxckpt.last_plans()
    # Besides the inputs of blocks 1 and 2, only the CPU RNG states (uint8) the partitioner
    # saves to replay a recomputed SDPA stay: no attention output.
    kept = [r for r in plan.activations if r.decision.kind == "keep" and r.dtype == "float32"]
    assert sorted(r.module for r in kept) == ["layers.0", "layers.1"], [r.name for r in kept]
