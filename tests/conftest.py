from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Compiles in the tests are small; keep Inductor from spawning a compile-worker pool per test.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Under pytest-xdist (-n N) the workers share the cores: each takes its share of torch's
# intra-op threads instead of every worker using them all.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    torch.set_num_threads(max(1, torch.get_num_threads() // workers))


# The host link the tests' plans price copies at, on the CPU (bytes/ms: 15 GB/s, about what this
# machine's memcpy measures when quiet). Measured, it moves with the machine's load, and the
# plans with it: a test's plan on a loaded CI machine was not the one it was written for.
# FXCKPT_TEST_LINK=measured measures it, as a user's compile does.
STEADY_LINK_BYTES_PER_MS = 15e6


@pytest.fixture(autouse=True)
def _steady_link(monkeypatch):
    if os.environ.get("FXCKPT_TEST_LINK") == "measured":
        return
    from fxckpt.graph import costs

    measured = costs.measure_bandwidth

    def steady(device, table=None):
        name = device if isinstance(device, str) else str(device)
        return STEADY_LINK_BYTES_PER_MS if name.startswith("cpu") else measured(device, table)

    monkeypatch.setattr(costs, "measure_bandwidth", steady)


@pytest.fixture(autouse=True)
def _piped_width(monkeypatch):
    # fxckpt inspect's table takes its width from COLUMNS where it is set; pytest-xdist's
    # workers have one (80), which would fold the tables the tests read. Tests of COLUMNS
    # set it themselves.
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import fxckpt

    torch._dynamo.reset()
    fxckpt.reset_stats()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    _shard(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _shard(config, items):
    """FXCKPT_CI_SHARD="K/N" keeps, of the tests marked neither slow nor heavy, those of every
    Nth test file (the files in path order, from the Kth, counting from 0); slow and heavy tests
    all stay. CI splits the fast tier between its torches, each fast test on one (.ci/run)."""
    spec = os.environ.get("FXCKPT_CI_SHARD")
    if not spec:
        return
    try:
        k, n = (int(x) for x in spec.split("/"))
        if not 0 <= k < n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(
            f"FXCKPT_CI_SHARD={spec!r}: write K/N with 0 <= K < N, e.g. FXCKPT_CI_SHARD=0/2"
        ) from None
    def tiered(item) -> bool:
        return "slow" in item.keywords or "heavy" in item.keywords

    files = sorted({item.path for item in items if not tiered(item)})
    mine = set(files[k::n])
    kept = [item for item in items if tiered(item) or item.path in mine]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


# FXCKPT_PLAN_DUMP=DIR appends every plan the suite makes to DIR/<worker>.jsonl, one JSON line
# per plan with the test that made it: `python tests/plan_dump_diff.py A B` compares two such
# directories, to show that a change left every plan as it was.
if _plan_dump := os.environ.get("FXCKPT_PLAN_DUMP"):
    import json

    import fxckpt.passes.partition as _partition

    _emit = _partition.trace_plan_artifact

    def _dump(name, payload):
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        os.makedirs(_plan_dump, exist_ok=True)
        with open(os.path.join(_plan_dump, f"{worker}.jsonl"), "a") as f:
            f.write(json.dumps({"test": test, "plan": json.loads(payload)}) + "\n")
        _emit(name, payload)

    _partition.trace_plan_artifact = _dump
