"""A byte budget under dynamic shapes, measured at four lengths.

    python -m benchmarks.dynamic_budget --docs

A 6-block GPT-style decoder compiled once with ``dynamic=True`` and ``memory_budget="2MiB"``
trains at 64, 128, 256 and 512 tokens. At each length one warm forward is measured with
``fxckpt.measure`` (the allocator's figures, never a plan's): what it leaves on the device for
the backward. Beside it, in the same process: plain ``torch.compile`` (``aot_eager``, min-cut),
the same lengths; and fxckpt with the length marked ``mark_dynamic(max=512)``, planned once for
512 tokens. The plan column names the compiled graph that served the length and the sizes its
plan was made for.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.methods import Decoder, DecoderConfig, make_batch

MiB = 2**20
GPT6 = DecoderConfig("gpt6", vocab=512, d=96, heads=4, layers=6, ffn=384)
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
START, END = "<!-- dynamic-table:start -->", "<!-- dynamic-table:end -->"


def _held(compiled: Any, idx: torch.Tensor, tgt: torch.Tensor) -> int:
    import fxckpt

    compiled(idx, tgt).backward()  # warm: this length's graph is compiled
    m = fxckpt.measure(compiled, idx, tgt)
    m.output.backward()
    return m.held_bytes


def _serving_plan(before: int) -> str:
    """The plan of the graph that served the last call: the newest one if it compiled now."""
    import fxckpt

    plans = fxckpt.last_plans()
    plan = plans[-1]
    sizes = next((n.removeprefix("planned for ") for n in plan.notes if n.startswith("planned for")), "")
    new = "new" if len(plans) > before else "reused"
    short = re.sub(r"L\['(\w+)'\]\.size\(\)\[(\d+)\]", r"\1.shape[\2]", sizes)
    return f"{plan.name} ({new}; planned for {short})"


def run(lengths: Sequence[int], budget: str, batch: int) -> list[dict[str, Any]]:
    import fxckpt

    torch.manual_seed(0)
    base = Decoder(GPT6)
    rows: list[dict[str, Any]] = [{"seq": n} for n in lengths]
    batches = {n: make_batch(GPT6, batch, n, "cpu") for n in lengths}

    torch._dynamo.reset()
    plain = torch.compile(base, backend="aot_eager", dynamic=True)
    for row in rows:
        row["plain_bytes"] = _held(plain, *batches[row["seq"]])

    torch._dynamo.reset()
    fxckpt.reset_stats()
    options = {"memory_budget": budget, "compiler": "eager"}
    compiled = torch.compile(base, backend="fxckpt", dynamic=True, options=options)
    for row in rows:
        before = len(fxckpt.last_plans())
        row["fxckpt_bytes"] = _held(compiled, *batches[row["seq"]])
        row["fxckpt_plan"] = _serving_plan(before)
        row["budget_bytes"] = fxckpt.last_plans()[-1].budget_bytes

    torch._dynamo.reset()
    fxckpt.reset_stats()
    marked = torch.compile(base, backend="fxckpt", options=options)
    for row in rows:
        idx, tgt = batches[row["seq"]]
        for t in (idx, tgt):
            torch._dynamo.mark_dynamic(t, 1, min=2, max=max(lengths))
        before = len(fxckpt.last_plans())
        row["marked_bytes"] = _held(marked, idx, tgt)
        row["marked_plan"] = _serving_plan(before)
    return rows


def markdown(rows: Sequence[dict[str, Any]], command: str, facts: dict[str, Any]) -> str:
    lines = [
        f"Command: `{command}`  ",
        f"Date: {facts['date']}; torch {facts['torch']}; {GPT6.describe()}, batch "
        f"{facts['batch']}, `memory_budget=\"{facts['budget']}\"`, `compiler=\"eager\"`.",
        "",
        "| tokens | plain compile MiB | fxckpt `dynamic=True` MiB | vs plain | served by | "
        "fxckpt `mark_dynamic(max)` MiB | served by | budget MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seq']} | {r['plain_bytes'] / MiB:.2f} | {r['fxckpt_bytes'] / MiB:.2f} | "
            f"{r['fxckpt_bytes'] / r['plain_bytes']:.2f}x | {r['fxckpt_plan']} | "
            f"{r['marked_bytes'] / MiB:.2f} | {r['marked_plan']} | {r['budget_bytes'] / MiB:.2f} |"
        )
    return "\n".join(lines)


def write_docs(table: str, path: Path = DOCS, start: str = START, end: str = END) -> None:
    """Replace what lies between the ``start`` and ``end`` markers of ``path`` by ``table``."""
    text = path.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{path} has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{table}\n{end}{tail}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.dynamic_budget",
        description="A byte budget under dynamic shapes: measured bytes left by a forward at "
        "four lengths (see docs/benchmarks.md).",
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--budget", default="2MiB")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    p.add_argument("--docs", action="store_true", help="rewrite docs/benchmarks.md's table")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m benchmarks.dynamic_budget " + " ".join(sys.argv[1:] if argv is None else argv)
    facts = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "batch": args.batch,
        "budget": args.budget,
        "loadavg_start": list(os.getloadavg()),
    }
    rows = run(args.lengths, args.budget, args.batch)
    table = markdown(rows, command, facts)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "facts": facts, "rows": rows}, indent=1) + "\n")
    if args.docs:
        write_docs(table)
        print(f"wrote {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
