"""Training through an emulated host link: exact gradients when copies are slow, and a step that
cannot be faster than its copies. Lower bounds only: nothing here asserts an upper bound on time.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from equality import assert_step_matches
from models import GPT, MLP, gpt_inputs

import fxckpt
from fxckpt.runtime import engine

ROOT = Path(__file__).resolve().parent.parent
ALL = {"compiler": "eager", "offload": "all", "min_offload_bytes": 0}


@pytest.fixture(autouse=True)
def _engine_defaults():
    engine.configure()
    yield
    engine.configure()


@pytest.mark.parametrize("coalesce", ["auto", "never"])
def test_gpt_through_a_slow_link_matches_eager(coalesce: str) -> None:
    torch.manual_seed(0)
    engine.configure(poison_fresh=True)  # a restore read before its copy lands cannot match
    with fxckpt.emulate_link("20MB/s", overhead_ms=1):
        assert_step_matches(GPT(n_layers=2), gpt_inputs(), fxckpt.backend(coalesce=coalesce, **ALL),
                            steps=2)
    s = fxckpt.stats()
    assert s["offloaded_bytes"] == s["prefetched_bytes"] > 0


def test_mlp_through_a_slow_link_is_bitwise_equal_to_eager() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 32, requires_grad=True)
    engine.configure(poison_fresh=True)
    with fxckpt.emulate_link("5MB/s", overhead_ms=0.5):
        assert_step_matches(MLP(), (x,), fxckpt.backend(**ALL), steps=2, atol=0, rtol=0)


def test_a_step_under_the_environment_link_takes_at_least_its_copies() -> None:
    # Timed from outside the engine: the wall time of a training step is bounded below by the
    # bytes it offloads over the bandwidth (the D2H copies alone); the engine's copy seconds,
    # both directions, by twice that.
    code = textwrap.dedent(
        """
        import json, sys, time, torch
        sys.path.insert(0, "tests")
        import fxckpt
        from models import GPT, gpt_inputs
        torch.manual_seed(0)
        model = GPT(n_layers=2)
        idx, tgt = gpt_inputs(batch=4, seq=32)
        step = torch.compile(model, backend="fxckpt", options={
            "compiler": "eager", "offload": "all", "min_offload_bytes": 0})
        step(idx, tgt).backward()  # compile
        fxckpt.reset_stats()
        start = time.perf_counter()
        step(idx, tgt).backward()
        took = time.perf_counter() - start
        s = fxckpt.stats()
        print(json.dumps({"took": took, "copy": s["copy_seconds"], "bytes": s["offloaded_bytes"],
                          "back": s["prefetched_bytes"]}))
        """
    )
    bandwidth = 8e6
    env = {**os.environ, "FXCKPT_EMULATE_LINK": f"{bandwidth / 1e6:g}MB/s",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["bytes"] == got["back"] > 0
    assert got["took"] >= got["bytes"] / bandwidth
    assert got["copy"] >= 2 * got["bytes"] / bandwidth


def test_a_plan_compiled_under_the_link_assumes_the_link() -> None:
    torch.manual_seed(0)
    model, inputs = GPT(n_layers=2), gpt_inputs()
    with fxckpt.emulate_link("50MB/s", overhead_ms=0.2):
        torch.compile(model, backend=fxckpt.backend(compiler="eager", memory_budget=0.5))(
            *inputs).backward()
        emulated = fxckpt.last_plans()[0].assumptions
        torch._dynamo.reset()
        fxckpt.reset_stats()
        chosen = fxckpt.backend(compiler="eager", memory_budget=0.5, bandwidth="1GB/s")
        torch.compile(copy_model(model), backend=chosen)(*inputs).backward()
        told = fxckpt.last_plans()[0].assumptions
    torch._dynamo.reset()
    fxckpt.reset_stats()
    torch.compile(copy_model(model), backend=fxckpt.backend(compiler="eager", memory_budget=0.5))(
        *inputs).backward()
    plain = fxckpt.last_plans()[0].assumptions
    assert emulated["bandwidth_bytes_per_s"] == {"value": 50e6, "source": "emulated"}
    assert emulated["link_overhead_ms"] == {"value": pytest.approx(0.2), "source": "emulated"}
    assert told["bandwidth_bytes_per_s"] == {"value": 1e9, "source": "option"}
    assert told["link_overhead_ms"] == {"value": pytest.approx(0.2), "source": "emulated"}
    assert plain["bandwidth_bytes_per_s"]["source"] == "measured"
    assert plain["link_overhead_ms"] == {"value": 0.0, "source": "default"}


def copy_model(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def test_the_eager_compiler_frees_each_saved_tensor_at_its_last_backward_use() -> None:
    # compiler="eager" once held every saved tensor until the whole backward had run (the
    # graph's frame kept its inputs): the same plan as plain min-cut then peaked higher than
    # aot_eager, by most of what the forward saved. Measured by the meter, not a plan.
    from measured import measure_step

    torch.manual_seed(0)
    model, inputs = GPT(n_layers=3), gpt_inputs(batch=2, seq=64)
    peaks = {}
    for name, backend in (("aot_eager", "aot_eager"), ("fxckpt", fxckpt.backend(compiler="eager"))):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        peaks[name] = measure_step(torch.compile(m, backend=backend), inputs).peak_bytes
    assert peaks["fxckpt"] == peaks["aot_eager"]


def test_copies_are_planned_with_a_margin_over_the_link() -> None:
    # Planned as taking 1 + copy_margin times the link's figures: a plan that says "hidden"
    # keeps room for compute that runs faster than its estimate.
    import re

    torch.manual_seed(0)
    with fxckpt.emulate_link("1GB/s"):
        backend = fxckpt.backend(compiler="eager", memory_budget=0.3, min_offload_bytes=0,
                                 segment_stride=0, on_infeasible="warn")
        torch.compile(GPT(n_layers=3, d=128, heads=4), backend=backend)(
            *gpt_inputs(batch=4, seq=128)).backward()
    (plan,) = fxckpt.last_plans()
    margin = plan.assumptions["copy_margin"]
    assert margin == {"value": 0.5, "source": "default"}
    offloads = [a for a in plan.activations if a.decision.kind == "offload"]
    assert offloads
    for a in offloads:
        ms = float(re.search(r"copies ([\d.]+) ms", a.decision.reason).group(1))
        assert ms == pytest.approx(2 * a.bytes / 1e9 * 1e3 * 1.5, abs=2e-3)


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("coalesce", ["auto", pytest.param("never", marks=pytest.mark.heavy)])
def test_under_inductor_a_slow_copy_reads_the_buffer_its_join_keeps(coalesce: str) -> None:
    # A saved view Inductor cannot express over its base (the attention's transposed
    # reshapes) reached offload and offload_done as two copies of its own: Inductor reused the
    # one being copied for the next kernel while the slow copy still read it, and the
    # gradients came out wrong in every fresh compile (passes.offload._one_buffer).
    from torch._inductor import config

    torch.manual_seed(0)
    with config.patch(force_disable_caches=True), fxckpt.emulate_link("20MB/s"):
        assert_step_matches(GPT(n_layers=2, d=32), gpt_inputs(seq=32),
                            fxckpt.backend(offload="all", min_offload_bytes=0, coalesce=coalesce,
                                           bandwidth="0.3GB/s"))
