"""Dynamic shapes: plans for symbolic sizes, and a host pool that absorbs varying lengths.

- ``dynamic=True`` (or ``mark_dynamic``): one graph serves every length. Its plan is made for
  symbolic sizes, and offloaded tensors are restored with sizes the backward rebuilds from
  the SymInts it receives.
- ``dynamic=False``: every new length compiles a static graph of its own.

Either way the pool's size classes (4 per power of two) let buffers freed by one length serve
the next, so over many steps of mixed lengths almost every request is a hit.

The last test runs examples/long_context.py small: lengths that plain compile cannot fit
under a byte budget, and fxckpt can.
"""

from __future__ import annotations

import copy
import gc
import random
from collections.abc import Callable

import pytest
import torch
from example_scripts import load_example
from measured import measure_absolute_step
from models import GPT, gpt_inputs

import fxckpt
from fxckpt.runtime.pool import get_pool

ALL = {"compiler": "eager", "offload": "all", "min_offload_bytes": 0}


def _train_and_compare(
    dynamic: bool | None, lengths: list[int], on_step: Callable[[int], None] | None = None, **options: object
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Train the lengths compiled and eagerly, comparing every step; the model and its
    compiled wrapper, warm."""
    torch.manual_seed(0)
    model = GPT(n_layers=2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxckpt.backend(**{**ALL, **options}), dynamic=dynamic)
    for i, length in enumerate(lengths):
        idx, tgt = gpt_inputs(seq=length, seed=i)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss = compiled(idx, tgt)
        loss.backward()
        want = ref(idx, tgt)
        want.backward()
        torch.testing.assert_close(loss, want)
        grads = dict(model.named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
        if on_step is not None:
            on_step(i)
    return model, compiled


def _mixed_lengths(n: int = 50, low: int = 24, high: int = 64, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


@pytest.fixture
def empty_pool() -> None:
    """Start from an empty host pool, so the hit rate counts this test's own warm-up."""
    gc.collect()  # handles of earlier tests give their buffers back when collected
    get_pool("cpu").trim()
    fxckpt.reset_stats()


def _hit_rate(stats: dict) -> float:
    return stats["pool_hits"] / max(1, stats["pool_hits"] + stats["pool_misses"])


def test_dynamic_true_plans_symbolic_sizes_and_offloads_them() -> None:
    _train_and_compare(True, [16, 24, 17, 31])
    plans = fxckpt.last_plans()
    assert len(plans) == 1, [p.name for p in plans]  # one graph for every length
    (plan,) = plans
    symbolic = [r for r in plan.activations if any(isinstance(d, str) for d in r.to_dict()["shape"])]
    assert symbolic, "the plan should hold tensors of symbolic size"
    assert {r.decision.kind for r in symbolic} == {"offload"}
    s = fxckpt.stats()
    assert s["offloaded_bytes"] == s["prefetched_bytes"] > 0
    assert s["planned_kept_bytes"] == 0


def test_mark_dynamic_sequence_dim_offloads_too() -> None:
    torch.manual_seed(0)
    model = GPT(n_layers=2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxckpt.backend(**ALL))
    for i, length in enumerate([20, 33, 27]):
        idx, tgt = gpt_inputs(seq=length, seed=i)
        torch._dynamo.mark_dynamic(idx, 1)
        torch._dynamo.mark_dynamic(tgt, 1)
        got, want = compiled(idx, tgt), ref(idx, tgt)
        torch.testing.assert_close(got, want)
    assert len(fxckpt.last_plans()) == 1
    assert fxckpt.stats()["offload_calls"] > 0


def test_a_budget_holds_for_symbolic_plans() -> None:
    # memory_budget bounds the step's absolute peak at every length the plans serve (one per
    # range of lengths its plan holds for: tests/test_shape_budget.py); measured by the meter.
    # Plain min-cut's step peaks at 0.29 MB at 16 tokens and 0.47 MB at 40 here.
    budget = 600_000
    model, compiled = _train_and_compare(True, [16, 40], memory_budget=budget)
    for length in (16, 40):
        peak = measure_absolute_step(compiled, model, gpt_inputs(seq=length)).absolute_peak_bytes
        assert 0 < peak <= budget, (length, peak)
    plans = fxckpt.last_plans()
    assert all(plan.budget_bytes == budget for plan in plans)
    assert plans[0].offloaded_bytes > 0


@pytest.mark.heavy
def test_pool_hit_rate_over_50_steps_of_mixed_lengths_with_dynamic_true(
    empty_pool: None, capsys: pytest.CaptureFixture
) -> None:
    lengths = _mixed_lengths()
    halfway: dict = {}
    _train_and_compare(True, lengths, on_step=lambda i: halfway.update(fxckpt.stats()) if i == 24 else None)
    s = fxckpt.stats()
    late_hits = s["pool_hits"] - halfway["pool_hits"]
    late_misses = s["pool_misses"] - halfway["pool_misses"]
    late = late_hits / max(1, late_hits + late_misses)
    with capsys.disabled():
        print(
            f"\n[dynamic=True] 50 steps, lengths {min(lengths)}..{max(lengths)} "
            f"({len(set(lengths))} distinct): pool_hits {s['pool_hits']}, "
            f"pool_misses {s['pool_misses']}, hit rate {_hit_rate(s):.1%} "
            f"(steps 26-50: {late:.1%}), pool {s['pool_bytes']} B"
        )
    assert len(fxckpt.last_plans()) == 1
    assert s["host_allocations"] == s["pool_misses"]
    # Misses come from the first use of each size class; once the classes are warm, hits.
    assert _hit_rate(s) >= 0.85
    assert late >= 0.95


def test_static_shapes_recompile_per_length_and_the_pool_absorbs_them(
    empty_pool: None, capsys: pytest.CaptureFixture
) -> None:
    # Four lengths whose saved tensors fall in the same size classes.
    lengths = [random.Random(1).choice([58, 60, 62, 64]) for _ in range(50)]
    lengths = [58, 60, 62, 64] + lengths[4:]
    _train_and_compare(False, lengths)
    s = fxckpt.stats()
    rate = _hit_rate(s)
    with capsys.disabled():
        print(
            f"\n[dynamic=False] 50 steps over lengths {sorted(set(lengths))}: "
            f"{len(fxckpt.last_plans())} graphs, pool_hits {s['pool_hits']}, "
            f"pool_misses {s['pool_misses']}, hit rate {rate:.1%}"
        )
    assert len(fxckpt.last_plans()) == 4  # one static graph per length
    assert rate >= 0.95


@pytest.mark.slow
@pytest.mark.inductor
def test_symbolic_offload_under_inductor() -> None:
    torch.manual_seed(0)
    model = GPT(n_layers=1, d=16)
    ref = copy.deepcopy(model)
    backend = fxckpt.backend(offload="all", min_offload_bytes=0)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for i, length in enumerate([12, 20]):
        idx, tgt = gpt_inputs(seq=length, seed=i)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss, want = compiled(idx, tgt), ref(idx, tgt)
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-4)
        grads = dict(model.named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, atol=1e-5, rtol=1e-4)
    assert len(fxckpt.last_plans()) == 1
    s = fxckpt.stats()
    assert s["offloaded_bytes"] == s["prefetched_bytes"] > 0


@pytest.mark.heavy
def test_long_context_example_fits_lengths_plain_compile_cannot(capsys: pytest.CaptureFixture) -> None:
    """examples/long_context.py, small: under a byte budget (the step's absolute device peak),
    the longer lengths overflow plain compile's step peak while fxckpt's (measured, and
    predicted by its plan) meets it."""
    example = load_example("long_context")
    results = example.run([  # type: ignore[attr-defined]
        "--budget", "2MiB", "--seq-start", "128", "--max-seq", "1024", "--layers", "2",
        "--d", "32", "--compiler", "eager",
    ])
    out = capsys.readouterr().out
    assert "longest length fxckpt fits and plain compile does not: 512 tokens" in out, out
    budget = 2 * 2**20
    assert [m.seq for m in results] == [128, 256, 512, 1024]
    assert results[0].plain_fits and results[0].fxckpt_fits  # short enough for both
    fit = results[2]
    assert fit.plain_saved > budget >= fit.fxckpt_resident
    assert fit.fxckpt_peak is not None and fit.fxckpt_peak <= budget
    # Offload or recompute, whichever the cost model prices lower (on the CPU engine, with its
    # per-copy hand-off, these 2-layer blocks are cheaper to recompute).
    assert fit.offloaded + fit.recomputed > 0
    assert fit.loss_diff <= 1e-5 and fit.max_grad_diff <= 1e-5
    # At 1024 tokens the backward of one block outgrows the budget: no plan fits (BudgetError),
    # so the search stops there.
    assert not results[3].fxckpt_fits and results[3].fxckpt_resident is None
