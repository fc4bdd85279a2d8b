"""Every plan records what its cost model assumed, and where each figure came from; the
probes behind the measured figures run on real tensors, outside the compile's fake mode."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fxckpt
from fxckpt.graph import costs
from fxckpt.options import Options

# A first compile in a fresh process: the probe runs inside the partitioner, where AOTAutograd's
# FakeTensorMode is active. Then the same probe again, outside any compile.
FRESH = textwrap.dedent(
    """
    import json, sys
    import torch
    import fxckpt
    from fxckpt.graph import costs
    sys.path.insert(0, sys.argv[1])
    from models import MLP

    torch.manual_seed(0)
    model = MLP(d=32, depth=4)
    options = {"compiler": "eager", "memory_budget": 0.3, "min_offload_bytes": 0}
    torch.compile(model, backend="fxckpt", options=options)(
        torch.randn(8, 32, requires_grad=True)).backward()
    (plan,) = fxckpt.last_plans()
    costs._bandwidth.cache_clear()
    outside = []
    for _ in range(5):
        costs._bandwidth.cache_clear()
        outside.append(costs.measure_bandwidth("cpu") * 1e3)
    print("RESULT " + json.dumps({"assumed": plan.assumptions, "outside": outside}))
    """
)


def test_a_first_compile_assumes_the_bandwidth_a_probe_outside_compile_measures() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FRESH, str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    got = json.loads(line[len("RESULT ") :])
    bw = got["assumed"]["bandwidth_bytes_per_s"]
    assert bw["source"] == "measured"
    outside = got["outside"]  # five probes after the compile, in bytes per second
    # Inside the fake mode the probe read ~56-100x the real rate: the bound that matters is the
    # upper one. Below, a memcpy rate drops when other processes share the memory bus (CI runs two
    # legs side by side: one in-compile probe read 8.4x under the five after it), so the lower
    # bound only says the probe timed a real copy.
    assert bw["value"] <= max(outside) * 4, (bw["value"], outside)
    assert bw["value"] >= min(outside) / 50, (bw["value"], outside)


def test_the_cuda_probe_steps_out_of_a_fake_mode() -> None:
    from cuda_double import FakeCuda
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxckpt import _cuda

    hw = FakeCuda(bandwidth={"cuda:0": 3e6})
    saved, _cuda.CUDA = _cuda.CUDA, hw
    costs._bandwidth.cache_clear()
    try:
        with FakeTensorMode():  # where the partitioner runs
            assert torch.empty(4).__class__.__name__ == "FakeTensor"
            rate = costs.measure_bandwidth("cuda:0")
    finally:
        _cuda.CUDA = saved
        costs._bandwidth.cache_clear()
    assert rate == pytest.approx(3e6)  # the double's link, timed on real copies
    assert hw.locked_bytes() == 0 and hw.races == []


def test_each_figure_says_where_it_came_from() -> None:
    measured = costs.assumptions(Options(), torch.device("cpu"))
    probed = costs.measure_bandwidth("cpu")  # cached per process: the figure just assumed
    assert measured["bandwidth_bytes_per_s"] == {"value": probed * 1e3, "source": "measured"}
    assert measured["compute_flops_per_s"] == {"value": 1e11, "source": "default"}
    assert measured["memory_bytes_per_s"] == {"value": 1e10, "source": "default"}
    assert measured["copy_overhead_ms"] == {"value": 0.5, "source": "default"}
    assert measured["copy_margin"] == {"value": 0.5, "source": "default"}
    given = costs.assumptions(Options(bandwidth="12GB/s"), "cuda:0")
    assert given["bandwidth_bytes_per_s"] == {"value": 12e9, "source": "option"}
    assert given["compute_flops_per_s"]["value"] == 1e14
    assert given["copy_overhead_ms"]["value"] == 0.1
    offline = costs.assumptions(Options(), "meta")
    assert offline["bandwidth_bytes_per_s"] == {"value": 2.5e10, "source": "default"}
    unit = costs.assumptions(Options(cost_model="unit"), "cpu")
    assert unit["bandwidth_bytes_per_s"] == {"value": 1e9, "source": "default"}
    assert unit["copy_overhead_ms"]["value"] == 0.0
    assert unit["copy_margin"]["value"] == 0.0


# Every figure unlike the default's and unlike each other's: a figure read from the wrong
# row, the wrong field or the default table shows.
OTHER = costs.CostTable(
    cpu=costs.DeviceCosts(flops_per_ms=4e8, bytes_per_ms=3e7, copy_overhead_ms=7.0),
    cuda=costs.DeviceCosts(flops_per_ms=5e10, bytes_per_ms=6e8, copy_overhead_ms=3.0),
    pcie_bytes_per_ms=9e6,
    copy_margin=0.25,
    unit_bytes_per_ms=2e6,
    unit_disk_bytes_per_ms=3e5,
)


def test_a_table_passed_in_gives_the_figures_it_holds() -> None:
    def values(options: Options, device: object) -> dict[str, float]:
        got = costs.assumptions(options, device, table=OTHER)
        assert got != costs.assumptions(options, device)
        return {k: v["value"] for k, v in got.items()}

    # Offline: every figure is the table's, from the GPU row.
    assert values(Options(), "meta") == {
        "bandwidth_bytes_per_s": 9e9, "compute_flops_per_s": 5e13, "memory_bytes_per_s": 6e11,
        "copy_overhead_ms": 3.0, "link_overhead_ms": 0.0, "copy_margin": 0.25}
    # A CPU device reads the CPU row; a given bandwidth still beats the table's.
    assert values(Options(bandwidth="12GB/s"), torch.device("cpu")) == {
        "bandwidth_bytes_per_s": 12e9, "compute_flops_per_s": 4e11, "memory_bytes_per_s": 3e10,
        "copy_overhead_ms": 7.0, "link_overhead_ms": 0.0, "copy_margin": 0.25}
    # The unit model: the table's unit link, and neither overhead nor margin.
    unit = values(Options(cost_model="unit"), "cuda:0")
    assert unit["bandwidth_bytes_per_s"] == 2e9
    assert unit["copy_overhead_ms"] == unit["copy_margin"] == 0.0
    # Measured at run time still beats the table.
    replan = costs.assumptions(Options(), "meta", {"copy_overhead_ms": 1.25}, table=OTHER)
    assert replan["copy_overhead_ms"] == {"value": 1.25, "source": costs.RUN_TIME}
    assert replan["copy_margin"] == {"value": 0.25, "source": "default"}


def test_the_unit_disk_rate_comes_from_the_table(tmp_path: Path) -> None:
    from fxckpt.planning import host

    unit = Options(cost_model="unit", offload_dir=str(tmp_path))  # measured nothing
    assert host.disk_rates(unit) == host.tiers.DiskRates(1e5, 1e5)
    assert host.disk_rates(unit, OTHER) == host.tiers.DiskRates(3e5, 3e5)
    given = Options(cost_model="unit", offload_dir_bandwidth="1GB/s")
    assert host.disk_rates(given, OTHER) == host.tiers.DiskRates(1e6, 1e6)  # the option wins


def test_the_plan_prices_copies_with_the_figures_it_records() -> None:
    from models import MLP

    torch.manual_seed(0)
    fxckpt.reset_stats()
    model = MLP(d=64, depth=4)
    # memory_budget=0.2 is 20 % of the way from the lowest plan's step peak to plain
    # min-cut's: a batch whose activations outweigh the weights' gradients leaves a range to
    # plan in, and without blocks to recompute (segment_stride=0) the plan offloads some.
    options = {"compiler": "eager", "memory_budget": 0.2, "min_offload_bytes": 0,
               "bandwidth": "2GB/s", "coalesce": "never", "segment_stride": 0}  # fmt: skip
    torch.compile(model, backend="fxckpt", options=options)(
        torch.randn(256, 64, requires_grad=True)).backward()
    (plan,) = fxckpt.last_plans()
    assert plan.assumptions["bandwidth_bytes_per_s"] == {"value": 2e9, "source": "option"}
    assert Plan_round_trip(plan).assumptions == plan.assumptions
    offloads = [a for a in plan.activations if "copies" in a.decision.reason]
    assert offloads
    slower = 1 + plan.assumptions["copy_margin"]["value"]
    assert slower == 1.5  # the default margin under the flops model
    for a in offloads:  # "copies X ms": both directions at the recorded bandwidth and margin
        copies_ms = float(a.decision.reason.split("copies ")[1].split(" ms")[0])
        assert copies_ms == pytest.approx(2 * a.bytes / 2e9 * 1e3 * slower, abs=1e-3), (
            a.decision.reason)


def Plan_round_trip(plan: fxckpt.Plan) -> fxckpt.Plan:
    return fxckpt.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))


def test_inspect_shows_the_assumptions(tmp_path) -> None:
    from fxckpt.report.table import plain_plans

    plan = fxckpt.Plan("g", [], assumptions=costs.assumptions(Options(), "meta"))
    text = plain_plans([plan])
    assert "assumed" in text and "bandwidth 25 GB/s (default)" in text
