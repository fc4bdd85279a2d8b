"""What measuring costs: a training step with its forward measured by ``fxckpt.measure``, and
with ``torch.profiler.profile(profile_memory=True)``, against the same step unmeasured.

    python -m benchmarks.meter_cost --docs

Both readings come from the same allocator reports; the profiler also records every op. The
rounds interleave the three variants in a rotating order; times are medians with the min and
max of the per-round ratios against the unmeasured step.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from benchmarks.cpu_bench import _quiet_fd2
from benchmarks.methods import GPT_QUICK, Decoder, make_batch, median

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
START, END = "<!-- meter-table:start -->", "<!-- meter-table:end -->"


def _profiler_net(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return out, sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


@contextlib.contextmanager
def _timed(into: list[float]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    into.append(time.perf_counter() - start)


def run(seq: int, batch: int, rounds: int) -> dict[str, object]:
    import fxckpt

    torch.manual_seed(0)
    cfg = GPT_QUICK
    model = torch.compile(Decoder(cfg), backend="fxckpt", options={"compiler": "eager", "memory_budget": 0.5})
    idx, tgt = make_batch(cfg, batch, seq, "cpu")
    for _ in range(2):
        model(idx, tgt).backward()
    times: dict[str, list[float]] = {"unmeasured": [], "fxckpt.measure": [], "torch.profiler": []}
    held = net = 0

    def step(kind: str) -> None:
        nonlocal held, net
        with _timed(times[kind]):
            if kind == "unmeasured":
                loss = model(idx, tgt)
            elif kind == "fxckpt.measure":
                with _quiet_fd2():
                    m = fxckpt.measure(model, idx, tgt)
                loss, held = m.output, m.resident_bytes
            else:
                with _quiet_fd2():
                    loss, net = _profiler_net(lambda: model(idx, tgt))
            loss.backward()

    kinds = list(times)
    for r in range(rounds):
        for kind in kinds[r % 3:] + kinds[: r % 3]:
            step(kind)
    base = times["unmeasured"]
    out: dict[str, object] = {"seq": seq, "batch": batch, "rounds": rounds, "meter_resident": held,
                              "profiler_net": net}  # fmt: skip
    for kind, ts in times.items():
        ratios = [a / b for a, b in zip(ts, base, strict=True)]
        out[kind] = (1e3 * median(ts), median(ratios), min(ratios), max(ratios))
    return out


def markdown(results: Sequence[dict[str, object]], command: str, date: str) -> str:
    first = results[0]
    lines = [
        f"Command: `{command}`  ",
        f"Date: {date}; torch {torch.__version__}; {GPT_QUICK.describe()}, batch {first['batch']}, "
        f"fxckpt `memory_budget=0.5`, {first['rounds']} rounds; load average "
        f"{os.getloadavg()[0]:.1f} at the end.",
        "",
        "| seq | step (forward measured by) | ms | vs unmeasured (min-max) | bytes the forward left |",
        "|---|---|---|---|---|",
    ]
    for res in results:
        for kind, key in (("unmeasured", None), ("fxckpt.measure", "meter_resident"),
                          ("torch.profiler", "profiler_net")):  # fmt: skip
            ms, ratio, lo, hi = res[kind]  # type: ignore[misc]
            left = "-" if key is None else str(res[key])
            lines.append(f"| {res['seq']} | {kind} | {ms:.1f} | {ratio:.2f}x ({lo:.2f}-{hi:.2f}) | {left} |")
    lines.append("")
    lines.append("The profiler's bytes include fxckpt's 8-byte offload handles, which the meter "
                 "leaves out as host memory.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.meter_cost",
                                description="The cost of fxckpt.measure against torch.profiler's "
                                "memory profiling, on a training step (see docs/benchmarks.md).")
    p.add_argument("--seqs", type=int, nargs="+", default=[16, 256],
                   help="sequence lengths: short ones are dominated by op overhead")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--docs", action="store_true", help="rewrite docs/benchmarks.md's table")
    p.add_argument("--json", metavar="PATH", help="write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m benchmarks.meter_cost " + " ".join(sys.argv[1:] if argv is None else argv)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = [run(seq, args.batch, args.rounds) for seq in args.seqs]
    table = markdown(results, command, date)
    print(table)
    if args.json:
        doc = {"command": command, "date": date, "results": results}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.docs:
        from benchmarks.dynamic_budget import write_docs

        write_docs(table, DOCS, START, END)
        print(f"wrote {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
