"""Copy buckets end to end: tensors of one block copied as one transfer train exactly as eager,
with fewer hand-offs to the copy engine, and the graphs read as planned."""

from __future__ import annotations

import copy
import operator
import re
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from equality import _fresh_inputs, assert_step_matches, step
from expecttest import TestCase
from measured import measure_forward
from models import GPT, gpt_inputs

import fxckpt
from fxckpt.graph import meta
from fxckpt.passes.schedule import _computes, pin_positions
from fxckpt.runtime import engine

# The flops cost model prices a per-copy overhead, so buckets are on (coalesce="auto").
ALL = {"compiler": "eager", "offload": "all", "min_offload_bytes": 0}
BUCKET_OPS = ("offload_many", "offload_many_done", "wait_many")


@pytest.fixture(autouse=True)
def _engine_defaults():
    engine.configure()
    yield
    engine.configure()


class Gate(nn.Module):
    """tanh(a x) * sigmoid(b x) + shift: two saved tensors made and last read inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        # Its gradient reads only the incoming gradient: compute the backward may run anywhere.
        self.shift = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x)) * torch.sigmoid(self.b(x)) + self.shift


class Gates(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Gate() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _handoffs(options: dict[str, Any]) -> tuple[int, int]:
    """Hand-offs to the copy engine and offloaded bytes of two compiled GPT steps, each
    checked against eager (loss and every gradient)."""
    torch._dynamo.reset()
    fxckpt.reset_stats()
    torch.manual_seed(0)
    assert_step_matches(GPT(n_layers=2), gpt_inputs(), fxckpt.backend(**options), steps=2)
    s = fxckpt.stats()
    assert s["offloaded_bytes"] == s["prefetched_bytes"] > 0
    return s["copy_handoffs"], s["offloaded_bytes"]


def test_buckets_train_like_eager_with_fewer_handoffs_and_the_same_bytes() -> None:
    alone, alone_bytes = _handoffs({**ALL, "coalesce": "never"})
    together, together_bytes = _handoffs(ALL)
    # The same tensors go to the host (each span padded to whole cache lines at most) ...
    assert alone_bytes <= together_bytes
    # ... in fewer transfers: a GPT block's tensors of one dtype go in one bucket each way.
    assert 0 < together < alone / 2, (together, alone)


def test_a_bucketed_forward_leaves_nothing_on_the_device_as_measured() -> None:
    torch.manual_seed(0)
    compiled = torch.compile(GPT(n_layers=2), backend=fxckpt.backend(**ALL))
    m = measure_forward(compiled, gpt_inputs())
    assert fxckpt.stats()["copy_handoffs"] > 0
    # The meter reads the allocator: every bucket was joined and its members freed.
    assert m.held_bytes == 0 and m.peak_bytes > 0


def test_a_delayed_bucket_copy_stays_exact() -> None:
    # Copies land late and fresh buffers are poisoned: a member read before its bucket's
    # wait, or a source freed before the copy read it, changes the gradients.
    engine.configure(copy_delay_s=0.002, poison_fresh=True)
    torch.manual_seed(0)
    assert_step_matches(GPT(n_layers=2), gpt_inputs(), fxckpt.backend(**ALL), steps=2)


def test_retain_graph_restores_a_bucket_twice() -> None:
    torch.manual_seed(0)
    model = GPT(n_layers=2)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxckpt.backend(**ALL))
    inputs = gpt_inputs()
    loss = compiled(*_fresh_inputs(inputs))
    grads = []
    for retain in (True, False):
        model.zero_grad(set_to_none=True)
        loss.backward(retain_graph=retain)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    want = step(reference, _fresh_inputs(inputs), reference)
    assert fxckpt.stats()["copy_handoffs"] > 0
    for got in grads:
        assert got.keys() == want[1].keys()
        for name, g in want[1].items():
            torch.testing.assert_close(got[name], g, msg=lambda m, n=name: f"{n}: {m}")


def _graphs(model: nn.Module, inputs: tuple[Any, ...]) -> list[fx.GraphModule]:
    """fxckpt's forward and backward for ``model`` as the eager compiler receives them."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from fxckpt.backend import FxckptPartitioner

    graphs: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, _: Any) -> Any:
        graphs.append(copy.deepcopy(gm))
        return make_boxed_func(gm.forward)

    # A fixed link: with the measured one, where the joins go would depend on this machine's
    # memcpy rate (and its load), and the golden text with it.
    options = fxckpt.Options(offload="all", min_offload_bytes=0, bandwidth="100GB/s")
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=FxckptPartitioner(options))
    torch.compile(model, backend=backend)(*inputs).sum().backward()
    return graphs


def _normalise(code: str) -> str:
    code = re.sub(r"'\{.*\}'", "'<plan>'", code)  # the plan payload of note_saved
    code = re.sub(r"\s*#.*", "", code)
    return "\n".join(line.rstrip() for line in code.strip().splitlines() if line.strip())


def _gates() -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    return Gates(), (torch.randn(2, 4, requires_grad=True),)


def _after_first_bucket_wait(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with the compute that reads only graph inputs (the shift's gradient) moved to
    right after the first bucket's wait and its members: compute that a scheduler may run
    anywhere, which pinning must order after that wait."""
    nodes = list(gm.graph.nodes)
    waits = [n for n in nodes if getattr(n.target, "_opname", "") == "wait_many"]
    if not waits:
        return gm
    anchor = max(waits[0].users, key=nodes.index)
    free = [n for n in nodes if _computes(n) and all(a.op == "placeholder" for a in n.all_input_nodes)]
    assert free
    for n in free:
        for m in (n, *n.users):  # with the views reading it
            anchor.append(m)
            anchor = m
    gm.graph.lint()
    return gm


def test_pinned_bucket_ops_sit_between_the_compute_around_them() -> None:
    for gm in _graphs(*_gates()):
        pinned = pin_positions(_after_first_bucket_wait(gm))
        nodes = list(pinned.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        ops = [n for n in nodes if meta.ROLE in n.meta]
        assert {getattr(o.target, "_opname", "") for o in ops} & set(BUCKET_OPS)
        for last, op in zip(ops, ops[1:], strict=False):
            prev = [n for n in nodes[: pos[op]] if n in ops or _computes(n)][-1]
            # Not earlier: each op reads the compute just before it and the op before it (the
            # chain); a bucket's wait returns a list, which is read through its first member.
            reads = set(op.all_input_nodes)
            through = {r.args[0] for r in reads if r.target is operator.getitem}
            assert prev in reads | through, (op, prev)
            assert last in reads | through, (op, last)
        # Not later: compute is ordered after an op through tensors only (torch 2.11's
        # control_deps drops any other dependency without a word).
        pinned_after = [d for n in nodes if getattr(n.target, "_name", "") == "control_deps" for d in n.args[0]]
        assert pinned_after
        assert all(isinstance(d.meta.get("val"), torch.Tensor) for d in pinned_after)


class TestGoldenBucketGraphs(TestCase):
    def test_forward_and_backward_code(self) -> None:
        fw, bw = (_normalise(gm.code) for gm in _graphs(*_gates()))
        self.assertExpectedInline(fw, """\
def forward(self, primals_1, primals_2, primals_3, primals_4, primals_5, primals_6, primals_7):
    t = torch.ops.aten.t.default(primals_1)
    mm = torch.ops.aten.mm.default(primals_2, t);  t = None
    tanh = torch.ops.aten.tanh.default(mm);  mm = None
    t_1 = torch.ops.aten.t.default(primals_3)
    mm_1 = torch.ops.aten.mm.default(primals_2, t_1);  t_1 = None
    sigmoid = torch.ops.aten.sigmoid.default(mm_1);  mm_1 = None
    tanh_bucket = torch.ops.fxckpt.offload_many.default([tanh, sigmoid])
    mul = torch.ops.aten.mul.Tensor(tanh, sigmoid)
    offload_many_done_default = torch.ops.fxckpt.offload_many_done.default(tanh_bucket, [tanh, sigmoid]);  tanh = sigmoid = offload_many_done_default = None
    add = torch.ops.aten.add.Tensor(mul, primals_4);  mul = primals_4 = None
    add_handle = torch.ops.fxckpt.offload.default(add)
    t_2 = torch.ops.aten.t.default(primals_5)
    mm_2 = torch.ops.aten.mm.default(add, t_2);  t_2 = None
    tanh_1 = torch.ops.aten.tanh.default(mm_2);  mm_2 = None
    t_3 = torch.ops.aten.t.default(primals_6)
    mm_3 = torch.ops.aten.mm.default(add, t_3);  t_3 = None
    offload_done_default = torch.ops.fxckpt.offload_done.default(add_handle, add);  add = offload_done_default = None
    sigmoid_1 = torch.ops.aten.sigmoid.default(mm_3);  mm_3 = None
    tanh_1_bucket = torch.ops.fxckpt.offload_many.default([tanh_1, sigmoid_1])
    mul_1 = torch.ops.aten.mul.Tensor(tanh_1, sigmoid_1)
    offload_many_done_default_1 = torch.ops.fxckpt.offload_many_done.default(tanh_1_bucket, [tanh_1, sigmoid_1]);  tanh_1 = sigmoid_1 = offload_many_done_default_1 = None
    add_1 = torch.ops.aten.add.Tensor(mul_1, primals_7);  mul_1 = primals_7 = None
    note_saved_default = torch.ops.fxckpt.note_saved.default([], '<plan>');  note_saved_default = None
    return (add_1, primals_1, primals_2, primals_3, primals_5, primals_6, tanh_bucket, add_handle, tanh_1_bucket)""")
        self.assertExpectedInline(bw, """\
def forward(self, primals_1, primals_2, primals_3, primals_5, primals_6, tanh_bucket, add_handle, tanh_1_bucket, tangents_1):
    prefetch_default_2 = torch.ops.fxckpt.prefetch.default(tanh_1_bucket)
    sum_1 = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True)
    view = torch.ops.aten.view.default(sum_1, [4]);  sum_1 = None
    wait_many_default_1 = torch.ops.fxckpt.wait_many.default(tanh_1_bucket, prefetch_default_2, [2, 4, 2, 4], [4, 1, 4, 1], [2, 2], torch.float32, device(type='cpu'));  tanh_1_bucket = prefetch_default_2 = None
    getitem_2 = wait_many_default_1[0]
    getitem_3 = wait_many_default_1[1];  wait_many_default_1 = None
    mul_2 = torch.ops.aten.mul.Tensor(tangents_1, getitem_2)
    mul_3 = torch.ops.aten.mul.Tensor(tangents_1, getitem_3);  tangents_1 = None
    detach_3 = torch.ops.aten.detach.default(getitem_3);  getitem_3 = None
    detach_4 = torch.ops.aten.detach.default(detach_3);  detach_3 = None
    prefetch_default_1 = torch.ops.fxckpt.prefetch.default(add_handle)
    sigmoid_backward = torch.ops.aten.sigmoid_backward.default(mul_2, detach_4);  mul_2 = detach_4 = None
    t_4 = torch.ops.aten.t.default(sigmoid_backward)
    wait_default = torch.ops.fxckpt.wait.default(add_handle, prefetch_default_1, [2, 4], [4, 1], torch.float32, device(type='cpu'));  add_handle = prefetch_default_1 = None
    mm_4 = torch.ops.aten.mm.default(t_4, wait_default);  t_4 = None
    t_5 = torch.ops.aten.t.default(mm_4);  mm_4 = None
    t_3 = torch.ops.aten.t.default(primals_6);  primals_6 = None
    t_6 = torch.ops.aten.t.default(t_3);  t_3 = None
    mm_5 = torch.ops.aten.mm.default(sigmoid_backward, t_6);  sigmoid_backward = t_6 = None
    t_7 = torch.ops.aten.t.default(t_5);  t_5 = None
    detach_2 = torch.ops.aten.detach.default(getitem_2);  getitem_2 = None
    detach_5 = torch.ops.aten.detach.default(detach_2);  detach_2 = None
    tanh_backward = torch.ops.aten.tanh_backward.default(mul_3, detach_5);  mul_3 = detach_5 = None
    t_8 = torch.ops.aten.t.default(tanh_backward)
    mm_6 = torch.ops.aten.mm.default(t_8, wait_default);  t_8 = wait_default = None
    t_9 = torch.ops.aten.t.default(mm_6);  mm_6 = None
    t_2 = torch.ops.aten.t.default(primals_5);  primals_5 = None
    t_10 = torch.ops.aten.t.default(t_2);  t_2 = None
    mm_7 = torch.ops.aten.mm.default(tanh_backward, t_10);  tanh_backward = t_10 = None
    add_2 = torch.ops.aten.add.Tensor(mm_5, mm_7);  mm_5 = mm_7 = None
    t_11 = torch.ops.aten.t.default(t_9);  t_9 = None
    prefetch_default = torch.ops.fxckpt.prefetch.default(tanh_bucket)
    sum_2 = torch.ops.aten.sum.dim_IntList(add_2, [0], True)
    view_1 = torch.ops.aten.view.default(sum_2, [4]);  sum_2 = None
    wait_many_default = torch.ops.fxckpt.wait_many.default(tanh_bucket, prefetch_default, [2, 4, 2, 4], [4, 1, 4, 1], [2, 2], torch.float32, device(type='cpu'));  tanh_bucket = prefetch_default = None
    getitem = wait_many_default[0]
    getitem_1 = wait_many_default[1];  wait_many_default = None
    mul_4 = torch.ops.aten.mul.Tensor(add_2, getitem)
    mul_5 = torch.ops.aten.mul.Tensor(add_2, getitem_1);  add_2 = None
    detach_1 = torch.ops.aten.detach.default(getitem_1);  getitem_1 = None
    detach_6 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    sigmoid_backward_1 = torch.ops.aten.sigmoid_backward.default(mul_4, detach_6);  mul_4 = detach_6 = None
    t_12 = torch.ops.aten.t.default(sigmoid_backward_1)
    mm_8 = torch.ops.aten.mm.default(t_12, primals_2);  t_12 = None
    t_13 = torch.ops.aten.t.default(mm_8);  mm_8 = None
    t_1 = torch.ops.aten.t.default(primals_3);  primals_3 = None
    t_14 = torch.ops.aten.t.default(t_1);  t_1 = None
    mm_9 = torch.ops.aten.mm.default(sigmoid_backward_1, t_14);  sigmoid_backward_1 = t_14 = None
    t_15 = torch.ops.aten.t.default(t_13);  t_13 = None
    detach = torch.ops.aten.detach.default(getitem);  getitem = None
    detach_7 = torch.ops.aten.detach.default(detach);  detach = None
    tanh_backward_1 = torch.ops.aten.tanh_backward.default(mul_5, detach_7);  mul_5 = detach_7 = None
    t_16 = torch.ops.aten.t.default(tanh_backward_1)
    mm_10 = torch.ops.aten.mm.default(t_16, primals_2);  t_16 = primals_2 = None
    t_17 = torch.ops.aten.t.default(mm_10);  mm_10 = None
    t = torch.ops.aten.t.default(primals_1);  primals_1 = None
    t_18 = torch.ops.aten.t.default(t);  t = None
    mm_11 = torch.ops.aten.mm.default(tanh_backward_1, t_18);  tanh_backward_1 = t_18 = None
    add_3 = torch.ops.aten.add.Tensor(mm_9, mm_11);  mm_9 = mm_11 = None
    t_19 = torch.ops.aten.t.default(t_17);  t_17 = None
    return (t_19, add_3, t_15, view_1, t_11, t_7, view)""")


def test_views_of_one_storage_cross_the_link_once_and_train_like_eager() -> None:
    # A fused qkv projection split into heads: at batch 1 the backward saves three views of
    # one storage (the heads' reshape for bmm needs no copy). Offloaded, they travel as one
    # bucket whose stretch of that storage is copied once each way (not once per view), and
    # come back as views of one buffer.
    from fuzz_models import Spec, build

    torch._dynamo.reset()
    fxckpt.reset_stats()
    model, inputs = build(Spec(ops=("attention",), n_blocks=2, batch=1, dropout=0.0))
    options = {**ALL, "coalesce": "never"}
    compiled = assert_step_matches(model, inputs, fxckpt.backend(**options), steps=2)
    (plan,) = fxckpt.last_plans()
    rows = [r for r in plan.activations if r.decision.kind == "offload"]
    storages = [r.storage or r.name for r in rows]
    assert len(set(storages)) < len(storages)  # some views share a storage
    s = fxckpt.stats()
    # Each storage's bytes cross at most once per step (views reach no further than it).
    assert s["offloaded_bytes"] == s["prefetched_bytes"] <= 2 * plan.offloaded_bytes
    assert s["offload_calls"] == 2 * len(set(storages))
    del compiled


def test_a_tensor_later_blocks_read_in_the_backward_has_a_bucket_of_its_own(monkeypatch, tmp_path) -> None:
    """A Llama's first layer builds the causal mask that every layer's attention reads: in the
    backward it is needed from the last layer's attention on. In the first layer's bucket it
    would bring the whole layer back at the start of the backward (its copy window the
    shortest of all layers, where it should be the longest)."""
    import json

    import fxckpt.planning.plan_round as plan_round
    from fxckpt.inspect import inspect_options, plan_workload
    from fxckpt.workloads import hf_workload

    pytest.importorskip("transformers")
    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 896,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
              "vocab_size": 4096, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    seen: list[tuple[Any, list[int]]] = []
    real = plan_round.copy_buckets

    def record(storages: Any, *args: Any) -> list[int]:
        ids = real(storages, *args)
        seen.append((storages, ids))
        return ids

    monkeypatch.setattr(plan_round, "copy_buckets", record)
    work = hf_workload(tmp_path, seq=512, dtype="float32")
    plan_workload(work, inspect_options(memory_budget=0.3, on_infeasible="warn"))
    assert seen
    storages, ids = seen[0]  # the first round: plain min-cut's saved tensors

    def need(block: int) -> int:
        """When the bucket of the block's matmul outputs must be back: the earliest backward
        use among its members."""
        own = [i for i, s in enumerate(storages)
               if any(a.block == block and a.op == "mm.default" for a in s.members)]  # fmt: skip
        buckets = {ids[i] for i in own if ids[i] >= 0}
        assert buckets, block
        return min(a.first_bw_use for i, s in enumerate(storages) if ids[i] in buckets
                   for a in s.members if a.first_bw_use >= 0)  # fmt: skip

    # The mask (a masked_fill or an expand, by transformers' version and length) is layer 0's
    # and read in the backward before anything of layer 1's.
    first_of_1 = min(a.first_bw_use for s in storages for a in s.members
                     if a.block == 1 and a.first_bw_use >= 0)  # fmt: skip
    assert any(0 <= a.first_bw_use < first_of_1 for s in storages for a in s.members if a.block == 0)
    # The backward runs the layers in reverse: layer 0's bucket comes back last.
    assert need(0) > need(1) > need(2)
