"""Streamed weights beside all-resident weights and an eager block swap, through one emulated link.

    python -m benchmarks.weights [--models stack,flux-lora,flux-full,llama-lora] [--json PATH]
                                 [--steps 5] [--threads 1] [--smoke] [--plot DIR]
    python -m benchmarks.weights --from PATH --plot DIR   (redraw a run's plots)

Each model of :mod:`benchmarks.weight_models` trains a few steps under
``torch.compile(backend="fxckpt", options={"compiler": "eager", ...})`` several ways, all
under one emulated host link per model:

- ``resident``: every weight on the device, no copies;
- ``fxckpt stream``: ``fxckpt.stream_weights(model, frozen_only=...)`` (the frozen base of a
  LoRA model; every weight under full fine-tuning), each streamed weight copied to the device
  ahead of each use, in the forward and again in the backward;
- ``fxckpt 50% off`` and ``fxckpt 90% off``: the same, under a ``memory_budget`` (the step's
  absolute device peak, in bytes) of the ``fxckpt stream`` step's measured absolute peak and
  50 % / 10 % of the streamed bytes: the plan keeps what fits on the device across steps and
  streams the rest;
- ``eager swap`` (frozen weights only): the block swap users write today, in eager mode: each
  block's forward copies its streamed weights in through the same link (blocking, compute
  waits) and frees them after; each block is checkpointed, so the backward swaps it in again;
- ``fxckpt low peak`` (beside the swap): small ``memory_budget`` values (saved activations
  offloaded or recomputed too), from the smallest that runs (``BudgetError.smallest_bytes``)
  up; the fastest whose measured peak is at most the swap's, else the one of the lowest peak.

The link is sized per model so that a block's weight copy takes 1.61x the block's forward
compute, as on the target: a block at 4096 tokens (a Flux DiT at 1024x1024, a decoder at 4k),
bf16 weights, on a 24 GB card over PCIe 4 (25 GB/s against 165 TFLOP/s dense bf16):
copy/compute = (1/4096 bytes per FLOP) / (25e9 / 165e12) = 1.61. The block's forward time is
measured here (the median of eager runs without autograd) and the bandwidth follows;
``--mbps`` overrides it.

Per method, measured: the step time (median of the timed steps after the first, run without
the meter, whose bookkeeping would cost time), then, over two more steps, the absolute
device peak over a step and what the step starts with (``fxckpt.measure``'s
``absolute_peak_bytes`` and ``start_bytes``: on the CPU the model's parameters, buffers and
gradients and the weight copies fxckpt keeps, fxckpt's host memory left out, plus the
allocator's peak above them), the weights kept on the device (for fxckpt's rows, the start
beyond the fully streamed run's), the exposed copy time per step (fxckpt: how long compute
waited for copies; the swap: every copy, made on the compute side) and gradient equality with
the resident run. None of it reads a plan; the plan's kept bytes are reported beside.

``--plot DIR`` draws, per model, ``DIR/weights_<model>.svg``: each method's measured absolute
device peak against its step time over all-resident's, the Pareto front dashed.

The link floor of a streamed row: the bytes its plan copies to the device per step over the
link's bandwidth, against the resident step. No step is shorter than the time its copies keep
the host-to-device queue busy, so a row cannot run below that ratio of the resident step.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import fxckpt
from benchmarks import pareto
from benchmarks.heap import keep_freed_blocks
from benchmarks.weight_models import BUILDERS, Workload, build, plain
from fxckpt.errors import BudgetError

TARGET_COPY_TO_COMPUTE = (1 / 4096) / (25e9 / 165e12)
# The parameters fxckpt.stream_weights leaves resident by default; the swap leaves them too.
MIN_BYTES = 64 * 2**10


def _streamable(work: Workload, model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Each block's parameters that fxckpt streams here, as (module, name, parameter): those
    ``fxckpt.stream_weights`` takes (of 64 KiB or more, or all where none is)."""
    found = [(mod, name, p) for block in work.blocks(model) for mod in block.modules()
             for name, p in mod.named_parameters(recurse=False)
             if not work.frozen_only or not p.requires_grad]  # fmt: skip
    large = [f for f in found if f[2].nbytes >= MIN_BYTES]
    return large or found


def _block_forward_seconds(work: Workload) -> tuple[float, int]:
    """(the median forward time of one block, its streamed bytes), averaged over the blocks:
    the model's forward without autograd, timed, divided by its block count."""
    model, blocks = work.model, work.blocks(work.model)
    with torch.no_grad():
        work.loss(model)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            work.loss(model)
            times.append(time.perf_counter() - t0)
    nbytes = sum(p.nbytes for *_, p in _streamable(work, model))
    return statistics.median(times) / len(blocks), nbytes // len(blocks)


def _swap(work: Workload, model: nn.Module, copied: list[float]) -> None:
    """An eager block swap over ``work``'s blocks; each copy's seconds go to ``copied``."""
    from fxckpt import _link

    link = _link.current()
    chosen = _streamable(work, model)
    for block in work.blocks(model):
        places = [(mod, name, p.detach().clone()) for mod, name, p in chosen
                  if any(m is mod for m in block.modules())]  # fmt: skip
        forward = block.forward

        def swapped(*args: Any, places: list = places, f: Any = forward, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            for mod, name, host in places:
                dev = torch.empty_like(host)
                link.copy("h2d", host.nbytes, lambda d=dev, s=host: d.copy_(s))
                setattr(mod, name, nn.Parameter(dev, requires_grad=False))
            copied.append(time.perf_counter() - t0)
            try:
                return f(*args, **kwargs)
            finally:  # also when the checkpoint's recompute stops early, by raising
                for mod, name, _ in places:
                    setattr(mod, name, nn.Parameter(torch.empty(0), requires_grad=False))

        for mod, name, _ in places:
            setattr(mod, name, nn.Parameter(torch.empty(0), requires_grad=False))
        block.forward = (lambda *a, g=swapped, **k:  # type: ignore[method-assign]
                         torch.utils.checkpoint.checkpoint(g, *a, use_reentrant=False, **k))  # fmt: skip


def run(name: str, method: str, smoke: bool, steps: int, memory_budget: int | None = None,
        warn: bool = True) -> dict[str, Any]:
    torch._dynamo.reset()
    gc.collect()  # the last method's model, and the weight copies it kept on the device
    fxckpt.reset_stats()
    work = build(name, smoke)
    model = work.model
    copied: list[float] = []
    streamed_bytes = 0
    if method.startswith("fxckpt"):
        streamed_bytes = fxckpt.stream_weights(model, frozen_only=work.frozen_only).nbytes
    run_model: Any = model
    if method == "eager swap":
        _swap(work, model, copied)
    else:
        # A budget below what the step can reach (the all-streamed step's own peak, plus a
        # little: what the budget's copies on their way need) runs its lowest plan: the row
        # then says how far over it went instead of stopping the run.
        options = {"compiler": "eager"} | ({"memory_budget": memory_budget} if memory_budget else {})
        if memory_budget and warn:
            options["on_infeasible"] = "warn"
        run_model = torch.compile(model, backend="fxckpt", options=options)
    times, exposed = [], []
    for _ in range(steps + 1):  # timed without the meter, whose bookkeeping costs time
        model.zero_grad(set_to_none=True)
        stalled, copied[:] = fxckpt.stats()["stall_seconds"], []
        t0 = time.perf_counter()
        work.loss(run_model).backward()
        times.append(time.perf_counter() - t0)
        exposed.append(sum(copied) if method == "eager swap" else fxckpt.stats()["stall_seconds"] - stalled)
    peaks, starts = [], []
    for _ in range(2):  # then measured: the step's absolute peak and what it starts with
        model.zero_grad(set_to_none=True)
        m = fxckpt.measure(lambda: work.loss(run_model).backward(), holding=(model,))
        peaks.append(m.absolute_peak_bytes)
        starts.append(m.start_bytes)
    grads = {plain(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # A graph planned again at run time (the adapt option: "0/0#0~r1") records a second plan,
    # which replaces the first.
    plans = list({p.name.split("~r")[0]: p for p in fxckpt.last_plans()}.values())
    row = {"method": method, "step_ms": statistics.median(times[1:]) * 1e3,
           "exposed_copy_ms": statistics.median(exposed[1:]) * 1e3,
           "absolute_peak_bytes": max(peaks), "start_bytes": starts[-1], "grads": grads}  # fmt: skip
    if method.startswith("fxckpt"):
        row |= {"memory_budget": memory_budget,
                "planned_resident_weight_bytes": sum(p.resident_weight_bytes for p in plans),
                "planned_activation_peak_bytes": sum(p.resident_peak_bytes for p in plans),
                "weight_h2d_bytes_per_step": sum(p.weight_h2d_bytes for p in plans),
                "streamed_bytes": streamed_bytes,
                "largest_streamed_bytes": max(w.bytes for p in plans for w in p.weights),
                "graphs": len(plans)}  # fmt: skip
    return row


def _budget_error(e: BaseException | None) -> BudgetError | None:
    """The BudgetError ``e`` is or carries (dynamo wraps a compile's: its inner_exception)."""
    while e is not None and not isinstance(e, BudgetError):
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return e


def _smallest_budget(name: str, smoke: bool, steps: int) -> int:
    """The smallest ``memory_budget`` the streamed model runs under: the figure the
    BudgetError of a one-byte budget names."""
    try:
        run(name, "fxckpt low peak", smoke, steps, memory_budget=1, warn=False)
    except Exception as e:  # noqa: BLE001 (a BudgetError, unwrapped here; anything else raises)
        if (err := _budget_error(e)) is None:
            raise
        return err.smallest_bytes
    raise AssertionError("a one-byte memory_budget ran")


def _at_swap_peak(name: str, smoke: bool, steps: int, largest: int, swap_peak: int,
                  tries: int = 6) -> dict[str, Any]:
    """fxckpt beside the swap at equal measured peak: ``tries`` budgets from the smallest that
    runs up, by half the largest streamed weight each; the fastest whose measured absolute
    peak is at most the swap's, else the one of the lowest peak. (The smallest budget need
    not peak lowest: with less room the backward may recompute more at once.)"""
    budget, found = _smallest_budget(name, smoke, steps), []
    for _ in range(1 if smoke else tries):
        row = run(name, "fxckpt low peak", smoke, steps, memory_budget=budget)
        print(f"    memory_budget {budget / 2**20:6.2f} MiB: step {row['step_ms']:7.1f} ms, "
              f"absolute device peak {row['absolute_peak_bytes'] / 2**20:7.2f} MiB", flush=True)  # fmt: skip
        found.append(row)
        budget += largest // 2
    within = [r for r in found if r["absolute_peak_bytes"] <= swap_peak]
    if within:
        return min(within, key=lambda r: r["step_ms"])
    return min(found, key=lambda r: (r["absolute_peak_bytes"], r["step_ms"]))


def bench(name: str, smoke: bool, steps: int, mbps: float | None) -> dict[str, Any]:
    work = build(name, smoke)
    if mbps is None:
        seconds, block_bytes = _block_forward_seconds(work)
        mbps = block_bytes / (seconds * TARGET_COPY_TO_COMPUTE) / 1e6
    print(f"{name}: {work.description}; emulated link {mbps:.1f} MB/s each way (a block's "
          f"weight copy {TARGET_COPY_TO_COMPUTE:.2f}x its forward)", flush=True)  # fmt: skip
    description, frozen_only = work.description, work.frozen_only
    del work
    rows: list[dict[str, Any]] = []

    def report(row: dict[str, Any]) -> None:
        rows.append(row)
        print(f"  {row['method']:15s} step {row['step_ms']:8.1f} ms  exposed copies "
              f"{row['exposed_copy_ms']:7.1f} ms  absolute device peak "
              f"{row['absolute_peak_bytes'] / 2**20:8.2f} MiB  start "
              f"{row['start_bytes'] / 2**20:7.2f} MiB", flush=True)  # fmt: skip

    with fxckpt.emulate_link(mbps * 1e6):
        for method in ("resident", "fxckpt stream"):
            report(run(name, method, smoke, steps))
        streamed_peak = rows[1]["absolute_peak_bytes"]  # every streamed weight in host memory
        weight_bytes, largest = rows[1]["streamed_bytes"], rows[1]["largest_streamed_bytes"]
        for off in (0.5, 0.9):
            budget = streamed_peak + int((1 - off) * weight_bytes)
            report(run(name, f"fxckpt {int(off * 100)}% off", smoke, steps, memory_budget=budget))
        if rows[1]["planned_resident_weight_bytes"] == 0 and frozen_only:
            report(run(name, "eager swap", smoke, steps))
            report(_at_swap_peak(name, smoke, steps, largest, rows[-1]["absolute_peak_bytes"]))
    ref = rows[0]["grads"]
    streamed_start = rows[1]["start_bytes"]  # every streamed weight in host memory
    for row in rows:
        got = row.pop("grads")
        row["grads_equal"] = got.keys() == ref.keys() and all(
            torch.allclose(got[n], ref[n], rtol=1e-4, atol=1e-5) for n in ref)
        if row["method"].startswith("fxckpt"):
            row["measured_resident_weight_bytes"] = row["start_bytes"] - streamed_start
            row["weights_off_device"] = 1 - row["measured_resident_weight_bytes"] / weight_bytes
    by = {r["method"]: r for r in rows}
    out: dict[str, Any] = {"description": description, "link_MBps": mbps,
                           "streamed_weight_bytes": weight_bytes, "rows": rows}  # fmt: skip
    for method in ("fxckpt stream", "fxckpt 50% off", "fxckpt 90% off"):
        out[f"{method} / resident time"] = by[method]["step_ms"] / by["resident"]["step_ms"]
        # No step is shorter than its weights' copies keep the host-to-device queue busy.
        out[f"{method} link floor / resident time"] = (
            by[method]["weight_h2d_bytes_per_step"] / (mbps * 1e6) * 1e3 / by["resident"]["step_ms"])
    if "eager swap" in by:
        for method in ("fxckpt 90% off", "fxckpt low peak"):
            out[f"eager swap / {method} time"] = by["eager swap"]["step_ms"] / by[method]["step_ms"]
        out["fxckpt low peak / eager swap peak"] = (
            by["fxckpt low peak"]["absolute_peak_bytes"] / by["eager swap"]["absolute_peak_bytes"])
    print("  " + "; ".join(f"{k} {v:.2f}x" for k, v in out.items() if k.endswith(("time", "peak")))
          + f"; off the device (measured): "
          f"{[round(r['weights_off_device'], 2) for r in rows if 'weights_off_device' in r]}; "
          f"grads equal: {[r['grads_equal'] for r in rows]}", flush=True)  # fmt: skip
    return out


def plot(report: dict[str, Any], directory: Path) -> list[Path]:
    """One SVG per model of ``report`` (what ``--json`` writes) under ``directory``."""
    paths = []
    for name, doc in report["models"].items():
        resident = next(r for r in doc["rows"] if r["method"] == "resident")["step_ms"]
        rows = [{"method": r["method"], "x": r["step_ms"] / resident,
                 "y": r["absolute_peak_bytes"] / 2**20} for r in doc["rows"]]  # fmt: skip
        path = directory / f"weights_{name}.svg"
        pareto.write(path, rows, f"{name}: absolute device peak against step time, through an "
                     f"emulated {doc['link_MBps']:.0f} MB/s link", "step time / all-resident's",
                     "absolute device peak over a step, MiB (meter)")  # fmt: skip
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(BUILDERS),
                    help=f"comma-separated, of {', '.join(BUILDERS)} (default: all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--mbps", type=float, default=None, help="emulated link, MB/s each way "
                    "(default: sized to the target's copy-to-compute ratio, per model)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny models, 1 step (tests)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; the default 1 "
                    "leaves the other core to the copy engine, as a GPU's compute leaves the host's")
    ap.add_argument("--os-heap", action="store_true", help="leave the C library's default: "
                    "large freed tensors go back to the OS (benchmarks/heap.py)")
    ap.add_argument("--plot", type=Path, default=None, metavar="DIR",
                    help="draw DIR/weights_<model>.svg per model: peak against step time")
    ap.add_argument("--from", dest="source", type=Path, default=None, metavar="PATH",
                    help="run nothing: draw --plot from a report --json wrote")
    args = ap.parse_args(argv)
    if args.source is not None:
        if args.plot is None:
            ap.error("--from draws plots only: give --plot DIR too")
        for path in plot(json.loads(args.source.read_text()), args.plot):
            print(f"wrote {path}")
        return 0
    torch.set_num_threads(args.threads)
    if not args.os_heap:
        keep_freed_blocks()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in BUILDERS]
    if unknown or not names:
        ap.error(f"--models: {unknown or args.models!r} is not among {', '.join(BUILDERS)}")
    steps = 1 if args.smoke else args.steps
    report = {"models": {n: bench(n, args.smoke, steps, args.mbps) for n in names}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot is not None:
        for path in plot(report, args.plot):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
