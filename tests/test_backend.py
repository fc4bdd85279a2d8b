"""The backend trains exactly like eager: loss, input gradients, every parameter gradient."""

from __future__ import annotations

import pytest
import torch
from equality import assert_step_matches
from models import GPT, MLP, gpt_inputs, hf_model

import fxckpt

SETTINGS = [
    pytest.param({}, id="default"),
    pytest.param({"segment_stride": 1}, id="stride1"),
    pytest.param({"segment_stride": 2}, id="stride2"),
    pytest.param({"segment_stride": 2, "segment_width": 1}, id="stride2w1"),
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_mlp_matches_eager(settings: dict) -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 32, requires_grad=True)
    assert_step_matches(MLP(), (x,), fxckpt.backend(compiler="eager", **settings), steps=2)


@pytest.mark.parametrize("settings", SETTINGS)
def test_gpt_matches_eager(settings: dict) -> None:
    torch.manual_seed(0)
    assert_step_matches(GPT(), gpt_inputs(), fxckpt.backend(compiler="eager", **settings), steps=2)


def test_gpt_with_dropout_matches_aot_eager_under_the_same_seed() -> None:
    torch.manual_seed(0)
    model = GPT(dropout=0.1)
    assert_step_matches(
        model,
        gpt_inputs(),
        fxckpt.backend(compiler="eager", segment_stride=1),
        reference_backend="aot_eager",
        steps=2,
    )


def test_the_partitioner_takes_keyword_arguments_min_cut_does_not() -> None:
    # Newer torch may pass partitioners more metadata (fw_metadata, pytorch#174823); it must
    # not reach min-cut, whose signature does not take it.
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from fxckpt.backend import FxckptPartitioner

    inner = FxckptPartitioner(fxckpt.Options(segment_stride=1, offload="all", min_offload_bytes=0))
    seen: list[set[str]] = []

    def newer_torch(gm, joint_inputs, **kwargs):
        seen.append(set(kwargs))
        return inner(gm, joint_inputs, fw_metadata=object(), some_future_flag=True, **kwargs)

    def boxed(gm, _):
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=boxed, bw_compiler=boxed, partition_fn=newer_torch)
    torch.manual_seed(0)
    assert_step_matches(GPT(n_layers=2), gpt_inputs(), backend, steps=2)
    assert seen and "num_fwd_outputs" in seen[0]
    (plan,) = fxckpt.last_plans()
    assert plan.offloaded_bytes > 0 and plan.recomputed_bytes > 0


def test_min_cut_keywords_passes_all_to_a_min_cut_that_takes_any(monkeypatch) -> None:
    from fxckpt import _torch_compat as compat

    kwargs = {"num_fwd_outputs": 1, "static_lifetime_input_indices": [0], "fw_metadata": 3}
    taken, unused = compat.min_cut_keywords(kwargs)
    assert taken == {"num_fwd_outputs": 1, "static_lifetime_input_indices": [0]}
    assert unused == ["fw_metadata"]

    def takes_any(joint, joint_inputs, *, num_fwd_outputs, **kwargs):  # as #174823 proposed
        raise AssertionError("not called")

    monkeypatch.setattr(compat, "min_cut_rematerialization_partition", takes_any)
    assert compat.min_cut_keywords(kwargs) == (kwargs, [])


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("settings", [SETTINGS[0], SETTINGS[2]])
def test_gpt_matches_eager_under_inductor(settings: dict) -> None:
    torch.manual_seed(0)
    assert_step_matches(GPT(n_layers=2), gpt_inputs(), fxckpt.backend(**settings), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.inductor
def test_mlp_matches_eager_under_inductor_by_string() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 32, requires_grad=True)
    assert_step_matches(MLP(depth=2), (x,), "fxckpt", atol=1e-5, rtol=1e-4)
    assert len(fxckpt.last_plans()) == 1


@pytest.mark.slow
@pytest.mark.inductor
def test_gpt_dropout_under_inductor_matches_aot_eager() -> None:
    torch.manual_seed(0)
    with torch._inductor.config.patch(fallback_random=True):
        assert_step_matches(
            GPT(n_layers=2, dropout=0.1),
            gpt_inputs(),
            fxckpt.backend(segment_stride=1),
            reference_backend="aot_eager",
            atol=1e-5,
            rtol=1e-4,
        )


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("settings", [SETTINGS[0], SETTINGS[2]])
def test_hf_models_match_eager(arch: str, settings: dict) -> None:
    model, inputs = hf_model(arch)
    model.train()
    assert_step_matches(model, inputs, fxckpt.backend(compiler="eager", **settings), atol=1e-5, rtol=1e-4)


def test_string_backend_uses_options() -> None:
    torch.manual_seed(0)
    model = GPT(n_layers=2)
    compiled = torch.compile(
        model, backend="fxckpt", options={"compiler": "eager", "segment_stride": 1}
    )
    compiled(*gpt_inputs()).backward()
    (plan,) = fxckpt.last_plans()
    assert plan.options["segment_stride"] == 1
    assert plan.recomputed_bytes > 0


def test_plan_to_dict_has_the_documented_keys() -> None:
    torch.manual_seed(0)
    torch.compile(GPT(n_layers=2), backend=fxckpt.backend(compiler="eager", segment_stride=2))(
        *gpt_inputs()
    ).backward()
    (plan,) = fxckpt.last_plans()
    d = plan.to_dict()
    for key in ("name", "budget_bytes", "baseline_saved_bytes", "resident_peak_bytes",
                "kept_bytes", "offloaded_bytes", "recomputed_bytes", "activations"):
        assert key in d
    row = d["activations"][0]
    assert set(row) >= {"name", "module", "op", "shape", "dtype", "bytes", "decision", "reason"}
    assert fxckpt.Plan.from_dict(d).to_dict() == d
    assert d["kept_bytes"] + d["recomputed_bytes"] >= d["baseline_saved_bytes"] > 0


def test_partition_leaves_the_programs_garbage_collector_as_it_found_it() -> None:
    # The partitioner freezes the objects that exist before it (or pauses the collector where
    # the program froze some itself); afterwards the collector must be back as it was.
    import gc

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    for frozen_before in (False, True):
        torch._dynamo.reset()
        if frozen_before:
            gc.freeze()
        try:
            # Frozen objects can die during the compile: compare "any frozen", not the count.
            before = (gc.isenabled(), gc.get_freeze_count() > 0)
            compiled = torch.compile(model, backend=fxckpt.backend(compiler="eager"))
            compiled(x).sum().backward()
            assert fxckpt.last_plans()  # the partitioner ran
            assert (gc.isenabled(), gc.get_freeze_count() > 0) == before == (True, frozen_before)
        finally:
            gc.unfreeze()
        fxckpt.reset_stats()
