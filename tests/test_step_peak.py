"""The whole step's peak: the plan's prediction (the rewritten graphs' liveness) against the
meter's measurement of the same step, for plans that keep, recompute, offload and bucket."""

from __future__ import annotations

import copy

import pytest
import torch
from equality import assert_step_matches
from measured import measure_absolute_step, measure_step
from models import GPT, gpt_inputs

import fxckpt
from fxckpt.runtime import engine

PLANS = {
    "keep": {},
    "budget_0.5": {"memory_budget": 0.5},
    "budget_0.25": {"memory_budget": 0.25},
    "stride_1": {"segment_stride": 1},
    "offload_all": {"offload": "all", "min_offload_bytes": 0},
    "offload_all_alone": {"offload": "all", "min_offload_bytes": 0, "coalesce": "never"},
    "offload_jit": {"offload": "all", "min_offload_bytes": 0, "prefetch": "jit"},
    # Planned for a slow link, prefetches start long before their waits: each restored
    # buffer is allocated at its prefetch.
    "offload_early_prefetch": {"offload": "all", "min_offload_bytes": 0, "bandwidth": "1MB/s",
                               "coalesce": "never"},
}


@pytest.fixture(autouse=True)
def _engine_defaults():
    engine.configure()
    yield
    engine.configure()


@pytest.mark.parametrize("name", PLANS)
def test_the_predicted_step_peak_is_the_measured_one(name: str) -> None:
    torch.manual_seed(0)
    model, inputs = GPT(n_layers=3), gpt_inputs(batch=2, seq=64)
    backend = fxckpt.backend(compiler="eager", on_infeasible="warn", **PLANS[name])
    measured = measure_step(torch.compile(copy.deepcopy(model), backend=backend), inputs)
    (plan,) = fxckpt.last_plans()
    assert plan.predicted_step_peak_bytes is not None
    # The meter reads the allocator; the prediction reads only the graphs. Exact here (the
    # eager compiler runs the graphs op by op); 0.5 % leaves room for a torch whose kernels
    # allocate a scratch buffer of their own.
    assert measured.peak_bytes == pytest.approx(plan.predicted_step_peak_bytes, rel=5e-3)


def test_the_prediction_round_trips_with_the_plan() -> None:
    torch.manual_seed(0)
    model, inputs = GPT(n_layers=2), gpt_inputs()
    torch.compile(model, backend=fxckpt.backend(compiler="eager", memory_budget=0.5))(
        *inputs).backward()
    (plan,) = fxckpt.last_plans()
    again = fxckpt.Plan.from_dict(plan.to_dict())
    assert again.predicted_step_peak_bytes == plan.predicted_step_peak_bytes > 0


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("budget", [0.5, pytest.param(0.3, marks=pytest.mark.heavy)])
def test_under_inductor_the_predicted_step_peak_is_inductors_own_and_the_measured_one(
        budget: float) -> None:
    # The graphs' liveness reads 6.8 % and 4.1 % above the meter here: it cannot see what
    # Inductor inlines nor the order its scheduler picks. The plan reports the peak of
    # Inductor's own schedules of the same graphs instead (fxckpt.passes.inductor_peak):
    # measured 0.01 % and 1.9 % above the meter.
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = GPT(n_layers=6, d=64, dropout=None), gpt_inputs(batch=4, seq=64)
    backend = fxckpt.backend(memory_budget=budget, on_infeasible="warn")
    # Compiled anew, into empty caches: the pass runs, and no figure another run kept is read.
    with fresh():
        measured = measure_step(torch.compile(model, backend=backend), inputs)
        (plan,) = fxckpt.last_plans()
    assert any(n.startswith("step peak from Inductor's schedules") for n in plan.notes)
    assert plan.predicted_step_peak_bytes == pytest.approx(measured.peak_bytes, rel=0.05)


def test_the_scheduled_peak_leaves_out_what_exists_before_the_step_and_counts_restores_early() -> None:
    from fxckpt.passes.inductor_peak import Tag, scheduled_peak

    steps = [{"prefetch"}, {"mm"}, {"wait"}, {"add"}]
    buffers = [
        (100, 100, 0, 3, "weight"),  # a parameter: there before the step
        (10, 10, 0, 1, "saved"),  # a saved tensor, freed after its last use
        (50, 50, 1, 2, ""),  # mm's output
        (40, 40, 2, 3, ""),  # the restored tensor, returned by its wait
        (5, 5, 3, -1, ""),  # a gradient: a graph output, never freed
    ]
    plain = Tag("k", "bw", ("weight",))
    assert scheduled_peak(steps, buffers, plain) == 90  # mm's output and the restored one
    early = Tag("k", "bw", ("weight",), (("wait", "prefetch"),))
    assert scheduled_peak(steps, buffers, early) == 100  # allocated at its prefetch, in step 0


def test_what_inductor_fuses_is_left_out_of_the_step_peak() -> None:
    from fxckpt.passes.schedule import fused_intermediates

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = torch.ops.aten.mul.Tensor(x, 2.0)  # read by b alone, past an mm: inlined
        m = torch.ops.aten.mm.default(x, w)
        b = torch.ops.aten.add.Tensor(a, m)  # read by an mm: a buffer
        c = torch.ops.aten.mm.default(b, w)
        d = torch.ops.aten.relu.default(c)  # read by e and by the output: a buffer
        e = torch.ops.aten.sum.default(d)
        return e, d

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(4, 4), torch.randn(4, 4))
    assert {n.name for n in fused_intermediates(gm)} == {"mul"}


def _plain_step(model: torch.nn.Module, inputs: tuple) -> fxckpt.Measurement:
    """Plain min-cut's whole step, measured absolute: ``start_bytes`` is what the device holds
    when it starts (the parameters, buffers and inputs), ``peak_bytes`` its own peak."""
    plain = copy.deepcopy(model)
    compiled = torch.compile(plain, backend=fxckpt.backend(compiler="eager"))
    measured = measure_absolute_step(compiled, plain, inputs)
    fxckpt.reset_stats()  # its plan is not the one under test
    torch._dynamo.reset()
    return measured


def _budget(plain: fxckpt.Measurement, fraction: float) -> int:
    """A byte budget: the start level and ``fraction`` of plain's own step peak."""
    return plain.start_bytes + int(fraction * plain.peak_bytes)


@pytest.mark.parametrize("fraction", [0.8, 0.6, 0.45])
def test_a_byte_budget_holds_the_measured_absolute_step_peak(fraction: float) -> None:
    # memory_budget bounds the whole step's peak, what the device holds before it included:
    # the meter reads it from the allocator, over forward and backward.
    torch.manual_seed(0)
    model, inputs = GPT(n_layers=4), gpt_inputs(batch=2, seq=64)
    budget = _budget(_plain_step(model, inputs), fraction)
    backend = fxckpt.backend(compiler="eager", memory_budget=budget)
    trained = copy.deepcopy(model)
    compiled = assert_step_matches(trained, inputs, backend)
    measured = measure_absolute_step(compiled, trained, inputs, warm=1)
    (plan,) = fxckpt.last_plans()
    assert measured.absolute_peak_bytes <= budget
    assert measured.peak_bytes == pytest.approx(plan.predicted_step_peak_bytes, rel=5e-3)
    assert plan.step is not None and plan.step["start_bytes"] == measured.start_bytes
    assert any(n.startswith("step budget:") for n in plan.notes), plan.notes


def test_a_byte_budget_keeps_what_fits_rather_than_the_least_peak() -> None:
    # The plan kept is the cheapest that fits, not the lowest: a roomy budget recomputes less
    # than a tight one, and no plan above the budget is kept.
    torch.manual_seed(0)
    model, inputs = GPT(n_layers=4), gpt_inputs(batch=2, seq=64)
    plain = _plain_step(model, inputs)
    plans, peaks = [], []
    for fraction in (0.9, 0.5):
        fxckpt.reset_stats()
        torch._dynamo.reset()
        budget = _budget(plain, fraction)
        trained = copy.deepcopy(model)
        compiled = torch.compile(trained, backend=fxckpt.backend(compiler="eager", memory_budget=budget))
        peaks.append(measure_absolute_step(compiled, trained, inputs).absolute_peak_bytes)
        (plan,) = fxckpt.last_plans()  # one plan recorded, however many were tried
        assert peaks[-1] <= budget
        plans.append(plan)
    roomy, tight = plans
    assert peaks[0] > peaks[1]
    assert roomy.predicted_step_peak_bytes > tight.predicted_step_peak_bytes
    assert roomy.recomputed_bytes + roomy.offloaded_bytes < tight.recomputed_bytes + tight.offloaded_bytes


def test_a_byte_budget_below_the_graphs_floor_names_the_smallest_budget() -> None:
    torch.manual_seed(0)
    model, inputs = GPT(n_layers=2), gpt_inputs(batch=2, seq=64)
    plain = _plain_step(model, inputs)
    budget = _budget(plain, 0.05)
    backend = fxckpt.backend(compiler="eager", memory_budget=budget)
    trained = copy.deepcopy(model)
    compiled = torch.compile(trained, backend=backend)
    raised_at, err = None, None
    for step in range(5):
        trained.zero_grad(set_to_none=True)
        try:
            compiled(*inputs).backward()
        except torch._dynamo.exc.BackendCompilerFailed as e:
            raised_at, err = step, e.inner_exception  # dynamo wraps what a backend raises
            break
        except fxckpt.BudgetError as e:
            raised_at, err = step, e
            break
    assert isinstance(err, fxckpt.BudgetError), "no BudgetError in five steps"
    assert err.option == "memory_budget" and err.budget_bytes == budget
    assert plain.start_bytes < err.smallest_bytes <= plain.absolute_peak_bytes + 4096
    assert f"memory_budget={budget} bytes" in str(err)
    assert f"the smallest budget it runs under is memory_budget={err.smallest_bytes}" in str(err)
    assert err.parts["start_bytes"] == plain.start_bytes
    # With on_infeasible="warn" the smallest of the plans runs, says so, and holds the figure.
    fxckpt.reset_stats()
    torch._dynamo.reset()
    backend = fxckpt.backend(compiler="eager", memory_budget=budget, on_infeasible="warn")
    trained = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="cannot meet memory_budget"):
        measured = measure_absolute_step(torch.compile(trained, backend=backend), trained, inputs)
    # The figure named is the lowest plans' predicted peak, plus the headroom and 3 %.
    assert err.smallest_bytes / 1.03 - 2 * 4096 <= measured.absolute_peak_bytes
    assert measured.absolute_peak_bytes <= err.smallest_bytes
    # The verdict waits for what eager code holds to be measured: the third step, usually.
    assert raised_at is not None and raised_at <= 3
