"""Host budgets against offload="all": step time, host memory and disk bytes, side by side.

    python -m benchmarks.host_budget --json docs/benchmarks/host_budget.json [--dir PATH]

``--smoke`` runs one tiny case instead (a 2-block decoder, batch 1 x seq 32, one round of
2-step blocks, ``min_offload_bytes=0``), in seconds: it checks that the script runs end to
end, and its figures mean nothing.

One process, one model (a GPT-style decoder on the CPU), ``offload="all"``, five rows:

1. **baseline**: no host budget. Its host high-water mark is what offload="all" needs.
2. ``host_budget`` at 100 %, 50 % and 25 % of that need, with ``offload_dir`` in ``--dir``
   (default: a new folder in the system's temporary directory).

Each row compiles its own copy of the same initial weights and trains on the same batches
with SGD; each keeps its own host pool and disk folder (runtime settings are per compile). The
rows take turns in blocks of ``--block`` steps, ``--rounds`` times: each block empties the
host pools and does not time its first step (the pool refills then). Per
row: the median step time and its ratio to the baseline's; ``host_high_water_bytes`` (the
pool's own accounting of the host buffers it allocated, staging included, never the plan's
figures), the most over its blocks; ``disk_bytes`` written per timed step, disk write and
read seconds and stall seconds per timed step (``fxckpt.stats()``); fallbacks; and whether
every step's loss equals the baseline's bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.methods import Decoder, DecoderConfig, make_batch, median

MODEL = DecoderConfig("gpt-host", vocab=512, d=128, heads=4, layers=8, ffn=512)
SMOKE = DecoderConfig("gpt-host-smoke", vocab=64, d=32, heads=2, layers=2, ffn=64)  # --smoke
SHARES = (1.0, 0.5, 0.25)


def _fs_type(path: str) -> str:
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, fs = line.split()[:3]
                if os.path.realpath(path).startswith(mount) and len(mount) > len(best):
                    best, kind = mount, fs
    except OSError:
        pass
    return kind


@dataclass
class Row:
    label: str
    options: dict[str, Any]
    model: torch.nn.Module
    compiled: Any = None
    opt: Any = None
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    sums: dict[str, float] = field(default_factory=dict)
    high_water: int = 0
    timed: int = 0
    o_direct: bool | None = None

    def block(self, batches: list[Any], steps: int) -> None:
        import fxckpt
        from fxckpt.backend import runtime_profile
        from fxckpt.runtime import disk, pool

        if self.compiled is None:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)
            self.compiled = torch.compile(self.model, backend=fxckpt.backend(**self.options))
        # Empty pools: the high-water mark is this block's alone. (Each row's compile keeps
        # its own host pool and folder: nothing to reconfigure between rows.)
        pool.trim_all()
        fxckpt.reset_stats()
        before: dict[str, Any] = {}
        for i in range(steps):
            if i == 1:
                disk.wait_for_staging()
                before = fxckpt.stats()
            start = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            loss = self.compiled(*batches[len(self.losses) % len(batches)])
            loss.backward()
            self.opt.step()
            if i:
                self.times.append(time.perf_counter() - start)
            self.losses.append(loss.item())
        disk.wait_for_staging()
        after = fxckpt.stats()
        for key in ("disk_bytes", "disk_write_seconds", "disk_read_seconds", "stall_seconds"):
            self.sums[key] = self.sums.get(key, 0) + after[key] - before[key]
        self.sums["fallbacks"] = (self.sums.get("fallbacks", 0) + after["fallbacks"]
                                  + after["disk_fallbacks"])  # fmt: skip
        self.high_water = max(self.high_water, int(after["host_high_water_bytes"]))
        self.timed += steps - 1
        profile = runtime_profile(fxckpt.Options.from_mapping(self.options))
        where = profile.disk if profile is not None else None
        if "offload_dir" in self.options and where is not None:
            self.o_direct = where.direct

    def result(self) -> dict[str, Any]:
        per = max(self.timed, 1)
        return {
            "row": self.label,
            "host_budget": self.options.get("host_budget"),
            "step_ms": median(self.times) * 1e3,
            "host_high_water_bytes": self.high_water,
            "disk_bytes_per_step": self.sums.get("disk_bytes", 0) / per,
            "disk_write_s_per_step": self.sums.get("disk_write_seconds", 0) / per,
            "disk_read_s_per_step": self.sums.get("disk_read_seconds", 0) / per,
            "stall_s_per_step": self.sums.get("stall_seconds", 0) / per,
            "fallbacks": self.sums.get("fallbacks", 0),
            "o_direct": self.o_direct,
            "losses": self.losses,
        }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_budget",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--dir", help="where the disk tier's files go (default: a new temp folder)")
    p.add_argument("--smoke", action="store_true",
                   help="one tiny case to check that the script runs: a 2-block d=32 decoder, "
                   "batch 1 x seq 32, 1 round of 2-step blocks, min_offload_bytes 0 (seconds; "
                   "the figures mean nothing)")
    p.add_argument("--block", type=int, help="steps per block, the first untimed (4)")
    p.add_argument("--rounds", type=int, help="blocks per row (default 3)")
    p.add_argument("--batch", type=int, help="default 4")
    p.add_argument("--seq", type=int, help="default 256")
    p.add_argument("--min-offload", help="min_offload_bytes (default 64KiB)")
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    args = p.parse_args(argv)
    smoke = args.smoke
    model_cfg = SMOKE if smoke else MODEL
    args.block = args.block if args.block is not None else 2 if smoke else 4
    args.rounds = args.rounds if args.rounds is not None else 1 if smoke else 3
    args.batch = args.batch or (1 if smoke else 4)
    args.seq = args.seq or (32 if smoke else 256)
    args.min_offload = args.min_offload or ("0" if smoke else "64KiB")
    if args.block < 2 or args.rounds < 1:
        p.error("--block must be at least 2 and --rounds at least 1")

    torch.manual_seed(0)
    base = Decoder(model_cfg)
    batches = [make_batch(model_cfg, args.batch, args.seq, "cpu", seed=s) for s in range(4)]
    common = {"compiler": "eager", "offload": "all", "min_offload_bytes": args.min_offload,
              "cost_model": "flops"}  # fmt: skip
    made = args.dir is None
    where = tempfile.mkdtemp(prefix="fxckpt-bench-") if made else args.dir
    try:
        first = Row("baseline (no host budget)", common, copy.deepcopy(base))
        first.block(batches, args.block)
        need = first.high_water
        rows = [first] + [
            Row(f"host_budget {share:.0%}",
                {**common, "host_budget": int(need * share), "offload_dir": where},
                copy.deepcopy(base))
            for share in SHARES
        ]  # fmt: skip
        for r in range(args.rounds):
            for row in rows[1:] if r == 0 else rows:
                row.block(batches, args.block)
    finally:
        from fxckpt.runtime import disk, disk_dir

        disk.shutdown()
        disk_dir.close_all()
        if made:
            shutil.rmtree(where, ignore_errors=True)
    results = [row.result() for row in rows]
    ref = results[0]
    print(f"{model_cfg.describe()}, batch {args.batch} x seq {args.seq}, offload='all', "
          f"min_offload_bytes={args.min_offload}; offload_dir on {_fs_type(where)} ({where}); "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")  # fmt: skip
    print(f"offload='all' needs {need / 2**20:.2f} MiB of host memory (baseline high water); "
          f"{args.rounds} rounds of {args.block}-step blocks")
    head = ("row", "host_budget", "step ms", "vs base", "host high water", "disk MiB/step",
            "write s", "read s", "stall s", "fallbacks", "loss = base")  # fmt: skip
    print(" | ".join(head))
    for r in results:
        budget = "none" if r["host_budget"] is None else f"{r['host_budget'] / 2**20:.2f} MiB"
        n = min(len(r["losses"]), len(ref["losses"]))
        same = r["losses"][:n] == ref["losses"][:n]
        r["loss_equal"] = same
        print(" | ".join((r["row"], budget, f"{r['step_ms']:.1f}", f"{r['step_ms'] / ref['step_ms']:.2f}x",
                          f"{r['host_high_water_bytes'] / 2**20:.2f} MiB",
                          f"{r['disk_bytes_per_step'] / 2**20:.2f}", f"{r['disk_write_s_per_step']:.4f}",
                          f"{r['disk_read_s_per_step']:.4f}", f"{r['stall_s_per_step']:.4f}",
                          str(r["fallbacks"]), "yes" if same else "NO")))  # fmt: skip
    if args.json:
        doc = {"model": model_cfg.describe(), "batch": args.batch, "seq": args.seq,
               "min_offload_bytes": args.min_offload, "offload_dir_fs": _fs_type(where),
               "torch": torch.__version__, "need_bytes": need, "rows": results,
               "block": args.block, "rounds": args.rounds,
               "command": " ".join(["python -m benchmarks.host_budget", *sys.argv[1:]])}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r["loss_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
