"""What keeping saved graph inputs in their own layout costs in step time, under Inductor.

    PYTHONPATH=. python -m benchmarks.conv_layout [--rounds 7] [--steps 5] [--json PATH]

Inductor's layout optimization lays convolutions out channels-last, and saves a
channels-last copy of each conv weight (and of the model's input) for the backward. fxckpt
saves those inputs as they are instead (:mod:`fxckpt.passes.saved_layout`), so that what the
backward holds is what the plan counted; the backward then re-lays out a weight where its
``convolution_backward`` wants to. The other way to the same memory is to turn layout
optimization off. A ResNet-shaped net (fp32, CPU), five methods in rotated rounds (each
round in another order) on one process, caches off:

- ``inductor``: plain ``torch.compile``, the baseline;
- ``inductor_nchw``: plain, ``torch._inductor.config.layout_optimization = False``;
- ``fxckpt``: no budget, saved inputs in their own layout (what fxckpt does);
- ``fxckpt_copies``: the same with that pass off (Inductor's channels-last copies saved);
- ``fxckpt_nchw``: fxckpt with layout optimization off.

Per method: what one forward leaves for the backward (fxckpt's meter, never a plan), and the
step time as a ratio to ``inductor``'s, paired per round (median, min, max); then ``fxckpt``
against ``fxckpt_copies`` and ``fxckpt_nchw``, paired the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.conv_case import ResNet

METHODS = ("inductor", "inductor_nchw", "fxckpt", "fxckpt_copies", "fxckpt_nchw")


@contextlib.contextmanager
def _compiling(name: str) -> Iterator[None]:
    """The settings a method compiles under (its first call)."""
    from torch._inductor import config

    import fxckpt.passes.saved_layout as saved_layout

    with contextlib.ExitStack() as stack:
        if name.endswith("_nchw"):
            stack.enter_context(config.patch(layout_optimization=False))
        if name == "fxckpt_copies":
            original = saved_layout.inductor_channels_last_nodes
            saved_layout.inductor_channels_last_nodes = lambda fw: set()  # type: ignore[assignment]
            stack.callback(setattr, saved_layout, "inductor_channels_last_nodes", original)
        yield


def _backend(name: str) -> Callable[..., Any]:
    """A backend of the method's own: dynamo keeps one compiled entry per backend, so the
    methods (one model class, one code object) never share one, and a recompile happens
    under the method's settings."""
    from torch._inductor.compile_fx import compile_fx

    import fxckpt

    inner = compile_fx if name.startswith("inductor") else fxckpt.backend()

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        with _compiling(name):
            return inner(gm, example_inputs)

    backend.__name__ = name
    return backend


def _stepper(name: str, base: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[Callable[[], None], Any]:
    model = copy.deepcopy(base)
    compiled = torch.compile(model, backend=_backend(name))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        compiled(*inputs).backward()

    step()
    return step, compiled


def measure(rounds: int, steps: int, widths: tuple[int, ...], batch: int, side: int) -> dict[str, dict[str, Any]]:
    import fxckpt

    torch._inductor.config.fx_graph_cache = False  # each method compiles its own graphs
    torch._functorch.config.enable_autograd_cache = False
    torch.manual_seed(0)
    base = ResNet(widths, blocks=2).train()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(batch, 3, side, side, generator=g), torch.randint(0, 10, (batch,), generator=g))
    steppers: dict[str, Callable[[], None]] = {}
    out: dict[str, dict[str, Any]] = {}
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64
    for name in METHODS:
        step, compiled = _stepper(name, base, inputs)
        steppers[name] = step
        m = fxckpt.measure(lambda compiled=compiled: compiled(*inputs))
        m.output.backward()
        out[name] = {"held_bytes": m.held_bytes, "step_ms": []}
    for name in METHODS:
        steppers[name]()  # warm, and no method compiles again from here on
    for r in range(rounds):
        for name in METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]:
            start = time.perf_counter()
            for _ in range(steps):
                steppers[name]()
            out[name]["step_ms"].append((time.perf_counter() - start) / steps * 1e3)
    base_ms = out["inductor"]["step_ms"]
    for row in out.values():
        ratios = [a / b for a, b in zip(row["step_ms"], base_ms, strict=True)]
        row["step_ms_median"] = statistics.median(row["step_ms"])
        row["ratio_median"] = statistics.median(ratios)
        row["ratio_min"], row["ratio_max"] = min(ratios), max(ratios)
    return out


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| method | held after forward | step ms (median) | vs inductor (median, min..max) |",
             "|---|---|---|---|"]  # fmt: skip
    for name, r in rows.items():
        lines.append(f"| {name} | {r['held_bytes']:,} B | {r['step_ms_median']:.1f} | "
                     f"{r['ratio_median']:.3f} ({r['ratio_min']:.3f}..{r['ratio_max']:.3f}) |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.conv_layout", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="timed steps per method and round")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--side", type=int, default=32)
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = measure(args.rounds, args.steps, tuple(args.widths), args.batch, args.side)
    load = os.getloadavg()
    print(f"ResNet-shaped, widths {tuple(args.widths)}, 2 blocks a stage, batch {args.batch}, "
          f"{args.side}x{args.side}, fp32, CPU, {args.threads} thread(s), {args.rounds} rotated "
          f"rounds of {args.steps} steps; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(table(rows))
    for name in ("fxckpt_copies", "fxckpt_nchw"):
        pair = [a / b for a, b in zip(rows["fxckpt"]["step_ms"], rows[name]["step_ms"], strict=True)]
        print(f"fxckpt / {name}, paired per round: median {statistics.median(pair):.3f} "
              f"({min(pair):.3f}..{max(pair):.3f})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
