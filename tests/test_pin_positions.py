"""The pass that pins fxckpt's ops for Inductor, on the graphs themselves (no Inductor run, so
this also runs on torch 2.11, whose ``control_deps`` it imports). What Inductor then does
with them is read from its generated code in ``test_inductor_order.py``."""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
import torch.fx as fx
from expecttest import TestCase

import fxckpt
from fxckpt.graph import meta
from fxckpt.passes.schedule import pin_positions

ALL = {"offload": "all", "min_offload_bytes": 0, "cost_model": "unit", "bandwidth": "0.05GB/s"}
ROLES = (meta.ROLE_OFFLOAD, meta.ROLE_OFFLOAD_DONE, meta.ROLE_PREFETCH, meta.ROLE_WAIT, meta.ROLE_NOTE)


def _graphs(model: torch.nn.Module, inputs: tuple[Any, ...]) -> list[fx.GraphModule]:
    """fxckpt's forward and backward for ``model`` as the eager compiler runs them (unpinned)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from fxckpt.backend import FxckptPartitioner

    graphs: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, _: Any) -> Any:
        graphs.append(copy.deepcopy(gm))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=FxckptPartitioner(fxckpt.Options(**ALL)))
    torch.compile(model, backend=backend)(*inputs).sum().backward()
    return graphs


def _chain() -> tuple[torch.nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8, bias=False), torch.nn.ReLU(), torch.nn.Linear(8, 8, bias=False),
        torch.nn.ReLU(), torch.nn.Linear(8, 1, bias=False),
    )  # fmt: skip
    return model, (torch.randn(2, 4),)


def _is_compute(n: fx.Node) -> bool:
    from fxckpt.passes.schedule import _computes

    return _computes(n) or getattr(n.target, "_name", "") == "control_deps"


def test_every_op_sits_between_the_compute_before_and_after_it() -> None:
    for gm in _graphs(*_chain()):
        pinned = pin_positions(gm)
        nodes = list(pinned.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        ops = [n for n in nodes if n.meta.get(meta.ROLE) in ROLES]
        assert ops
        for op in ops:
            before = [n for n in nodes[: pos[op]] if _is_compute(n) or n in ops]
            after = [n for n in nodes[pos[op] + 1 :] if _is_compute(n)]
            # Not earlier: the op reads (as data or as its `after` list) the op or compute just
            # before it.
            if before:
                assert before[-1] in op.all_input_nodes, (op, before[-1])
            # Not later: the next compute node depends on it through control_deps, or reads it.
            if after and op.meta[meta.ROLE] != meta.ROLE_NOTE:
                nxt = after[0]
                deps = nxt.args[0] if getattr(nxt.target, "_name", "") == "control_deps" else ()
                assert op in deps or op in nxt.all_input_nodes or any(
                    op in d.all_input_nodes for d in ops if pos[op] < pos[d] < pos[nxt]
                ), (op, nxt)


def _normalise(code: str) -> str:
    code = re.sub(r"'\{.*\}'", "'<plan>'", code)
    code = re.sub(r"\s*#.*", "", code)
    return "\n".join(line.rstrip() for line in code.strip().splitlines() if line.strip())


class TestGoldenPinnedGraphs(TestCase):
    def test_forward_and_backward_code(self) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        fw, bw = (_normalise(pin_positions(gm).code) for gm in _graphs(model, (torch.randn(2, 4),)))
        self.assertExpectedInline(fw, """\
def forward(self, primals_1, primals_2, primals_3, primals_4, primals_5):
    t = torch.ops.aten.t.default(primals_1);  primals_1 = None
    addmm = torch.ops.aten.addmm.default(primals_2, primals_3, t);  primals_2 = t = None
    tanh = torch.ops.aten.tanh.default(addmm);  addmm = None
    tanh_handle = torch.ops.fxckpt.offload.default(tanh)
    t_1 = torch.ops.aten.t.default(primals_4)
    subgraph_addmm_1 = self.subgraph_addmm_1
    addmm_1 = torch.ops.higher_order.control_deps((tanh_handle,), subgraph_addmm_1, primals_5, tanh, t_1);  subgraph_addmm_1 = primals_5 = t_1 = None
    offload_done_default = torch.ops.fxckpt.offload_done.default(tanh_handle, tanh, [addmm_1]);  tanh = None
    note_saved_default = torch.ops.fxckpt.note_saved.default([], '<plan>', [offload_done_default]);  offload_done_default = note_saved_default = None
    return (addmm_1, primals_3, primals_4, tanh_handle)""")
        self.assertExpectedInline(bw, """\
def forward(self, primals_3, primals_4, tanh_handle, tangents_1):
    t_1 = torch.ops.aten.t.default(primals_4);  primals_4 = None
    t_2 = torch.ops.aten.t.default(t_1);  t_1 = None
    prefetch_default = torch.ops.fxckpt.prefetch.default(tanh_handle)
    subgraph_mm = self.subgraph_mm
    mm = torch.ops.higher_order.control_deps((prefetch_default,), subgraph_mm, tangents_1, t_2);  subgraph_mm = t_2 = None
    t_3 = torch.ops.aten.t.default(tangents_1)
    wait_default = torch.ops.fxckpt.wait.default(tanh_handle, prefetch_default, [2, 8], [8, 1], torch.float32, device(type='cpu'), [mm]);  tanh_handle = prefetch_default = None
    mm_1 = torch.ops.aten.mm.default(t_3, wait_default);  t_3 = None
    t_4 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    subgraph_sum_1 = self.subgraph_sum_1
    sum_1 = torch.ops.higher_order.control_deps((wait_default,), subgraph_sum_1, tangents_1);  subgraph_sum_1 = tangents_1 = None
    view = torch.ops.aten.view.default(sum_1, [1]);  sum_1 = None
    t_5 = torch.ops.aten.t.default(t_4);  t_4 = None
    detach = torch.ops.aten.detach.default(wait_default);  wait_default = None
    detach_1 = torch.ops.aten.detach.default(detach);  detach = None
    tanh_backward = torch.ops.aten.tanh_backward.default(mm, detach_1);  mm = detach_1 = None
    t_6 = torch.ops.aten.t.default(tanh_backward)
    mm_2 = torch.ops.aten.mm.default(t_6, primals_3);  t_6 = primals_3 = None
    t_7 = torch.ops.aten.t.default(mm_2);  mm_2 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(tanh_backward, [0], True);  tanh_backward = None
    view_1 = torch.ops.aten.view.default(sum_2, [8]);  sum_2 = None
    t_8 = torch.ops.aten.t.default(t_7);  t_7 = None
    return (t_8, view_1, None, t_5, view)""")


def test_fusable_runs_are_connected_pointwise_ops_and_reductions() -> None:
    # Positions inside these runs move to their edges under Inductor (place_offloads).
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxckpt.passes.schedule import _fusable_runs

    def f(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x @ w                       # mm: ends any run
        a = torch.relu(h) * 2           # relu, mul: one run, reading the mm
        s = a.sum(-1)                   # sum: a reduction of the run joins it
        u = t + 1                       # reads nothing the run reads: a new run
        v = u * 3
        return (s @ w[:1].t(), v)       # fmt: skip

    gm = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4), torch.randn(4))
    nodes = list(gm.graph.nodes)
    names = {i: n.name for i, n in enumerate(nodes)}
    runs = {names[i]: (names[a], names[b]) for i, (a, b) in _fusable_runs(nodes).items()}
    assert runs == {
        "relu": ("relu", "sum_1"), "mul": ("relu", "sum_1"), "sum_1": ("relu", "sum_1"),
        "add": ("add", "mul_1"), "mul_1": ("add", "mul_1"),
    }  # fmt: skip
