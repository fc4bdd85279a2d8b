"""A warm Inductor / AOTAutograd cache: a second process loads the compiled graphs without
running fxckpt's partitioner, and still offloads, restores and reports the same plans.

The plan travels inside the compiled forward (``fxckpt::note_saved``), so ``last_plans()`` is
complete after the first step even though no planning happened in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import fxckpt
    import fxckpt.passes.partition as partition_module
    from torch._dynamo.utils import counters
    sys.path.insert(0, sys.argv[1])
    from equality import assert_step_matches
    from models import MLP

    calls = []
    real_partition = partition_module.partition

    def counting_partition(*args, **kwargs):
        calls.append(kwargs.get("graph_name"))
        return real_partition(*args, **kwargs)

    partition_module.partition = counting_partition  # the backend imports it at call time

    torch.manual_seed(0)
    model = MLP(d=16, depth=2)
    x = torch.randn(4, 16, requires_grad=True)
    backend = fxckpt.backend(offload="all", min_offload_bytes=0, cost_model="unit")
    assert_step_matches(model, (x,), backend, steps=2, atol=1e-5, rtol=1e-4)
    stats = fxckpt.stats()
    print("RESULT " + json.dumps({
        "partition_calls": len(calls),
        "plans": [p.to_dict() for p in fxckpt.last_plans()],
        "offloaded_bytes": stats["offloaded_bytes"],
        "prefetched_bytes": stats["prefetched_bytes"],
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aot_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
    }))
    """
)


def _run(script: Path, cache_dir: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    }
    env.pop("FXCKPT_OPTIONS", None)
    tests = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, str(script), tests], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
@pytest.mark.inductor
def test_warm_cache_skips_the_partitioner_and_keeps_ops_and_plans(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    cache_dir = tmp_path / "inductor-cache"

    cold = _run(script, cache_dir)
    assert cold["partition_calls"] >= 1
    assert cold["aot_cache_miss"] >= 1 and cold["aot_cache_hit"] == 0
    assert len(cold["plans"]) == cold["partition_calls"]
    assert cold["offloaded_bytes"] == cold["prefetched_bytes"] > 0

    warm = _run(script, cache_dir)
    counts = {k: v for k, v in warm.items() if k != "plans"}
    # Loaded from the cache: the partitioner never ran in this process...
    assert warm["partition_calls"] == 0, counts
    assert warm["aot_cache_hit"] >= 1 and warm["aot_cache_miss"] == 0
    # ...yet the ops ran (the child compared every gradient with eager) and moved the same
    # bytes, and the plans are complete and identical, decisions and reasons included.
    assert warm["offloaded_bytes"] == cold["offloaded_bytes"]
    assert warm["prefetched_bytes"] == cold["prefetched_bytes"]
    assert warm["plans"] == cold["plans"]
    kinds = {row["decision"] for plan in warm["plans"] for row in plan["activations"]}
    assert kinds == {"offload"}
