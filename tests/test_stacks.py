"""Block detection finds every repeated stack of a model and numbers them in execution order.

Detection used to take one container only: T5's and Whisper's decoder (not their encoder),
ResNet's ``layer2``, so ``segment_stride=2`` left most of the model saved (T5 held 60 % of
what aot_eager holds). Here each model trains one step at ``segment_stride=2`` under
``compiler="eager"``; every stack is found and numbered one after another, the stride
applies across them, the result equals eager, and the meter shows what that bought.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import pytest
import torch
import torch.nn as nn
from equality import assert_step_matches
from measured import measure_forward
from models import ResNet, hf_zoo_model

import fxckpt
from fxckpt.errors import OptionsError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers")
TOL = {"atol": 1e-5, "rtol": 1e-4}


def _resnet() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return ResNet((8, 16, 32, 64), blocks=2), (torch.randn(2, 3, 16, 16, generator=g), torch.tensor([1, 3]))


# model -> (the stacks, in execution order, each with its blocks' module-path prefix)
CASES: dict[str, list[tuple[str, range]]] = {
    "t5": [("encoder.block", range(0, 3)), ("decoder.block", range(3, 6))],
    "whisper": [("model.encoder.layers", range(0, 3)), ("model.decoder.layers", range(3, 6))],
    "resnet": [("layer1", range(0, 2)), ("layer2", range(2, 4)), ("layer3", range(4, 6)),
               ("layer4", range(6, 8))],
}  # fmt: skip


def _case(name: str) -> tuple[nn.Module, Any]:
    if name == "resnet":
        return _resnet()
    return hf_zoo_model(name, layers=3)  # odd: the second stack's numbers depend on the first's


# torch 2.11's dynamo breaks Hugging Face's T5 and Whisper between the encoder and the
# decoder: each stack is then a graph of its own, its blocks numbered from 0 there, and a
# stride applies within each graph (docs/limitations.md). Both stacks in one graph is 2.13's.
ONE_GRAPH = pytest.mark.skipif(
    torch.__version__ < "2.13",
    reason="torch 2.11 compiles the encoder and the decoder as separate graphs (a graph break)",
)


@functools.cache
def _trained(name: str, blocks: str | None = None) -> tuple[fxckpt.Plan, int]:
    """One training step at segment_stride=2, equal to eager; the plan and the held bytes."""
    torch._dynamo.reset()
    fxckpt.reset_stats()
    model, inputs = _case(name)
    backend = fxckpt.backend(compiler="eager", segment_stride=2, blocks=blocks)
    compiled = assert_step_matches(model, inputs, backend, **TOL)
    (plan,) = fxckpt.last_plans()
    # Measured after a warm-up step: CI once saw 5056 bytes (a CPU RNG state's size) more held
    # on the second call of the same plan, in a worker that had run other files first; not
    # reproduced alone or after test_hf_models.
    return plan, measure_forward(compiled, inputs).held_bytes


@pytest.mark.heavy
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=ONE_GRAPH) if n != "resnet" else n for n in CASES]
)
def test_every_stack_is_found_and_numbered_in_execution_order(name: str) -> None:
    plan, _ = _trained(name)
    stacks = CASES[name]
    note = ", ".join(f"{p} {r.start}..{r.stop - 1}" for p, r in stacks)
    assert f"blocks 0..{stacks[-1][1].stop - 1} in {len(stacks)} stacks: {note}" in plan.notes
    for prefix, blocks in stacks:
        rows = [r for r in plan.activations if re.match(re.escape(prefix) + r"\.\d+(\.|$)", r.module)]
        assert rows, prefix
        for r in rows:
            index = int(r.module[len(prefix) + 1 :].split(".")[0])
            assert r.block == blocks.start + index, (r.name, r.module, r.block)
    # The stride reaches every stack: each one has a recomputed segment interior.
    for prefix, _ in stacks:
        assert any(r.module.startswith(prefix + ".") and r.decision.kind == "recompute"
                   for r in plan.activations), prefix  # fmt: skip


@pytest.mark.heavy
@ONE_GRAPH
def test_stride_over_both_stacks_holds_what_one_stack_cannot() -> None:
    # With only the decoder's blocks (the old detection, written as a regex), a stride of 2
    # leaves T5 holding more than half of aot_eager's bytes; over both stacks, under a third.
    _, both = _trained("t5")
    _, decoder_only = _trained("t5", r"decoder\.block\.\d+$")
    model, inputs = _case("t5")
    torch._dynamo.reset()
    plain = measure_forward(torch.compile(copy.deepcopy(model), backend="aot_eager"), inputs).held_bytes
    assert both < 0.35 * plain < 0.5 * plain < decoder_only, (both, decoder_only, plain)


@pytest.mark.heavy
@ONE_GRAPH
def test_a_group_without_digits_numbers_the_item_the_match_ends_in() -> None:
    # The pattern: group 1 is "encoder" or "decoder"; it used to give no block an
    # index, so the stride silently did nothing. Now it numbers both stacks as detection
    # does: the same plan, the same bytes held.
    plan, held = _trained("t5", r"(encoder|decoder)\.block\.\d+$")
    auto, auto_held = _trained("t5")
    assert "no repeated blocks found" not in " ".join(plan.notes)
    assert {r.block for r in plan.activations if r.module.startswith("decoder.block.")} == {3, 4, 5}
    assert [(r.name, r.block, r.decision.kind) for r in plan.activations] == [
        (r.name, r.block, r.decision.kind) for r in auto.activations
    ]
    assert held == auto_held


def test_a_pattern_that_ends_at_no_index_is_an_options_error() -> None:
    model, inputs = _case("resnet")
    backend = fxckpt.backend(compiler="eager", segment_stride=2, blocks=r"layer\d\.\d+\.conv")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(model, backend=backend)(*inputs)
    err = info.value.inner_exception
    assert isinstance(err, OptionsError) and err.option == "blocks"
    assert "ends at no index" in str(err) and r"layers\.\d+$" in str(err)
