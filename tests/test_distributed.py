"""DDP and FSDP2 on CPU with gloo, two processes: fxckpt trains like aot_eager.

Each case runs tests/dist_worker.py under torchrun (world size 2) with a timeout. The ranks
compare fxckpt with aot_eager themselves (loss and every gradient, two steps); rank 0 reports
the plans, which the tests below check.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

TIMEOUT_S = 240
HERE = Path(__file__).parent


@functools.cache
def _run(case: str, tmp: str) -> dict[str, Any]:
    out = Path(tmp) / f"{case}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    env.pop("FXCKPT_OPTIONS", None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(HERE / "dist_worker.py"), case, str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{case} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("dist"))


def _blocks(plan: dict[str, Any], kind: str) -> set[int]:
    return {r["block"] for r in plan["rows"] if r["decision"] == kind and r["block"] is not None}


def test_ddp_matches_aot_eager_over_several_graphs(tmp_dir: str) -> None:
    report = _run("ddp", tmp_dir)
    assert report["world_size"] == 2
    plans = report["plans"]
    # DDP's optimizer split the model into one graph per gradient bucket.
    assert len(plans) >= 3, [p["name"] for p in plans]
    stats = report["stats"]
    assert stats["offloaded_bytes"] == stats["prefetched_bytes"] > 0


def test_ddp_segment_stride_follows_the_global_block_index(tmp_dir: str) -> None:
    """stride 2, width 1: blocks 0 and 2 recompute, 1 and 3 don't, whichever graph holds them."""
    plans = _run("ddp", tmp_dir)["plans"]
    seen: set[int] = set()
    for plan in plans:
        seen |= {r["block"] for r in plan["rows"] if r["block"] is not None}
        assert _blocks(plan, "recompute") <= {0, 2}, plan
    assert seen == {0, 1, 2, 3}
    recomputed = set().union(*(_blocks(p, "recompute") for p in plans))
    assert recomputed == {0, 2}
    # More than one graph holds a segment: the numbering is global, not per graph.
    assert sum(bool(_blocks(p, "recompute")) for p in plans) >= 2


def test_fsdp2_per_block_compile_follows_the_global_block_index(tmp_dir: str) -> None:
    """Each fully_shard-ed block compiled on its own with block_index=i: stride 2, width 1
    recomputes blocks 0 and 2 and offloads 1 and 3; the ranks matched aot_eager."""
    report = _run("fsdp2_blocks", tmp_dir)
    plans = report["plans"]
    assert len(plans) == 4, [p["name"] for p in plans]  # one graph per block, none shared
    for plan in plans:
        (block,) = {r["block"] for r in plan["rows"]}
        assert plan["notes"] == [f"the graph is block {block} (block_index)"]
    assert set().union(*(_blocks(p, "recompute") for p in plans)) == {0, 2}
    assert set().union(*(_blocks(p, "offload") for p in plans)) == {1, 3}
    assert report["stats"]["offloaded_bytes"] == report["stats"]["prefetched_bytes"] > 0


def test_fsdp2_with_offload_all_matches_aot_eager(tmp_dir: str) -> None:
    report = _run("fsdp2", tmp_dir)
    stats = report["stats"]
    assert stats["offloaded_bytes"] == stats["prefetched_bytes"] > 0
    kinds = {r["decision"] for p in report["plans"] for r in p["rows"]}
    assert "offload" in kinds, kinds


@pytest.mark.xfail(
    strict=True,
    reason=(
        "FSDP2's hooks are dynamo-disabled, so a model's loop over its blocks is skipped and "
        "each block's forward is compiled as a frame of its own; identical blocks then share "
        "one compiled graph (module paths relative to the block, no index), so one plan serves "
        "every block and a stride cannot tell block 0 from block 1. Compiling each block with "
        "block_index=i works (the test above). See docs/limitations.md."
    ),
)
def test_fsdp2_segment_stride_follows_the_global_block_index(tmp_dir: str) -> None:
    plans = _run("fsdp2", tmp_dir)["plans"]
    recomputed = set().union(*(_blocks(p, "recompute") for p in plans))
    assert recomputed == {0, 2}
