"""The memory budget under dynamic shapes, measured at every length.

One compiled graph serves many lengths. ``memory_budget`` bounds the step's absolute device
peak (what the device holds when the step starts, plus the most the step allocates). A budget
is planned at a dimension's upper bound when it has one; otherwise a guard limits the graph to
the sizes its plan holds for, and other sizes compile a new plan. A fraction is a point
between the lowest plan and plain min-cut at the sizes a plan is made for. Every figure
checked here comes from the meter: the absolute peak of a warm training step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from measured import measure_absolute_step
from models import GPT, gpt_inputs

import fxckpt

OPTS = {"compiler": "eager", "min_offload_bytes": 0}
# What the meter may read over a plan's own figure: a few bytes of eager code's tensors.
SLACK = 4096
# The lowest plan, as a fraction.
LOWEST = 1e-9


def _budget_error(raised: pytest.ExceptionInfo | BaseException | None) -> fxckpt.BudgetError:
    err = raised.value if isinstance(raised, pytest.ExceptionInfo) else raised
    while err is not None and not isinstance(err, fxckpt.BudgetError):
        # dynamo wraps backend errors in BackendCompilerFailed, keeping them as inner_exception
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
    assert isinstance(err, fxckpt.BudgetError)
    return err


def _marked(length: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, tgt = gpt_inputs(seq=length)
    for t in (idx, tgt):
        torch._dynamo.mark_dynamic(t, 1, min=2, max=max_len)
    return idx, tgt


def _matches_eager(
    compiled, ref: torch.nn.Module, model: torch.nn.Module, length: int, marked: int = 0
) -> None:
    idx, tgt = gpt_inputs(seq=length, seed=length)
    for t in (idx, tgt) if marked else ():
        torch._dynamo.mark_dynamic(t, 1, min=2, max=marked)
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    got, want = compiled(idx, tgt), ref(idx, tgt)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want)
    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")


def _peak(compiled, model: torch.nn.Module, inputs: tuple) -> int:
    """The measured absolute peak of a warm training step at ``inputs``."""
    return measure_absolute_step(compiled, model, inputs).absolute_peak_bytes


def _peak_of(budget: float | None, inputs: tuple) -> int:
    """The measured absolute step peak of a fresh GPT(n_layers=2) under ``budget``: ``None``
    for plain min-cut, :data:`LOWEST` for the lowest plan."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(n_layers=2)
    backend = fxckpt.backend(memory_budget=budget, **OPTS)
    peak = _peak(torch.compile(model, backend=backend), model, inputs)
    torch._dynamo.reset()
    fxckpt.reset_stats()
    return peak


@pytest.mark.heavy
def test_a_byte_budget_holds_at_every_length_with_dynamic_true() -> None:
    torch.manual_seed(0)
    model = GPT(n_layers=2)
    ref = copy.deepcopy(model)
    # Plain min-cut's step peaks at 0.31 MB at 16 tokens, 1.05 MB at 64 and 1.71 MB at 96
    # (0.12 MB of it held before the step starts); the lowest plan at 96 tokens, 1.07 MB.
    budget = 1_100_000
    compiled = torch.compile(model, backend=fxckpt.backend(memory_budget=budget, **OPTS), dynamic=True)
    for length in (16, 64, 40, 96):
        peak = _peak(compiled, model, gpt_inputs(seq=length))
        assert peak <= budget, f"{length} tokens: a step peak of {peak} bytes, budget {budget}"
        _matches_eager(compiled, ref, model, length)
    plans = fxckpt.last_plans()
    # The plan made at 16 tokens cannot hold 64: a guard sent that length to a new plan.
    assert len(plans) >= 2
    assert any("guarded to sizes where the plan meets" in n for n in plans[0].notes)
    assert plans[0].resident_peak_bytes == plans[0].baseline_saved_bytes  # kept all at 16
    # A length no plan can hold is refused when it is compiled, by length and bytes.
    with pytest.raises(Exception) as info:
        compiled(*gpt_inputs(seq=1024))
    err = _budget_error(info)
    assert err.budget_bytes == budget < err.smallest_bytes
    assert "size()[1]=1024" in err.sizes and "size()[1]=1024" in str(err)


@pytest.mark.heavy
def test_a_fraction_holds_at_the_length_each_plan_was_made_for() -> None:
    # Each plan puts its step's peak 0.3 of the way from the lowest plan's to plain's at the
    # sizes it was made for; measured against static compiles of those lengths.
    lengths = (16, 64)
    plain = {n: _peak_of(None, gpt_inputs(seq=n)) for n in lengths}
    floor = {n: _peak_of(LOWEST, gpt_inputs(seq=n)) for n in lengths}
    torch.manual_seed(0)
    model = GPT(n_layers=2)
    compiled = torch.compile(model, backend=fxckpt.backend(memory_budget=0.3, **OPTS), dynamic=True)
    for n in lengths:
        peak = _peak(compiled, model, gpt_inputs(seq=n))
        assert 0 < peak <= floor[n] + 0.3 * (plain[n] - floor[n]) + SLACK, (n, peak, floor[n], plain[n])
    assert plain[64] - floor[64] > 4 * (plain[16] - floor[16])  # the lengths differ enough


def test_mark_dynamic_max_plans_once_for_the_longest_length() -> None:
    torch.manual_seed(0)
    # Plain min-cut's step peaks at 2.5 MB at 128 tokens; the lowest plans are under 2 MB.
    budget = 2_000_000
    model = GPT(n_layers=2)
    compiled = torch.compile(model, backend=fxckpt.backend(memory_budget=budget, **OPTS))
    peaks = {n: _peak(compiled, model, _marked(n, 128)) for n in (16, 128, 64)}
    (plan,) = fxckpt.last_plans()  # one graph, one plan, for every length up to 128
    assert any(note.endswith("size()[1]=128 (upper bound)") for note in plan.notes), plan.notes
    assert max(peaks.values()) == peaks[128] <= budget
    # Planned at 128 tokens, so at 128 the plan's predicted step is what the meter finds.
    assert plan.step is not None
    assert plan.step["total_bytes"] == pytest.approx(peaks[128], abs=SLACK)


def test_mark_dynamic_max_that_a_byte_budget_cannot_hold_raises_naming_the_upper_bound() -> None:
    torch.manual_seed(0)
    budget = 600 * 1024
    model = GPT(n_layers=2)
    compiled = torch.compile(model, backend=fxckpt.backend(memory_budget=budget, **OPTS))
    # 16 tokens alone would fit (a step peak of 0.31 MB); the graph would serve up to 1024,
    # which cannot.
    raised_at, raised = None, None
    for step in range(5):
        model.zero_grad(set_to_none=True)
        try:
            compiled(*_marked(16, 1024)).backward()
        except Exception as e:  # noqa: BLE001 (unwrapped and checked below)
            raised_at, raised = step, e
            break
    err = _budget_error(raised)
    assert err.sizes.endswith("size()[1]=1024 (upper bound)")
    assert err.budget_bytes == budget < err.smallest_bytes
    assert f"memory_budget={err.smallest_bytes} (" in str(err)
    # Written back, the figure holds up to 1024 tokens, with the batch's own growth: the start
    # level the error counted holds the 16-token batch the steps ran with (docs/limitations.md).
    growth = sum(t.nbytes for t in _marked(1024, 1024)) - sum(t.nbytes for t in _marked(16, 1024))
    torch._dynamo.reset()
    budget = err.smallest_bytes + growth
    compiled = torch.compile(model, backend=fxckpt.backend(memory_budget=budget, **OPTS))
    assert _peak(compiled, model, _marked(1024, 1024)) <= budget + SLACK
    # The verdict waits for what eager code holds to be measured: the third step, usually.
    assert raised_at is not None and raised_at <= 3


@pytest.mark.parametrize("dropout", [0.0, None], ids=["dropout-p0", "no-dropout"])
def test_a_fraction_over_a_marked_range_is_planned_at_its_end_and_holds_at_every_length(
    dropout: float | None,
) -> None:
    # A guard would narrow the range mark_dynamic fixed, which dynamo refuses; one graph
    # serves it all, planned at 128 tokens: its budget is the start level there and 0.3 of the
    # way from the lowest plan's own step peak to plain's (tests/test_budget.py measures what
    # a fraction means); a shorter length holds less.
    torch.manual_seed(0)
    model = GPT(n_layers=2, dropout=dropout)
    ref = copy.deepcopy(model)
    lengths = (2, 16, 40, 128)
    backend = fxckpt.backend(memory_budget=0.3, cost_model="unit", **OPTS)
    compiled = torch.compile(model, backend=backend)
    peaks = {n: _peak(compiled, model, _marked(n, 128)) for n in lengths}
    (plan,) = fxckpt.last_plans()
    assert any(note.endswith("(upper bound)") for note in plan.notes), plan.notes
    assert plan.budget_bytes is not None
    for n in lengths:
        assert 0 < peaks[n] <= plan.budget_bytes + SLACK, (n, peaks[n], plan.budget_bytes)
    assert [peaks[n] for n in lengths] == sorted(peaks[n] for n in lengths)
    _matches_eager(compiled, ref, model, 40, marked=128)


def test_every_fraction_over_a_marked_range_has_a_plan() -> None:
    # A fraction is a point between the lowest plan and plain min-cut at the sizes the graph
    # is planned for (the range's upper end): whatever the fraction, the plan exists, and
    # every size of the range holds within it.
    torch.manual_seed(0)
    model = GPT(n_layers=2, dropout=None)
    backend = fxckpt.backend(memory_budget=0.05, cost_model="unit", **OPTS)
    compiled = torch.compile(model, backend=backend)
    peaks = {n: _peak(compiled, model, _marked(n, 128)) for n in (16, 2, 128)}
    (plan,) = fxckpt.last_plans()
    assert plan.budget_bytes is not None
    assert all(0 < p <= plan.budget_bytes + SLACK for p in peaks.values()), (peaks, plan.budget_bytes)


@pytest.mark.slow
@pytest.mark.inductor
def test_the_guard_replans_under_inductor() -> None:
    torch.manual_seed(0)
    model = GPT(n_layers=1, d=16)
    # Under Inductor plain min-cut's step peaks at 80 KB at 16 tokens and 289 KB at 64; the
    # lowest plan at 64 measures about 201 KB. The plan made at 16 keeps all; 64 needs a plan
    # of its own. Under a size symbol Inductor's schedule can read that plan at 300-350 KB
    # (docs/limitations.md, Dynamic shapes); fxckpt trusts it, and may raise BudgetError
    # naming such a figure (whether it does depends on the link's measured bandwidth, which
    # moves the plan): that figure, written back, holds. Either way the measured step holds
    # the budget it runs under, and 64 tokens get a plan that chose.
    def run(budget: int) -> None:
        torch._dynamo.reset()
        fxckpt.reset_stats()
        backend = fxckpt.backend(memory_budget=budget, min_offload_bytes=0)
        compiled = torch.compile(model, backend=backend, dynamic=True)
        for length in (16, 64):
            peak = _peak(compiled, model, gpt_inputs(seq=length))
            assert peak <= budget, (length, peak, budget)

    budget = 256 * 1024
    named = None
    try:
        run(budget)
    except AssertionError:
        raise
    except Exception as raised:  # noqa: BLE001 (dynamo wraps the backend's BudgetError)
        named = _budget_error(raised).smallest_bytes
        assert budget < named < 400_000, named
        run(named)
    plans = fxckpt.last_plans()
    assert plans[0].resident_peak_bytes == plans[0].baseline_saved_bytes  # kept all at 16 tokens
    assert plans[-1].baseline_saved_bytes > plans[0].baseline_saved_bytes  # 64 got its own plan
    if named is None:  # which had to choose (a named figure can lie above plain's peak)
        assert plans[-1].recomputed_bytes + plans[-1].offloaded_bytes > 0


class _CheckpointedDropout(torch.nn.Module):
    """Blocks under torch.utils.checkpoint, each ending in a dropout that really draws."""

    def __init__(self, d: int = 32, n: int = 2) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
            for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            body = lambda t, b=block: torch.nn.functional.dropout(b(t), 0.1, self.training)  # noqa: E731
            x = x + checkpoint(body, x, use_reentrant=False)
        return x.square().mean()


def test_regression_saved_rng_state_sizes_are_not_guarded() -> None:
    # A recomputed random op (here dropout with p=0.1 inside torch.utils.checkpoint) makes
    # min-cut save the CPU generator's state, to replay it in the backward; under
    # dynamic=True its fake value gets a size symbol of its own, with no graph input behind
    # it. A guard on it failed dynamo's guard building ("Guard failed on the same frame it
    # was created": name '__meta_utils_unknown_tensor..' is not defined); such sizes are now
    # read at their hint. (SDPA with dropout_p=0 saved a state too up to torch 2.13; 2.15
    # no longer counts it as random.)
    torch.manual_seed(0)
    model = _CheckpointedDropout()
    ref = copy.deepcopy(model)
    # min-cut saves 18,304 bytes at 2 x 16 rows; the step peaks at 98 KB, 37 KB of it held
    # before it starts (the weights and x).
    budget = 128 * 1024
    backend = fxckpt.backend(compiler="eager", memory_budget=budget, offload="never")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(2, 16, 32, requires_grad=True)
    torch.manual_seed(1)
    measured = measure_absolute_step(compiled, model, (x,))
    (plan,) = fxckpt.last_plans()
    assert sum(r.dtype == "uint8" and r.decision.kind == "keep" for r in plan.activations) == 2
    assert any("guarded to sizes" in n for n in plan.notes), plan.notes
    assert measured.absolute_peak_bytes <= budget
    # The replayed masks are the forward's: the gradients are eager's under the same seed.
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(2)
    got = compiled(x)
    got.backward()
    got_x, x.grad = x.grad, None
    torch.manual_seed(2)
    want = ref(x)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_x, x.grad)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=lambda m, n=name: f"{n}: {m}")
