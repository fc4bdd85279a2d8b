"""FLOPs, the cost models and bandwidth measurement."""

from __future__ import annotations

import dataclasses
import operator
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxckpt.graph import costs
from fxckpt.graph.costs import (
    DEFAULT_COSTS,
    CostTable,
    DeviceCosts,
    device_rates,
    flops_to_ms,
    is_random,
    is_view_like,
    measure_bandwidth,
    node_cost_ms,
    node_flops,
)


def traced():
    def f(x, w):
        y = torch.nn.functional.dropout((x @ w).relu(), 0.5, True)
        return y.view(-1).sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(64, 128), torch.randn(128, 32))
    return {str(n.target): n for n in gm.graph.nodes}


def test_mm_flops_and_non_compute_ops():
    nodes = traced()
    assert node_flops(nodes["aten.mm.default"]) == 2 * 64 * 128 * 32
    for name in ("aten.relu.default", "aten.view.default", "x_1", "output"):
        assert node_flops(nodes[name]) == 0.0


def test_flops_from_real_tensor_vals():
    # ShapeProp-style graphs carry real tensors; they are counted through meta copies.
    gm = torch.fx.symbolic_trace(lambda x, w: torch.mm(x, w))
    vals = iter([torch.randn(64, 128), torch.randn(128, 32)])
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["val"] = next(vals)
    mm = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert node_flops(mm) == 2 * 64 * 128 * 32


def test_formulas_count_what_flop_counter_mode_counts():
    # node_flops calls FlopCounterMode's formulas on the fake vals instead of running each op;
    # on a joint graph with matmuls, convolutions, attention and their backwards, every node
    # must count what running it under FlopCounterMode counts.
    from torch.utils.flop_counter import FlopCounterMode

    def f(x, img, w, conv_w, q):
        y = torch.nn.functional.gelu(x @ w)
        z = torch.nn.functional.conv2d(img, conv_w, padding=1).relu()
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        b = torch.baddbmm(torch.ones(2, 8, 8), q[:, 0], q[:, 0].transpose(1, 2))
        return y.sum() + z.sum() + a.sum() + b.sum()

    def joint(*args):
        out = f(*args)
        return torch.autograd.grad(out, args)

    args = [
        torch.randn(16, 32, requires_grad=True),
        torch.randn(2, 3, 8, 8, requires_grad=True),
        torch.randn(32, 24, requires_grad=True),
        torch.randn(4, 3, 3, 3, requires_grad=True),
        torch.randn(2, 2, 8, 16, requires_grad=True),
    ]
    gm = make_fx(joint, tracing_mode="fake")(*args)
    counted = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or is_view_like(n):
            continue
        fake = costs._meta_args(n, lambda v: v)
        with FlopCounterMode(display=False) as counter:
            n.target(*fake[0], **fake[1])
        assert node_flops(n) == counter.get_total_flops(), n.format_node()
        counted += node_flops(n) > 0
    assert counted >= 5  # mm, convolution (+ backward), attention, baddbmm


def test_missing_vals_give_zero():
    gm = torch.fx.symbolic_trace(lambda x: x @ x)
    assert [node_flops(n) for n in gm.graph.nodes] == [0.0, 0.0, 0.0]


def test_unit_model_is_deterministic():
    nodes = traced()
    got = {k: node_cost_ms(n, "unit", "cpu") for k, n in nodes.items()}
    assert got == {k: node_cost_ms(n, "unit", "cpu") for k, n in traced().items()}
    assert got["aten.mm.default"] == got["aten.relu.default"] == 1.0
    assert got["aten.view.default"] == got["x_1"] == got["output"] == 0.0
    with pytest.raises(ValueError, match="cost_model"):
        node_cost_ms(nodes["aten.mm.default"], "guess", "cpu")


def test_flops_model_and_profile_falls_back_on_cpu():
    mm = traced()["aten.mm.default"]
    compute = 2 * 64 * 128 * 32 / 1e8  # the default CPU rates: 1e8 FLOPs and 1e7 bytes per ms
    traffic = (64 * 128 + 128 * 32 + 64 * 32) * 4 / 1e7
    want = max(compute, traffic)
    assert node_cost_ms(mm, "flops", "cpu") == pytest.approx(want)
    assert node_cost_ms(mm, "profile", "cpu") == pytest.approx(want)
    assert flops_to_ms(1e11, "cuda:0") == pytest.approx(1.0)  # 1e11 FLOPs per ms on a GPU
    assert flops_to_ms(1e8, torch.device("cpu")) == pytest.approx(1.0)


# Every figure different from the default's and from each other's, so that a function that
# reads the wrong row, the wrong field or the default table instead of this one gets caught.
OTHER = CostTable(
    cpu=DeviceCosts(flops_per_ms=4e8, bytes_per_ms=3e7, copy_overhead_ms=7.0),
    cuda=DeviceCosts(flops_per_ms=5e10, bytes_per_ms=6e8, copy_overhead_ms=3.0),
    pcie_bytes_per_ms=9e6,
    copy_margin=0.25,
    unit_bytes_per_ms=2e6,
    unit_disk_bytes_per_ms=3e5,
)


def test_the_default_table_holds_the_figures_the_plans_were_made_with():
    # Plans (tests/fixtures/golden_plans) depend on these numbers: changing one is a
    # behaviour change, to be made here on purpose and in the docs.
    assert DEFAULT_COSTS == CostTable()
    assert DEFAULT_COSTS.cpu == DeviceCosts(flops_per_ms=1e8, bytes_per_ms=1e7, copy_overhead_ms=0.5)
    assert DEFAULT_COSTS.cuda == DeviceCosts(flops_per_ms=1e11, bytes_per_ms=2e9, copy_overhead_ms=0.1)
    assert (DEFAULT_COSTS.pcie_bytes_per_ms, DEFAULT_COSTS.copy_margin) == (2.5e7, 0.5)
    assert (DEFAULT_COSTS.unit_bytes_per_ms, DEFAULT_COSTS.unit_disk_bytes_per_ms) == (1e6, 1e5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_COSTS.copy_margin = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_COSTS.cpu.copy_overhead_ms = 1.0  # type: ignore[misc]


def test_the_cost_model_has_no_mutable_module_state_to_patch():
    # Figures come in through a table; none sits in a module-level dict, list or set.
    mutable = [name for name, value in vars(costs).items()
               if not name.startswith("__") and isinstance(value, (dict, list, set, bytearray))]
    assert mutable == []


def test_every_field_says_what_it_is():
    # Each field carries a docstring (units, where the number comes from) in the source.
    import ast
    import inspect

    for cls in (CostTable, DeviceCosts):
        body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
        documented = {
            stmt.target.id for stmt, nxt in zip(body, body[1:], strict=False)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str) and nxt.value.value.strip()
        }
        assert documented == {f.name for f in dataclasses.fields(cls)}, cls


@pytest.mark.parametrize(("device", "row"), [
    ("cpu", "cpu"), (torch.device("cpu"), "cpu"), ("cuda", "cuda"), ("cuda:0", "cuda"),
    (torch.device("cuda", 1), "cuda"), ("meta", "cuda"), (torch.device("meta"), "cuda"),
])  # fmt: skip
def test_each_device_kind_picks_its_row(device, row):
    # Offline plans (meta) are made for a GPU that is not here: they price a GPU's row.
    want = getattr(OTHER, row)
    assert OTHER.row(device) is want
    assert device_rates(device, OTHER) == costs.Rates(want.flops_per_ms, want.bytes_per_ms)
    assert costs.copy_overhead_ms(device, "flops", OTHER) == want.copy_overhead_ms
    assert costs.copy_overhead_ms(device, "profile", OTHER) == want.copy_overhead_ms
    assert costs.copy_overhead_ms(device, "unit", OTHER) == 0.0  # unit plans stay deterministic
    assert flops_to_ms(want.flops_per_ms * 3, device, table=OTHER) == pytest.approx(3.0)


def test_a_table_passed_in_prices_nodes():
    mm = traced()["aten.mm.default"]
    compute = 2 * 64 * 128 * 32 / OTHER.cpu.flops_per_ms
    traffic = (64 * 128 + 128 * 32 + 64 * 32) * 4 / OTHER.cpu.bytes_per_ms
    assert node_cost_ms(mm, "flops", "cpu", table=OTHER) == pytest.approx(max(compute, traffic))
    assert node_cost_ms(mm, "flops", "cpu", table=OTHER) != node_cost_ms(mm, "flops", "cpu")
    assert node_cost_ms(mm, "unit", "cpu", table=OTHER) == 1.0  # no figure in the unit model
    slower = dataclasses.replace(OTHER, cpu=dataclasses.replace(OTHER.cpu, flops_per_ms=1e3))
    assert node_cost_ms(mm, "flops", "cpu", table=slower) == pytest.approx(2 * 64 * 128 * 32 / 1e3)


def test_offline_probe_reads_the_table():
    assert measure_bandwidth("meta") == 2.5e7  # the default table's host link
    assert measure_bandwidth("meta", OTHER) == OTHER.pcie_bytes_per_ms


DOCS = Path(__file__).resolve().parents[2] / "docs"


def _figure(x: float) -> str:
    return f"{x:g}"


def test_the_docs_quote_the_default_table():
    # The defaults are quoted in prose; change one here and the docs must follow.
    t = DEFAULT_COSTS
    options = " ".join((DOCS / "options.md").read_text().split())
    assert f"{_figure(t.cpu.copy_overhead_ms)} ms for the CPU engine" in options
    assert f"{_figure(t.cuda.copy_overhead_ms)} ms for CUDA" in options
    assert "DEFAULT_COSTS.cpu.copy_overhead_ms" in options
    how = " ".join((DOCS / "how-it-works.md").read_text().split())
    assert f"(`CostTable.copy_margin`, {_figure(t.copy_margin * 100)} %)" in how
    assert f"if they took {_figure(1 + t.copy_margin)} times that" in how
    cli = " ".join((DOCS / "cli.md").read_text().split())
    assert f"a fixed host link of {_figure(t.pcie_bytes_per_ms * 1e3 / 1e9)} GB/s" in cli
    assert (f"about {_figure(t.cuda.flops_per_ms * 1e3 / 1e12)} TFLOP/s and "
            f"{_figure(t.cuda.bytes_per_ms * 1e3 / 1e12)} TB/s of device memory") in cli


def test_view_and_random_helpers():
    nodes = traced()
    assert is_view_like(nodes["aten.view.default"])
    assert not is_view_like(nodes["aten.mm.default"])
    assert is_random(nodes["aten.bernoulli_.float"])
    assert not is_random(nodes["aten.relu.default"])
    g = torch.fx.Graph()
    x = g.placeholder("x")
    item = g.call_function(operator.getitem, (x, 0))
    assert is_view_like(item)


def test_measure_bandwidth_is_positive_and_cached(monkeypatch):
    costs._bandwidth.cache_clear()
    first = measure_bandwidth("cpu")
    assert first > 0
    monkeypatch.setattr(torch, "empty", None)
    assert measure_bandwidth("cpu") == first  # served from the cache: nothing allocated
    assert costs._bandwidth.cache_info().hits >= 1


def test_the_cpu_probe_copies_written_memory(monkeypatch):
    # An unwritten torch.empty source maps every page to the kernel's shared zero page: the
    # copy then reads the cache, and the probe reported a rate no memory system has.
    sources: list[bool] = []
    real_copy = torch.Tensor.copy_

    def spy(self, src, *args, **kwargs):
        sources.append(bool(src.numel() > 2**20 and src[:: 2**12].ne(0).all()))
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    costs._bandwidth.cache_clear()
    try:
        assert measure_bandwidth("cpu") > 0
    finally:
        costs._bandwidth.cache_clear()
    assert len(sources) >= 3 and all(sources)  # every page of every timed source was written


def test_the_cuda_probe_times_the_copies_own_device(monkeypatch):
    # The copy runs on the stream of the device its device tensor lives on; timing events on
    # the current device's stream instead measured ~0 s for a model on cuda:1.
    from cuda_double import FakeCuda

    from fxckpt import _cuda

    hw = FakeCuda(bandwidth={"cuda:0": 5e6, "cuda:1": 2e6})  # bytes per ms
    monkeypatch.setattr(_cuda, "CUDA", hw)
    costs._bandwidth.cache_clear()
    try:
        assert hw.current_device == "cuda:0"
        assert measure_bandwidth("cuda:1") == pytest.approx(2e6)
        assert measure_bandwidth("cuda:0") == pytest.approx(5e6)
    finally:
        costs._bandwidth.cache_clear()
    assert hw.pageable_copies == []
    assert hw.locked_bytes() == 0  # the probe's page-locked buffer is given back
    assert hw.races == []


@pytest.mark.gpu
def test_measure_bandwidth_cuda():
    bw = measure_bandwidth("cuda")
    assert 1e5 < bw < 1e9  # between 0.1 and 1000 GB/s, in bytes per ms
    assert measure_bandwidth("cuda") == bw
    mm = traced()["aten.mm.default"]
    assert node_cost_ms(mm, "profile", "cuda") > 0


def test_copy_overhead_is_a_per_engine_figure_and_zero_for_unit_costs():
    assert costs.copy_overhead_ms("cpu", "unit") == 0.0
    assert costs.copy_overhead_ms("cpu", "flops") == 0.5  # the CPU engine's, measured
    # Offline plans (meta) and CUDA price a GPU's engine.
    assert costs.copy_overhead_ms("meta", "flops") == costs.copy_overhead_ms("cuda:0", "profile")
    assert costs.copy_overhead_ms(torch.device("cuda", 1), "flops") == 0.1
    # Another figure comes in through a table (a probe's, say), not by editing a global.
    mine = dataclasses.replace(DEFAULT_COSTS, cpu=dataclasses.replace(DEFAULT_COSTS.cpu,
                                                                      copy_overhead_ms=7.0))
    assert costs.copy_overhead_ms(torch.device("cpu"), "flops", mine) == 7.0
    assert costs.copy_overhead_ms("cuda:0", "flops", mine) == 0.1
    assert costs.copy_overhead_ms("cpu", "unit", mine) == 0.0
    assert costs.copy_overhead_ms("cpu", "flops") == 0.5  # the default table is untouched


def _on(val: object, device: str) -> object:
    if isinstance(val, (tuple, list)):
        return type(val)(_on(v, device) for v in val)
    return torch.empty(val.shape, device=device) if isinstance(val, torch.Tensor) else val


@pytest.mark.parametrize(("p", "device", "random"), [
    (0.0, "cpu", False),  # torch tags SDPA seeded, but without dropout it draws nothing
    (0.1, "cpu", True),
    (0.0, "meta", True),  # offline: a seeded op cannot be replayed on meta, so it stays saved
])  # fmt: skip
def test_one_rule_for_random_ops_sdpa_by_its_dropout(p: float, device: str, random: bool) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxckpt.graph.costs import random_output

    def attend(q: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, p)[0]

    # Traced on meta for the graph alone (the CPU kernel refuses dropout), then given the
    # device's values, as a partitioner sees them.
    gm = make_fx(attend)(torch.randn(1, 2, 4, 8, device="meta"))
    for n in gm.graph.nodes:
        n.meta["val"] = _on(n.meta.get("val"), device)
    (sdpa,) = [n for n in gm.graph.nodes if "attention" in str(n.target)]
    assert is_random(sdpa) is random
    assert random_output(next(iter(sdpa.users))) is random  # the partitioner's rule is the same one
