"""FLOPs, bandwidth and the cost models that turn an FX node into estimated milliseconds.

Nothing here runs at import: bandwidth is measured on first use and cached per process
(:mod:`fxckpt.graph.probes`). :func:`assumptions` is what one compile assumes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from fxckpt import _torch_compat as compat
from fxckpt._torch_compat import flop_formula
from fxckpt.graph.probes import (  # noqa: F401  (_bandwidth: tests clear its cache)
    _bandwidth,
    measure_bandwidth,
    profile_ms,
)
from fxckpt.graph.sizes import concrete

if TYPE_CHECKING:
    import torch
    import torch.fx

    from fxckpt.options import Options

@dataclass(frozen=True)
class DeviceCosts:
    """One device kind's row of a :class:`CostTable`: what the ``"flops"`` model prices a
    node with, and what one offload costs the compute thread, on that kind of device."""

    flops_per_ms: float
    """Sustained compute, in FLOPs per millisecond. Deliberately below peak: a recomputed op
    runs alone, without the fusion and overlap of the original step."""

    bytes_per_ms: float
    """Sustained device-memory traffic, in bytes per millisecond. It bounds the ops
    ``FlopCounterMode`` gives no FLOPs (elementwise, norms, softmax): without it their
    recompute would look free."""

    copy_overhead_ms: float
    """Host time, in milliseconds, the compute thread spends per offloaded tensor (per copy
    bucket): four runtime-op calls (``offload``, ``offload_done``, ``prefetch``, ``wait``) and
    two hand-offs to the copy engine. The copies hide behind compute; this does not, so the
    planner pays it per offload instead of excluding small tensors with a fixed threshold."""


@dataclass(frozen=True)
class CostTable:
    """Every default rate and overhead of the cost model, in one place.

    :func:`assumptions` turns a table into the figures one compile plans with (the plan
    records them, each with its source); a figure measured, given as an option or emulated
    replaces the table's there. The functions that read a figure take the table as a
    parameter, :data:`DEFAULT_COSTS` by default (another is made with ``dataclasses.replace``);
    the compile passes none, so every plan is priced with :data:`DEFAULT_COSTS`, and code that
    holds a plan's assumptions reads its figures from there. :meth:`row` picks a device
    kind's row: ``cuda`` for CUDA and for the meta device (offline plans are made for a GPU
    that is not here), ``cpu`` otherwise.
    """

    cpu: DeviceCosts = DeviceCosts(flops_per_ms=1e8, bytes_per_ms=1e7, copy_overhead_ms=0.5)
    """A CPU device: ~100 GFLOP/s (a few cores of a server CPU) and ~10 GB/s of memory
    traffic. Its copy overhead, 0.5 ms, is the CPU engine's (worker threads), measured by
    ``python -m benchmarks.copy_overhead``: 0.40-0.56 ms per 64 KiB round trip on two loaded
    cores."""

    cuda: DeviceCosts = DeviceCosts(flops_per_ms=1e11, bytes_per_ms=2e9, copy_overhead_ms=0.1)
    """A GPU (CUDA, and meta for offline plans): ~100 TFLOP/s, well below an H100's bf16
    dense peak, and ~2 TB/s of HBM. Its copy overhead, 0.1 ms, is an estimate until
    ``benchmarks/copy_overhead.py`` runs on a GPU: four Python custom-op dispatches (~10-20 us
    each) plus two cudaMemcpyAsync calls (~5-7 us each, as measured for page-locked copies)
    and their events."""

    pcie_bytes_per_ms: float = 2.5e7
    """The host link an offline plan (meta device) assumes, in bytes per millisecond:
    ~25 GB/s host<->device, about what a PCIe 4.0 x16 link sustains (32 GB/s raw), and half
    of a Gen5 x16's: an offline plan errs towards a slow link. Nothing is measured offline;
    the ``bandwidth`` option replaces it."""

    copy_margin: float = 0.5
    """The planner places and prices copies as if they took ``1 + copy_margin`` times what
    the link's figures say: compute runs faster or slower than its estimate (another
    process's load, a kernel the cost model misjudges) and a link delivers less than its probe
    (torchtitan saw 32 GB/s in steps against 52 benchmarked). Through an emulated link at an
    H200's ratio, plans made without it stalled up to 2.8 % of a step where they said
    "hidden"; with it, the same offloads and no stall (``benchmarks/gpu_shaped.py``,
    ``docs/benchmarks.md``). 0 under ``cost_model="unit"``."""

    unit_bytes_per_ms: float = 1e6
    """The host link under ``cost_model="unit"``, in bytes per millisecond: 1 MB per unit
    step, so that unit plans are deterministic and measure nothing."""

    unit_disk_bytes_per_ms: float = 1e5
    """The disk tier under ``cost_model="unit"``, in bytes per millisecond, both directions:
    10x slower than the unit model's host link, so that unit plans with a disk tier measure
    nothing either."""

    def row(self, device: Any) -> DeviceCosts:
        """The row of ``device``'s kind (a ``torch.device`` or its name): :attr:`cuda` for
        CUDA and meta, :attr:`cpu` for anything else."""
        kind = device if isinstance(device, str) else getattr(device, "type", str(device))
        return self.cuda if _gpu_like(str(kind)) else self.cpu


DEFAULT_COSTS = CostTable()
"""The table every compile plans with unless given another: frozen, so nothing changes it
behind a plan's back."""


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
    """Whether recomputing ``node`` would draw new random numbers: never recompute these.

    An op torch tags ``nondeterministic_seeded`` is, except one called with ``dropout_p=0``:
    torch tags every SDPA kernel so, dropout or not, and one that drops nothing draws nothing.
    On meta tensors (offline plans, ``fxckpt inspect``) every seeded op is: replaying one
    needs ``run_and_save_rng_state``, which has no meta kernel, so torch too keeps it saved.
    The RNG's own ops (``philox_rand``, ``run_and_save_rng_state``, ...) are, by name.
    """
    if node.op != "call_function":
        return False
    import torch

    target = _aten_target(node)
    if target is not None and torch.Tag.nondeterministic_seeded in getattr(target, "tags", ()):
        if _on_meta_device(node):
            return True
        for i, arg in enumerate(target._schema.arguments):
            if arg.name == "dropout_p":
                p = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else arg.default_value)
                return not (isinstance(p, (int, float)) and p == 0)
        return True
    name = str(getattr(node.target, "__name__", node.target)).lower()
    return "rng" in name or "philox" in name


def _on_meta_device(node: torch.fx.Node) -> bool:
    import torch

    val = node.meta.get("val")
    first = val[0] if isinstance(val, (tuple, list)) and val else val
    return isinstance(first, torch.Tensor) and first.device.type == "meta"


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
    if compat.is_fake_tensor(v) or v.device.type == "meta":
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

    formula = flop_formula(node.target)
    if formula is None and isinstance(node.target, compat.OpOverload):
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


def device_rates(device: Any, table: CostTable = DEFAULT_COSTS) -> Rates:
    """The rates of ``device``'s kind in ``table`` (meta stands for a GPU)."""
    row = table.row(device)
    return Rates(row.flops_per_ms, row.bytes_per_ms)


def planning_rates(device: Any, table: CostTable = DEFAULT_COSTS) -> tuple[Rates, str]:
    """The rates the planner prices compute with on ``device``, and their source: the
    table's, or (CPU, under an emulated link derived from a target) the table's scaled to
    this machine's measured compute, ``"emulated"``."""
    from fxckpt import _link

    rates = device_rates(device, table)
    name = device if isinstance(device, str) else str(device)
    link = _link.spec() if name.startswith("cpu") else None
    if link is None or link.compute_scale == 1.0:
        return rates, DEFAULT
    scale = link.compute_scale
    return Rates(rates.flops_per_ms / scale, rates.bytes_per_ms / scale), EMULATED


def flops_to_ms(flops: float, device: Any, rates: Rates | None = None,
                table: CostTable = DEFAULT_COSTS) -> float:
    """Milliseconds for ``flops`` at ``rates`` (default: ``table``'s sustained rate for
    ``device``'s kind)."""
    return flops / (rates or device_rates(device, table)).flops_per_ms


def _gpu_like(device: str) -> bool:
    # Offline plans (fxckpt inspect) run on the meta device for a GPU that is not here.
    return device.startswith(("cuda", "meta"))


# Sources of an assumed figure: measured on this machine, given as an option, the table's, or
# the CPU engine's emulated host link (fxckpt._link).
MEASURED, OPTION, DEFAULT, EMULATED = "measured", "option", "default", "emulated"
RUN_TIME = "measured at run time"  # a re-plan's figures, from the graph's own copies


def assumptions(options: Options, device: Any, measured: Mapping[str, float] | None = None,
                table: CostTable = DEFAULT_COSTS) -> dict[str, dict[str, Any]]:
    """What the cost model assumes for one compile on ``device``, each figure with where it
    came from: ``{"name": {"value": float, "source": "measured" | "option" | "default" |
    "emulated"}}``.

    - ``bandwidth_bytes_per_s``: the host link (``bandwidth`` option, else an emulated link's
      on the CPU, else probed once per device and process, outside any fake mode; offline
      plans and ``cost_model="unit"`` take ``table``'s figure);
    - ``link_overhead_ms``: each copy's fixed time on its queue (an emulated link's, else 0);
    - ``compute_flops_per_s`` and ``memory_bytes_per_s``: the ``"flops"`` model's sustained
      rates for the device's kind (``"profile"`` times ops instead, where it can), scaled to
      this machine's measured compute under a link derived from a target
      (:func:`planning_rates`);
    - ``copy_overhead_ms``: the host time one offloaded tensor costs the compute thread
      (:func:`copy_overhead_ms`);
    - ``copy_margin``: copies are placed and priced as taking ``1 + copy_margin`` times what
      the link's figures say (:attr:`CostTable.copy_margin`; 0 under ``cost_model="unit"``).

    Every figure not measured, given or emulated is ``table``'s (:data:`DEFAULT_COSTS`
    unless another is passed), with the source ``"default"``.

    The planner prices copies with exactly these figures, and the plan records them as
    ``Plan.assumptions``. This is the one place a figure's source is decided: a setting
    that replaces a figure for a whole compile (an emulated host link, say, with its own
    source name) hooks in here, and the plan, the logs and ``fxckpt inspect`` follow.

    ``measured``: figures measured while the graph ran (a re-plan, :mod:`fxckpt.adapt`);
    each replaces the figure of its name, with the source ``"measured at run time"``.
    """
    from fxckpt import _link

    name = device if isinstance(device, str) else str(device)
    link = _link.spec() if name.startswith("cpu") else None
    if options.bandwidth is not None:
        bandwidth = _figure(float(options.bandwidth), OPTION)
    elif link is not None:
        bandwidth = _figure(link.bandwidth, EMULATED)
    elif options.cost_model == "unit":
        bandwidth = _figure(table.unit_bytes_per_ms * 1e3, DEFAULT)
    elif name.startswith("meta"):
        bandwidth = _figure(table.pcie_bytes_per_ms * 1e3, DEFAULT)
    else:
        bandwidth = _figure(measure_bandwidth(device) * 1e3, MEASURED)
    rates, rates_source = planning_rates(name, table)
    unit = options.cost_model == "unit"
    figures = {
        "bandwidth_bytes_per_s": bandwidth,
        "compute_flops_per_s": _figure(rates.flops_per_ms * 1e3, rates_source),
        "memory_bytes_per_s": _figure(rates.bytes_per_ms * 1e3, rates_source),
        "copy_overhead_ms": _figure(copy_overhead_ms(device, options.cost_model, table),
                                    DEFAULT),
        "link_overhead_ms": (_figure(link.overhead_s * 1e3, EMULATED) if link is not None
                             and not unit else _figure(0.0, DEFAULT)),
        "copy_margin": _figure(0.0 if unit else table.copy_margin, DEFAULT),
    }
    for key, value in (measured or {}).items():
        figures[key] = _figure(float(value), RUN_TIME)
    return figures


def _figure(value: float, source: str) -> dict[str, Any]:
    return {"value": value, "source": source}


def copy_overhead_ms(device: Any, cost_model: str, table: CostTable = DEFAULT_COSTS) -> float:
    """The fixed host cost of one offloaded tensor on ``device``'s copy engine
    (:attr:`DeviceCosts.copy_overhead_ms` of ``table``'s row for ``device``); 0.0 under
    ``cost_model="unit"``, which stays deterministic."""
    if cost_model == "unit":
        return 0.0
    return table.row(device).copy_overhead_ms


def node_cost_ms(node: torch.fx.Node, cost_model: str, device: Any, rates: Rates | None = None,
                 table: CostTable = DEFAULT_COSTS) -> float:
    """Estimated milliseconds to (re)compute ``node``.

    - ``"unit"``: 1.0 per compute node, 0.0 for views, ``getitem`` and non-calls
      (deterministic, for tests);
    - ``"flops"``: the larger of :func:`flops_to_ms` of :func:`node_flops` and the time to
      move the node's inputs and outputs once (which prices elementwise ops, that have no
      FLOP formula), at ``rates`` (default: :func:`planning_rates` of ``device`` in ``table``);
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
            return profile_ms(node, name, _meta_args)
        except Exception:
            pass
    rates = rates or planning_rates(name, table)[0]
    return max(flops_to_ms(node_flops(node), name, rates), _traffic_ms(node, rates))


def _traffic_ms(node: torch.fx.Node, rates: Rates) -> float:
    """Milliseconds to read a node's tensor inputs and write its outputs once, at the sizes
    the plan is made for (:func:`fxckpt.graph.sizes.concrete`, as :func:`node_flops`)."""
    import torch

    total = 0
    for n in (node, *node.all_input_nodes):
        val = n.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else (val,)
        for v in vals:
            if isinstance(v, torch.Tensor):
                numel = 1
                for s in v.shape:
                    numel *= concrete(s)
                total += numel * v.element_size()
    return total / rates.bytes_per_ms


def random_output(node: fx.Node) -> bool:
    """A random op, or a getitem of one (``native_dropout`` returns output and mask)."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return is_random(node.args[0])
    return is_random(node)
