"""Acceptance check of the emulated link, from outside: under ``FXCKPT_EMULATE_LINK``, a
training step timed with a wall clock lasts at least the bytes it offloads over the
bandwidth, and the engine's copy seconds are at least twice that (each byte goes out and
comes back).

``FXCKPT_EMULATE_LINK=20MB/s PYTHONPATH=. python -m benchmarks.link_floor [--steps N]``

Reads nothing of the plan: the bytes are the engine's ``offloaded_bytes`` counter, the
copy seconds its ``copy_seconds``, the step time ``time.perf_counter`` around
``loss.backward()``. Exit status 1 when either inequality fails on any step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.nn as nn

import fxckpt
from fxckpt._link import ENV_VAR, parse_env


class Net(nn.Module):
    """A stack of MLP blocks: every saved activation is big enough to be worth a copy."""

    def __init__(self, d: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x.square().mean()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args(argv)
    link = parse_env(os.environ.get(ENV_VAR, ""))
    if link is None:
        print(f"set {ENV_VAR} (for example {ENV_VAR}=20MB/s)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(args.tokens, 256)
    step = torch.compile(model, backend=fxckpt.backend(compiler="eager", offload="all",
                                                       min_offload_bytes=0))
    step(x).backward()  # compile and warm
    rows, ok = [], True
    for _ in range(args.steps):
        for p in model.parameters():
            p.grad = None
        fxckpt.reset_stats()
        start = time.perf_counter()
        step(x).backward()
        wall = time.perf_counter() - start
        st = fxckpt.stats()
        moved = int(st["offloaded_bytes"])
        floor = moved / link.bandwidth
        row = {"step_s": wall, "offloaded_bytes": moved, "bytes_over_bandwidth_s": floor,
               "copy_s": float(st["copy_seconds"]),
               "step_at_least_floor": wall >= floor,
               "copy_at_least_twice_floor": float(st["copy_seconds"]) >= 2 * floor}
        ok &= moved > 0 and row["step_at_least_floor"] and row["copy_at_least_twice_floor"]
        rows.append(row)
    print(json.dumps({"link": os.environ[ENV_VAR], "bandwidth_bytes_per_s":
                      link.bandwidth, "steps": rows, "ok": bool(ok)}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
