"""Compare two plan dumps (``FXCKPT_PLAN_DUMP`` directories): which tests' plans differ, and where.

Figures that come from a measurement (a probed bandwidth, a measured rate) differ from run to
run, so each plan's ``assumptions`` are compared by their sources only, and a plan whose
decisions depend on a measured figure shows up as a difference: read it before calling it one.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def load(directory: str) -> dict[str, list[dict]]:
    plans: dict[str, list[dict]] = defaultdict(list)
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            plan = row["plan"]
            plan["assumptions"] = {k: v.get("source") for k, v in plan.get("assumptions", {}).items()}
            plans[row["test"]].append(plan)
    return plans


def main(a: str, b: str) -> int:
    before, after = load(a), load(b)
    differ = 0
    for test in sorted(set(before) | set(after)):
        x, y = before.get(test, []), after.get(test, [])
        if x != y:
            differ += 1
            keys = sorted({k for p, q in zip(x, y, strict=False) for k in p if p.get(k) != q.get(k)})
            print(f"{test}: {len(x)} vs {len(y)} plans; differing fields: {keys}")
    print(f"{len(before)} tests before, {len(after)} after, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
