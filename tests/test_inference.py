"""One compiled model for training steps, gradient accumulation and inference calls.

Under ``torch.no_grad()``, ``torch.inference_mode()`` or with nothing requiring grad, AOTAutograd
compiles an inference graph: there is no backward, so the partitioner never runs. fxckpt then
plans nothing, offloads nothing and leaves no saved tensors, and the training graph it planned
keeps working alongside.
"""

from __future__ import annotations

import copy

import pytest
import torch
from equality import step
from models import GPT, gpt_inputs

import fxckpt

OPTIONS = {"compiler": "eager", "segment_stride": 1, "offload": "all", "min_offload_bytes": 0}


def _pair(dropout: float = 0.0) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = GPT(n_layers=2, dropout=dropout)
    ref = copy.deepcopy(model)
    return model, ref, torch.compile(model, backend=fxckpt.backend(**OPTIONS))


def _assert_same_grads(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")


def test_gradient_accumulation_matches_eager() -> None:
    model, ref, compiled = _pair()
    batches = [gpt_inputs(seed=s) for s in range(3)]
    for idx, tgt in batches:  # no zero_grad between micro-batches: gradients add up
        loss = compiled(idx, tgt) / len(batches)
        loss.backward()
        want = ref(idx, tgt) / len(batches)
        want.backward()
        torch.testing.assert_close(loss, want)
    _assert_same_grads(model, ref)
    (plan,) = fxckpt.last_plans()
    s = fxckpt.stats()
    assert s["offloaded_bytes"] == s["prefetched_bytes"] > 0
    assert plan.recomputed_bytes > 0 and plan.offloaded_bytes > 0


TORCH_BEFORE_2_13 = tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13)


@pytest.mark.parametrize(
    "mode",
    [
        "no_grad",
        "inference_mode",
        pytest.param(
            "frozen",
            marks=pytest.mark.xfail(
                TORCH_BEFORE_2_13,
                strict=True,
                reason="torch 2.11 does not guard on a parameter's requires_grad: the frozen "
                "call reuses the training graph, whose offloads run (and are freed with the "
                "output, as no backward comes)",
            ),
        ),
    ],
)
def test_inference_calls_plan_nothing_and_training_still_matches(mode: str) -> None:
    model, ref, compiled = _pair()
    idx, tgt = gpt_inputs()
    torch.testing.assert_close(step(model, (idx, tgt), compiled)[0], step(ref, (idx, tgt), ref)[0])
    (trained,) = fxckpt.last_plans()
    before = fxckpt.stats()

    if mode == "no_grad":
        with torch.no_grad():
            got, want = compiled(idx, tgt), ref(idx, tgt)
    elif mode == "inference_mode":
        with torch.inference_mode():
            got, want = compiled(idx, tgt), ref(idx, tgt)
    else:
        model.requires_grad_(False)
        got, want = compiled(idx, tgt), ref(idx, tgt)
        model.requires_grad_(True)
    torch.testing.assert_close(got, want)
    assert not got.requires_grad

    # The inference graph never reached the partitioner: no new plan, no copies, no saves.
    after = fxckpt.stats()
    assert [p.name for p in fxckpt.last_plans()] == [trained.name]
    for key in ("offload_calls", "offloaded_bytes", "prefetched_bytes"):
        assert after[key] == before[key], key

    # Training again on the same compiled model: same plan, same gradients as eager.
    idx2, tgt2 = gpt_inputs(seed=5)
    got_step, want_step = step(model, (idx2, tgt2), compiled), step(ref, (idx2, tgt2), ref)
    torch.testing.assert_close(got_step[0], want_step[0])
    _assert_same_grads(model, ref)
    assert fxckpt.stats()["offload_calls"] > after["offload_calls"]


def test_eval_mode_with_dropout_matches_eager_eval() -> None:
    model, ref, compiled = _pair(dropout=0.1)
    idx, tgt = gpt_inputs()
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(idx, tgt), ref(idx, tgt))
    assert fxckpt.last_plans() == []
    assert fxckpt.stats()["offload_calls"] == 0
