"""Ops and host time per training step with copy buckets (``coalesce="auto"``) and without.

    python -m benchmarks.bucket_overhead [--device cuda] [--compiler inductor] [--json PATH]

``--smoke`` runs one tiny case instead (2 blocks, one round of one step), in seconds: it
checks that the script runs end to end, and its figures mean nothing.

A small decoder (8 blocks, d=64) whose saved tensors are all offloaded (``offload="all"``),
so that a step is mostly the runtime's fixed costs: op calls, events and hand-offs to the copy
engine. Three methods, in rotated rounds (each round in another order), on one process:

- ``keep``: ``offload="never"``, the baseline: no copies at all;
- ``alone``: ``offload="all", coalesce="never"``: one transfer per tensor;
- ``bucketed``: ``offload="all"`` (buckets on): one transfer per bucket.

Per method: the fxckpt op calls of one step (the profiler's op events), the offload calls and hand-offs to the copy engine (the runtime's
counters), the step's wall time and the compute thread's CPU time, and both as overhead over
``keep`` (paired per round, median). Nothing is read from a plan.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.methods import GPT_SMALL, Decoder, DecoderConfig, make_batch

CONFIG = replace(GPT_SMALL, name="gpt-tiny", vocab=256, d=64, heads=4, layers=8, ffn=256)
SMOKE = replace(CONFIG, name="gpt-tiny-smoke", layers=2)  # --smoke
METHODS: dict[str, dict[str, Any]] = {
    "keep": {"offload": "never"},
    "alone": {"offload": "all", "coalesce": "never"},
    "bucketed": {"offload": "all"},
}


def _count_ops(step: Callable[[], None]) -> dict[str, int]:
    """The ``fxckpt::`` op calls of one run of ``step``, from the profiler's op events (a
    ``TorchDispatchMode`` would not do: under one, dynamo runs the frame uncompiled)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    calls: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("fxckpt::"):
            calls[e.name] = calls.get(e.name, 0) + 1
    return calls


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stepper(options: dict[str, Any], device: torch.device, compiler: str, batch: int, seq: int,
             cfg: DecoderConfig = CONFIG) -> Callable[[], None]:
    import fxckpt  # noqa: F401  (registers the backend)

    torch.manual_seed(0)
    model = Decoder(cfg).to(device)
    # backend="fxckpt" with options, as benchmarks.methods compiles: dynamo keeps one
    # compiled frame per backend and options, so the three models never share a graph.
    compiled = torch.compile(model, backend="fxckpt", dynamic=False,
                             options={"compiler": compiler, "min_offload_bytes": 0, **options})
    idx, tgt = make_batch(cfg, batch, seq, device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        compiled(idx, tgt).backward()

    return step


def measure(device: torch.device, compiler: str = "eager", *, batch: int = 2, seq: int = 64,
            rounds: int = 5, steps: int = 20, cfg: DecoderConfig = CONFIG
            ) -> dict[str, dict[str, Any]]:
    """Per method: ops, offload calls and hand-offs per step, and per-step ms (wall and the
    compute thread's CPU time), with their overhead over ``keep``."""
    import fxckpt

    torch._dynamo.config.recompile_limit = 1024
    steppers = {name: _stepper(opts, device, compiler, batch, seq, cfg)
                for name, opts in METHODS.items()}
    out: dict[str, dict[str, Any]] = {}
    for name, step in steppers.items():
        for _ in range(3):  # compile, threads, pool buffers
            step()
        _sync(device)
        calls = _count_ops(step)
        _sync(device)
        fxckpt.reset_stats()
        step()
        _sync(device)
        s = fxckpt.stats()
        out[name] = {"ops_per_step": sum(calls.values()), "ops": calls,
                     "offload_calls_per_step": s["offload_calls"],
                     "handoffs_per_step": s["copy_handoffs"], "wall_ms": [], "thread_ms": []}
    names = list(steppers)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            _sync(device)
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                steppers[name]()
            _sync(device)
            out[name]["wall_ms"].append((time.perf_counter() - wall) / steps * 1e3)
            out[name]["thread_ms"].append((time.thread_time() - cpu) / steps * 1e3)
    for row in out.values():
        for key in ("wall_ms", "thread_ms"):
            base = out["keep"][key]
            row[f"{key}_median"] = statistics.median(row[key])
            row[f"{key}_over_keep"] = statistics.median(a - b for a, b in zip(row[key], base, strict=True))
    return out


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| method | fxckpt ops / step | offload calls / step | hand-offs / step | step ms "
             "| over keep ms | compute-thread CPU ms | over keep ms |", "|" + "---|" * 8]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['ops_per_step']} | {r['offload_calls_per_step']} "
            f"| {r['handoffs_per_step']} | {r['wall_ms_median']:.1f} | {r['wall_ms_over_keep']:+.1f} "
            f"| {r['thread_ms_median']:.1f} | {r['thread_ms_over_keep']:+.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bucket_overhead",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--compiler", choices=("eager", "inductor"), default="eager")
    p.add_argument("--smoke", action="store_true",
                   help="one tiny case to check that the script runs: 2 blocks instead of 8, "
                   "1 round of 1 step (seconds; the figures mean nothing)")
    p.add_argument("--rounds", type=int, help="default 5")
    p.add_argument("--steps", type=int, help="timed steps per method and round (default 20)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = p.parse_args(argv)
    cfg = SMOKE if args.smoke else CONFIG
    args.rounds = args.rounds or (1 if args.smoke else 5)
    args.steps = args.steps or (1 if args.smoke else 20)
    torch.set_num_threads(args.threads)
    rows = measure(torch.device(args.device), args.compiler, rounds=args.rounds, steps=args.steps,
                   cfg=cfg)
    print(f"{cfg.describe()}, batch 2, seq 64, {args.compiler}, {args.rounds} rotated rounds "
          f"of {args.steps} steps")
    print(table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
