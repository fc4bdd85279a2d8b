"""The conv case of the memory goal: a ResNet-shaped net under Inductor, where Inductor's
layout optimization lays convolutions out channels-last (the default for such widths on a
GPU, and always with mkldnn on the CPU).

    PYTHONPATH=. python benchmarks/conv_case.py --json conv_case.json [--compiler eager]

For each budget (0.5 and 0.3: that share of the way from the lowest plan's step peak to
plain compile's) it trains under fxckpt and measures, with fxckpt's meter (CUDA's
``memory_allocated`` on a GPU, the allocator's reports on the CPU; it never reads a plan),
what one forward leaves for the backward and the absolute peak of one whole step (what the
device held when it began, the model and the batch, plus the most it allocated: what
``memory_budget`` bounds). Verdicts: that step peak is at most plain ``torch.compile``'s (the
same compiler, without fxckpt), measured: a fraction is a share of the way down from it (the
plans' budget in bytes, ``plan_budget_bytes``, is in the planner's model, which does not see
what an op allocates inside itself, a convolution's workspace, so the record only shows it);
what the forward leaves is within 5 % of the plan's kept bytes; gradients are within the noise floor of plain
``torch.compile`` (eager against plain compile). :func:`run` is the entry point
``gpu_check.py`` calls; it returns one check record.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn as nn
import torch.nn.functional as F

BUDGETS = (0.5, 0.3)
__all__ = ["BUDGETS", "BasicBlock", "ConvBNNet", "ResNet", "run"]


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 conv + BatchNorm, and a 1x1 projection where the shape
    changes (torchvision's layout, written here: torchvision is not a test dependency)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """ResNet-shaped: a stem, then stages ``layer1``.. (each ``blocks`` basic blocks, the
    first of each later stage halving the resolution), pooling and a classifier; the loss
    is cross-entropy against ``labels``."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32, 64), blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        cin = widths[0]
        for i, w in enumerate(widths):
            stage = [BasicBlock(cin if j == 0 else w, w, 2 if i > 0 and j == 0 else 1) for j in range(blocks)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*stage))
            cin = w
        self.stages = len(widths)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return F.cross_entropy(logits, labels)


class ConvBNNet(nn.Module):
    """``depth`` x (Conv2d, BatchNorm2d, ReLU) at one width; the loss is the output's mean
    square."""

    def __init__(self, channels: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[
                nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
                for _ in range(depth)
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def _case(device: torch.device) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], torch.dtype]:
    """A ResNet-18-shaped net in bf16 on a GPU (widths 64..512: Inductor's heuristics keep
    layout optimization on), a narrow one in fp32 on the CPU."""
    cuda = device.type == "cuda"
    widths, batch, side = ((64, 128, 256, 512), 32, 64) if cuda else ((8, 16, 32, 64), 2, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = ResNet(widths, blocks=2).to(device=device, dtype=dtype).train()
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(batch, 3, side, side, generator=g, device=device, dtype=dtype)
    labels = torch.randint(0, 10, (batch,), generator=g, device=device)
    return model, (x, labels), dtype


# Steps after the first before measuring: a budget's step account measures one step whole
# and may plan again at the step after it.
WARM_STEPS = 2


def _step(model: nn.Module, backend: Any, inputs: tuple[torch.Tensor, torch.Tensor]
          ) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """Compile, train one step and keep its gradients, warm up, then measure one more forward
    (what it leaves for the backward) and one whole step, its gradients dropped first (its
    absolute peak); returns both measurements and the first step's gradients."""
    import fxckpt

    compiled = model if backend is None else torch.compile(model, backend=backend)
    model.zero_grad(set_to_none=True)
    compiled(*inputs).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    for _ in range(WARM_STEPS):
        model.zero_grad(set_to_none=True)
        compiled(*inputs).backward()
    model.zero_grad(set_to_none=True)
    m = fxckpt.measure(lambda: compiled(*inputs))
    m.output.backward()
    model.zero_grad(set_to_none=True)
    step = fxckpt.measure(lambda: compiled(*inputs).backward(), holding=(model, inputs))
    model.zero_grad(set_to_none=True)
    return m, step, grads


def run(device: torch.device | str, compiler: str = "inductor") -> dict[str, Any]:
    """The conv memory check on ``device``: ``{"status", "why", **figures}``, as
    ``gpu_check``'s report takes it."""
    import fxckpt
    from benchmarks import gpu_verdicts as v

    device = torch.device(device)
    base, inputs, dtype = _case(device)
    figures: dict[str, Any] = {"device": str(device), "dtype": str(dtype), "compiler": compiler}
    torch._dynamo.reset()
    eager_grads = _step(copy.deepcopy(base), None, inputs)[2]
    again = _step(copy.deepcopy(base), None, inputs)[2]
    plain, plain_step, plain_grads = _step(copy.deepcopy(base), "aot_eager", inputs)
    torch._dynamo.reset()
    compiled, compiled_step, compiled_grads = _step(
        copy.deepcopy(base), compiler if compiler != "eager" else "aot_eager", inputs)
    figures["aot_eager_held_bytes"] = plain.held_bytes
    figures["plain_compile_held_bytes"] = compiled.held_bytes
    figures["aot_eager_step_peak_bytes"] = plain_step.absolute_peak_bytes
    figures["plain_compile_step_peak_bytes"] = compiled_step.absolute_peak_bytes
    floor = v.noise_floor(v.grad_diffs(eager_grads, again), v.grad_diffs(eager_grads, compiled_grads))
    scale = v.grad_scale(eager_grads)
    failed: list[str] = []
    for budget in BUDGETS:
        torch._dynamo.reset()
        fxckpt.reset_stats()
        m, step, grads = _step(copy.deepcopy(base), fxckpt.backend(memory_budget=budget, compiler=compiler), inputs)
        plans = fxckpt.last_plans()
        kept = sum(p.kept_bytes for p in plans)
        # The step's budget in bytes (every plan of the step carries it), and the plans'
        # prediction of the step's absolute peak (each plan's ``step`` is the whole step's).
        limit = max((p.budget_bytes for p in plans if p.budget_bytes is not None), default=0)
        predicted = max((p.step["total_bytes"] for p in plans if p.step), default=None)
        ok, worst = v.within_floor(v.grad_diffs(eager_grads, grads), floor, scale)
        resident = v.memory_verdict(m.held_bytes, kept, reference=0)
        peak = step.absolute_peak_bytes
        row = {
            "held_bytes": m.held_bytes, "peak_bytes": m.peak_bytes, "plan_kept_bytes": kept,
            "step_start_bytes": step.start_bytes, "step_peak_bytes": peak,
            "plan_step_peak_bytes": predicted, "plan_budget_bytes": limit,
            "held_vs_aot_eager": m.held_bytes / max(plain.held_bytes, 1),
            "step_peak_vs_plain_compile": peak / max(compiled_step.absolute_peak_bytes, 1),
            "resident": resident, "gradients_ok": ok, "worst_gradient": worst,
            "layouts_kept": any("stay in their own layout" in n for p in plans for n in p.notes),
            "first_step_held_bytes": [g.get("held_bytes") for g in fxckpt.stats()["graphs"].values()],
        }  # fmt: skip
        figures[f"budget{budget}"] = row
        if peak > compiled_step.absolute_peak_bytes:
            failed.append(f"budget {budget}: step peak {peak} B > plain compile's "
                          f"{compiled_step.absolute_peak_bytes} B")
        if not resident["ok"]:
            failed.append(f"budget {budget}: held {resident['relative_error']:.1%} off the plan's kept bytes")
        if not ok:
            failed.append(f"budget {budget}: gradients outside the floor ({worst})")
    torch._dynamo.reset()
    return {"status": "failed" if failed else "passed", "why": "; ".join(failed), **figures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/conv_case.py", description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", default="conv_case.json")
    p.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    record = run(args.device, args.compiler)
    Path(args.json).write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(json.dumps({k: record[k] for k in ("status", "why")}), f"-> {args.json}")
    return 0 if record["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
