"""Host budgets against offload="all": step time, host memory and disk bytes, side by side.

    python -m benchmarks.host_budget --json docs/benchmarks/host_budget.json [--dir PATH]

One process, one model (a GPT-style decoder on the CPU), ``offload="all"``:

1. **baseline**: no host budget. Its host high-water mark is what offload="all" needs.
2. ``host_budget`` at 100 %, 50 % and 25 % of that need, with ``offload_dir`` in ``--dir``
   (default: a new folder in the system's temporary directory).
3. the baseline again, so drift over the run shows.

Each row compiles afresh from the same initial weights, empties the host pool, and trains
``--steps`` steps of SGD on the same batches. Reported per row: the median step time after
``--warmup`` steps and its ratio to the first baseline's; ``host_high_water_bytes`` (the
pool's own accounting of the host buffers it allocated: staging included, never the plan's
figures); ``disk_bytes`` written per step, disk write and read seconds and stall seconds per
step (``fxckpt.stats()``); and whether every step's loss equals the baseline's bit for bit.

The host pool's cap and the disk directory are per process, so rows run one after another,
not interleaved; the repeated baseline bounds the drift.
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
from typing import Any

import torch

from benchmarks.methods import Decoder, DecoderConfig, make_batch, median

MODEL = DecoderConfig("gpt-host", vocab=512, d=128, heads=4, layers=8, ffn=512)
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


def run_row(label: str, base: torch.nn.Module, batches: list[Any], options: dict[str, Any],
            steps: int, warmup: int) -> dict[str, Any]:
    import fxckpt
    from fxckpt.runtime import disk, pool

    torch._dynamo.reset()
    pool.set_pool_cap(0)  # an empty pool: the high-water mark is this row's alone
    pool.set_pool_cap(None)
    fxckpt.reset_stats()
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend=fxckpt.backend(**options))
    times, losses = [], []
    snap_warm: dict[str, Any] = {}
    for i in range(steps):
        if i == warmup:
            disk.wait_for_staging()
            snap_warm = fxckpt.stats()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = compiled(*batches[i % len(batches)])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    disk.wait_for_staging()
    snap = fxckpt.stats()
    measured = steps - warmup
    plans = fxckpt.last_plans()
    where = disk.current()
    return {
        "row": label,
        "host_budget": options.get("host_budget"),
        "step_ms": median(times[warmup:]) * 1e3,
        "host_high_water_bytes": snap["host_high_water_bytes"],
        "disk_bytes_per_step": (snap["disk_bytes"] - snap_warm.get("disk_bytes", 0)) / measured,
        "disk_write_s_per_step":
            (snap["disk_write_seconds"] - snap_warm.get("disk_write_seconds", 0)) / measured,
        "disk_read_s_per_step":
            (snap["disk_read_seconds"] - snap_warm.get("disk_read_seconds", 0)) / measured,
        "stall_s_per_step": (snap["stall_seconds"] - snap_warm.get("stall_seconds", 0)) / measured,
        "fallbacks": snap["fallbacks"] + snap["disk_fallbacks"],
        "plan_host_bytes": sum(p.host_bytes for p in plans),
        "plan_disk_bytes": sum(p.disk_bytes for p in plans),
        "o_direct": None if where is None or "offload_dir" not in options else where.direct,
        "losses": losses,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_budget",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--dir", help="where the disk tier's files go (default: a new temp folder)")
    p.add_argument("--steps", type=int, default=10, help="steps per row (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="steps not timed (default 3)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--min-offload", default="64KiB", help="min_offload_bytes (default 64KiB)")
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")

    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    base = Decoder(MODEL)
    batches = [make_batch(MODEL, args.batch, args.seq, "cpu", seed=s) for s in range(4)]
    common = {"compiler": "eager", "offload": "all", "min_offload_bytes": args.min_offload,
              "cost_model": "flops"}  # fmt: skip
    made = args.dir is None
    where = tempfile.mkdtemp(prefix="fxckpt-bench-") if made else args.dir
    rows = []
    try:
        rows.append(run_row("baseline (no host budget)", base, batches, common, args.steps,
                            args.warmup))  # fmt: skip
        need = rows[0]["host_high_water_bytes"]
        for share in SHARES:
            options = {**common, "host_budget": int(need * share), "offload_dir": where}
            rows.append(run_row(f"host_budget {share:.0%}", base, batches, options, args.steps,
                                args.warmup))  # fmt: skip
        rows.append(run_row("baseline again", base, batches, common, args.steps, args.warmup))
    finally:
        from fxckpt.runtime import disk, disk_dir

        disk.shutdown()
        disk_dir.close_all()
        if made:
            shutil.rmtree(where, ignore_errors=True)
    ref = rows[0]
    print(f"{MODEL.describe()}, batch {args.batch} x seq {args.seq}, offload='all', "
          f"min_offload_bytes={args.min_offload}; offload_dir on {_fs_type(where)} ({where}); "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")  # fmt: skip
    print(f"offload='all' needs {need / 2**20:.2f} MiB of host memory (baseline high water)")
    head = ("row", "host_budget", "step ms", "vs base", "host high water", "disk MiB/step",
            "write s", "read s", "stall s", "fallbacks", "loss = base")  # fmt: skip
    print(" | ".join(head))
    for r in rows:
        budget = "none" if r["host_budget"] is None else f"{r['host_budget'] / 2**20:.2f} MiB"
        same = r["losses"] == ref["losses"]
        r["loss_equal"] = same
        print(" | ".join((r["row"], budget, f"{r['step_ms']:.1f}", f"{r['step_ms'] / ref['step_ms']:.2f}x",
                          f"{r['host_high_water_bytes'] / 2**20:.2f} MiB",
                          f"{r['disk_bytes_per_step'] / 2**20:.2f}", f"{r['disk_write_s_per_step']:.4f}",
                          f"{r['disk_read_s_per_step']:.4f}", f"{r['stall_s_per_step']:.4f}",
                          str(r["fallbacks"]), "yes" if same else "NO")))  # fmt: skip
    if args.json:
        doc = {"model": MODEL.describe(), "batch": args.batch, "seq": args.seq,
               "min_offload_bytes": args.min_offload, "offload_dir_fs": _fs_type(where),
               "torch": torch.__version__, "need_bytes": need, "rows": rows,
               "command": " ".join(["python -m benchmarks.host_budget", *sys.argv[1:]])}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r["loss_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
