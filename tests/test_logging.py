"""``TORCH_LOGS="+fxckpt"`` logs the pass pipeline and every decision with its reason.

The setting is read when torch starts, so each case runs in a fresh process. The child prints
its plan as JSON; the parent checks that stderr names every pipeline step in order and every
saved activation with the very reason the plan gives.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from fxckpt.units import format_bytes

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import fxckpt
    sys.path.insert(0, sys.argv[1])
    from models import MLP

    torch.manual_seed(0)
    model = MLP(d=16, depth=4)
    options = {"compiler": "eager", "memory_budget": 0.3, "min_offload_bytes": 0,
               "cost_model": "unit", "segment_stride": 2, "segment_width": 1}
    compiled = torch.compile(model, backend="fxckpt", options=options)
    # A batch whose activations outweigh the weights: 30 % of the way from the lowest plan
    # to plain min-cut keeps, recomputes and offloads.
    compiled(torch.randn(256, 16, requires_grad=True)).backward()
    print("PLANS " + json.dumps([p.to_dict() for p in fxckpt.last_plans()]))
    """
)
STEPS = ["blocks", "baseline min-cut", "segment", "min-cut", "plan round 0", "offload"]


def _run(torch_logs: str | None) -> tuple[list[dict[str, Any]], str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "FXCKPT_OPTIONS")}
    if torch_logs is not None:
        env["TORCH_LOGS"] = torch_logs
    tests = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, tests], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("PLANS ")]
    return json.loads(line[len("PLANS ") :]), done.stderr


def test_plus_fxckpt_logs_the_pipeline_and_every_decision_with_its_reason() -> None:
    (plan,), log = _run("+fxckpt")
    name = re.escape(plan["name"])

    # The pipeline, step by step, in order, with a time for each.
    positions = []
    for step in STEPS:
        match = re.search(rf"fxckpt\[{name}\] {re.escape(step)}\s+[\d.]+ ms", log)
        assert match, f"pipeline step {step!r} not logged:\n{log}"
        positions.append(match.start())
    assert positions == sorted(positions), "pipeline steps logged out of order"
    assert re.search(r"fxckpt: segments \{0: \(0,\), 1: \(2,\)\} \(tagged \d+ nodes\)", log)

    # The summary (the step's predicted peak against the budget, and its parts), then one
    # line per saved activation carrying the plan's own reason.
    def mib(n: int) -> str:
        return f"{n / 2**20:.2f} MiB"

    step = plan["step"]
    assert step is not None and plan["budget_bytes"] is not None
    assert step["total_bytes"] <= plan["budget_bytes"]
    summary = (f"fxckpt {plan['name']}: step peak {mib(step['total_bytes'])} predicted (budget "
               f"{mib(plan['budget_bytes'])}): start {mib(step['start_bytes'])}, gradients "
               f"{mib(step['gradients_bytes'])}, activations {mib(step['activations_bytes'])}; "
               f"saved: baseline {mib(plan['baseline_saved_bytes'])}")
    assert summary in log, log
    rows = plan["activations"]
    assert {r["decision"] for r in rows} >= {"keep", "recompute", "offload"}
    # Every decision in one record under one header, a line each, aligned (torch's formatter
    # repeats the record's prefix on each line).
    lines = log.splitlines()
    (head,) = [i for i, ln in enumerate(lines)
               if f"fxckpt[{plan['name']}] {len(rows)} saved tensors (name, module, size, reason):" in ln]
    block = lines[head + 1 : head + 1 + len(rows)]
    reasons = []
    for row, line in zip(rows, block, strict=True):
        assert row["reason"].startswith(row["decision"] + ":")
        assert f"  {row['name']} " in line and line.endswith(row["reason"]), (row, line)
        assert format_bytes(row["bytes"]) in line
        reasons.append(line.index(row["reason"]))
    assert len(set(reasons)) == 1, block  # aligned
    assert not any(f"fxckpt[{plan['name']}] {row['name']} " in log for row in rows)
    for note in plan["notes"]:
        assert f"fxckpt[{plan['name']}] {note}" in log
    # What the cost model assumed, with where each figure came from.
    assert plan["assumptions"]["bandwidth_bytes_per_s"]["source"] == "default"  # unit model
    assert re.search(rf"fxckpt\[{name}\] assumed: bandwidth 1 GB/s \(default\), compute", log)


def test_without_torch_logs_fxckpt_is_silent() -> None:
    (plan,), log = _run(None)
    assert plan["activations"]
    assert "fxckpt[" not in log and "baseline saved" not in log
