"""Link targets: the target's copy-to-compute ratio from the cost model on meta tensors, and
an emulated bandwidth that gives another model the same ratio."""

from __future__ import annotations

import pytest
import torch
from models import GPT, gpt_inputs

import fxckpt
from fxckpt import _link, targets
from fxckpt.errors import OptionsError


def test_the_h200_target_is_priced_on_meta_from_its_blocks():
    figs, ratio = targets.target_figures("h200-pcie5")
    t = targets.TARGETS["h200-pcie5"]
    assert figs.blocks == 3
    # What min-cut saves of one Qwen3-8B layer at 32k tokens in bf16: well above the layer's
    # input (32k x 4096 x 2 bytes = 256 MiB), well below the S x S probabilities (64 GiB).
    assert 8 * 2**28 < figs.saved_bytes < 2**34
    assert figs.forward_ms > 0 and figs.backward_ms > figs.forward_ms
    assert ratio == pytest.approx(
        (t.gpu.copy_overhead_ms + 1e3 * figs.saved_bytes / t.gpu.link_bytes_per_s) / figs.forward_ms)
    assert ratio > 1  # at peak compute, copying a layer out takes longer than computing it


def test_a_model_here_gets_the_targets_ratio():
    torch.manual_seed(0)
    model, inputs = GPT(n_layers=2), gpt_inputs(batch=2, seq=32)
    d = targets.derive("h200-pcie5", model, inputs)
    assert d.model_figures.blocks == 2 and d.model_figures.saved_bytes > 0
    mine = d.model_figures.ratio(d.bandwidth, d.overhead_ms)
    assert mine == pytest.approx(d.target_ratio, rel=1e-9)
    measured = targets.derive("h200-pcie5", model, inputs, forward_ms=10 * d.model_forward_ms)
    assert measured.bandwidth == pytest.approx(d.bandwidth / 10, rel=1e-6)  # slower compute
    assert "ratio" in d.describe() and "h200-pcie5" in d.describe()


def test_emulate_link_with_a_target_sets_the_derived_link():
    torch.manual_seed(0)
    model, inputs = GPT(n_layers=2), gpt_inputs(batch=2, seq=32)
    with fxckpt.emulate_link(target="h200-pcie5", model=model, inputs=inputs) as link:
        assert _link.spec() == link.spec and link.spec is not None
        assert link.bandwidth == pytest.approx(link.derivation.bandwidth)
        assert link.spec.source == "target h200-pcie5"
    assert _link.spec() is None


@pytest.mark.parametrize("bad", [{"target": "a100"}, {"target": "h200-pcie5"},
                                 {"target": "h200-pcie5", "bandwidth": "1GB/s"}])
def test_bad_targets_name_what_is_wrong(bad):
    with pytest.raises(OptionsError) as e:
        fxckpt.emulate_link(**bad)
    assert e.value.option in ("target", "model", "bandwidth", "inputs")
    assert _link.spec() is None
