"""Re-planning from measured copies (``adapt``), end to end, against eager.

Most tests force the trigger with a policy that re-plans at every step (``ALWAYS``): what is
under test is the re-plan itself (the swap, the bound, the gradients, the budget, dynamic
shapes), not the timing rule, which tests/planning/test_adapt_rules.py checks on recorded
samples. No test asserts a duration.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from models import GPT, gpt_inputs

import fxckpt
from fxckpt import adapt
from fxckpt.planning import adapt as rules
from fxckpt.runtime import engine

# Judge every step, and re-plan whenever a step copied anything (a stall of 0 s is over a
# threshold below 0 s): deterministic, whatever the machine's load.
ALWAYS = rules.Policy(warmup_steps=0, window_steps=1, stall_fraction=-1.0, stall_floor_s=-1.0)
EAGER_ALL = {"compiler": "eager", "offload": "all", "min_offload_bytes": 0, "coalesce": "never"}


@pytest.fixture
def always(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The forced policy, behind a fast emulated link: on the CPU only an emulated link is a
    link a plan can be corrected for (a bare memcpy is measured, never re-planned)."""
    monkeypatch.setattr(rules, "DEFAULT_POLICY", ALWAYS)
    fxckpt.reset_stats()
    with fxckpt.emulate_link(bandwidth="20GB/s"):
        yield


def _check_grads(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")


def _step_against_eager(compiled: Any, model: torch.nn.Module, ref: torch.nn.Module,
                        idx: torch.Tensor, tgt: torch.Tensor) -> None:
    """One training step of ``compiled`` (training ``model``) and of eager ``ref``: the loss
    and every gradient equal."""
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    loss = compiled(idx, tgt)
    loss.backward()
    want = ref(idx, tgt)
    want.backward()
    torch.testing.assert_close(loss, want)
    _check_grads(model, ref)


def train(options: dict[str, Any], steps: int, *, lengths: list[int] | None = None,
          dynamic: bool | None = None, seed: int = 0) -> list[str]:
    """Train a small GPT against eager for ``steps`` steps; the plan names in stats()."""
    torch.manual_seed(seed)
    model = GPT(n_layers=2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxckpt.backend(**options), dynamic=dynamic)
    for i in range(steps):
        seq = 16 if lengths is None else lengths[i % len(lengths)]
        idx, tgt = gpt_inputs(seq=seq, seed=i)
        _step_against_eager(compiled, model, ref, idx, tgt)
    return sorted(fxckpt.stats()["graphs"])


def _plans() -> dict[str, fxckpt.Plan]:
    return {p.name: p for p in fxckpt.last_plans()}


def _replanned(names: list[str], times: int) -> bool:
    """``names`` are one graph's plan and its ``times`` re-plans."""
    (base,) = {n.split("~")[0] for n in names}
    return names == [base] + [f"{base}~r{k}" for k in range(1, times + 1)]


def test_a_replan_keeps_loss_and_gradients_equal_to_eager(always: None) -> None:
    names = train(EAGER_ALL, 6)
    assert fxckpt.stats()["replans"] == 2
    assert _replanned(names, 2), names
    plans = _plans()
    for name in names[1:]:
        fig = plans[name].assumptions["bandwidth_bytes_per_s"]
        assert fig["source"] == "measured at run time" and fig["value"] > 0
    assert plans[names[0]].assumptions["bandwidth_bytes_per_s"]["source"] != "measured at run time"


def test_the_bound_holds(always: None) -> None:
    train(EAGER_ALL, 12)
    assert fxckpt.stats()["replans"] == rules.MAX_REPLANS == 2
    assert len(fxckpt.last_plans()) == 3


def test_adapt_never_never_changes_the_plan(always: None) -> None:
    names = train({**EAGER_ALL, "adapt": "never"}, 8)
    assert fxckpt.stats()["replans"] == 0
    assert _replanned(names, 0) and [p.name for p in fxckpt.last_plans()] == names


def test_adapt_measure_warns_once_and_never_replans(always: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = train({**EAGER_ALL, "adapt": "measure"}, 6)
    ours = [w for w in caught if issubclass(w.category, adapt.AdaptWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "would re-plan" in str(ours[0].message) and "bandwidth=" in str(ours[0].message)
    assert fxckpt.stats()["replans"] == 0 and _replanned(names, 0)


def test_auto_changes_nothing_for_a_plan_without_offloads(always: None) -> None:
    names = train({"compiler": "eager", "offload": "never", "memory_budget": 0.5}, 6)
    assert fxckpt.stats()["replans"] == 0 and _replanned(names, 0)


def test_a_cpu_graph_without_an_emulated_link_is_measured_not_replanned(always: None) -> None:
    with fxckpt.emulate_link(None):
        names = train(EAGER_ALL, 6)
        assert fxckpt.stats()["graphs"][names[0]]["copied_bytes"] > 0
    assert fxckpt.stats()["replans"] == 0 and _replanned(names, 0)


def test_cost_model_unit_is_measured_not_replanned(always: None) -> None:
    names = train({**EAGER_ALL, "cost_model": "unit"}, 6)
    assert fxckpt.stats()["replans"] == 0 and _replanned(names, 0)


@pytest.mark.heavy
def test_a_replan_under_dynamic_shapes_keeps_one_graph_for_every_length(always: None) -> None:
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    names = train(EAGER_ALL, 8, lengths=[16, 24, 17, 31], dynamic=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 1  # no recompile
    assert fxckpt.stats()["replans"] == 2
    assert _replanned(names, 2), names
    for plan in fxckpt.last_plans():  # each made for the symbolic sizes, at the longest
        symbolic = [a for a in plan.activations if any(isinstance(d, str) for d in a.to_dict()["shape"])]
        assert symbolic, plan.name


def test_a_replan_of_static_graphs_keeps_one_plan_per_length(always: None) -> None:
    names = train(EAGER_ALL, 12, lengths=[16, 24], dynamic=False)
    bases = {n.split("~")[0] for n in names}
    assert len(bases) == 2, names  # one graph per length, each re-planned on its own
    assert fxckpt.stats()["replans"] == 4
    for base in bases:
        assert _replanned([n for n in names if n.split("~")[0] == base], 2), names


def test_the_budget_holds_before_during_and_after_a_replan(always: None) -> None:
    torch.manual_seed(0)
    model = GPT(d=64, heads=4, n_layers=4)
    # The step's absolute peak (parameters and batch, 0.8 MiB, included): a plan that
    # offloads part and recomputes part of what min-cut saves.
    budget = int(6.5 * 2**20)
    options = {"compiler": "eager", "memory_budget": "6.5MiB", "bandwidth": "3.2GB/s"}
    compiled = torch.compile(model, backend=fxckpt.backend(**options))
    inputs = gpt_inputs(seq=128)
    peaks, steps_ = [], []
    for _ in range(6):
        model.zero_grad(set_to_none=True)  # each step starts from the same level
        # The whole step, as memory_budget counts it; a re-plan compiles inside it (behind
        # the emulated link no probe runs at compile time).
        m = fxckpt.measure(lambda: compiled(*inputs).backward(), holding=(model, inputs))
        assert m.peak_bytes > 0, m
        peaks.append(m.absolute_peak_bytes)
        steps_.append(fxckpt.stats()["replans"])
    plans = fxckpt.last_plans()
    assert fxckpt.stats()["replans"] >= 1, steps_
    assert len(plans) == 1 + fxckpt.stats()["replans"], [p.name for p in plans]
    assert {a.decision.kind for a in plans[0].activations} >= {"offload", "recompute"}
    # The re-plan keeps the compile's budget, and every plan predicts a step within it.
    assert {p.budget_bytes for p in plans} == {budget}
    for p in plans:
        assert p.step is not None and p.step["total_bytes"] <= budget, (p.name, p.step)
    assert all(0 < peak <= budget for peak in peaks), (peaks, budget)


def test_stats_count_each_graphs_copies_on_the_emulated_link() -> None:
    fxckpt.reset_stats()
    with fxckpt.emulate_link(bandwidth="20MB/s"):
        train({**EAGER_ALL, "adapt": "never"}, 2)
        snap = fxckpt.stats()
    (fig,) = snap["graphs"].values()
    assert fig["copied_bytes"] == snap["offloaded_bytes"] + snap["prefetched_bytes"] > 0
    assert fig["copy_seconds"] == pytest.approx(snap["copy_seconds"])
    # a window lasts bytes / bandwidth, or longer when its memcpy overran: never less
    assert 0 < fig["measured_bandwidth_bytes_per_s"] <= 20e6 * (1 + 1e-9)
    assert 0 < fig["exposed_copy_seconds"] <= snap["stall_seconds"] + 1e-12


def test_stalls_are_counted_for_the_graph_whose_backward_waited() -> None:
    fxckpt.reset_stats()
    engine.configure(copy_delay_s=0.02)
    try:
        train({**EAGER_ALL, "adapt": "never"}, 1)
    finally:
        engine.configure()
    snap = fxckpt.stats()
    (fig,) = snap["graphs"].values()
    assert fig["exposed_copy_seconds"] == pytest.approx(snap["stall_seconds"]) and fig["exposed_copy_seconds"] > 0


@pytest.mark.slow
def test_a_replan_under_inductor_keeps_gradients_equal_to_eager(always: None) -> None:
    names = train({"offload": "all", "min_offload_bytes": 0}, 4)
    assert fxckpt.stats()["replans"] == 2 and len(names) == 3


def test_a_backward_pending_across_the_swap_runs_the_plan_of_its_forward(always: None) -> None:
    torch.manual_seed(0)
    model = GPT(n_layers=2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxckpt.backend(**EAGER_ALL))
    (a, ta), (b, tb) = gpt_inputs(seed=1), gpt_inputs(seed=2)
    first = compiled(a, ta)  # the first plan; its backward waits
    assert fxckpt.stats()["replans"] == 0
    second = compiled(b, tb)  # re-planned at this call's start: the second plan
    assert fxckpt.stats()["replans"] == 1
    (first + second).backward()
    want = ref(a, ta) + ref(b, tb)
    want.backward()
    torch.testing.assert_close(first + second, want)
    _check_grads(model, ref)
    assert _replanned(sorted(fxckpt.stats()["graphs"]), 1)


def test_a_replan_whose_compile_adds_shape_guards_is_dropped(
    always: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = iter(range(0, 1000, 3))  # every count 3 more than the one before
    monkeypatch.setattr(adapt.compat, "shape_guard_count", lambda mode: next(counts))
    names = train(EAGER_ALL, 6)
    assert fxckpt.stats()["replans"] == 0 and _replanned(names, 0)


# The trigger's own thresholds, judged from the second step: a plan with nothing to stall on
# is judged by its copies or, too few to measure the link, by a probe.
PROBING = rules.Policy(warmup_steps=1, window_steps=1)
# Behind a 200 MB/s link (well under this machine's memcpy speed, so that the link's windows,
# not memcpys, time the copies), with the planner's compute 5x the cost model's: at 50 MB/s
# this decoder's plan offloads nothing and recomputes; at the link's 200 MB/s it offloads
# some of that instead (its plans' decisions are asserted below).
LINK = {"bandwidth": "200MB/s", "compute_scale": 5.0}
LOW = {"compiler": "eager", "memory_budget": 0.4, "bandwidth": "50MB/s"}


def _train_deep(options: dict[str, Any], steps: int) -> None:
    torch.manual_seed(0)
    model = GPT(d=64, heads=4, n_layers=4)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxckpt.backend(**options))
    for i in range(steps):
        idx, tgt = gpt_inputs(seq=128, seed=i)
        _step_against_eager(compiled, model, ref, idx, tgt)


@pytest.fixture
def probing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(rules, "DEFAULT_POLICY", PROBING)
    fxckpt.reset_stats()
    with fxckpt.emulate_link(**LINK):
        yield


def _decisions(plan: fxckpt.Plan) -> tuple[int, int]:
    kinds = [a.decision.kind for a in plan.activations]
    return kinds.count("offload"), kinds.count("recompute")


def test_a_bandwidth_4x_too_low_is_probed_and_replanned_to_offload_more(probing: None) -> None:
    _train_deep(LOW, 5)  # loss and every gradient against eager, every step
    snap = fxckpt.stats()
    assert snap["replans"] == 1 and snap["link_probes"] == 1, snap
    first, second = sorted(fxckpt.last_plans(), key=lambda p: p.name)
    assert second.name == f"{first.name}~r1"
    (off0, rec0), (off1, rec1) = _decisions(first), _decisions(second)
    assert off0 == 0 < rec0, (off0, rec0)  # the first plan copies nothing: only a probe can tell
    assert off1 > off0 and rec1 < rec0, (off1, rec1)
    assert second.offloaded_bytes > 0 and second.recomputed_bytes < first.recomputed_bytes
    assert second.budget_bytes == first.budget_bytes
    fig = second.assumptions["bandwidth_bytes_per_s"]
    probed = snap["graphs"][first.name]["probed_bandwidth_bytes_per_s"]
    assert fig["source"] == "measured at run time" and fig["value"] == probed
    assert snap["graphs"][first.name]["link_probes"] == 1
    # the emulated link's windows last bytes / bandwidth, or longer when a memcpy overran
    assert 1.5 * 50e6 < probed <= 200e6 * (1 + 1e-9)


def test_adapt_never_never_probes(probing: None) -> None:
    _train_deep({**LOW, "adapt": "never"}, 4)
    snap = fxckpt.stats()
    assert snap["link_probes"] == 0 and snap["replans"] == 0
    (plan,) = fxckpt.last_plans()
    assert _decisions(plan)[0] == 0 and all(g["link_probes"] == 0 for g in snap["graphs"].values())


def test_adapt_measure_probes_once_and_warns(probing: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_deep({**LOW, "adapt": "measure"}, 5)
    ours = [w for w in caught if issubclass(w.category, adapt.AdaptWarning)]
    assert len(ours) == 1 and "probe" in str(ours[0].message), [str(w.message) for w in ours]
    snap = fxckpt.stats()
    assert snap["link_probes"] == 1 and snap["replans"] == 0


def test_no_probe_without_a_link(probing: None) -> None:
    with fxckpt.emulate_link(None):
        _train_deep(LOW, 4)
    snap = fxckpt.stats()
    assert snap["link_probes"] == 0 and snap["replans"] == 0
