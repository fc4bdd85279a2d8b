"""fxckpt under ``mode="reduce-overhead"`` (CUDA graphs) on a GPU: gradients equal eager's, and
fxckpt's ops run between the captured regions, never inside one.

    python -m benchmarks.gpu_cudagraphs --json gpu_cudagraphs.json

fxckpt's ops carry the ``cudagraph_unsafe`` tag, so Inductor's graph partitioning captures the
compute between them in CUDA graphs and calls the ops from the uncaptured wrapper. This check
trains a small decoder for a few steps with ``offload="all"`` and compares the loss and every
gradient with an eager copy at each step; it reads the generated code to count the partitions
and to find any fxckpt op inside one; and it reports Inductor's count of graphs it ran without
CUDA graphs. ``benchmarks/gpu_check.py`` can call :func:`cudagraph_check`. Exit code 1 when a
check fails, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

OPTIONS = {"offload": "all", "min_offload_bytes": 0}
_PARTITION = re.compile(r"^def (partition_\d+)\(args\):\n((?:[ \t]+.*\n|\n)*)", re.MULTILINE)


def ops_inside_partitions(code: str) -> dict[str, list[str]]:
    """The fxckpt ops each CUDA-graph partition function of ``code`` calls (should be none)."""
    found = {}
    for name, body in _PARTITION.findall(code):
        ops = re.findall(r"torch\.ops\.fxckpt\.(\w+)\.", body)
        if ops:
            found[name] = ops
    return found


def partition_count(code: str) -> int:
    return len(_PARTITION.findall(code))


def cudagraph_check(device: str = "cuda", steps: int = 3, mode: str | None = "reduce-overhead"
                    ) -> dict[str, Any]:
    """Train ``steps`` steps of a small decoder with fxckpt under ``mode`` (None: the default
    mode, no CUDA graphs) and eagerly; return what matched, what the generated code holds,
    and the last step's peak (``max_memory_allocated`` above the step's start)."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    import fxckpt
    from benchmarks.methods import Decoder, DecoderConfig, make_batch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = DecoderConfig("cudagraphs", vocab=512, d=128, heads=4, layers=4, ffn=512)
    torch.manual_seed(0)
    model = Decoder(cfg).to(device)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxckpt.backend(**OPTIONS), mode=mode)
    fxckpt.reset_stats()  # offloaded_bytes below counts this run's copies only
    skips_before = counters["inductor"]["cudagraph_skips"]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "mode": mode,
                              "torch": torch.__version__, "steps": []}  # fmt: skip
    codes: list[str] = []
    for i in range(steps):
        idx, tgt = make_batch(cfg, 4, 128, device, seed=i)
        torch.compiler.cudagraph_mark_step_begin()

        def train(idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            loss = compiled(idx, tgt)
            loss.backward()
            return loss.detach().clone()

        if i == 0:
            loss, codes = run_and_get_code(train, idx, tgt)
        else:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
            loss = train(idx, tgt)
            torch.cuda.synchronize(device)
            result["step_peak_bytes"] = torch.cuda.max_memory_allocated(device) - start
        want = reference(idx, tgt)
        want.backward()
        diffs = [(loss - want.detach()).abs().max().item()]
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None, name
            diffs.append((p.grad - q.grad).abs().max().item())
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
            p.grad = q.grad = None
        torch.testing.assert_close(loss, want.detach(), atol=1e-4, rtol=1e-3)
        result["steps"].append({"loss": loss.item(), "max_abs_diff": max(diffs)})
    result["partitions"] = [partition_count(code) for code in codes]
    result["ops_inside_partitions"] = [ops_inside_partitions(code) for code in codes]
    result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips_before
    result["offloaded_bytes"] = fxckpt.stats()["offloaded_bytes"]
    graphs = mode in ("reduce-overhead", "max-autotune")
    result["ok"] = (
        not any(result["ops_inside_partitions"])
        and (not graphs or all(n > 0 for n in result["partitions"]))
        and (not graphs or result["cudagraph_skips"] == 0)  # ran under CUDA graphs, all of it
        and result["offloaded_bytes"] > 0
    )
    return result


def run_cudagraph_checks(device: torch.device | str, compiler: str = "inductor"
                         ) -> tuple[list[str], dict[str, Any]]:
    """``gpu_check``'s entry: the failures of :func:`cudagraph_check` under
    ``mode="reduce-overhead"``, one line each (empty when every check passed), and the
    figures: that run's and the same run's without CUDA graphs, whose step peaks show what
    the static input buffers of the captured partitions cost (a restored tensor becomes an
    input of the next partition, and torch copies it into one).

    ``"max-autotune"`` captures the same CUDA graphs around the same partitions and adds
    minutes of kernel autotuning that gpu_check cannot afford. CUDA graphs are an Inductor
    feature, so ``compiler="eager"`` has nothing to check.
    """
    if compiler != "inductor":
        return [], {"skipped": "compiler='eager': CUDA graphs are Inductor's"}
    failures: list[str] = []
    figures: dict[str, Any] = {}
    for mode in ("reduce-overhead", None):
        name = mode or "default"
        try:
            result = cudagraph_check(str(device), mode=mode)
        except AssertionError as err:  # a gradient or the loss differs from eager
            failures.append(f"{name}: {str(err).splitlines()[0]}")
            continue
        figures[name] = {k: result[k] for k in ("partitions", "cudagraph_skips",
                                                "offloaded_bytes", "step_peak_bytes", "ok")}
        if not result["ok"]:
            failures.append(
                f"{name}: partitions {result['partitions']}, fxckpt ops inside captured "
                f"partitions {result['ops_inside_partitions']}, {result['cudagraph_skips']} "
                f"graphs run without CUDA graphs, offloaded {result['offloaded_bytes']} B"
            )
    if "reduce-overhead" in figures and "default" in figures:
        figures["step_peak_ratio"] = (figures["reduce-overhead"]["step_peak_bytes"]
                                      / max(figures["default"]["step_peak_bytes"], 1))
    return failures, figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mode", default="reduce-overhead",
                        choices=["reduce-overhead", "max-autotune"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_cudagraphs: no CUDA device", file=sys.stderr)
        return 2
    result = cudagraph_check(steps=args.steps, mode=args.mode)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
