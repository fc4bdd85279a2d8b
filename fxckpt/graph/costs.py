"""FLOPs, bandwidth and the cost models that turn an FX node into estimated milliseconds.

Nothing here runs at import: bandwidth is measured on first use and cached per process.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fxckpt._torch_compat import flop_formula
from fxckpt.graph.sizes import concrete

if TYPE_CHECKING:
    import torch
    import torch.fx

# Sustained rates for the "flops" model, in FLOPs per millisecond. Deliberately below peak:
# a recomputed op runs alone, without the fusion and overlap of the original step.
DEFAULT_CPU_FLOPS_PER_MS = 1e8  # ~100 GFLOP/s, a few cores of a server CPU
DEFAULT_CUDA_FLOPS_PER_MS = 1e11  # ~100 TFLOP/s, well below an H100's bf16 dense peak
# Memory traffic bounds the ops FlopCounterMode gives no FLOPs (elementwise, norms, softmax):
# without it their recompute would look free.
DEFAULT_CPU_BYTES_PER_MS = 1e7  # ~10 GB/s
DEFAULT_CUDA_BYTES_PER_MS = 2e9  # ~2 TB/s of HBM
DEFAULT_PCIE_BYTES_PER_MS = 2.5e7  # ~25 GB/s host<->device, a derated PCIe Gen5 x16 link

# Host time the compute thread spends per offloaded tensor, in ms: four runtime-op calls
# (offload, offload_done, prefetch, wait) and two hand-offs to the copy engine. The copies hide
# behind compute; this does not, so the planner pays it per offload instead of excluding small
# tensors with a fixed threshold. "cpu": the CPU engine (worker threads), measured by
# ``python -m benchmarks.copy_overhead`` (0.40-0.56 ms per 64 KiB round trip on two loaded
# cores). "cuda": an estimate until ``benchmarks/copy_overhead.py`` runs on a GPU: four Python
# custom-op dispatches (~10-20 us each) plus two cudaMemcpyAsync calls (~5-7 us each,
# HOST_MEMORY_NOTES) and their events. Offline plans (meta) price a GPU's engine.
COPY_OVERHEAD_MS = {"cpu": 0.5, "cuda": 0.1}

# The planner places and prices copies as if they took this much longer than the link's
# figures say: compute runs faster or slower than its estimate (another process's load, a
# kernel the cost model misjudges) and a link delivers less than its probe (torchtitan saw
# 32 GB/s in steps against 52 benchmarked). Through an emulated link at an H200's ratio,
# plans made without it stalled up to 2.8 % of a step where they said "hidden"; with it,
# the same offloads and no stall (benchmarks/gpu_shaped.py, docs/benchmarks.md).
COPY_MARGIN = 0.5

_COPY_BYTES = 64 * 2**20
_VIEW_METHODS = frozenset({"view", "reshape", "expand", "permute", "transpose", "t",
                           "squeeze", "unsqueeze", "flatten", "unflatten", "narrow",
                           "as_strided", "view_as", "expand_as", "contiguous", "detach"})


def _aten_target(node: torch.fx.Node) -> Any:
    return node.target if hasattr(node.target, "_schema") else None


def is_view_like(node: torch.fx.Node) -> bool:
    """True for nodes that alias an input instead of computing: views and ``getitem``."""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    target = _aten_target(node)
    return bool(target is not None and getattr(target, "is_view", False))


def is_random(node: torch.fx.Node) -> bool:
    """True for ops whose result depends on the RNG state: never recompute these."""
    if node.op != "call_function":
        return False
    import torch

    target = _aten_target(node)
    if target is not None and torch.Tag.nondeterministic_seeded in getattr(target, "tags", ()):
        return True
    name = str(getattr(node.target, "__name__", node.target)).lower()
    # rngprims.philox_rand, higher_order.run_and_save_rng_state / run_with_rng_state, ...
    return "rng" in name or "philox" in name


def _is_compute(node: torch.fx.Node) -> bool:
    return node.op in ("call_function", "call_method", "call_module") and not is_view_like(node)


def _meta_args(node: torch.fx.Node, make: Callable[[Any], Any]) -> tuple[tuple, dict] | None:
    """``node``'s args with every input node replaced by ``make(its meta['val'])``."""
    import torch

    missing = False

    def val(n: torch.fx.Node) -> Any:
        nonlocal missing
        v = n.meta.get("val")
        if v is None:
            missing = True
        return make(v) if isinstance(v, torch.Tensor) else v

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), val)  # type: ignore[misc]
    return None if missing else (tuple(args), dict(kwargs))


def _on_meta(v: Any) -> Any:
    """FakeTensors count as they are; real tensors become meta tensors so nothing runs."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(v, FakeTensor) or v.device.type == "meta":
        return v
    return v.new_empty_strided(v.shape, v.stride(), device="meta")


def node_flops(node: torch.fx.Node) -> float:
    """FLOPs of one ``call_function`` node, by ``FlopCounterMode``'s formulas on its fake
    inputs.

    An aten op is priced by its registered formula called on the node's ``meta["val"]``s,
    without running the op (most ops have none and count 0, as under ``FlopCounterMode``);
    anything else (higher-order ops, nodes without an output ``val``) runs under
    ``FlopCounterMode`` on fake or meta inputs.
    Returns 0.0 for views, ``getitem``, nodes whose inputs lack ``meta["val"]``, and anything
    that fails (e.g. a guard on a symbolic size).
    """
    if node.op != "call_function" or not _is_compute(node):
        return 0.0
    import torch

    formula = flop_formula(node.target)
    if formula is None and isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    try:
        out = node.meta.get("val")
        if formula is not None and out is not None:
            got = _meta_args(node, lambda v: v)
            if got is None:
                return 0.0
            count = formula(*got[0], **got[1], out_val=out)
        else:
            count = _counted_flops(node)
            if count is None:
                return 0.0
        # With symbolic sizes the count is a SymInt; float() on it would install a guard
        # (dynamo then recompiles the graph for every new length). Take its planning value.
        return float(concrete(count, 0))
    except Exception:
        return 0.0


def _counted_flops(node: torch.fx.Node) -> Any:
    """Run ``node`` under ``FlopCounterMode`` on meta or fake inputs."""
    from torch.utils.flop_counter import FlopCounterMode

    got = _meta_args(node, _on_meta)
    if got is None:
        return None
    with FlopCounterMode(display=False) as counter:
        node.target(*got[0], **got[1])  # type: ignore[operator]
    return counter.get_total_flops()


@dataclass(frozen=True)
class Rates:
    """What the ``"flops"`` model prices a node with: compute and memory-traffic rates."""

    flops_per_ms: float
    bytes_per_ms: float


def device_rates(device: Any) -> Rates:
    """The default rates of ``device``'s type (meta stands for a GPU)."""
    kind = device if isinstance(device, str) else getattr(device, "type", str(device))
    if _gpu_like(str(kind)):
        return Rates(DEFAULT_CUDA_FLOPS_PER_MS, DEFAULT_CUDA_BYTES_PER_MS)
    return Rates(DEFAULT_CPU_FLOPS_PER_MS, DEFAULT_CPU_BYTES_PER_MS)


def planning_rates(device: Any) -> tuple[Rates, str]:
    """The rates the planner prices compute with on ``device``, and their source: the
    defaults, or (CPU, under an emulated link derived from a target) the defaults scaled to
    this machine's measured compute, ``"emulated"``."""
    from fxckpt import _link

    rates = device_rates(device)
    name = device if isinstance(device, str) else str(device)
    link = _link.spec() if name.startswith("cpu") else None
    if link is None or link.compute_scale == 1.0:
        return rates, "default"
    scale = link.compute_scale
    return Rates(rates.flops_per_ms / scale, rates.bytes_per_ms / scale), "emulated"


def flops_to_ms(flops: float, device: Any, rates: Rates | None = None) -> float:
    """Milliseconds for ``flops`` at ``rates`` (default: the sustained rate of ``device``'s
    type)."""
    return flops / (rates or device_rates(device)).flops_per_ms


@functools.cache
def _bandwidth(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return _cuda_bandwidth(torch.device(device))
    # Both buffers written before timing: an untouched torch.empty maps every page of the
    # source to the kernel's one shared zero page, and copying from it reads the cache, not
    # memory (it measured ~900 GB/s).
    src = torch.full((_COPY_BYTES,), 7, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return _COPY_BYTES / max(best * 1e3, 1e-6)


def _cuda_bandwidth(device: torch.device) -> float:
    """Bytes/ms of the slower direction between page-locked host memory and ``device``.

    Everything happens on ``device``'s own current stream, under its device guard: a copy
    runs on the stream of the device its device tensor lives on, so events recorded on the
    *current* device's stream would time nothing when the model sits on another GPU, and
    the planner would then believe copies are free.
    """
    import torch

    from fxckpt import _cuda

    cuda = _cuda.CUDA
    host = cuda.page_locked(_COPY_BYTES)  # like the pool's slabs: exactly locked pages
    try:
        with cuda.device(device):
            stream = cuda.current_stream(device)
            dev = cuda.empty(_COPY_BYTES, torch.uint8, device)
            with cuda.use_stream(stream):
                cuda.copy(dev, host)  # warm up the copy engines and the allocator
                cuda.copy(host, dev)
                slower_ms = 0.0
                for dst, src in ((dev, host), (host, dev)):
                    start, end = cuda.event(timing=True), cuda.event(timing=True)
                    start.record(stream)
                    for _ in range(3):
                        cuda.copy(dst, src)
                    end.record(stream)
                    end.synchronize()
                    slower_ms = max(slower_ms, start.elapsed_time(end) / 3)
    finally:
        cuda.unlock(host)  # every copy has completed: end.synchronize()
    return _COPY_BYTES / max(slower_ms, 1e-6)


def _gpu_like(device: str) -> bool:
    # Offline plans (fxckpt inspect) run on the meta device for a GPU that is not here.
    return device.startswith(("cuda", "meta"))


def measure_bandwidth(device: Any) -> float:
    """Host↔device copy bandwidth in bytes/ms, measured once per process and device.

    CUDA: a page-locked 64 MiB host buffer copied H2D then D2H three times each on the
    device's own stream, timed with CUDA events; the slower direction wins. CPU: the best of
    three 64 MiB ``copy_`` calls between buffers written beforehand (a memcpy rate). Meta (offline
    planning): ``DEFAULT_PCIE_BYTES_PER_MS``; pass ``bandwidth`` for another link.
    """
    name = device if isinstance(device, str) else str(device)
    if name.startswith("meta"):
        return DEFAULT_PCIE_BYTES_PER_MS  # offline planning: nothing to measure
    if name == "cuda":
        import torch

        name = f"cuda:{torch.cuda.current_device()}"
    return _bandwidth(name)


def copy_overhead_ms(device: Any, cost_model: str) -> float:
    """The fixed host cost of one offloaded tensor on ``device``'s copy engine
    (:data:`COPY_OVERHEAD_MS`); 0.0 under ``cost_model="unit"``, which stays deterministic."""
    if cost_model == "unit":
        return 0.0
    name = device if isinstance(device, str) else str(device)
    return COPY_OVERHEAD_MS["cuda" if _gpu_like(name) else "cpu"]


def _profile_ms(node: torch.fx.Node, device: str, repeats: int = 5) -> float:
    import torch

    def real(v: torch.Tensor) -> torch.Tensor:
        if v.dtype.is_floating_point or v.dtype.is_complex:
            return torch.randn(v.shape, dtype=v.dtype, device=device)
        return torch.zeros(v.shape, dtype=v.dtype, device=device)  # safe as an index

    got = _meta_args(node, real)
    if got is None:
        return 0.0
    fn = node.target
    fn(*got[0], **got[1])  # type: ignore[operator]  # warm-up: kernels, allocator
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn(*got[0], **got[1])  # type: ignore[operator]
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def node_cost_ms(node: torch.fx.Node, cost_model: str, device: Any, rates: Rates | None = None
                 ) -> float:
    """Estimated milliseconds to (re)compute ``node``.

    - ``"unit"``: 1.0 per compute node, 0.0 for views, ``getitem`` and non-calls
      (deterministic, for tests);
    - ``"flops"``: the larger of :func:`flops_to_ms` of :func:`node_flops` and the time to
      move the node's inputs and outputs once (which prices elementwise ops, that have no
      FLOP formula), at ``rates`` (default: :func:`planning_rates` of ``device``);
    - ``"profile"``: times the op on random tensors of its input shapes, on CUDA only. On a
      CPU device it falls back to ``"flops"``; if the op can't run on made-up inputs, too.
    """
    if cost_model not in ("unit", "flops", "profile"):
        raise ValueError(f"cost_model={cost_model!r}; expected 'unit', 'flops' or 'profile'")
    if not _is_compute(node):
        return 0.0
    if cost_model == "unit":
        return 1.0
    name = device if isinstance(device, str) else str(device)
    if cost_model == "profile" and name.startswith("cuda") and node.op == "call_function":
        try:
            return _profile_ms(node, name)
        except Exception:
            pass
    rates = rates or planning_rates(name)[0]
    return max(flops_to_ms(node_flops(node), name, rates), _traffic_ms(node, rates))


def _traffic_ms(node: torch.fx.Node, rates: Rates) -> float:
    """Milliseconds to read a node's tensor inputs and write its outputs once."""
    import torch

    total = 0
    for n in (node, *node.all_input_nodes):
        val = n.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else (val,)
        for v in vals:
            if isinstance(v, torch.Tensor):
                numel = 1
                for s in v.shape:
                    numel *= s if isinstance(s, int) else 4096
                total += numel * v.element_size()
    return total / rates.bytes_per_ms


def assumptions(options: Any, device: Any) -> dict[str, dict[str, Any]]:
    """What the cost model assumes for one compile on ``device``, and where each figure came
    from: ``"option"`` (the user's), ``"emulated"`` (the CPU engine's emulated link,
    :mod:`fxckpt._link`), ``"measured"`` (a probe on this machine) or ``"default"`` (a table).

    Keys: ``bandwidth_bytes_per_s`` (host link, each way), ``link_overhead_ms`` (each copy's
    fixed time on its queue), ``copy_overhead_ms`` (host time per offloaded copy, never
    hidden), ``copy_margin`` (copies are planned as taking ``1 + copy_margin`` times what the
    link's figures say; 0 under ``cost_model="unit"``), ``compute_flops_per_s`` and
    ``memory_bytes_per_s`` (the ``"flops"`` model's rates).
    """
    from fxckpt import _link

    name = device if isinstance(device, str) else str(device)
    link = _link.spec() if name.startswith("cpu") else None
    cost_model = options.cost_model

    def fig(value: float, source: str) -> dict[str, Any]:
        return {"value": float(value), "source": source}

    if options.bandwidth is not None:
        bandwidth = fig(options.bandwidth, "option")
    elif link is not None:
        bandwidth = fig(link.bandwidth, "emulated")
    elif cost_model == "unit":
        bandwidth = fig(1e9, "default")  # deterministic: 1 MB per unit step
    elif name.startswith("meta"):
        bandwidth = fig(DEFAULT_PCIE_BYTES_PER_MS * 1e3, "default")
    else:
        bandwidth = fig(measure_bandwidth(device) * 1e3, "measured")
    rates, rates_source = planning_rates(name)
    out = {
        "bandwidth_bytes_per_s": bandwidth,
        "link_overhead_ms": (fig(link.overhead_s * 1e3, "emulated") if link is not None
                             and cost_model != "unit" else fig(0.0, "default")),
        "copy_overhead_ms": fig(copy_overhead_ms(device, cost_model), "default"),
        "copy_margin": fig(0.0 if cost_model == "unit" else COPY_MARGIN, "default"),
        "compute_flops_per_s": fig(rates.flops_per_ms * 1e3, rates_source),
        "memory_bytes_per_s": fig(rates.bytes_per_ms * 1e3, rates_source),
    }
    return out
