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


def _payload(name: str, budget=None, peak=None, spec=None) -> str:
    return json.dumps(
        {"name": name, "budget_bytes": budget, "resident_peak_bytes": peak, "options": {"memory_budget": spec}}
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


def test_a_byte_budget_overrun_at_run_time_is_warned_once_with_the_figures():
    big = torch.randn(512)
    with pytest.warns(stats.BudgetOverrunWarning, match=r"kept 2048 bytes.*memory_budget=1000 bytes.*\[512\]") as first:
        OPS.note_saved([big], _payload("g", budget=1000, peak=900, spec=1000))
    assert len(first) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OPS.note_saved([big], _payload("g", budget=1000, peak=900, spec=1000))  # once
        # A fraction is a fraction of each size's own baseline; the guard handles it.
        OPS.note_saved([big], _payload("h", budget=1000, peak=900, spec=0.5))
        # A plan that was already over its budget was reported when it was compiled.
        OPS.note_saved([big], _payload("i", budget=1000, peak=3000, spec=1000))


def test_plan_payloads_are_ordered_and_deduplicated_by_value():
    OPS.note_saved([torch.ones(2)], '{"graph": "b"}')
    OPS.note_saved([torch.ones(2)], '{"graph": "a"}')
    OPS.note_saved([torch.ones(2)], "".join(['{"graph": ', '"b"}']))  # equal, not identical
    OPS.note_saved([torch.ones(2)], "")
    stats.add_plan_payload('{"graph": "a"}')
    assert stats.plan_payloads() == ['{"graph": "b"}', '{"graph": "a"}']
