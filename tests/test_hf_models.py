"""Hugging Face models built from small configs train under fxckpt exactly like eager.

Each architecture runs under four settings: default options, ``segment_stride=2``,
``offload="all"`` and ``memory_budget=0.3`` (each graph's own step peak 0.3 of the way from its
lowest plan to plain min-cut's; the meter then holds the step's absolute peak within the
plan's budget). Loss and every parameter gradient are compared over two steps with
``torch.testing.assert_close``. A model with dropout is compared with the
same model compiled by ``aot_eager`` under the same seed: the masks must be the very ones
eager draws, also inside recomputed segments (fxckpt keeps random ops saved there).

Llama, Qwen3 and GPT-2 under default options and stride 2, and Llama and Qwen3 under
``offload="all"``, are covered in test_backend.py and test_offload.py; the cells below are the
rest. ``FXCKPT_HF_ZOO=1`` also runs every other architecture ``hf_zoo_model`` builds.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import pytest
import torch
from equality import assert_step_matches, step
from measured import measure_absolute_step
from models import GPT, gpt_inputs, hf_model, hf_zoo_model

import fxckpt

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers")

SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "stride2": {"segment_stride": 2},
    "offload_all": {"offload": "all", "min_offload_bytes": 0},
    "budget0.3": {"memory_budget": 0.3, "min_offload_bytes": 0},
}
TOL = {"atol": 1e-5, "rtol": 1e-4}
SEEDS = (0, 1)
# What the meter may read over a plan's own figure: a few bytes of eager code's tensors.
SLACK = 4096

# (architecture, dropout, settings). The first three are the issue's own; then an encoder
# with dropout (BERT), a GPT-NeoX decoder (parallel attention + MLP residual) and a
# mixture of experts (Mixtral: top-k routing, index_add).
CASES = [
    ("llama", 0.0, "budget0.3"),
    ("qwen3", 0.0, "budget0.3"),
    ("gpt2", 0.0, "offload_all"),
    ("gpt2", 0.0, "budget0.3"),
    *[(arch, p, s) for arch, p in (("bert", 0.1), ("gpt_neox", 0.0), ("mixtral", 0.0)) for s in SETTINGS],
]
ZOO = ["roberta", "modernbert", "opt", "mistral", "phi3", "gemma2", "t5", "vit"]


def _build(arch: str, dropout: float) -> tuple[torch.nn.Module, dict[str, Any]]:
    if arch in ("llama", "qwen3", "gpt2"):
        model, inputs = hf_model(arch, dropout=dropout)
    else:
        model, inputs = hf_zoo_model(arch, dropout=dropout)
    # GPT2LMHeadModel has no loss_type of its own; transformers then logs a warning from inside
    # the forward, which is a graph break that leaves the loss in a graph of its own.
    model.loss_type = "ForCausalLM" if arch == "gpt2" else model.loss_type
    return model.train(), inputs


def _run(model: torch.nn.Module, inputs: dict[str, Any], runner: Any) -> list[tuple]:
    results = []
    for seed in SEEDS:
        torch.manual_seed(seed)
        results.append(step(model, inputs, runner))
    return results


@functools.cache
def _reference(arch: str, dropout: float) -> list[tuple]:
    """Eager, or aot_eager with dropout (whose masks fxckpt must reproduce); computed once."""
    model, inputs = _build(arch, dropout)
    runner = torch.compile(model, backend="aot_eager") if dropout else model
    try:
        return _run(model, inputs, runner)
    finally:
        torch._dynamo.reset()


def _assert_matches(got: list[tuple], want: list[tuple]) -> None:
    for (loss, grads, _), (ref_loss, ref_grads, _) in zip(got, want, strict=True):
        torch.testing.assert_close(loss, ref_loss, **TOL)
        assert grads.keys() == ref_grads.keys() and grads
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, msg=lambda m, n=name: f"{n}: {m}", **TOL)


def _check(arch: str, dropout: float, settings: dict[str, Any]) -> list[fxckpt.Plan]:
    return _check_compiled(arch, dropout, settings)[0]


def _check_compiled(arch: str, dropout: float, settings: dict[str, Any]
                    ) -> tuple[list[fxckpt.Plan], Any, torch.nn.Module, dict[str, Any]]:
    """:func:`_check`, and the compiled model, warm, the model and its inputs."""
    want = _reference(arch, dropout)
    model, inputs = _build(arch, dropout)
    compiled = torch.compile(model, backend=fxckpt.backend(compiler="eager", **settings))
    _assert_matches(_run(model, inputs, compiled), want)
    plans = fxckpt.last_plans()
    assert plans
    return plans, compiled, model, inputs


@pytest.mark.parametrize(("arch", "dropout", "setting"), CASES, ids=[f"{a}-{s}" for a, _, s in CASES])
def test_hf_model_matches_reference(arch: str, dropout: float, setting: str) -> None:
    if setting == "budget0.3" and torch.__version__ < "2.13":
        # The step measured 2.6-6.4 % above the fraction's figure on torch 2.11 (cause not
        # found yet): docs/limitations.md, "A fraction's figure on torch 2.11".
        pytest.xfail("torch 2.11: a fraction's figure is under the measured step peak")
    plans, compiled, model, inputs = _check_compiled(arch, dropout, SETTINGS[setting])
    (plan,) = plans  # one graph: no graph breaks in these models
    kinds = {r.decision.kind for r in plan.activations}
    stats = fxckpt.stats()
    if setting == "default":
        assert kinds == {"keep"} and stats["offloaded_bytes"] == 0
    elif setting == "stride2":
        assert plan.recomputed_bytes > 0 and "offload" not in kinds
        assert {r.block for r in plan.activations if r.decision.kind == "recompute"} >= {0, 1}
    elif setting == "offload_all":
        assert stats["offloaded_bytes"] == stats["prefetched_bytes"] > 0
        assert plan.offloaded_bytes > plan.kept_bytes
    else:
        # A fraction: the step's start level and the graph's own step peak 0.3 of the way
        # from its lowest plan to plain min-cut's. The meter holds the step within it.
        assert plan.budget_bytes is not None and plan.step is not None and plan.target is not None
        assert plan.budget_bytes == plan.step["start_bytes"] + max(plan.target.values())
        measured = measure_absolute_step(compiled, model, inputs, warm=1)
        assert 0 < measured.absolute_peak_bytes <= plan.budget_bytes + SLACK, (measured, plan.notes)
        assert plan.offloaded_bytes + plan.recomputed_bytes > 0
    if dropout and setting == "stride2":
        # The dropout masks inside the segment were saved, not redrawn in the backward.
        assert any("random ops inside segments stay saved" in n for n in plan.notes), plan.notes


def test_dropout_is_live_in_the_reference() -> None:
    """Guards the dropout comparisons above: two seeds must give two different losses."""
    (loss0, *_), (loss1, *_) = _reference("bert", 0.1)
    assert not torch.equal(loss0, loss1)


@pytest.mark.skipif(not os.environ.get("FXCKPT_HF_ZOO"), reason="set FXCKPT_HF_ZOO=1 (minutes)")
@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ZOO)
def test_more_hf_architectures(arch: str, setting: str) -> None:
    _check(arch, 0.0, SETTINGS[setting])


# torch.utils.checkpoint inside a compiled model (docs/faq.md): torch's own recompute tags
# win, fxckpt plans what is left saved, and a selective-checkpoint policy may ask to offload.


def test_hf_gradient_checkpointing_composes_with_offload() -> None:
    model, inputs = _build("llama", 0.0)
    # transformers 5 renames gradient_checkpointing_enable; 4.x has only the old name.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxckpt.backend(compiler="eager", **SETTINGS["offload_all"]))
    _assert_matches(_run(model, inputs, compiled), _run(ref, inputs, ref))
    assert fxckpt.stats()["offloaded_bytes"] > 0


class _CheckpointedGPT(GPT):
    """A GPT whose blocks run under torch.utils.checkpoint, optionally with a SAC policy."""

    def __init__(self, policy: Any = None) -> None:
        super().__init__(n_layers=2)
        self.policy = policy

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        x = self.wte(idx)
        for layer in self.layers:
            kw = {}
            if self.policy is not None:
                kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, self.policy)
            x = checkpoint(layer, x, use_reentrant=False, **kw)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_checkpointed_blocks_keep_torch_recompute_and_stride_adds_nothing() -> None:
    torch.manual_seed(0)
    plain_saved = []
    for settings in ({}, {"segment_stride": 1}):
        torch._dynamo.reset()
        fxckpt.reset_stats()
        assert_step_matches(_CheckpointedGPT(), gpt_inputs(), fxckpt.backend(compiler="eager", **settings))
        (plan,) = fxckpt.last_plans()
        # Only block inputs and the head's tensors are saved: torch.utils.checkpoint's tags
        # already recompute the blocks, and a user's tags win over the stride.
        assert plan.recomputed_bytes == 0
        plain_saved.append(plan.kept_bytes)
    assert plain_saved[0] == plain_saved[1] > 0


def test_a_selective_checkpoint_policy_can_ask_for_offload() -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.MUST_CPU_OFFLOAD  # torch itself treats this as a save
        return CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    backend = fxckpt.backend(compiler="eager", min_offload_bytes=0)
    assert_step_matches(_CheckpointedGPT(policy), gpt_inputs(), backend, steps=2)
    (plan,) = fxckpt.last_plans()
    offloaded = [r for r in plan.activations if r.decision.kind == "offload"]
    assert offloaded and all("checkpoint policy" in r.decision.reason for r in offloaded)
    assert {r.op.split(".")[0] for r in offloaded} <= {"mm", "addmm", "view"}, {r.op for r in offloaded}
    s = fxckpt.stats()
    assert s["offloaded_bytes"] == s["prefetched_bytes"] > 0
