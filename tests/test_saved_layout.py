"""passes.saved_layout on partitioned graphs, without Inductor's code generation.

The pass asks Inductor's own rules which saved graph inputs it would copy into channels-last
(a 4-D conv weight, the model's input) and saves each as ``unsqueeze(x, 0)`` instead, which
the backward squeezes. Here the partition comes from fxckpt's partitioner under
``compiler="eager"``: the graphs run as FX code, so the rewritten pair must still give
eager's gradients, and the saved views must share the inputs' storage (no copy).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx
from equality import step
from models import ConvBNNet

import fxckpt
from fxckpt.graph.activations import saved_nodes
from fxckpt.passes.saved_layout import keep_input_layouts

aten = torch.ops.aten


def _partitioned(model: torch.nn.Module, x: torch.Tensor) -> list[tuple[fx.GraphModule, fx.GraphModule, int]]:
    """fxckpt's (forward, backward, number of forward outputs), captured as it partitions."""
    from fxckpt.backend import FxckptPartitioner

    captured: list[tuple[fx.GraphModule, fx.GraphModule, int]] = []
    call = FxckptPartitioner.__call__

    def capture(self: Any, gm: fx.GraphModule, inputs: Any, **kw: Any) -> Any:
        n = kw["num_fwd_outputs"]
        fw, bw = call(self, gm, inputs, **kw)
        captured.append((copy.deepcopy(fw), copy.deepcopy(bw), n))
        return fw, bw

    FxckptPartitioner.__call__ = capture  # type: ignore[method-assign]
    try:
        torch.compile(model, backend=fxckpt.backend(compiler="eager"))(x).backward()
    finally:
        FxckptPartitioner.__call__ = call  # type: ignore[method-assign]
    return captured


def test_saved_conv_weights_and_input_leave_as_views_and_the_backward_squeezes_them() -> None:
    torch.manual_seed(0)
    model, x = ConvBNNet(8, 2), torch.randn(2, 8, 6, 6)
    ((fw, bw, n),) = _partitioned(copy.deepcopy(model), x)
    before = [s.name for s in saved_nodes(fw, n)]
    kept = keep_input_layouts(fw, bw, n)
    # Two conv weights and the input: on the CPU Inductor always lays convolutions out
    # channels-last (mkldnn), and would have saved a copy of each.
    assert len(kept.names) == 3 and kept.copy_bytes == 2 * 8 * 8 * 3 * 3 * 4 + 2 * 8 * 6 * 6 * 4
    saved = saved_nodes(fw, n)
    assert len(saved) == len(before)
    views = [s for s in saved if s.target is aten.unsqueeze.default]
    assert sorted(v.args[0].name for v in views) == sorted(kept.names)
    assert all(v.args[0].op == "placeholder" and v.meta["val"].dim() == 5 for v in views)
    squeezes = [node for node in bw.graph.nodes if node.target is aten.squeeze.dim]
    assert len(squeezes) == 3 and all(s.args[0].op == "placeholder" for s in squeezes)
    assert any("3 saved graph inputs stay in their own layout" in note for note in kept.note())


def test_without_layout_optimization_the_pass_changes_nothing() -> None:
    torch.manual_seed(0)
    model, x = ConvBNNet(8, 2), torch.randn(2, 8, 6, 6)
    ((fw, bw, n),) = _partitioned(copy.deepcopy(model), x)
    code = fw.code, bw.code
    with torch._inductor.config.patch(layout_optimization=False):
        assert keep_input_layouts(fw, bw, n).names == ()
    assert (fw.code, bw.code) == code


def test_inductor_partitions_train_like_eager_with_the_views_in_the_graph() -> None:
    # Under compiler="eager" the pass does not run (nothing re-lays out); run the rewritten
    # pair as the backend would, through aot_autograd, and compare with eager.
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from fxckpt.backend import FxckptPartitioner
    from fxckpt.options import Options

    partitioner = FxckptPartitioner(Options(compiler="eager"))
    seen: list[int] = []

    def partition(gm: fx.GraphModule, inputs: Any, **kw: Any) -> Any:
        fw, bw = partitioner(gm, inputs, **kw)
        seen.append(len(keep_input_layouts(fw, bw, kw["num_fwd_outputs"]).names))
        return fw, bw

    def nop(gm: fx.GraphModule, _: Any) -> Any:
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition)
    torch.manual_seed(0)
    model, x = ConvBNNet(8, 2), torch.randn(2, 8, 6, 6, requires_grad=True)
    reference = copy.deepcopy(model)
    got = step(model, (x,), torch.compile(model, backend=backend))
    want = step(reference, (x.detach().clone().requires_grad_(),), reference)
    assert seen == [3]
    torch.testing.assert_close(got[0], want[0])
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name])
    torch.testing.assert_close(got[2][0], want[2][0])
