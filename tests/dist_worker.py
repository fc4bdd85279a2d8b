"""One rank of a distributed fxckpt check, launched by test_distributed.py through torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_worker.py CASE OUT

CASE is ``ddp``, ``fsdp2`` (the whole model compiled) or ``fsdp2_blocks`` (each block
compiled on its own, fxckpt told its index with ``block_index``). Each rank trains the same tiny GPT for two steps (SGD in
between) twice: compiled with fxckpt, then compiled with ``aot_eager``, and compares the losses
and every gradient with ``torch.testing.assert_close``; a mismatch fails the rank and torchrun.
Rank 0 writes what the plans did to OUT (JSON), for the test to check.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from models import GPT, gpt_inputs  # noqa: E402

import fxckpt  # noqa: E402

STRIDE, WIDTH = 2, 1  # blocks 0 and 2 are segments, 1 and 3 are not
BLOCKS = r"layers\.\d+$"  # a graph may hold a single block: name them (auto needs two)


OPTIONS: dict[str, Any] = {
    "compiler": "eager",
    "segment_stride": STRIDE,
    "segment_width": WIDTH,
    "offload": "all",
    "min_offload_bytes": 0,
    "blocks": BLOCKS,
}


def _backend(case: str, block: int | None) -> Any:
    """fxckpt's backend for the whole model (``block`` None) or for one block of it."""
    if block is None:
        return fxckpt.backend(**OPTIONS)
    return fxckpt.backend(**{k: v for k, v in OPTIONS.items() if k != "blocks"}, block_index=block)


def _wrap(case: str, model: torch.nn.Module) -> torch.nn.Module:
    if case == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # DDP's graph splitting (optimize_ddp) cuts one graph per ~1 MiB gradient bucket; the
        # first bucket is at least 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES).
        return DDP(model, bucket_cap_mb=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _grads(case: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        if case.startswith("fsdp2"):
            g = g.full_tensor()  # DTensor shards -> the whole gradient on every rank
        out[name.removeprefix("module.")] = g.detach().clone()
    return out


def _train(case: str, base: torch.nn.Module, reference: bool) -> list[tuple[torch.Tensor, dict]]:
    """Two steps with fxckpt, or with aot_eager where ``reference``."""
    torch._dynamo.reset()
    fxckpt.reset_stats()
    model = _wrap(case, copy.deepcopy(base))
    if case == "fsdp2_blocks":
        # torchtitan's recipe: compile each block, leave the root eager. Each block gets a
        # backend of its own, so dynamo keeps one graph per block instead of sharing one.
        for i, layer in enumerate(model.layers):  # type: ignore[union-attr,arg-type]
            layer.compile(backend="aot_eager" if reference else _backend(case, i))
        compiled = model
    else:
        compiled = torch.compile(model, backend="aot_eager" if reference else _backend(case, None))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for step in range(2):
        idx, tgt = gpt_inputs(seed=10 * step + dist.get_rank())  # each rank its own batch
        opt.zero_grad(set_to_none=True)
        loss = compiled(idx, tgt)
        loss.backward()
        results.append((loss.detach(), _grads(case, model)))
        opt.step()
    return results


def main(case: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # two ranks share the machine's cores
    torch.manual_seed(0)
    # DDP needs > 1 MiB of gradients per block to split per block; FSDP2 does not.
    base = GPT(d=128, heads=4, n_layers=4) if case == "ddp" else GPT(d=32, n_layers=4)
    got = _train(case, base, reference=False)
    plans = fxckpt.last_plans()
    stats = fxckpt.stats()
    want = _train(case, base, reference=True)
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want, strict=True):
        torch.testing.assert_close(loss, ref_loss)
        assert grads.keys() == ref_grads.keys() and grads, sorted(grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, msg=lambda m, n=name: f"{n}: {m}")
    if dist.get_rank() == 0:
        report = {
            "world_size": dist.get_world_size(),
            "losses": [float(loss) for loss, _ in got],
            "stats": stats,
            "plans": [
                {
                    "name": p.name,
                    "notes": p.notes,
                    "rows": [
                        {"block": r.block, "decision": r.decision.kind, "bytes": r.bytes}
                        for r in p.activations
                    ],
                }
                for p in plans
            ],
        }
        Path(out).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    main(sys.argv[1], sys.argv[2])
