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


# Two models with runtime settings of their own, served from the cache in a second process:
# each still copies on its own engine into its own host pool (the key rides on the graph).
TWO_PROFILES = textwrap.dedent(
    """
    import json, sys
    import torch
    import fxckpt
    import fxckpt.passes.partition as partition_module
    from torch._dynamo.utils import counters
    sys.path.insert(0, sys.argv[1])
    from equality import assert_step_matches
    from measured import measure_forward
    from models import MLP
    from fxckpt.backend import runtime_profile
    from fxckpt.runtime import engine

    calls, used = [], []
    real_partition = partition_module.partition
    real_start = engine.CpuEngine.start_offload

    def counting_partition(*args, **kwargs):
        calls.append(kwargs.get("graph_name"))
        return real_partition(*args, **kwargs)

    def start_offload(self, rec, copies):
        used.append([self.streams, rec.profile.cap])
        real_start(self, rec, copies)

    partition_module.partition = counting_partition
    engine.CpuEngine.start_offload = start_offload
    common = dict(offload="all", min_offload_bytes=0, cost_model="unit")
    a = fxckpt.backend(**common, copy_streams=3, host_budget="64MiB")
    b = fxckpt.backend(**common, host_budget="4KiB")
    x = torch.randn(8, 16, requires_grad=True)
    out = {}
    for name, backend in (("a", a), ("b", b)):
        torch.manual_seed(0)
        used.clear()
        compiled = assert_step_matches(MLP(d=16, depth=2), (x,), backend, steps=2, atol=1e-5,
                                       rtol=1e-4)
        out[name] = {"engines": sorted({tuple(u) for u in used}),
                     "held": measure_forward(compiled, (x,)).held_bytes,
                     "cap": runtime_profile(backend.options).cap}
    out["partition_calls"] = len(calls)
    out["fallbacks"] = fxckpt.stats()["fallbacks"]
    out["fxgraph_cache_hit"] = counters["inductor"]["fxgraph_cache_hit"]
    print("RESULT " + json.dumps(out))
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


@pytest.mark.slow
@pytest.mark.inductor
def test_graphs_from_a_warm_cache_keep_their_compiles_runtime_settings(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(TWO_PROFILES)
    cache_dir = tmp_path / "inductor-cache"
    cold = _run(script, cache_dir)
    warm = _run(script, cache_dir)
    assert cold["partition_calls"] >= 2 and warm["partition_calls"] == 0, warm
    assert warm["fxgraph_cache_hit"] >= 2
    for run in (cold, warm):
        assert run["a"]["engines"] == [[3, 64 * 2**20]]  # three streams, A's own 64 MiB pool
        assert run["b"]["engines"] == [[1, 4096]]  # B's budget did not touch A's
        assert run["a"]["cap"] == 64 * 2**20 and run["b"]["cap"] == 4096
    assert warm["a"]["held"] == cold["a"]["held"] and warm["b"]["held"] == cold["b"]["held"]
    assert cold["fallbacks"] == warm["fallbacks"] == 0
