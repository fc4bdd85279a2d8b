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


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import fxckpt

    torch._dynamo.reset()
    fxckpt.reset_stats()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
