"""Host time per offloaded tensor: the figure behind ``copy_overhead_ms`` in
``fxckpt.graph.costs.DEFAULT_COSTS`` (its ``cpu`` and ``cuda`` rows).

    python -m benchmarks.copy_overhead [--device cuda] [--kib 64] [--weights]

Times the compute thread through one offload round trip of a small tensor, the four runtime
ops a plan inserts for it (``offload``, ``offload_done``, ``prefetch``, ``wait``), on the
device's copy engine (worker threads on the CPU, side streams on CUDA). The tensor is small
so that the copies themselves add little: what is left is the op dispatch and the hand-offs
to the engine, the part of an offload that no compute hides. Prints the median and the
spread of 7 rounds of 200 round trips, and the table value the planner uses.

``--weights``: a streamed weight's copy instead, the two ops a plan inserts for each use
(``weight_prefetch``, ``wait``), from fxckpt host memory as ``fxckpt.stream_weights`` leaves
a weight.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch


def round_trip_ms(device: str, kib: int, rounds: int = 7, per_round: int = 200,
                  weights: bool = False) -> list[float]:
    import fxckpt  # noqa: F401  (registers the fxckpt:: ops)
    from fxckpt.runtime.weight_ops import adopt_host

    ops = torch.ops.fxckpt
    x = torch.randn(kib * 256, device=device)
    w = adopt_host(torch.randn(kib * 256))  # where fxckpt.stream_weights keeps a weight
    dev = torch.device(device)

    def once() -> torch.Tensor:
        handle = ops.offload(x)
        ops.offload_done(handle, x)
        ticket = ops.prefetch(handle)
        return ops.wait(handle, ticket, list(x.shape), list(x.stride()), x.dtype, x.device)

    def weight_once() -> torch.Tensor:
        handle = ops.weight_prefetch(w, dev)
        return ops.wait(handle, handle, list(w.shape), list(w.stride()), w.dtype, dev)

    run = weight_once if weights else once

    for _ in range(50):  # threads, pool buffers, CUDA streams and events come up here
        run()
    times = []
    for _ in range(rounds):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(per_round):
            run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / per_round * 1e3)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.copy_overhead", description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--kib", type=int, default=64, help="size of the tensor moved")
    p.add_argument("--weights", action="store_true",
                   help="a streamed weight's copy (weight_prefetch, wait) instead of an offload")
    args = p.parse_args(argv)
    from fxckpt.graph.costs import copy_overhead_ms

    times = round_trip_ms(args.device, args.kib, weights=args.weights)
    what = "streamed weight's copy" if args.weights else "offload round trip"
    print(f"{args.device}: one {what} of {args.kib} KiB: median "
          f"{statistics.median(times):.3f} ms (min {min(times):.3f}, max {max(times):.3f}, "
          f"7 rounds of 200); planner's table value: "
          f"{copy_overhead_ms(args.device, 'flops'):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
