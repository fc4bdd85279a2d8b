"""The whole step's peak under Inductor: the plan's prediction, composed from Inductor's own
schedule of the two graphs, against the meter's measurement of the same step."""

from __future__ import annotations

import copy

import pytest
import torch
from measured import measure_step
from models import GPT, gpt_inputs

import fxckpt
from fxckpt.graph.inductor_peak import SOURCE_INDUCTOR, GraphTimeline
from fxckpt.runtime import engine


@pytest.fixture(autouse=True)
def _engine_defaults():
    engine.configure()
    yield
    engine.configure()


def test_an_in_place_reuse_allocates_nothing_and_keeps_the_input_alive() -> None:
    # step 0: buf0 (100) from the input in0 (50, freed at step 1); step 1: buf1 (100) written
    # into buf0, which dies there; step 2: buf2 (10), an output.
    t = GraphTimeline(3, [("in0", True, 50, 50, 0, 1), ("buf0", False, 100, 100, 0, 1),
                          ("buf1", False, 100, 100, 1, 2), ("buf2", False, 10, 10, 2, -1)],
                      {"buf1": "buf0"})
    assert t.live(lambda _: False) == [150, 150, 110]
    assert t.live(lambda name: name == "in0") == [100, 100, 110]
    without = GraphTimeline(t.steps, t.rows, {})
    assert without.live(lambda _: False) == [150, 250, 110]


def _loss_and_grads(model: torch.nn.Module, inputs: tuple) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    loss = model(*inputs)
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.5, 0.3])
def test_the_predicted_step_peak_holds_under_inductor(budget: float) -> None:
    torch.manual_seed(0)
    model, inputs = GPT(n_layers=6), gpt_inputs(batch=2, seq=64)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend=fxckpt.backend(
        compiler="inductor", memory_budget=budget))
    measured = measure_step(compiled, inputs)
    (plan,) = fxckpt.last_plans()
    assert plan.step_peak_source == SOURCE_INDUCTOR
    assert plan.predicted_step_peak_bytes is not None
    # The fx liveness of these graphs is 17 % over the meter: Inductor fuses and reuses.
    assert measured.peak_bytes == pytest.approx(plan.predicted_step_peak_bytes, rel=0.05)
    for got, want in zip(_loss_and_grads(compiled, inputs), _loss_and_grads(model, inputs),
                         strict=True):
        torch.testing.assert_close(got, want)
