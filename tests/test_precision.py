"""Mixed precision: autocast(bfloat16) training under fxckpt matches its eager autocast
reference within bf16 tolerances, and offloaded bf16 activations come back as bf16."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from equality import assert_step_matches, step
from models import GPT, gpt_inputs, hf_model

import fxckpt

# bf16 has an 8-bit mantissa (eps 2**-7): a compiled graph that orders a reduction differently
# from eager may move a result by a few ulps of bf16.
BF16 = {"atol": 2e-2, "rtol": 2e-2}

SETTINGS = [
    pytest.param({}, id="default"),
    pytest.param({"segment_stride": 1}, id="stride1"),
    pytest.param({"offload": "all", "min_offload_bytes": 0}, id="offload_all"),
    pytest.param({"memory_budget": 0.3, "min_offload_bytes": 0}, id="budget0.3"),
]


def _autocast_runner(fn: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(*args, **kwargs)

    return run


def _compare(model: torch.nn.Module, inputs: Any, settings: dict[str, Any], **tol: Any) -> None:
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxckpt.backend(compiler="eager", **settings))
    for seed in (0, 1):
        torch.manual_seed(seed)
        got = step(model, inputs, _autocast_runner(compiled))
        torch.manual_seed(seed)
        want = step(ref, inputs, _autocast_runner(ref))
        assert got[0].dtype == want[0].dtype
        torch.testing.assert_close(got[0], want[0], **tol)
        assert got[1].keys() == want[1].keys() and got[1]
        for name, g in want[1].items():
            assert got[1][name].dtype == torch.float32  # parameters and grads stay fp32
            torch.testing.assert_close(got[1][name], g, msg=lambda m, n=name: f"{n}: {m}", **tol)


@pytest.mark.parametrize("settings", SETTINGS)
def test_gpt_autocast_bf16_matches_eager_autocast(settings: dict[str, Any]) -> None:
    torch.manual_seed(0)
    _compare(GPT(n_layers=2), gpt_inputs(), settings, **BF16)
    plans = fxckpt.last_plans()
    dtypes = {r.dtype for p in plans for r in p.activations}
    assert "bfloat16" in dtypes, dtypes  # autocast's matmuls saved bf16 activations
    if settings.get("offload") == "all":
        s = fxckpt.stats()
        assert s["offloaded_bytes"] == s["prefetched_bytes"] > 0
        offloaded = [r for p in plans for r in p.activations if r.decision.kind == "offload"]
        assert any(r.dtype == "bfloat16" for r in offloaded)


def test_hf_llama_autocast_bf16_offload_all() -> None:
    model, inputs = hf_model("llama")
    _compare(model.train(), inputs, {"offload": "all", "min_offload_bytes": 0}, **BF16)
    assert fxckpt.stats()["offloaded_bytes"] > 0


def test_bf16_model_offload_is_bitwise_equal_to_aot_eager() -> None:
    """A model held in bf16: keep and offload reorder no arithmetic, so nothing moves."""
    torch.manual_seed(0)
    model = GPT(n_layers=2).to(torch.bfloat16)
    backend = fxckpt.backend(compiler="eager", offload="all", min_offload_bytes=0)
    assert_step_matches(model, gpt_inputs(), backend, reference_backend="aot_eager", steps=2, atol=0, rtol=0)
    (plan,) = fxckpt.last_plans()
    assert {r.dtype for r in plan.activations if r.decision.kind == "offload"} >= {"bfloat16"}
