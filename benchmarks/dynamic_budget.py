"""A byte budget under dynamic shapes, measured at four lengths.

    python -m benchmarks.dynamic_budget --docs

``--smoke`` runs one tiny case instead (a 2-block decoder at 32 and 64 tokens, a 1792 KiB
budget), in seconds: it checks that the script runs end to end, and its figures mean nothing.

A 6-block GPT-style decoder compiled once with ``dynamic=True`` and ``memory_budget="8MiB"``
trains at 64, 128, 256 and 512 tokens. At each length, after warm steps, one whole training
step is measured with ``fxckpt.measure`` (the allocator's figures, never a plan's): its absolute
peak, what ``memory_budget`` bounds: what the device held when the step began (the model's
parameters and buffers, the batch; gradients dropped first) plus the most the forward and
backward allocated. Beside it, in the same process: plain ``torch.compile`` (``aot_eager``,
min-cut), the same lengths; and fxckpt with the length marked ``mark_dynamic(max=512)``,
planned once for 512 tokens. The plan column names the compiled graph that served the length
and the sizes its plan was made for. A length no plan holds under the budget is refused
(fxckpt's ``BudgetError``, once the step is known: its third step, usually).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.methods import Decoder, DecoderConfig, make_batch
from fxckpt.options import parse_bytes

MiB = 2**20
# Small enough that one length's logits (batch x tokens x vocab fp32: 1 MiB at 512 tokens)
# leave room under the budget.
GPT6 = DecoderConfig("gpt6", vocab=256, d=64, heads=4, layers=6, ffn=256)
SMOKE = replace(GPT6, name="gpt6-smoke", layers=2)  # --smoke
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
START, END = "<!-- dynamic-table:start -->", "<!-- dynamic-table:end -->"


# Warm steps at each length before the measured one: the first compiles this length's graph,
# the step account measures the next one and may plan again, or refuse the budget, at the one
# after it.
WARM_STEPS = 3


def _step_peak(compiled: Any, model: torch.nn.Module, idx: torch.Tensor,
               tgt: torch.Tensor) -> int | str:
    """The absolute peak of one warm training step at this length (what the device held when
    it began, the model and the batch, plus the most it allocated), or the BudgetError raised
    at this length."""
    import fxckpt

    try:
        for _ in range(WARM_STEPS):
            model.zero_grad(set_to_none=True)
            compiled(idx, tgt).backward()
    except Exception as err:  # dynamo may wrap the BudgetError a length no plan can hold raises
        model.zero_grad(set_to_none=True)
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, fxckpt.BudgetError):
            cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
        if cause is None:
            raise
        return f"BudgetError: smallest {cause.smallest_bytes / MiB:.2f} MiB"
    model.zero_grad(set_to_none=True)
    m = fxckpt.measure(lambda: compiled(idx, tgt).backward(), holding=(model, idx, tgt))
    model.zero_grad(set_to_none=True)
    return m.absolute_peak_bytes


def _mib(v: int | str) -> str:
    return v if isinstance(v, str) else f"{v / MiB:.2f}"


def _serving_plan(before: int) -> str:
    """The plan of the graph that served the last call: the newest one if it compiled now."""
    import fxckpt

    plans = fxckpt.last_plans()
    plan = plans[-1]
    sizes = next((n.removeprefix("planned for ") for n in plan.notes if n.startswith("planned for")), "")
    tokens = re.search(r"\.size\(\)\[1\]=(\d+)", sizes)
    at = f"{tokens.group(1)} tokens" if tokens else sizes
    bound = ", the max" if sizes.endswith("(upper bound)") else ""
    new = "new" if len(plans) > before else "reused"
    return f"{plan.name}: {new}, planned at {at}{bound}"


def run(lengths: Sequence[int], budget: str, batch: int, min_offload: str,
        cfg: DecoderConfig = GPT6) -> list[dict[str, Any]]:
    import fxckpt

    torch.manual_seed(0)
    base = Decoder(cfg)
    rows: list[dict[str, Any]] = [{"seq": n} for n in lengths]
    batches = {n: make_batch(cfg, batch, n, "cpu") for n in lengths}

    torch._dynamo.reset()
    plain = torch.compile(base, backend="aot_eager", dynamic=True)
    for row in rows:
        row["plain_bytes"] = _step_peak(plain, base, *batches[row["seq"]])

    torch._dynamo.reset()
    fxckpt.reset_stats()
    options = {"memory_budget": budget, "compiler": "eager", "min_offload_bytes": min_offload}
    compiled = torch.compile(base, backend="fxckpt", dynamic=True, options=options)
    for row in rows:
        before = len(fxckpt.last_plans())
        row["fxckpt_bytes"] = _step_peak(compiled, base, *batches[row["seq"]])
        row["fxckpt_plan"] = _serving_plan(before) if isinstance(row["fxckpt_bytes"], int) else "-"

    torch._dynamo.reset()
    fxckpt.reset_stats()
    marked = torch.compile(base, backend="fxckpt", options=options)
    for row in rows:
        idx, tgt = batches[row["seq"]]
        for t in (idx, tgt):
            torch._dynamo.mark_dynamic(t, 1, min=2, max=max(lengths))
        before = len(fxckpt.last_plans())
        row["marked_bytes"] = _step_peak(marked, base, idx, tgt)
        row["marked_plan"] = _serving_plan(before) if isinstance(row["marked_bytes"], int) else "-"
    return rows


def markdown(rows: Sequence[dict[str, Any]], command: str, facts: dict[str, Any],
             cfg: DecoderConfig = GPT6) -> str:
    lines = [
        f"Command: `{command}`  ",
        f"Date: {facts['date']}; torch {facts['torch']}; {cfg.describe()}, batch "
        f"{facts['batch']}, `memory_budget=\"{facts['budget']}\"` "
        f"({facts['budget_bytes'] / MiB:.2f} MiB), `min_offload_bytes={facts['min_offload']!r}`, "
        "`compiler=\"eager\"`. MiB: each step's measured absolute peak (what the device held "
        "when it began, the model and the batch, plus the most the step allocated), the figure "
        "`memory_budget` bounds.",
        "",
        "| tokens | plain compile MiB | fxckpt `dynamic=True` MiB | vs plain | served by | "
        "fxckpt `mark_dynamic(max)` MiB | served by | within budget |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fx, marked, plain = r["fxckpt_bytes"], r["marked_bytes"], r["plain_bytes"]
        ratio = f"{fx / plain:.2f}x" if isinstance(fx, int) else "-"
        # A length no plan can hold raises BudgetError once its step is known: refused, not over.
        ran = [v for v in (fx, marked) if isinstance(v, int)]
        within = "yes" if all(v <= facts["budget_bytes"] for v in ran) else "no"
        if not ran:
            within = "refused"
        elif len(ran) < 2:
            within += ", the other refused"
        lines.append(
            f"| {r['seq']} | {_mib(plain)} | {_mib(fx)} | {ratio} | {r['fxckpt_plan']} | "
            f"{_mib(marked)} | {r['marked_plan']} | {within} |"
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
        description="A byte budget under dynamic shapes: the measured absolute step peak at "
        "four lengths (see docs/benchmarks.md).",
    )
    p.add_argument("--smoke", action="store_true",
                   help="one tiny case to check that the script runs: a 2-block decoder at 32 "
                   "and 64 tokens, memory_budget 1792KiB (seconds; the figures mean nothing)")
    p.add_argument("--lengths", type=int, nargs="+", help="default 64 128 256 512")
    p.add_argument("--budget", help="default 8MiB")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--min-offload-bytes", default="0",
                   help="fxckpt's min_offload_bytes (the default option, 1MiB, leaves this "
                   "small model nothing to offload)")
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    p.add_argument("--docs", action="store_true", help="rewrite docs/benchmarks.md's table")
    args = p.parse_args(argv)
    if args.smoke and args.docs:
        p.error("--smoke's figures mean nothing: not for --docs")
    cfg = SMOKE if args.smoke else GPT6
    args.lengths = args.lengths or ([32, 64] if args.smoke else [64, 128, 256, 512])
    args.budget = args.budget or ("1792KiB" if args.smoke else "8MiB")
    torch.set_num_threads(1)
    command = "python -m benchmarks.dynamic_budget " + " ".join(sys.argv[1:] if argv is None else argv)
    facts = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "batch": args.batch,
        "budget": args.budget,
        "budget_bytes": parse_bytes(args.budget, "--budget"),
        "min_offload": args.min_offload_bytes,
        "loadavg_start": list(os.getloadavg()),
    }
    mob: int | str = int(args.min_offload_bytes) if args.min_offload_bytes.isdigit() else args.min_offload_bytes
    facts["min_offload"] = mob
    rows = run(args.lengths, args.budget, args.batch, mob, cfg)
    table = markdown(rows, command, facts, cfg)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "facts": facts, "rows": rows}, indent=1) + "\n")
    if args.docs:
        write_docs(table)
        print(f"wrote {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
