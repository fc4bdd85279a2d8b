"""Train a small GPT with ``backend="fxckpt"`` and print the plan and the memory it saved.

    python examples/quickstart.py [--steps 5] [--budget 0.5] [--offload auto]

The same model is first trained with plain ``torch.compile`` (Inductor), and its step's
absolute device peak is measured by ``fxckpt.measure`` (the allocator's figures, not a plan's).
fxckpt then trains it under ``memory_budget`` = ``--budget`` of that peak, in bytes (or the
bytes ``--budget`` gives, such as ``"40MiB"``), and its step's peak is measured the same way.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxckpt


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


class GPT(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 128, heads: int = 4, layers: int = 8) -> None:
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


def step_peak(compiled, model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> int:
    """The absolute device peak of one warm training step (forward and backward), measured by
    ``fxckpt.measure`` from the allocator: what the device held when it started (weights,
    optimizer state, the batch) plus the most it allocated. No plan is read."""
    model.zero_grad(set_to_none=True)
    m = fxckpt.measure(lambda: compiled(idx, tgt).backward(), holding=(model, idx, tgt))
    return m.absolute_peak_bytes


def train(compiled, opt, steps: int, data) -> tuple[list[float], float]:
    """Train ``steps`` steps; returns the losses and the mean time of the steps after the
    first, whose backward compiles the backward graph (compiled lazily, at first use)."""
    losses, times = [], []
    for idx, tgt in data[:steps]:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = compiled(idx, tgt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    timed = times[1:] or times
    return losses, sum(timed) / len(timed)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stride", type=int, default=None,
                        help="segment_stride (default: unset, the planner chooses)")
    parser.add_argument("--budget", default="0.5",
                        help="memory_budget: a share of plain torch.compile's measured step "
                             "peak, such as 0.5, or bytes such as '40MiB'")
    parser.add_argument("--offload", default="auto", choices=["auto", "never", "all"])
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT()
    baseline_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(args.steps):
        idx = torch.randint(0, 512, (4, args.seq), generator=g)
        data.append((idx, torch.roll(idx, -1, 1)))

    mib = 2**20
    plain = torch.compile(baseline_model)
    pl_losses, pl_step = train(plain, torch.optim.SGD(baseline_model.parameters(), lr=0.1),
                               args.steps, data)
    plain_peak = step_peak(plain, baseline_model, *data[0])  # warm: compiled by now
    budget: object = args.budget
    try:
        budget = int(float(args.budget) * plain_peak) if "." in args.budget else int(args.budget)
    except ValueError:
        pass  # a byte string such as "40MiB"; fxckpt parses it

    options: dict[str, object] = {"memory_budget": budget, "offload": args.offload}
    if args.stride is not None:
        options["segment_stride"] = args.stride
    print(f"fxckpt {fxckpt.__version__}, torch {torch.__version__}; options {options}")
    untrained = copy.deepcopy(model)
    try:
        fx_model = torch.compile(model, backend="fxckpt", options=options)
        fx_losses, fx_step = train(fx_model, torch.optim.SGD(model.parameters(), lr=0.1), args.steps, data)
        fx_peak = step_peak(fx_model, model, *data[0])
    except fxckpt.BudgetError as err:  # no plan fits: the error names the smallest that does
        print(f"{err.summary.split(': ', 1)[1]}\ntraining again under memory_budget={err.smallest_bytes}")
        budget = options["memory_budget"] = err.smallest_bytes
        torch._dynamo.reset()
        fxckpt.reset_stats()
        model = untrained
        fx_model = torch.compile(model, backend="fxckpt", options=options)
        fx_losses, fx_step = train(fx_model, torch.optim.SGD(model.parameters(), lr=0.1), args.steps, data)
        fx_peak = step_peak(fx_model, model, *data[0])

    for plan in fxckpt.last_plans():
        print(plan.summary())
        counts: dict[str, int] = {}
        for row in plan.activations:
            counts[row.decision.kind] = counts.get(row.decision.kind, 0) + 1
        print("  decisions:", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        shown: set[str] = set()
        for row in plan.activations:  # one example of each decision
            if row.decision.kind not in shown:
                shown.add(row.decision.kind)
                print(f"  {row.name:<14} {row.module or '-':<16} {row.bytes:>9} B  {row.decision.reason}")
    print(f"losses  fxckpt {' '.join(f'{v:.4f}' for v in fx_losses)}")
    print(f"losses  plain  {' '.join(f'{v:.4f}' for v in pl_losses)}")
    limit = fxckpt.Options(memory_budget=budget).resolve_budget()
    print(
        f"step peak (measured, weights and batch included): plain torch.compile "
        f"{plain_peak / mib:.2f} MiB, fxckpt {fx_peak / mib:.2f} MiB "
        f"({100 * (1 - fx_peak / plain_peak):.0f}% less), under memory_budget "
        f"{(limit or 0) / mib:.2f} MiB"
    )
    print(f"step time after the first: fxckpt {fx_step * 1e3:.0f} ms, plain {pl_step * 1e3:.0f} ms")
