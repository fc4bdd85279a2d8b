"""Compare two plan dumps (``FXCKPT_PLAN_DUMP`` directories): which tests' plans differ, and where.

Each test's plans are compared as a set (under pytest-xdist a plan's name carries a compile
counter that depends on the worker's order, so names are left out). A plan that read a
figure measured on this machine (a probed bandwidth, a re-plan's copy times) can differ from
run to run; such tests are listed as ``measured``, the others as ``fixed``. A ``fixed``
difference is a changed plan, unless the test draws its own inputs (hypothesis, a temporary
directory, the machine's free memory): read it before calling it one.

    python tests/plan_dump_diff.py BEFORE_DIR AFTER_DIR
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

LEFT_OUT = ("name", "timeline", "est_overhead_ms", "assumptions")


def load(directory: str) -> dict[str, list[dict[str, Any]]]:
    plans: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            plans[row["test"]].append(row["plan"])
    return plans


def _measured(plan: dict[str, Any]) -> bool:
    return any(str(v.get("source", "")).startswith("measured")
               for v in plan.get("assumptions", {}).values())  # fmt: skip


def _key(plan: dict[str, Any]) -> str:
    kept = {k: v for k, v in plan.items() if k not in LEFT_OUT}
    kept["activations"] = [{k: v for k, v in a.items() if k != "reason"}
                           for a in plan.get("activations", [])]  # fmt: skip
    return json.dumps(kept, sort_keys=True)


def main(a: str, b: str) -> int:
    before, after = load(a), load(b)
    differ = 0
    for test in sorted(set(before) | set(after)):
        x, y = before.get(test, []), after.get(test, [])
        if sorted(map(_key, x)) != sorted(map(_key, y)):
            differ += 1
            kind = "measured" if any(map(_measured, x + y)) else "fixed"
            print(f"{kind:8s} {test}: {len(x)} vs {len(y)} plans")
    print(f"{len(before)} tests before, {len(after)} after, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
