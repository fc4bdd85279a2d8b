"""The GPU checks, as one prepared script: under 8 minutes on one H200.

    PYTHONPATH=. python benchmarks/gpu_check.py --json gpu_check.json

Without CUDA it prints why and exits 0. With CUDA it checks, and prints as one table:

1. Gradients equal eager's on CUDA: every row of the table, on a small Qwen3-shaped decoder in
   float32 (``torch.testing.assert_close``, default tolerances).
2. Step time and peak memory of eager, full_checkpoint, save_on_cpu(pin_memory=True),
   torch_offload (every eligible node tagged) and fxckpt offload="all", on a Qwen3-1.7B-shaped
   decoder (``--layers`` of its 28 layers) at 8k and 32k tokens in bfloat16. The rows are
   ``benchmarks/methods.py``'s, the same as cpu_bench.py's, run by the same harness.
3. Measured against planned: ``fxckpt.Meter`` (CUDA's ``memory_allocated`` and
   ``max_memory_allocated``, peak reset) gives the bytes a forward leaves allocated and the
   step's peak, beside fxckpt's planned peak (``plan.resident_peak_bytes``).
4. How much of the copy time is hidden behind compute: ``fxckpt.stats()["stall_seconds"]``
   against the time the copies take at the measured pinned bandwidth.

``--allow-cpu`` runs the same code on the CPU with a tiny configuration, to try the script
where there is no GPU; its numbers mean nothing about GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Before CUDA initialises: many model copies and two sequence lengths in one process.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from benchmarks.cpu_bench import (  # noqa: E402
    machine_info,
    markdown_table,
    run_suite,
    warm_compilers,
)
from benchmarks.methods import (  # noqa: E402
    BASELINE_SPECS,
    QWEN3_1_7B,
    Runner,
    default_fxckpt_specs,
)

GPU_ROWS = ("eager", "full_checkpoint", "save_on_cpu", "torch_offload", "fxckpt_offload_all")
GiB = 2**30


def gpu_specs(extra: Sequence[str] = ()) -> list[Any]:
    every = {s.name: s for s in (*BASELINE_SPECS, *default_fxckpt_specs("1MiB"))}
    names = list(GPU_ROWS) + [n for n in extra if n not in GPU_ROWS]
    if "fxckpt_at_full_ckpt" in names and names.index("full_checkpoint") > names.index(
        "fxckpt_at_full_ckpt"
    ):
        raise ValueError("full_checkpoint must come before fxckpt_at_full_ckpt")
    return [every[n] for n in names]


def pinned_bandwidth(device: torch.device, nbytes: int = 512 * 2**20) -> dict[str, float]:
    """Device-to-host and host-to-device bytes per second, pinned memory, one copy each."""
    if device.type != "cuda":
        return {"d2h": float("nan"), "h2d": float("nan")}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        out[name] = 3 * nbytes / (time.perf_counter() - start)
    return out


def memory_probe(device: torch.device, bandwidth: dict[str, float]) -> Any:
    """After the timed rounds: bytes allocated after the forward, and the copy overlap."""

    def probe(runner: Runner, idx: torch.Tensor, tgt: torch.Tensor, row: dict[str, Any]) -> None:
        import fxckpt

        fxckpt.reset_stats()
        if device.type == "cuda":
            # fxckpt's meter: CUDA's memory_allocated / max_memory_allocated, peak reset at
            # each start. The forward's meter starts right after the step's, so resetting the
            # peak there loses nothing the step's meter needs.
            forward, whole = fxckpt.Meter(device), fxckpt.Meter(device)
            with whole:
                runner.step(idx, tgt, meter=forward)
            assert forward.result is not None and whole.result is not None
            row["measured_resident_bytes"] = forward.result.held_bytes
            row["forward_peak_bytes"] = forward.result.peak_bytes
            row["step_peak_bytes"] = whole.result.peak_bytes
        else:
            runner.step(idx, tgt)
        if runner.spec.kind != "fxckpt":
            return
        stats = fxckpt.stats()
        copy_s = (stats["offloaded_bytes"] / bandwidth["d2h"]
                  + stats["prefetched_bytes"] / bandwidth["h2d"])
        stall = row.get("stall_s_per_step")  # median over the timed rounds
        row["copy_s_per_step"] = copy_s if copy_s == copy_s else None  # NaN without CUDA
        if stall is not None and copy_s == copy_s and copy_s > 0:
            row["copy_hidden_share"] = max(0.0, 1.0 - stall / copy_s)

    return probe


def gpu_table(rows: Sequence[dict[str, Any]]) -> str:
    """The columns the CPU table does not have."""
    lines = ["| seq | method | after fwd GiB (measured) | fwd peak GiB | step peak GiB | planned "
             "peak GiB | stall ms | copy ms | copy hidden |", "|" + "---|" * 9]
    for r in rows:
        if r.get("unavailable"):
            continue

        def gib(key: str, r: dict[str, Any] = r) -> str:
            v = r.get(key)
            return "-" if v is None else f"{v / GiB:.2f}"

        stall, copy = r.get("stall_s_per_step"), r.get("copy_s_per_step")
        hidden = r.get("copy_hidden_share")
        lines.append(
            f"| {r['seq']} | {r['method']} | {gib('measured_resident_bytes')} | "
            f"{gib('forward_peak_bytes')} | {gib('step_peak_bytes')} | "
            f"{gib('planned_peak_bytes')} | {'-' if stall is None else f'{stall * 1e3:.1f}'} "
            f"| {'-' if copy is None else f'{copy * 1e3:.1f}'} | "
            f"{'-' if hidden is None else f'{100 * hidden:.0f}%'} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py",
                                description="GPU checks: gradients, memory against the simulator, "
                                "step time and copy overlap per method (see docs/benchmarks.md).")
    p.add_argument("--json", metavar="PATH", default="gpu_check.json")
    p.add_argument("--layers", type=int, default=8, help="layers of Qwen3-1.7B's 28 to build")
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compiler", choices=("eager", "inductor"), default="eager")
    p.add_argument("--extra", nargs="*", default=[],
                   help="more rows from cpu_bench's set, e.g. fxckpt_at_full_ckpt")
    p.add_argument("--deadline-s", type=float, default=420.0,
                   help="start no new sequence length after this many seconds")
    p.add_argument("--allow-cpu", action="store_true",
                   help="without CUDA, run a tiny configuration on the CPU (tries the script)")
    args = p.parse_args(argv)

    if not torch.cuda.is_available() and not args.allow_cpu:
        print(f"gpu_check: CUDA is not available (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}); nothing to check. Run it on a machine with an NVIDIA GPU: "
              "PYTHONPATH=. python benchmarks/gpu_check.py")
        return 0
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 1 << 16
    if cuda:
        big = replace(QWEN3_1_7B, layers=args.layers)
        small = replace(QWEN3_1_7B, name="qwen3-1.7b-grads", layers=2)
        seqs, grad_seq, dtype = args.seqs, 1024, torch.bfloat16
    else:
        big = replace(QWEN3_1_7B, name="qwen3-tiny", vocab=256, d=64, heads=4, kv_heads=2,
                      head_dim=16, ffn=128, layers=2)
        small, seqs, grad_seq, dtype = big, [64, 128], 64, torch.float32
    specs = gpu_specs(args.extra)
    started = time.perf_counter()
    facts = machine_info(torch.get_num_threads())
    command = "PYTHONPATH=. python benchmarks/gpu_check.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    bandwidth = pinned_bandwidth(device)
    facts["compiler_warmup_s"] = round(warm_compilers(device, args.compiler), 1)
    print(f"{command}\n{facts['date']}, {facts.get('gpu', facts['cpu'])}, torch {facts['torch']}"
          f"\npinned bandwidth: D2H {bandwidth['d2h'] / 1e9:.1f} GB/s, H2D "
          f"{bandwidth['h2d'] / 1e9:.1f} GB/s")
    doc: dict[str, Any] = {"command": command, "machine": facts, "bandwidth": bandwidth,
                           "compiler": args.compiler, "suites": []}  # fmt: skip
    failures: list[str] = []

    # 1. Gradients, float32.
    print(f"\n1. gradients against eager, float32, {small.describe()}, seq {grad_seq}")
    rows = run_suite(small, batch=1, seq=grad_seq, specs=specs, device=device,
                     dtype=torch.float32, compiler=args.compiler, warmup=0, repeats=1)
    doc["suites"].append({"check": "gradients", "model": small.__dict__, "dtype": "float32",
                          "rows": rows})  # fmt: skip
    failures += [f"grads {r['method']}: {r['grads_note'] or r.get('unavailable')}" for r in rows
                 if not r.get("grads_match")]  # fmt: skip

    # 2-4. The table, bfloat16.
    bf16_tol = {"rtol": 5e-2, "atol": 1e-2}  # bf16 rounding after reordered compiled ops
    probe = memory_probe(device, bandwidth)
    table: list[dict[str, Any]] = []
    last_s = 0.0
    for seq in seqs:
        # A longer sequence costs more than the last one: guess 1.5x, and skip what would end
        # past the deadline rather than be cut off by the machine's limit.
        elapsed = time.perf_counter() - started
        if elapsed + 1.5 * last_s > args.deadline_s:
            print(f"\nseq {seq}: skipped: {elapsed:.0f} s spent, the last sequence length took "
                  f"{last_s:.0f} s, --deadline-s {args.deadline_s:.0f}")
            doc["suites"].append({"check": "table", "seq": seq, "skipped": "deadline"})
            continue
        suite_start = time.perf_counter()
        print(f"\n2. {big.describe()}, {dtype}, batch 1 x seq {seq}")
        try:
            rows = run_suite(big, batch=1, seq=seq, specs=specs, device=device, dtype=dtype,
                             compiler=args.compiler, warmup=1, repeats=args.repeats,
                             tolerances=bf16_tol, probe=probe)  # fmt: skip
        except torch.OutOfMemoryError as e:
            print(f"seq {seq}: out of memory: {str(e).splitlines()[0]}")
            doc["suites"].append({"check": "table", "seq": seq, "oom": str(e)[:500]})
            failures.append(f"seq {seq}: out of memory")
            torch.cuda.empty_cache()
            continue
        table += rows
        last_s = time.perf_counter() - suite_start
        print(f"seq {seq}: {last_s:.0f} s")
        doc["suites"].append({"check": "table", "model": big.__dict__, "dtype": str(dtype),
                              "seq": seq, "tolerances": bf16_tol, "rows": rows})  # fmt: skip
        failures += [f"grads {seq} {r['method']}: {r['grads_note']}" for r in rows
                     if not r.get("unavailable") and not r.get("grads_match")]  # fmt: skip
    if table:
        print("\n" + markdown_table(table) + "\n\n" + gpu_table(table))
    doc["wall_s"] = facts["wall_s"] = round(time.perf_counter() - started, 1)
    facts["loadavg_end"] = list(os.getloadavg())
    doc["failures"] = failures
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\nwrote {args.json}; {doc['wall_s']} s; "
          + ("all gradients match" if not failures else "FAILED: " + "; ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
