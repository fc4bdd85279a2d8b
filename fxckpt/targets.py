"""Link targets: a model on a GPU over a host link, and the copy-to-compute ratio per block
that fxckpt's cost model predicts for it.

A target's ratio is ``(saved bytes per block / link bandwidth) / forward ms per block``: how
much longer (or shorter) copying one block's saved activations to the host takes than
computing that block's forward, the window those copies must hide in. It is computed offline:
a few of the target model's blocks are traced on the ``meta`` device, torch's min-cut picks
what they save, and fxckpt's cost model (``graph/costs.py``, at the target GPU's rates) prices
their forward. :func:`derive` then gives the bandwidth at which another model, on this
machine, has the same ratio: what ``fxckpt.emulate_link(target=..., model=..., inputs=...)``
emulates.

    python -m fxckpt.targets            # every target's figures and ratio
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fxckpt import _torch_compat as compat
from fxckpt.errors import OptionsError
from fxckpt.graph.costs import Rates, device_rates


@dataclass(frozen=True)
class Gpu:
    """A GPU and its host link, as the cost model prices them."""

    name: str
    flops_per_s: float  # dense bf16 tensor-core peak
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # host link, each direction, as measured for pinned memory
    copy_overhead_ms: float  # per copy: the op's dispatch and one cudaMemcpyAsync
    source: str

    @property
    def rates(self) -> Rates:
        return Rates(self.flops_per_s / 1e3, self.hbm_bytes_per_s / 1e3)


@dataclass(frozen=True)
class Target:
    name: str
    gpu: Gpu
    model: str  # what the traced blocks stand for
    build: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]

    def build_on_meta(self) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        with torch.device("meta"):
            return self.build()


def _qwen3_8b_32k() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from fxckpt._target_models import QwenStack

    # Qwen3-8B's config.json: hidden 4096, 32 heads (8 KV) of 128, intermediate 12288.
    model = QwenStack(layers=3, d=4096, heads=32, kv_heads=8, head_dim=128, ffn=12288)
    x = torch.empty(1, 32768, 4096, dtype=torch.bfloat16, requires_grad=True)
    return model.to(torch.bfloat16), (x,)


def _flux_dit_1024() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from fxckpt._target_models import DiTStack

    # FLUX.1's transformer widths (3072, 24 heads of 128, MLP 4x) at 1024x1024: 64x64 latent
    # patches (4096 tokens) plus 512 text tokens.
    model = DiTStack(layers=3, d=3072, heads=24, mlp=12288)
    x = torch.empty(1, 4608, 3072, dtype=torch.bfloat16, requires_grad=True)
    c = torch.empty(1, 3072, dtype=torch.bfloat16)
    return model.to(torch.bfloat16), (x, c)


H200_PCIE5 = Gpu(
    "H200 over PCIe Gen5 x16", flops_per_s=989e12, hbm_bytes_per_s=4.8e12,
    link_bytes_per_s=55e9, copy_overhead_ms=0.01,
    source="NVIDIA H200 datasheet (989 TFLOP/s dense bf16, 4.8 TB/s); ~53-55 GB/s pinned D2H "
           "measured on Gen5 x16 (nvbandwidth)",
)  # fmt: skip
RTX4090_PCIE4 = Gpu(
    "24 GB consumer card (RTX 4090) over PCIe Gen4 x16", flops_per_s=165e12,
    hbm_bytes_per_s=1.0e12, link_bytes_per_s=25e9, copy_overhead_ms=0.01,
    source="RTX 4090: 165 TFLOP/s dense bf16 with fp32 accumulation, 1.0 TB/s GDDR6X; "
           "PCIe Gen4 x16 ~25 GB/s pinned each way",
)  # fmt: skip

TARGETS: dict[str, Target] = {
    "h200-pcie5": Target("h200-pcie5", H200_PCIE5,
                         "Qwen3-8B-shaped decoder layers, 32k tokens, bf16", _qwen3_8b_32k),
    "consumer24-pcie4": Target("consumer24-pcie4", RTX4090_PCIE4,
                               "FLUX.1-shaped diffusion-transformer blocks, 1024x1024 "
                               "(4608 tokens), bf16 (SimpleTuner's users)", _flux_dit_1024),
}


@dataclass(frozen=True)
class BlockFigures:
    """One model's repeated blocks, priced by the cost model: per block, on average."""

    blocks: int
    saved_bytes: float  # what plain min-cut saves for the backward, one count per storage
    forward_ms: float
    backward_ms: float  # the whole backward graph's, shared out over the blocks

    def ratio(self, link_bytes_per_s: float, overhead_ms: float = 0.0) -> float:
        """Copy time of one block's saved bytes over its forward time."""
        return (overhead_ms + 1e3 * self.saved_bytes / link_bytes_per_s) / self.forward_ms


def block_figures(model: nn.Module, inputs: tuple[Any, ...], rates: Rates, *,
                  meta: bool) -> BlockFigures:
    """Trace one training step of ``model`` through AOTAutograd and torch's min-cut, and price
    its repeated blocks at ``rates``. ``meta``: the model and inputs live on ``meta`` (a GPU
    stands behind them: attention takes a GPU's kernels); otherwise one real forward runs."""
    from fxckpt._torch_compat import aot_autograd, boxed_nop, min_cut_rematerialization_partition
    from fxckpt.graph.activations import saved_activations
    from fxckpt.graph.blocks import find_blocks
    from fxckpt.graph.costs import node_cost_ms

    got: dict[str, float] = {}

    def partition(joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        blocks = find_blocks(joint)
        if not blocks.blocks:
            raise OptionsError("model", type(model).__name__,
                               "a model with repeated blocks (a ModuleList of layers)")
        saved = saved_activations(fw, bw, kwargs["num_fwd_outputs"], blocks)
        seen: dict[str, int] = {}
        for a in saved:
            if a.block is not None:
                seen.setdefault(a.storage, a.bytes)
        fw_ms = sum(node_cost_ms(n, "flops", "meta", rates) for n in fw.graph.nodes
                    if n.op == "call_function" and blocks.block_of(n) is not None)
        bw_ms = sum(node_cost_ms(n, "flops", "meta", rates) for n in bw.graph.nodes
                    if n.op == "call_function")
        got.update(blocks=len(blocks.blocks), saved=sum(seen.values()), fw=fw_ms, bw=bw_ms)
        return fw, bw

    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition)
    compat.reset_dynamo()
    try:
        from fxckpt.inspect import offline_dispatch

        with offline_dispatch() if meta else contextlib.nullcontext():
            torch.compile(model, backend=backend, dynamic=False)(*inputs)
    finally:
        compat.reset_dynamo()
    if "blocks" not in got:
        raise OptionsError("model", type(model).__name__, "a model whose forward has a loss "
                           "to differentiate (one graph, no graph break before it)")
    n = got["blocks"]
    return BlockFigures(int(n), got["saved"] / n, got["fw"] / n, got["bw"] / n)


@dataclass(frozen=True)
class Derivation:
    """The emulated link that gives a model, here, a target's copy-to-compute ratio."""

    target: Target
    target_figures: BlockFigures
    target_ratio: float
    model_figures: BlockFigures
    model_forward_ms: float  # per block, what the bandwidth is scaled to
    forward_source: str  # "cost model" or "measured"
    bandwidth: float  # bytes/s each way
    overhead_ms: float

    @property
    def compute_scale(self) -> float:
        """This model's forward here over the cost model's estimate of it: what the planner
        scales its compute estimates by under this link."""
        return self.model_forward_ms / self.model_figures.forward_ms

    def describe(self) -> str:
        t, m = self.target_figures, self.model_figures
        return "\n".join([
            f"target {self.target.name}: {self.target.model} on {self.target.gpu.name}",
            f"  per block: {t.saved_bytes / 2**30:.2f} GiB saved, forward {t.forward_ms:.2f} ms "
            f"(cost model at {self.target.gpu.flops_per_s / 1e12:.0f} TFLOP/s, "
            f"{self.target.gpu.hbm_bytes_per_s / 1e12:.1f} TB/s); copy at "
            f"{self.target.gpu.link_bytes_per_s / 1e9:.0f} GB/s: "
            f"{1e3 * t.saved_bytes / self.target.gpu.link_bytes_per_s:.2f} ms",
            f"  copy-to-compute ratio per block: {self.target_ratio:.3f}",
            f"this model: {m.blocks} blocks, per block {m.saved_bytes / 2**20:.2f} MiB saved, "
            f"forward {self.model_forward_ms:.2f} ms ({self.forward_source}; cost model "
            f"{m.forward_ms:.2f} ms, so the planner's compute is scaled by "
            f"{self.compute_scale:.3g})",
            f"  emulated link: {self.bandwidth / 1e6:.1f} MB/s each way, "
            f"{self.overhead_ms:.4f} ms per copy -> ratio {self.target_ratio:.3f}",
        ])


def target(name: str) -> Target:
    if name not in TARGETS:
        raise OptionsError("target", name, "one of " + ", ".join(repr(k) for k in TARGETS))
    return TARGETS[name]


def target_figures(name: str) -> tuple[BlockFigures, float]:
    """The target's figures per block and its copy-to-compute ratio (cached per process)."""
    if name not in _CACHE:
        t = target(name)
        model, inputs = t.build_on_meta()
        figs = block_figures(model, inputs, t.gpu.rates, meta=True)
        _CACHE[name] = (figs, figs.ratio(t.gpu.link_bytes_per_s, t.gpu.copy_overhead_ms))
    return _CACHE[name]


_CACHE: dict[str, tuple[BlockFigures, float]] = {}


def derive(name: str, model: Any, inputs: Any, *, forward_ms: float | None = None
           ) -> Derivation:
    """The link that gives ``model`` (called as ``model(*inputs)``, returning its loss) the
    copy-to-compute ratio of target ``name``. ``forward_ms``: ``model``'s forward time per
    block as measured here; without it the cost model's CPU estimate stands in."""
    t = target(name)
    if not isinstance(model, nn.Module):
        raise OptionsError("model", model, "an nn.Module whose forward returns the loss")
    if inputs is None:
        raise OptionsError("inputs", inputs, "the model's example inputs, a tuple of tensors")
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    figs, ratio = target_figures(name)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    mine = block_figures(model, inputs, device_rates(device), meta=device.type == "meta")
    fwd = mine.forward_ms if forward_ms is None else float(forward_ms)
    if not fwd > 0:
        raise OptionsError("forward_ms", forward_ms, "a positive number of milliseconds")
    # Same ratio: saved / bandwidth = ratio * forward (the overhead scales with compute).
    overhead_ms = t.gpu.copy_overhead_ms * fwd / figs.forward_ms
    copy_ms = ratio * fwd - overhead_ms
    bandwidth = 1e3 * mine.saved_bytes / max(copy_ms, 1e-9)
    return Derivation(t, figs, ratio, mine, fwd, "cost model" if forward_ms is None else
                      "measured", bandwidth, overhead_ms)


def main(argv: list[str] | None = None) -> int:
    """Print every target's figures and ratio."""
    for name, t in TARGETS.items():
        start = time.perf_counter()
        figs, ratio = target_figures(name)
        print(f"{name}: {t.model} on {t.gpu.name}\n"
              f"  per block: {figs.saved_bytes / 2**30:.3f} GiB saved by min-cut, forward "
              f"{figs.forward_ms:.2f} ms, backward {figs.backward_ms:.2f} ms "
              f"(fxckpt's cost model at the GPU's rates)\n"
              f"  copy per block at {t.gpu.link_bytes_per_s / 1e9:.0f} GB/s: "
              f"{1e3 * figs.saved_bytes / t.gpu.link_bytes_per_s:.2f} ms; copy-to-compute "
              f"ratio {ratio:.3f}  [{time.perf_counter() - start:.1f} s]\n"
              f"  rates: {t.gpu.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
