"""Streamed weights beside all-resident weights and an eager block swap, through one emulated link.

    python -m benchmarks.weights [--json PATH] [--steps 5] [--smoke]

The link is sized so that one block's weight copy takes as long, relative to the block's
forward compute, as on the target: a Flux-style DiT block at 1024x1024 (4096 tokens), bf16
weights, on a 24 GB card over PCIe 4 (25 GB/s, 165 TFLOP/s dense bf16): copy/compute =
(1/4096 bytes per FLOP) / (25e9 / 165e12) = 1.61. This machine's compute rate is measured
(a matmul of the block's shape) and the bandwidth follows; ``--mbps`` overrides it.

A LoRA decoder-shaped stack (frozen base linears, trainable rank-8 adapters), trained with
``torch.compile(backend="fxckpt")`` three ways, each under the same emulated host link:

- ``resident``: every weight on the device, no copies;
- ``fxckpt stream``: ``fxckpt.stream_weights(model, frozen_only=True)``, each base weight
  copied to the device ahead of each use, in the forward and again in the backward;
- ``fxckpt 50% off`` and ``fxckpt 90% off``: the same, under a ``device_budget`` of the saved
  activations' planned peak, the streamed copies in flight (three weights) and 50 % / 10 % of
  the frozen weight bytes: the plan keeps what fits on the device across steps and streams
  the rest;
- ``fxckpt low peak``: the smallest ``device_budget`` that plans (activations offloaded or
  recomputed too), for a peak near the swap's;
- ``eager swap``: the block swap users write today, in eager mode: a forward pre-hook per block
  copies its weights in through the same link (one blocking copy per block, compute waits) and
  a hook after it frees them; the backward swaps each block in again.

Per method, measured: the step time (median of the timed steps), the absolute device peak
over a step, what the step starts with on the device (so, for the fxckpt rows, the kept
weights' bytes: the start beyond the fully streamed run's), and gradient equality with the
resident run. The absolute figure is
``fxckpt.measure``'s ``absolute_peak_bytes``: on the CPU, what the step starts with on the
device (the storages of the model's parameters, buffers and gradients and of the input,
fxckpt's host memory left out) plus the allocator's peak above that level during the step.
Neither reads a plan.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

import fxckpt


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 8) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False).requires_grad_(False)
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.up.weight, std=0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = LoRALinear(d, 4 * d), LoRALinear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


TARGET_COPY_TO_COMPUTE = (1 / 4096) / (25e9 / 165e12)


def _flops_per_s(d: int, tokens: int) -> float:
    a, b = torch.randn(tokens, d), torch.randn(d, 4 * d)
    a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * tokens * d * 4 * d / (time.perf_counter() - t0)


def _swap(model: Stack) -> None:
    """An eager block swap: each block's base weights copied in before it runs, through the
    emulated link, and dropped after; each block is checkpointed, so its backward re-runs it
    (and swaps its weights in again) first."""
    from fxckpt import _link

    link = _link.current()
    for block in model.blocks:
        bases = [m.base for m in (block.fc1, block.fc2)]
        host = [b.weight.detach().clone() for b in bases]
        forward = block.forward

        def swapped(y: torch.Tensor, bases: list = bases, host: list = host, f: Any = forward) -> torch.Tensor:
            for b, h in zip(bases, host, strict=True):
                dev = torch.empty_like(h)
                link.copy("h2d", h.nbytes, lambda d=dev, s=h: d.copy_(s))
                b.weight = nn.Parameter(dev, requires_grad=False)
            try:
                return f(y)
            finally:  # also when the checkpoint's recompute stops early, by raising
                for b in bases:
                    b.weight = nn.Parameter(torch.empty(0), requires_grad=False)

        for b in bases:
            b.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        block.forward = lambda x, g=swapped: torch.utils.checkpoint.checkpoint(g, x, use_reentrant=False)


def run(method: str, d: int, depth: int, x: torch.Tensor, steps: int, device_budget: int | None = None
        ) -> dict[str, Any]:
    torch._dynamo.reset()
    gc.collect()  # the last method's model, and the weight copies it kept on the device
    fxckpt.reset_stats()
    torch.manual_seed(0)
    model = Stack(d, depth)
    if method.startswith("fxckpt"):
        fxckpt.stream_weights(model, frozen_only=True)
    run_model: Any = model
    if method == "eager swap":
        _swap(model)
    else:
        options = {"compiler": "eager"} | ({"device_budget": device_budget} if device_budget else {})
        run_model = torch.compile(model, backend="fxckpt", options=options)
    times, peaks, starts = [], [], []
    for _ in range(steps + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        m = fxckpt.measure(lambda: run_model(x).backward(), holding=(model, x))
        times.append(time.perf_counter() - t0)
        peaks.append(m.absolute_peak_bytes)
        starts.append(m.start_bytes)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    plans = fxckpt.last_plans()
    row = {"method": method, "step_ms": statistics.median(times[1:]) * 1e3,
           "absolute_peak_bytes": max(peaks[1:]), "start_bytes": starts[-1], "grads": grads}
    if method.startswith("fxckpt"):
        row |= {"device_budget": device_budget,
                "planned_resident_weight_bytes": sum(p.resident_weight_bytes for p in plans),
                "planned_activation_peak_bytes": sum(p.resident_peak_bytes for p in plans),
                "weight_h2d_bytes_per_step": sum(p.weight_h2d_bytes for p in plans)}
    return row


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--mbps", type=float, default=None, help="emulated link, MB/s each way "
                    "(default: sized to the target's copy-to-compute ratio)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 1 step (tests)")
    args = ap.parse_args(argv)
    d, depth, tokens = (64, 4, 16) if args.smoke else (256, 6, 1024)
    steps = 1 if args.smoke else args.steps
    torch.manual_seed(0)
    x = torch.randn(tokens, d)
    weight_bytes = sum(p.nbytes for n, p in Stack(d, depth).named_parameters() if ".base." in n)
    if args.mbps is None:
        block_bytes, block_flops = weight_bytes / depth, 2 * 2 * tokens * d * 4 * d
        args.mbps = block_bytes * _flops_per_s(d, tokens) / (block_flops * TARGET_COPY_TO_COMPUTE) / 1e6
    print(f"emulated link {args.mbps:.1f} MB/s each way: a block's weight copy takes "
          f"{TARGET_COPY_TO_COMPUTE:.2f}x its forward compute, as on the target", flush=True)
    rows = []
    largest = max(p.nbytes for n, p in Stack(d, depth).named_parameters() if ".base." in n)

    def report(row: dict[str, Any]) -> None:
        rows.append(row)
        print(f"{row['method']:14s} step {row['step_ms']:8.1f} ms   absolute device peak "
              f"{row['absolute_peak_bytes'] / 2**20:8.2f} MiB   at the start "
              f"{row['start_bytes'] / 2**20:8.2f} MiB", flush=True)

    with fxckpt.emulate_link(args.mbps * 1e6):
        for method in ("resident", "fxckpt stream"):
            report(run(method, d, depth, x, steps))
        # Budgets that leave a share of the frozen weights off the device: the saved
        # activations' planned peak, the streamed copies in flight, and the rest kept.
        activations = rows[1]["planned_activation_peak_bytes"]
        for off in (0.5, 0.9):
            budget = activations + 3 * largest + int((1 - off) * weight_bytes)
            report(run(f"fxckpt {int(off * 100)}% off", d, depth, x, steps, device_budget=budget))
        report(run("eager swap", d, depth, x, steps))
        # The swap checkpoints every block: its peak is lower. The smallest device budget the
        # plan meets, 90 % of the weights and most activations off the device, for a step
        # near that peak (the budget grows by half a weight until one plans).
        budget = 3 * largest
        while True:
            budget += largest // 2
            try:
                row = run("fxckpt low peak", d, depth, x, steps, device_budget=budget)
            except Exception as e:  # BudgetError, inside dynamo's BackendCompilerFailed
                if "cannot meet device_budget" not in str(e):
                    raise
                continue
            report(row)
            break
    ref = rows[0]["grads"]
    streamed_start = rows[1]["start_bytes"]  # every frozen weight in host memory
    for row in rows:
        got = {n.replace("parametrizations.", "").replace(".original", ""): g for n, g in row.pop("grads").items()}
        row["grads_equal"] = got.keys() == ref.keys() and all(
            torch.allclose(got[n], ref[n], rtol=1e-4, atol=1e-5) for n in ref)
        if row["method"].startswith("fxckpt"):
            # Measured: what the step starts with beyond the fully streamed run's start.
            row["measured_resident_weight_bytes"] = row["start_bytes"] - streamed_start
            row["weights_off_device"] = 1 - row["measured_resident_weight_bytes"] / weight_bytes
    by = {r["method"]: r for r in rows}
    out = {"link_MBps": args.mbps, "model": {"d": d, "depth": depth, "tokens": tokens},
           "frozen_weight_bytes": weight_bytes, "rows": rows,
           "stream_vs_resident_time": by["fxckpt stream"]["step_ms"] / by["resident"]["step_ms"],
           "off90_vs_resident_time": by["fxckpt 90% off"]["step_ms"] / by["resident"]["step_ms"],
           "swap_vs_stream_time": by["eager swap"]["step_ms"] / by["fxckpt stream"]["step_ms"],
           "swap_vs_off90_time": by["eager swap"]["step_ms"] / by["fxckpt 90% off"]["step_ms"],
           "swap_vs_low_peak_time": by["eager swap"]["step_ms"] / by["fxckpt low peak"]["step_ms"],
           "low_peak_vs_swap_peak": by["fxckpt low peak"]["absolute_peak_bytes"] / by["eager swap"]["absolute_peak_bytes"]}
    print(f"frozen weights {weight_bytes / 2**20:.2f} MiB; stream/resident time "
          f"{out['stream_vs_resident_time']:.2f}x, 90% off/resident {out['off90_vs_resident_time']:.2f}x, "
          f"swap/90% off {out['swap_vs_off90_time']:.2f}x; swap/low peak {out['swap_vs_low_peak_time']:.2f}x "
          f"at {out['low_peak_vs_swap_peak']:.2f}x the swap's peak; off the device (measured): "
          f"{[round(r['weights_off_device'], 2) for r in rows if 'weights_off_device' in r]}; "
          f"grads equal: {[r['grads_equal'] for r in rows]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
