"""Runtime counters and the plan registry."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from fxckpt.runtime import engine, pool, stats

OPS = torch.ops.fxckpt


@pytest.fixture(autouse=True)
def _clean_runtime():
    engine.configure()
    pool.set_pool_cap(None)
    stats.reset()
    yield
    engine.configure()
    pool.set_pool_cap(None)


def _round_trip(src: torch.Tensor) -> None:
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    OPS.prefetch(h)
    assert torch.equal(OPS.wait(h, h, src.shape, src.stride(), src.dtype, src.device), src)


def test_offloaded_bytes_equal_prefetched_bytes_and_count_spans():
    base = torch.randn(10, 8)
    srcs = [base, base[3:, 1:5], base.t(), base.to(torch.bfloat16)]
    for s in srcs:
        _round_trip(s)
    snap = stats.snapshot()
    # base[3:, 1:5] reaches from element 25 to element 76 of base: a 52-element span.
    assert snap["offloaded_bytes"] == 320 + 52 * 4 + 320 + 160
    assert snap["prefetched_bytes"] == snap["offloaded_bytes"]
    assert snap["offload_calls"] == 4
    assert snap["fallbacks"] == 0


def test_stall_seconds_count_time_blocked_on_copies():
    engine.configure(copy_delay_s=0.05)
    _round_trip(torch.randn(100))
    assert stats.snapshot()["stall_seconds"] >= 0.08  # one blocked offload_done and one wait


def test_copy_seconds_count_the_workers_copy_time_and_reset_zeroes_them():
    engine.configure(copy_delay_s=0.05)
    _round_trip(torch.randn(100))
    assert stats.snapshot()["copy_seconds"] >= 0.1  # both copies, each delayed 0.05 s
    stats.reset()
    assert stats.snapshot()["copy_seconds"] == 0.0


def test_reset_zeroes_counters_and_rebases_the_high_water_mark():
    _round_trip(torch.randn(1 << 16))
    before = stats.snapshot()
    assert before["offload_calls"] == 1 and before["pool_bytes"] > 0
    stats.add_plan_payload('{"plan": 1}')
    stats.reset()
    after = stats.snapshot()
    for name in ("offloaded_bytes", "prefetched_bytes", "offload_calls", "fallbacks"):
        assert after[name] == 0, name
    assert after["stall_seconds"] == 0.0
    assert after["pool_bytes"] == before["pool_bytes"]  # memory still held
    assert after["pool_high_water_bytes"] == after["pool_bytes"]
    assert stats.plan_payloads() == []


def test_high_water_tracks_the_peak():
    p = pool.HostPool(pinned=False)
    start = stats.snapshot()["pool_bytes"]
    bufs = [p.acquire(200_000) for _ in range(3)]
    for b in bufs:
        p.release(b)
    p.trim()
    snap = stats.snapshot()
    assert snap["pool_bytes"] == start
    assert snap["pool_high_water_bytes"] >= start + 3 * pool.size_class(200_000)


def _documented(section: str) -> set[str]:
    """The backticked names in the first column of ``section``'s table in docs/options.md."""
    text = (Path(__file__).parents[2] / "docs" / "options.md").read_text()
    body = text.split(section, 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1] for line in body.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([a-z][a-z0-9_]*)`", row)}


def test_every_figure_of_the_snapshot_is_documented_and_nothing_else():
    assert set(stats.snapshot()) == _documented("### `fxckpt.stats()`")


def test_every_figure_of_a_graph_is_documented():
    text = (Path(__file__).parents[2] / "docs" / "options.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `graphs` |"))
    fields = {f.name for f in dataclasses.fields(stats.GraphFigures)}
    fields |= {"exposed_copy_seconds", "copy_seconds", "copied_bytes", "measured_bandwidth_bytes_per_s"}
    assert {f for f in fields if f"`{f}`" not in row} == set()


def _payload(name: str, budget=None, peak=None, spec=None, held=None, step=None) -> str:
    target = {"forward_bytes": budget, "backward_bytes": budget} if budget is not None else None
    return json.dumps(
        {"name": name, "budget_bytes": budget, "resident_peak_bytes": peak, "held_bytes": held,
         "target": target, "step": step, "options": {"memory_budget": spec}}
    )


def test_note_saved_counts_each_storage_once():
    base = torch.randn(16, 16)
    other = torch.randn(7, dtype=torch.bfloat16)
    OPS.note_saved([base, base[2:], base.t(), other, other[1:]], _payload("g"))
    assert stats.snapshot()["graphs"]["g"]["planned_kept_bytes"] == base.nbytes + other.nbytes
    OPS.note_saved([], _payload("g"))
    assert stats.snapshot()["graphs"]["g"]["planned_kept_bytes"] == 0


def test_each_graph_keeps_its_own_figures_and_the_step_adds_them_up():
    a, b = torch.randn(100), torch.randn(30)
    OPS.note_saved([a], _payload("first", budget=1000, peak=400))
    h = OPS.offload(torch.randn(64))  # runs between the notes: the second graph's offload
    OPS.note_saved([b], _payload("second", budget=1000, peak=120))
    OPS.note_saved([a], _payload("first", budget=1000, peak=400))  # a second step
    snap = stats.snapshot()
    first, second = snap["graphs"]["first"], snap["graphs"]["second"]
    assert (first["runs"], first["planned_kept_bytes"], first["offloaded_bytes"]) == (2, 400, 0)
    assert (second["runs"], second["planned_kept_bytes"], second["offloaded_bytes"]) == (1, 120, 256)
    assert (first["planned_peak_bytes"], first["budget_bytes"]) == (400, 1000)
    assert snap["planned_kept_bytes"] == 520
    assert snap["planned_peak_bytes"] == 520
    del h


def test_fallbacks_are_counted_in_bytes_per_graph_and_warned_once_with_the_figures():
    pool.set_pool_cap(0)
    src = torch.randn(1000)
    with pytest.warns(pool.HostMemoryWarning) as caught:
        handles = [OPS.offload(src), OPS.offload(src[:500])]
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "4000 bytes" in message and "cap of 0 bytes" in message and "fallback_bytes" in message
    OPS.note_saved([], _payload("g"))
    snap = stats.snapshot()
    assert (snap["fallbacks"], snap["fallback_bytes"], snap["offloaded_bytes"]) == (2, 6000, 0)
    assert snap["graphs"]["g"]["fallback_bytes"] == 6000
    for h, want in zip(handles, (src, src[:500]), strict=True):
        assert torch.equal(OPS.wait(h, h, list(want.shape), [1], torch.float32, src.device), want)


def test_a_forward_that_keeps_more_than_its_plan_counts_is_warned_once_with_the_figures():
    """Under a budget, the step was planned with what each forward leaves for its backward
    (the plan's held_bytes); a forward that keeps more (sizes the plan was not made for) is
    warned once, with the figures."""
    big = torch.randn(4096)
    with pytest.warns(stats.BudgetOverrunWarning,
                      match=r"kept 16384 bytes.*over the 900 bytes its plan counts.*memory_budget=5000 bytes.*\[4096\]") as first:  # fmt: skip
        OPS.note_saved([big], _payload("g", budget=5000, held=900, spec=5000))
    assert len(first) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OPS.note_saved([big], _payload("g", budget=5000, held=900, spec=5000))  # once
        # Within the plan's figure and its slack (the allocator's rounding, small tensors).
        OPS.note_saved([big], _payload("h", budget=5000, held=16384 - 100, spec=5000))
        # Without a budget nothing was planned with the figure.
        OPS.note_saved([big], _payload("i", held=900))


def test_the_planned_step_is_the_largest_graphs_figure():
    small = {"start_bytes": 10, "gradients_bytes": 0, "activations_bytes": 5, "total_bytes": 15}
    large = {"start_bytes": 10, "gradients_bytes": 3, "activations_bytes": 7, "total_bytes": 20}
    OPS.note_saved([], _payload("a", budget=100, step=small))
    OPS.note_saved([], _payload("b", budget=100, step=large))
    snap = stats.snapshot()
    assert snap["graphs"]["a"]["planned_step"] == small and snap["planned_step"] == large


def test_plan_payloads_are_ordered_and_deduplicated_by_value():
    OPS.note_saved([torch.ones(2)], '{"graph": "b"}')
    OPS.note_saved([torch.ones(2)], '{"graph": "a"}')
    OPS.note_saved([torch.ones(2)], "".join(['{"graph": ', '"b"}']))  # equal, not identical
    OPS.note_saved([torch.ones(2)], "")
    stats.add_plan_payload('{"graph": "a"}')
    assert stats.plan_payloads() == ['{"graph": "b"}', '{"graph": "a"}']
