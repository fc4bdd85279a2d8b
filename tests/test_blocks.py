from __future__ import annotations

import pytest
import torch

from fxckpt.graph.blocks import find_blocks, module_path


@pytest.mark.parametrize(
    "raw,want",
    [
        ("L['self'].layers.0.ln", "layers.0.ln"),
        ("L['self'].layers[3].attn", "layers.3.attn"),
        ("L['self']._modules['model']._modules['layers']._modules['7']", "model.layers.7"),
        ("L['mod'].h.11.mlp", "h.11.mlp"),
        ("head", "head"),
        ("L['args'][0].model.layers.3.mlp", "model.layers.3.mlp"),
        ("L['args'][0]._modules['lm_head']", "lm_head"),
        # A model held by a wrapper module (a diffusers transformer inside a loss module).
        (
            "L['self'].model.__dict__['_modules']['transformer_blocks'].1.attn",
            "model.transformer_blocks.1.attn",
        ),
    ],
)
def test_module_path_normalises_dynamo_paths(raw: str, want: str) -> None:
    assert module_path(raw) == want


def _joint_of(model: torch.nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    captured: list[torch.fx.GraphModule] = []

    def partition(joint, inputs, **kw):
        captured.append(joint)
        from torch._functorch.partitioners import default_partition

        return default_partition(joint, inputs, **kw)

    def backend(gm, inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(
            fw_compiler=lambda g, i: make_boxed_func(g.forward),
            bw_compiler=lambda g, i: make_boxed_func(g.forward),
            partition_fn=partition,
        )(gm, inputs)

    torch.compile(model, backend=backend)(x).sum().backward()
    return captured[0]


class Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        x = self.a(x)
        for m in self.b:
            x = m(x)
        return x


class Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Inner() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def test_auto_detection_picks_the_outer_container() -> None:
    joint = _joint_of(Outer(), torch.randn(2, 4))
    facts = find_blocks(joint)
    assert facts.prefix == "blocks"
    assert facts.blocks == (0, 1, 2)
    assert facts.source == "auto"


def test_regex_picks_inner_blocks() -> None:
    joint = _joint_of(Outer(), torch.randn(2, 4))
    facts = find_blocks(joint, r"blocks\.\d+\.b\.(\d+)$")
    assert facts.blocks == (0, 1)
    assert facts.source == "regex"


def test_no_blocks() -> None:
    joint = _joint_of(torch.nn.Linear(4, 4), torch.randn(2, 4))
    facts = find_blocks(joint)
    assert facts.source == "none" and facts.blocks == ()
