"""The CPU goal: fxckpt at the full-checkpointing budget against every plan that also meets it.

    python -m benchmarks.cpu_goal --json docs/benchmarks/cpu_goal.json --docs

``--smoke`` runs one tiny case instead (a 2-block decoder, batch 1 x seq 32, 2 rounds), in
seconds: it checks that the script runs end to end, and its figures mean nothing.

On the CPU benchmark's decoder (d=256, 8 blocks, 4 x 512 tokens, fp32), ``memory_budget`` is
set to the absolute step peak of eager per-block checkpointing (``full_checkpoint``): what the
device held when its step began (parameters, batch) plus the most its forward and backward
allocated, measured by fxckpt's meter in the same run. Then, side by side, in rotated
rounds (``cpu_bench.run_suite``: the methods take turns, each round in another order):

- ``fxckpt_plan``: the planner's own plan at that budget, every other option at its default;
- ``fxckpt_offload_all``: ``offload="all"``;
- ``fxckpt_stride{s}``: ``segment_stride=s`` at that budget, for every stride ``s`` from 1 to
  the number of blocks (the solver then places what the stride leaves);
- ``fxckpt_recompute_only``: ``offload="never"`` at that budget (blocks and single ops);
- ``compiled``: min-cut alone (plain ``torch.compile``), which keeps what min-cut saves;
- ``eager`` (the baseline of every ratio) and ``full_checkpoint`` (the budget's source).

A row *meets* the budget when the meter's absolute step peak (``absolute_peak_bytes``, an
untimed step after the timed rounds) is at most the budget. The goal: ``fxckpt_plan`` at most 1.05x eager and no slower than ``offload="all"``;
the summary says whether this run reached it, and which row that meets the budget was fastest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.cpu_bench import machine_info, run_suite, warm_compilers
from benchmarks.methods import (
    AT_FULL_CHECKPOINT,
    BASELINE_SPECS,
    GPT_SMALL,
    GPT_SMOKE,
    MethodSpec,
    fxckpt_spec,
    median,
)

MiB = 2**20
DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
GOAL_RATIO = 1.05


def goal_specs(strides: Sequence[int]) -> list[MethodSpec]:
    base = {s.name: s for s in BASELINE_SPECS}
    at = {"memory_budget": AT_FULL_CHECKPOINT}
    specs = [base["eager"], base["full_checkpoint"], base["compiled"],
             fxckpt_spec("fxckpt_plan", "the planner's plan at the budget", **at),
             fxckpt_spec("fxckpt_offload_all", 'offload="all"', offload="all")]  # fmt: skip
    specs += [fxckpt_spec(f"fxckpt_stride{s}", f"segment_stride={s} at the budget",
                          segment_stride=s, **at) for s in strides]  # fmt: skip
    specs.append(fxckpt_spec("fxckpt_recompute_only", 'offload="never" at the budget',
                             offload="never", **at))  # fmt: skip
    return specs


def paired(rows: dict[str, dict[str, Any]], a: str, b: str) -> list[float]:
    """Per-round step-time ratios of row ``a`` over row ``b`` (the same round each time)."""
    return [x / y for x, y in zip(rows[a]["step_s"], rows[b]["step_s"], strict=True)]


def summarise(rows: Sequence[dict[str, Any]], budget: int) -> dict[str, Any]:
    by = {r["method"]: r for r in rows if not r.get("unavailable")}
    for r in by.values():
        r["meets_budget"] = r["absolute_peak_bytes"] <= budget
    plan, off = by.get("fxckpt_plan"), by.get("fxckpt_offload_all")
    out: dict[str, Any] = {"budget_bytes": budget}
    if plan is not None:
        out["plan_vs_eager"] = plan["step_time_ratio"]
        out["plan_meets_budget"] = plan["meets_budget"]
        out["goal_vs_eager_met"] = plan["step_time_ratio"] <= GOAL_RATIO
    if plan is not None and off is not None:
        ratios = paired(by, "fxckpt_plan", "fxckpt_offload_all")
        out["plan_vs_offload_all"] = median(ratios)
        out["plan_vs_offload_all_min_max"] = [min(ratios), max(ratios)]
        out["goal_vs_offload_all_met"] = median(ratios) <= 1.0
    meeting = [r for r in by.values() if r["meets_budget"] and r["method"].startswith("fxckpt")]
    if meeting:
        fastest = min(meeting, key=lambda r: r["step_time_ratio"])
        out["fastest_meeting"] = fastest["method"]
    return out


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    m = doc["machine"]
    lines = [
        f"Command: `{doc['command']}`  ",
        f"Date: {m['date']}; {m['cpu']}, {m['cores']} cores; torch {m['torch']}, torch threads "
        f"{m['torch_threads']}; load average {m['loadavg_start'][0]:.1f} at the start and "
        f"{m['loadavg_end'][0]:.1f} at the end; wall {m['wall_s']} s; {doc['repeats']} rotated "
        f"rounds.  ",
        f"Budget: {s['budget_bytes'] / MiB:.2f} MiB (`full_checkpoint`'s absolute step peak: "
        "what the device held when its step began plus the most the step allocated, measured by "
        "the meter).",
        "",
        "| method | step peak MiB | meets budget | resident after fwd MiB | host MiB | decisions "
        "(keep/recompute/offload) | step ms (min-max) | step vs eager (min-max) | "
        "CPU time vs eager | grads |",
        "|" + "---|" * 10,
    ]
    for r in doc["rows"]:
        if r.get("unavailable"):
            lines.append(f"| {r['method']} | unavailable: {r['unavailable']} |" + " |" * 8)
            continue
        d = r.get("plan_decisions") or {}
        dec = "/".join(str(d.get(k, 0)) for k in ("keep", "recompute", "offload")) if d else "-"
        lines.append(
            f"| {r['method']} | {r['absolute_peak_bytes'] / MiB:.1f} "
            f"| {'yes' if r['meets_budget'] else 'no'} | {r['measured_resident_bytes'] / MiB:.1f} "
            f"| {(r['host_saved_bytes'] or 0) / MiB:.1f} "
            f"| {dec} | {r['step_ms']:.0f} ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}) "
            f"| {r['step_time_ratio']:.2f}x ({r['step_ratio_min']:.2f}-{r['step_ratio_max']:.2f}) "
            f"| {r['cpu_time_ratio']:.2f}x | {'ok' if r['grads_match'] else 'DIFF'} |"
        )
    lines.append("")
    if "plan_vs_eager" in s:
        lines.append(f"Goal: `fxckpt_plan` {s['plan_vs_eager']:.2f}x eager (goal <= {GOAL_RATIO}x: "
                     f"{'met' if s['goal_vs_eager_met'] else 'not met'})"
                     + (f"; against `offload=\"all\"` {s['plan_vs_offload_all']:.2f}x, per-round "
                        f"{s['plan_vs_offload_all_min_max'][0]:.2f}-"
                        f"{s['plan_vs_offload_all_min_max'][1]:.2f} (goal <= 1.00x: "
                        f"{'met' if s['goal_vs_offload_all_met'] else 'not met'})"
                        if "plan_vs_offload_all" in s else "")
                     + (f"; fastest fxckpt row that meets the budget: `{s['fastest_meeting']}`."
                        if "fastest_meeting" in s else "."))  # fmt: skip
    return "\n".join(lines)


def write_doc(text: str, doc_path: Path = DOC) -> None:
    start, end = "<!-- cpu-goal:start -->", "<!-- cpu-goal:end -->"
    page = doc_path.read_text()
    if start not in page or end not in page:
        raise SystemExit(f"{doc_path} has no {start} ... {end} block to replace")
    head, rest = page.split(start, 1)
    _, tail = rest.split(end, 1)
    doc_path.write_text(f"{head}{start}\n{text}\n{end}{tail}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_goal", description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the rows and the run's facts here")
    p.add_argument("--docs", action="store_true",
                   help="also replace the cpu-goal block of docs/benchmarks.md with this run")
    p.add_argument("--smoke", action="store_true",
                   help="one tiny case to check that the script runs: a 2-block d=32 decoder, "
                   "batch 1 x seq 32, 2 rounds (seconds; the figures mean nothing)")
    p.add_argument("--seq", type=int, help="default 512")
    p.add_argument("--batch", type=int, help="default 4")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per method")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (the other core is left to fxckpt's copy threads)")
    p.add_argument("--strides", type=int, nargs="*",
                   help="segment strides to compare (default: 1 to the number of blocks)")
    p.add_argument("--only", nargs="+", metavar="METHOD",
                   help="run only these methods (and eager, the baseline of every ratio), e.g. "
                        "--only fxckpt_plan fxckpt_offload_all --repeats 15: a tighter pair")
    p.add_argument("--quick", action="store_true",
                   help="strides 1, 2 and 4 only, and 3 rounds: about half the time")
    args = p.parse_args(argv)
    if args.smoke and args.docs:
        p.error("--smoke's figures mean nothing: not for --docs")
    args.seq = args.seq or (32 if args.smoke else 512)
    args.batch = args.batch or (1 if args.smoke else 4)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = GPT_SMOKE if args.smoke else GPT_SMALL
    strides = args.strides if args.strides is not None else (
        [1, 2, 4] if args.quick and not args.smoke else list(range(1, cfg.layers + 1)))
    repeats = args.repeats
    if args.repeats == 5 and (args.quick or args.smoke):
        repeats = 2 if args.smoke else 3
    specs = goal_specs(strides)
    if args.only:
        names = {s.name for s in specs}
        unknown = sorted(set(args.only) - names)
        if unknown:
            raise SystemExit(f"--only {' '.join(unknown)}: not a method here; choose from "
                             f"{', '.join(sorted(names))}")
        # full_checkpoint stays: it sets the budget every "at the budget" row is given.
        specs = [s for s in specs if s.name in {"eager", "full_checkpoint", *args.only}]
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 1 << 16
    command = "python -m benchmarks.cpu_goal " + " ".join(sys.argv[1:] if argv is None else argv)
    facts = machine_info(args.threads)
    print(f"{command}\n{facts['date']}, {facts['cpu']}, load {facts['loadavg_start'][0]:.1f}\n"
          f"{cfg.describe()}, batch {args.batch}, seq {args.seq}")
    started = time.perf_counter()
    facts["compiler_warmup_s"] = round(warm_compilers(torch.device("cpu")), 1)
    rows = run_suite(cfg, batch=args.batch, seq=args.seq, specs=specs,
                     device=torch.device("cpu"), warmup=args.warmup, repeats=repeats)
    facts["wall_s"] = round(time.perf_counter() - started, 1)
    facts["loadavg_end"] = list(os.getloadavg())
    # The budget every "at the budget" row was given: full_checkpoint's absolute step peak.
    budget = int(next(r for r in rows if r["method"] == "full_checkpoint")["budget_source_bytes"])
    summary = summarise(rows, budget)
    doc = {"command": command, "machine": facts, "model": cfg.__dict__, "batch": args.batch,
           "seq": args.seq, "repeats": repeats, "warmup": args.warmup, "strides": strides,
           "summary": summary, "rows": rows}  # fmt: skip
    text = markdown(doc)
    print()
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.docs:
        write_doc(text)
        print(f"rewrote the cpu-goal block of {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
