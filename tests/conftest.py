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
