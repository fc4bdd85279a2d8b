"""Long context under a memory budget: fxckpt fits sequence lengths plain torch.compile cannot.

    python examples/long_context.py --budget 64MiB [--seq-start 512] [--max-seq 0]

A decoder is trained one step at growing sequence lengths (doubling from ``--seq-start``).
At each length the script compiles it twice: plain (torch's own min-cut partitioner) and
fxckpt with ``memory_budget=--budget``, and measures the absolute device peak of a warm
training step of each (what the device held when it started, the weights and the batch, plus
the most it allocated), with ``fxckpt.measure`` (the allocator's figures, not a plan's); beside
fxckpt's, its plan's prediction of that peak.

A length *fits* when that peak is within the budget. The script stops at the first length
where fxckpt cannot meet the budget (``fxckpt.BudgetError``), at ``--max-seq``, or (the
default) when the next length would not fit this machine's free memory, and reports the
longest length fxckpt fits that plain compile does not. On a CPU-only machine "device" and
"host" are the same RAM, so the budget stands in for a GPU's memory; on CUDA the same run
measures real device bytes.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxckpt
from fxckpt.options import parse_bytes


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), targets.flatten())


@dataclass
class Measurement:
    seq: int
    budget: int
    plain_saved: int  # plain compile's measured step peak
    fxckpt_resident: int | None  # fxckpt's measured step peak; None: no plan fits the budget
    fxckpt_peak: int | None  # the step peak fxckpt's plan predicts
    offloaded: int = 0
    recomputed: int = 0
    max_grad_diff: float = math.nan
    loss_diff: float = math.nan

    @property
    def plain_fits(self) -> bool:
        return self.plain_saved <= self.budget

    @property
    def fxckpt_fits(self) -> bool:
        return self.fxckpt_resident is not None and self.fxckpt_resident <= self.budget


def step_peak(compiled: Any, model: nn.Module, *args: Any) -> int:
    """The absolute device peak of one more (warm) training step, measured by
    ``fxckpt.measure`` from the allocator (no plan is read): what the device held when the step
    started (weights, batch) plus the most it allocated."""
    model.zero_grad(set_to_none=True)
    m = fxckpt.measure(lambda: compiled(*args).backward(), holding=(model, args))
    return m.absolute_peak_bytes


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def measure(
    base: nn.Module,
    seq: int,
    budget: int,
    *,
    batch: int,
    compiler: str,
    plain_backend: Any,
    min_offload_bytes: int | str | None = None,
) -> Measurement:
    """One training step at ``seq`` under plain compile and under fxckpt with ``budget``."""
    device = next(base.parameters()).device
    g = torch.Generator().manual_seed(seq)
    idx = torch.randint(0, base.head.out_features, (batch, seq), generator=g).to(device)
    tgt = torch.roll(idx, -1, 1)

    torch._dynamo.reset()
    plain_model = copy.deepcopy(base)
    plain = torch.compile(plain_model, backend=plain_backend)
    plain_loss = plain(idx, tgt)
    plain_loss.backward()
    plain_grads = _grads(plain_model)
    plain_saved = step_peak(plain, plain_model, idx, tgt)
    del plain_model, plain

    torch._dynamo.reset()
    fxckpt.reset_stats()
    model = copy.deepcopy(base)
    options: dict[str, Any] = {"memory_budget": budget, "compiler": compiler}
    if min_offload_bytes is not None:  # otherwise the library's default (and its relaxation)
        options["min_offload_bytes"] = min_offload_bytes
    compiled = torch.compile(model, backend="fxckpt", options=options)
    try:
        loss = compiled(idx, tgt)
        loss.backward()
        grads = _grads(model)
        # The budget's verdict comes once the step's graphs and what eager code holds are
        # known: a step or two after the first.
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            compiled(idx, tgt).backward()
        resident = step_peak(compiled, model, idx, tgt)
    except Exception as err:  # a BudgetError, maybe wrapped by dynamo: look in the chain
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, fxckpt.BudgetError):
            cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
        if cause is None:
            raise
        return Measurement(seq, budget, plain_saved, None, None)
    plans = fxckpt.last_plans()
    diff = max((grads[n] - plain_grads[n]).abs().max().item() for n in plain_grads)
    return Measurement(
        seq,
        budget,
        plain_saved,
        resident,
        max(((p.step or {}).get("total_bytes", 0) for p in plans), default=0),
        offloaded=sum(p.offloaded_bytes for p in plans),
        recomputed=sum(p.recomputed_bytes for p in plans),
        max_grad_diff=diff,
        loss_diff=(loss - plain_loss).abs().item(),
    )


def _machine_fits(last: Measurement, device: str) -> bool:
    """Whether twice the last length should still fit the machine: a step's peak at least
    doubles, and the machine holds it about three times over (plain's, fxckpt's host copies)."""
    need = 3 * 2 * last.plain_saved
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        try:
            with open("/proc/meminfo") as f:  # MemAvailable counts reclaimable page cache too
                free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            pass
    return need <= free // 2


def _mib(n: int | None) -> str:
    return "   n/a" if n is None else f"{n / 2**20:8.2f}"


def run(argv: list[str] | None = None) -> list[Measurement]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="64MiB",
                        help="memory_budget: the step's device peak, weights and batch included")
    parser.add_argument("--seq-start", type=int, default=512)
    parser.add_argument(
        "--max-seq", type=int, default=0,
        help="stop after this length; 0: when the next length would not fit this machine's memory",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument(
        "--min-offload-bytes", default=None,
        help="fxckpt's min_offload_bytes (default: the library's own, which prices each copy instead)",
    )
    default_compiler = "inductor" if torch.cuda.is_available() else "eager"
    parser.add_argument("--compiler", choices=["eager", "inductor"], default=default_compiler)
    args = parser.parse_args(argv)
    budget = parse_bytes(args.budget, "--budget")
    assert budget is not None
    # Plain compile: torch's min-cut partitioner, with the same code generation as fxckpt's.
    plain_backend = "inductor" if args.compiler == "inductor" else "aot_eager_decomp_partition"

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    base = Decoder(d=args.d, layers=args.layers).to(device)
    print(f"decoder: {args.layers} layers, d={args.d}, batch {args.batch}, on {device}; "
          f"budget {args.budget} = {budget} B; compiler {args.compiler} (plain: {plain_backend})")
    print(f"{'seq':>7} {'plain peak MiB':>16} {'fxckpt peak MiB':>20} {'predicted MiB':>16} "
          f"{'offloaded MiB':>14} {'recomputed MiB':>15} {'plain':>6} {'fxckpt':>7}")
    results = []
    seq = args.seq_start
    while args.max_seq == 0 or seq <= args.max_seq:
        if results and not _machine_fits(results[-1], device):
            print(f"{seq:7d}  stop: the next length would not fit this machine's free memory")
            break
        m = measure(
            base, seq, budget, batch=args.batch, compiler=args.compiler,
            plain_backend=plain_backend, min_offload_bytes=args.min_offload_bytes,
        )
        results.append(m)
        print(f"{seq:7d} {_mib(m.plain_saved):>16} {_mib(m.fxckpt_resident):>20} {_mib(m.fxckpt_peak):>16} "
              f"{_mib(m.offloaded):>14} {_mib(m.recomputed):>15} {'fits' if m.plain_fits else 'over':>6} "
              f"{'fits' if m.fxckpt_fits else 'over':>7}")
        if not m.fxckpt_fits:
            break
        seq *= 2
    best = [m for m in results if m.fxckpt_fits and not m.plain_fits]
    if best:
        m = best[-1]
        print(f"\nlongest length fxckpt fits and plain compile does not: {m.seq} tokens; "
              f"plain's step peaks at {_mib(m.plain_saved).strip()} MiB > budget {_mib(budget).strip()} "
              f"MiB >= fxckpt's {_mib(m.fxckpt_resident).strip()} MiB "
              f"(predicted {_mib(m.fxckpt_peak).strip()} MiB, {_mib(m.offloaded).strip()} MiB offloaded, "
              f"{_mib(m.recomputed).strip()} MiB recomputed); "
              f"loss diff {m.loss_diff:.2e}, max grad diff {m.max_grad_diff:.2e}")
    else:
        print("\nno length where fxckpt fits and plain compile does not; raise --max-seq or lower --budget")
    return results


if __name__ == "__main__":
    run()
