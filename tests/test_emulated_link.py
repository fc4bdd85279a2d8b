"""Training through an emulated host link: exact gradients when copies are slow, and a step that
cannot be faster than its copies. Lower bounds only: nothing here asserts an upper bound on time.
"""

from __future__ import annotations

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
