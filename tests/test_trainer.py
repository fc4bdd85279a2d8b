"""The Hugging Face Trainer trains an fxckpt-compiled model like an uncompiled one.

Options reach fxckpt through ``FXCKPT_OPTIONS`` (a JSON object read at the backend's entry),
since the Trainer cannot pass ``options=``. The runs go through examples/hf_trainer.py, so
the example is exercised too.
"""

from __future__ import annotations

import copy
import json
import sys
from types import ModuleType

import pytest
import torch
from example_scripts import load_example

import fxckpt

pytest.importorskip("accelerate")

OPTIONS = {"compiler": "eager", "segment_stride": 2, "offload": "all", "min_offload_bytes": 0}
STEPS = 4


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setenv("FXCKPT_OPTIONS", json.dumps(OPTIONS))
    return load_example("hf_trainer")


def _setup(example: ModuleType) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    model = example.build_model(layers=2, hidden=32, vocab=128)
    return model, copy.deepcopy(model), example.TokenDataset(4 * STEPS, 16, vocab=128)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_logs_the_same_losses_as_an_uncompiled_run(example: ModuleType) -> None:
    model, plain_model, data = _setup(example)
    # Two micro-batches per optimizer step: gradient accumulation through the compiled graph.
    want = example.train(plain_model, data, steps=STEPS, via=None, grad_accum=2)
    got = example.train(model, data, steps=STEPS, via="model", grad_accum=2)
    assert len(got) == len(want) == STEPS
    assert len(set(want)) == STEPS  # the model learns: every logged loss differs
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)
    trained = dict(plain_model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, trained[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

    # The options came from FXCKPT_OPTIONS.
    plans = fxckpt.last_plans()
    assert plans
    for plan in plans:
        assert plan.options["segment_stride"] == 2 and plan.options["offload"] == "all"
    assert sum(p.recomputed_bytes for p in plans) > 0
    s = fxckpt.stats()
    assert s["offloaded_bytes"] == s["prefetched_bytes"] > 0


def test_options_argument_wins_over_the_environment(example: ModuleType) -> None:
    model, _, _ = _setup(example)
    compiled = torch.compile(
        model, backend="fxckpt", options={"compiler": "eager", "offload": "never"}
    )
    ids = torch.randint(0, 128, (2, 16))
    compiled(input_ids=ids, labels=ids).loss.backward()
    (plan,) = fxckpt.last_plans()
    assert plan.options["offload"] == "never"  # explicit
    assert plan.options["segment_stride"] == 2  # from FXCKPT_OPTIONS
    assert fxckpt.stats()["offloaded_bytes"] == 0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_training_arguments_torch_compile_backend(example: ModuleType) -> None:
    # The Trainer compiles the model itself: accelerate builds torch.compile(backend="fxckpt")
    # from the string once register_with_accelerate() has added it to accelerate's enum.
    model, plain_model, data = _setup(example)
    want = example.train(plain_model, data, steps=STEPS, via=None)
    got = example.train(model, data, steps=STEPS, via="args")
    assert len(got) == len(want) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)
    trained = dict(plain_model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, trained[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    plans = fxckpt.last_plans()
    assert plans and all(p.options["offload"] == "all" for p in plans)  # FXCKPT_OPTIONS
    assert fxckpt.stats()["offloaded_bytes"] > 0


def test_accelerate_refuses_the_name_until_registered() -> None:
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin

    from fxckpt import integrations

    members = dict(DynamoBackend.__members__)
    names = list(DynamoBackend._member_names_)
    values = dict(DynamoBackend._value2member_map_)
    try:
        for table in (DynamoBackend._member_map_, DynamoBackend._value2member_map_):
            table.pop(integrations.NAME, None)
        if integrations.NAME in DynamoBackend._member_names_:
            DynamoBackend._member_names_.remove(integrations.NAME)
        with pytest.raises(ValueError, match="not a valid DynamoBackend"):
            TorchDynamoPlugin(backend="fxckpt")
        fxckpt.register_with_accelerate()
        fxckpt.register_with_accelerate()  # idempotent
        assert TorchDynamoPlugin(backend="fxckpt").to_kwargs()["backend"] == "fxckpt"
        assert DynamoBackend["FXCKPT"] is DynamoBackend("FXCKPT") is DynamoBackend.FXCKPT
        assert list(DynamoBackend).count(DynamoBackend.FXCKPT) == 1
        assert DynamoBackend("INDUCTOR") is DynamoBackend.INDUCTOR  # the others are untouched
    finally:
        DynamoBackend._member_map_.clear()
        DynamoBackend._member_map_.update(members)
        DynamoBackend._value2member_map_.clear()
        DynamoBackend._value2member_map_.update(values)
        DynamoBackend._member_names_[:] = names


def test_register_with_accelerate_explains_a_missing_accelerate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "accelerate.utils", None)
    with pytest.raises(fxckpt.FxckptError, match="pip install accelerate"):
        fxckpt.register_with_accelerate()
