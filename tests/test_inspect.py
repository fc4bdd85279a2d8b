"""fxckpt.inspect: planning offline on meta tensors gives the plan a real run would give."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fixtures.tiny_gpt import GPT, gpt
from models import GPT as LossGPT
from models import gpt_inputs

import fxckpt
from fxckpt.inspect import TargetError, meta_copy, offline_dispatch, to_meta
from fxckpt.workloads import hf_workload, read_hf_config


def rows(plans: list[fxckpt.Plan]) -> list[tuple]:
    return sorted(
        (a.name, a.module, tuple(a.shape), a.dtype, a.bytes, a.decision.kind)
        for p in plans
        for a in p.activations
    )


def test_meta_plan_equals_the_plan_of_a_real_compile() -> None:
    model, inputs = LossGPT(), gpt_inputs()
    torch.compile(model, backend=fxckpt.backend(compiler="eager", segment_stride=2))(*inputs)
    real = fxckpt.last_plans()
    torch._dynamo.reset()
    offline = fxckpt.inspect(model, inputs, segment_stride=2)
    # Same tensors, sizes and decisions; names match because both graphs come from one trace.
    assert rows(offline) == rows(real)
    assert any(a.op.startswith("_log_softmax") for a in offline[0].activations)  # loss grads
    assert offline[0].baseline_saved_bytes == real[0].baseline_saved_bytes > 0


def test_real_model_is_left_untouched() -> None:
    model = LossGPT()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    plans = fxckpt.inspect(model, gpt_inputs())
    assert plans and plans[0].activations
    assert not model.training  # the mode is restored
    for k, v in model.state_dict().items():
        assert v.device.type == "cpu"
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_meta_copy_shares_no_data_and_keeps_ties() -> None:
    model = GPT()
    model.head.weight = model.wte.weight  # tied
    copy = meta_copy(model)
    assert copy is not model
    assert all(p.device.type == "meta" for p in copy.parameters())
    assert copy.head.weight is copy.wte.weight
    assert model.wte.weight.device.type == "cpu"
    assert meta_copy(copy) is copy  # already on meta: no copy
    x = to_meta({"idx": torch.ones(2, 3, dtype=torch.long), "n": 3})
    assert x["idx"].device.type == "meta" and x["idx"].shape == (2, 3) and x["n"] == 3


def test_attention_is_planned_with_gpu_kernels_not_the_math_path() -> None:
    with torch.device("meta"):
        model, inputs, loss_fn = gpt()
    plans = fxckpt.inspect(model, inputs, loss_fn=loss_fn)
    seq = inputs[0].shape[1]
    square = [a for p in plans for a in p.activations if tuple(a.shape[-2:]) == (seq, seq)]
    # The math path would save softmax probabilities of shape (batch, heads, seq, seq).
    assert square == [], square


def test_offline_dispatch_restores_torch() -> None:
    nll = torch.ops.aten.nll_loss.default
    had_meta_kernel = torch._C.DispatchKey.Meta in nll.py_kernels
    with offline_dispatch():
        assert F.scaled_dot_product_attention is not torch._C._nn.scaled_dot_product_attention
        assert torch._C.DispatchKey.Meta not in nll.py_kernels
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    assert (torch._C.DispatchKey.Meta in nll.py_kernels) == had_meta_kernel


def test_loss_fn_paths_are_relative_to_the_model() -> None:
    with torch.device("meta"):
        model, inputs, loss_fn = gpt()
    plans = fxckpt.inspect(model, inputs, loss_fn=loss_fn, segment_stride=2)
    modules = {a.module for a in plans[0].activations}
    assert "wte" in modules and "layers.0" in modules
    assert not any(m.startswith("model.") for m in modules)
    assert any("under 'layers'" in n for n in plans[0].notes)


def test_progress_reports_each_step_and_restores_the_logger() -> None:
    logger = logging.getLogger("fxckpt.passes.partition")
    level = logger.level
    seen: list[str] = []
    with torch.device("meta"):
        model, inputs, loss_fn = gpt()
    fxckpt.inspect(model, inputs, loss_fn=loss_fn, progress=seen.append)
    assert any("min-cut done" in s for s in seen), seen
    assert seen[0].startswith("tracing") and seen[-1].startswith("planned 1 graph")
    assert logger.level == level and not logger.filters


def test_auto_budget_is_an_options_error_offline() -> None:
    # inspect plans on the meta device: there is no card whose capacity "auto" could read,
    # and a capacity stated for the CPU is not the meta device's.
    for stated in (None, "64MiB"):
        with fxckpt.emulate_device_memory(stated), pytest.raises(fxckpt.OptionsError) as info:
            fxckpt.inspect(GPT(), torch.zeros(1, 4, dtype=torch.long), memory_budget="auto")
        assert info.value.option == "memory_budget" and info.value.value == "auto"
        assert "'meta'" in str(info.value)
    # A budget in bytes plans offline.
    (plan,) = fxckpt.inspect(GPT(), torch.zeros(1, 4, dtype=torch.long), memory_budget="64MiB")
    assert plan.budget_bytes == 64 * 2**20


def test_nothing_to_plan_without_gradients() -> None:
    model = GPT().requires_grad_(False)
    with pytest.raises(TargetError, match="requires grad"):
        fxckpt.inspect(model, torch.zeros(1, 4, dtype=torch.long))


def test_hf_config_is_read_as_json_and_remote_code_is_ignored(tmp_path) -> None:
    cfg = json.loads(open("tests/fixtures/qwen3_tiny/config.json").read())
    cfg["auto_map"] = {"AutoModelForCausalLM": "remote_module.Evil"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    work = hf_workload(tmp_path, batch=2, seq=32)
    assert type(work.model).__name__ == "Qwen3ForCausalLM"
    assert all(p.device.type == "meta" for p in work.model.parameters())
    assert work.kwargs["input_ids"].shape == (2, 32)
    assert work.kwargs["labels"] is work.kwargs["input_ids"]
    assert work.model.config.use_cache is False
    assert "Qwen3ForCausalLM" in work.description and "2 x seq 32" in work.description


@pytest.mark.parametrize(
    "text, match",
    [("{not json", "not valid JSON"), ('{"hidden_size": 8}', "model_type"), (None, "cannot read")],
)
def test_bad_hf_configs(tmp_path, text: str | None, match: str) -> None:
    if text is not None:
        (tmp_path / "config.json").write_text(text)
    with pytest.raises(TargetError, match=match):
        read_hf_config(tmp_path)


def test_unknown_model_type(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(TargetError, match="no-such-model"):
        hf_workload(tmp_path)


def test_a_misspelt_model_type_is_one_short_line_with_the_nearest(tmp_path) -> None:
    """transformers' own error lists every model type it knows (some 11,000 characters)."""
    (tmp_path / "config.json").write_text('{"model_type": "lama", "hidden_size": 8}')
    with pytest.raises(TargetError) as info:
        hf_workload(tmp_path)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, message
    assert "'llama'" in message and "CONFIG_MAPPING" in message


def test_a_diffusers_config_points_to_a_factory(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"_class_name": "FluxTransformer2DModel", "num_layers": 2}')
    with pytest.raises(TargetError, match=r"diffusers config \(FluxTransformer2DModel\).*factory"):
        read_hf_config(tmp_path)


def test_the_documented_diffusers_factory_plans(tmp_path, capsys) -> None:
    """docs/cli.md's factory for a diffusers transformer, on a tiny Flux config, end to end."""
    pytest.importorskip("diffusers")
    from fxckpt.cli import main

    doc = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    section = doc.split("## Diffusers models", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    config = {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 16,
              "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
              "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 24,
              "guidance_embeds": True, "axes_dims_rope": [4, 4, 8]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "flux_factory.py"
    path.write_text(code.replace('CONFIG = "FLUX.1-dev/transformer/config.json"',
                                 f"CONFIG = {str(tmp_path / 'config.json')!r}"))  # fmt: skip
    assert main(["inspect", f"{path}:factory", "--budget", "0.5", "--format", "json", "-q"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["graphs"] and plan["graphs"][0]["activations"]
    assert plan["totals"]["recomputed_flops"] > 0  # the recomputed attention and matmuls


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:
        return (self.a(x).relu() * scale).sum()


def test_keyword_inputs() -> None:
    plans = fxckpt.inspect(_Pair(), {"x": torch.ones(4, 8), "scale": 2.0}, min_offload_bytes=0)
    saved = [(tuple(a.shape), a.dtype) for a in plans[0].activations]
    assert saved == [((4, 8), "float32")]  # relu's output, for its backward
