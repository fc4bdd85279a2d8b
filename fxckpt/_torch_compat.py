"""Every torch internal fxckpt touches, in one place: this file, and nowhere else.

fxckpt supports torch 2.11 up to (not including) 2.16; when a name below moves, this is the
only file to change. Callers import it as ``compat`` and name everything ``compat.<name>``.
What each relies on, and what to check when torch changes it: docs/torch-internals.md.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
MIN_TORCH = (2, 11)
MAX_TORCH_EXCLUSIVE = (2, 16)

if not (MIN_TORCH <= TORCH_VERSION < MAX_TORCH_EXCLUSIVE):  # pragma: no cover
    raise ImportError(f"fxckpt supports torch >=2.11,<2.16; found torch {torch.__version__}. "
                      "Install a supported torch, for example `pip install torch==2.13.0`.")

from torch._dynamo.backends.common import aot_autograd  # noqa: E402, F401
from torch._dynamo.backends.debugging import boxed_nop  # noqa: E402, F401  (lets go of inputs)
from torch._functorch import config as _functorch_config  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402, F401
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402
from torch._inductor.custom_graph_pass import CustomPartitionerFn  # noqa: E402, F401
from torch.fx.node import has_side_effect  # noqa: E402, F401
from torch.utils import _pytree as pytree  # noqa: E402, F401  (tree_leaves, tree_map)
from torch.utils._sympy.functions import FloorDiv  # noqa: E402, F401
from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402

# Offload policies a selective-checkpoint policy may return: no torch partitioner reads them.
OFFLOAD_POLICIES = frozenset({CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD})


def flop_formula(target: Any) -> Any:
    """``FlopCounterMode``'s formula for an aten op (it reads only shapes), or None."""
    from torch.utils.flop_counter import flop_registry
    packet = getattr(target, "_overloadpacket", None)
    return None if packet is None else flop_registry.get(packet)


def lazy_graph_modules() -> Any:
    """A context in which new graph modules generate their code on first call, not when built."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    return _use_lazy_graph_module(True)


def make_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """``GraphModule(root, graph)``, lazy inside :func:`lazy_graph_modules`."""
    from torch.fx._lazy_graph_module import _make_graph_module
    return _make_graph_module(root, graph)


def dedup_joint(joint: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """``joint`` after min-cut's CSE pass, or None where ``torch._functorch.config.cse`` is off."""
    from torch._functorch.compile_utils import fx_graph_cse
    return make_graph_module(joint, fx_graph_cse(joint.graph)) if _functorch_config.cse else None


def min_cut_without_cse(joint: torch.fx.GraphModule, joint_inputs: Any,
                        **kwargs: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """min-cut on a joint graph :func:`dedup_joint` already deduplicated."""
    with _functorch_config.patch(cse=False):
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


_DEFERRING: set[int] = set()  # threads inside min_cut_code_deferred
_DEFER_LOCK = threading.Lock()
_found_recompile: Any = torch.fx.GraphModule.recompile  # as the first of them found it


def _recompile_unless_deferred(self: torch.fx.GraphModule) -> Any:
    return None if threading.get_ident() in _DEFERRING else _found_recompile(self)


def min_cut_code_deferred(run: Any, *args: Any, **kwargs: Any) -> tuple[torch.fx.GraphModule, ...]:
    """``run(*args, **kwargs)`` (a min-cut), its graph modules handed back lazy: their Python
    code is generated on their first call, not in the partitioner. min-cut builds its backward
    with the eager ``GraphModule`` and generates its code twice (its reordering, then
    ``raise_getitems``); fxckpt rewrites the graphs it gets before anything runs them. Only
    this thread's plain graph modules skip the code while inside."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    global _found_recompile
    me = threading.get_ident()
    with _DEFER_LOCK:
        if not _DEFERRING:
            _found_recompile = torch.fx.GraphModule.__dict__["recompile"]
            torch.fx.GraphModule.recompile = _recompile_unless_deferred  # type: ignore[method-assign]
        _DEFERRING.add(me)
    try:
        out = run(*args, **kwargs)
    finally:
        with _DEFER_LOCK:
            _DEFERRING.discard(me)
            if not _DEFERRING:
                torch.fx.GraphModule.recompile = _found_recompile  # type: ignore[method-assign]
    return tuple(_LazyGraphModule.from_graphmodule(gm) for gm in out)


def min_cut_keywords(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The keywords a partitioner received that min-cut takes, and the names of the others."""
    params = inspect.signature(min_cut_rematerialization_partition).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs), []
    taken = {k: v for k, v in kwargs.items() if k in params}
    return taken, sorted(k for k in kwargs if k not in params)


def outside_fake_mode() -> Any:
    """A context in which tensors are real: every active torch dispatch mode is set aside."""
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


OpOverload = torch._ops.OpOverload  # an aten/custom op at one overload: FX call targets
CustomSchedulerPass: Any = getattr(inspect.getmodule(CustomPartitionerFn), "CustomSchedulerPass", None)  # None: torch lacks it


def is_fake_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` has no real storage: a FakeTensor, or a functional wrapper of one."""
    from torch._subclasses.fake_tensor import is_fake
    return bool(is_fake(t))


def register_backend_name(name: str, target: str) -> None:
    """Make ``torch.compile(backend=name)`` load ``target`` ("module:attr") if nothing claims it."""
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends import registry
    if name in registry._COMPILER_FNS or name in registry._BACKENDS:
        return
    registry._BACKENDS[name] = EntryPoint(name=name, value=target, group="torch_dynamo_backends")


def register_logging() -> None:
    """Make ``TORCH_LOGS="+fxckpt"`` and the ``fxckpt_plan`` trace artifact known to torch."""
    from torch._logging import _internal
    registry = _internal.log_registry
    if not registry.is_log("fxckpt"):
        _internal.register_log("fxckpt", "fxckpt")
    if not registry.is_artifact("fxckpt_plan"):
        _internal.register_artifact("fxckpt_plan", "fxckpt's keep/recompute/offload plan for each compiled graph")


def trace_plan_artifact(name: str, payload: str) -> None:
    """Emit a plan as a structured-trace artifact, so tlparse shows it beside the graphs."""
    from torch._logging import trace_structured
    trace_structured("artifact", payload_fn=lambda: payload,
                     metadata_fn=lambda: {"name": f"fxckpt_plan_{name}", "encoding": "json"})


def saved_tensors_hooks_free() -> bool:
    """Whether a pack hook pushed now sees every saved tensor and hides no hook of the caller's."""
    autograd = torch._C._autograd
    return bool(autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]
                and autograd._top_saved_tensors_default_hooks(False) is None)


def compile_call_owner() -> Any:
    """The object dynamo holds for the ``torch.compile`` call compiling now, or None."""
    from torch._dynamo.symbolic_convert import InstructionTranslator
    try:
        tx = InstructionTranslator.current_tx()
    except (AttributeError, IndexError, AssertionError, RuntimeError):
        return None
    output = getattr(tx, "output", None) if tx is not None else None
    return getattr(output, "compiler_fn", None)


def at_backward_end(fn: Any) -> None:
    """Run ``fn()`` when the backward running now ends (call it from inside a backward hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


def compiled_module_of(obj: Any) -> Any:
    """The module ``obj`` wraps where it is dynamo's wrapper of a compiled module, else None."""
    from torch._dynamo.eval_frame import OptimizedModule
    return obj._orig_mod if isinstance(obj, OptimizedModule) else None


def current_compile_id() -> Any:
    """Dynamo's id of the graph compiling now (``frame_id``, ``frame_compile_id``) or None."""
    from torch._guards import CompileContext
    return CompileContext.current_compile_id()


reset_dynamo, mark_dynamic = torch._dynamo.reset, torch._dynamo.mark_dynamic  # forget frames; a symbolic dim


def backend_failure() -> type[Exception]:
    """The exception dynamo wraps a backend's error in (its ``inner_exception`` is the error)."""
    from torch._dynamo.exc import BackendCompilerFailed
    return BackendCompilerFailed


@contextlib.contextmanager
def composite_ops_decompose_on_meta() -> Iterator[None]:
    """Let CompositeImplicitAutograd ops decompose on meta tensors, as on real ones."""
    removed: list[tuple[Any, Any]] = []
    meta_key = torch._C.DispatchKey.Meta
    for name in dir(torch.ops.aten):  # the packets loaded so far; the registrations load them
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if meta_key in op.py_kernels and torch._C._dispatch_has_kernel_for_dispatch_key(
                    op.name(), "CompositeImplicitAutograd"):
                removed.append((op, op.py_kernels.pop(meta_key)))
                op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in removed:
            op.py_kernels[meta_key] = kernel
            op._dispatch_cache.clear()


# Inductor: its entry point, lowering, cache settings and layout rules.
def compile_fx(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's entry point, imported late because it pulls in all of Inductor."""
    from torch._inductor.compile_fx import compile_fx as _compile_fx
    return _compile_fx(gm, example_inputs, **kwargs)


def run_after(graph: torch.fx.Graph, deps: dict[torch.fx.Node, list[torch.fx.Node]]) -> None:
    """Make each key node of ``graph`` run after the nodes listed for it, in any scheduler.
    A listed node must lower to a tensor, a key node to at least one operation of its own."""
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet
    _control_deps_kernels()
    preserve_node_ordering(graph, {node: OrderedSet(after) for node, after in deps.items()})


def _control_deps_kernels() -> None:
    """Give ``control_deps`` the autograd and eager kernels of torch 2.13 (2.11 lacks them)."""
    from torch._C import DispatchKey
    from torch._inductor.fx_passes.control_dependencies import control_deps

    def run(additional_deps: Any, subgraph: Any, *args: Any, **kwargs: Any) -> Any:
        return subgraph(*args, **kwargs)

    for key in (DispatchKey.CompositeExplicitAutograd, DispatchKey.Autograd):
        if key not in control_deps.py_kernels:
            control_deps.py_impl(key)(run)


def assume_aligned_outputs(op: Any) -> None:
    """Let Inductor assume the tensors ``op`` returns are aligned (once per process)."""
    from torch._inductor import ir, lowering
    from torch._inductor.virtualized import V
    if getattr(lowering.lowerings.get(op), "_fxckpt_aligned", False):
        return
    fallback = lowering.fallback_handler(op)

    def lower(*args: Any, **kwargs: Any) -> Any:
        out = fallback(*args, **kwargs)
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, ir.IRNode):
                V.graph.unaligned_buffers.discard(leaf.get_name())
        return out

    lower._is_fallback_handler = True  # type: ignore[attr-defined]  # as fallback_handler's
    lower._fxckpt_aligned = True  # type: ignore[attr-defined]
    lowering.register_lowering(op, type_promotion_kind=None)(lower)


def cache_pinned_graphs() -> dict[str, Any]:
    """The Inductor setting that lets the FX graph cache store :func:`run_after`'s graphs."""
    from torch._inductor import config
    from torch._inductor.fx_passes.control_dependencies import control_deps
    name = f"{control_deps.__module__}.{control_deps.__name__}"
    return {"unsafe_marked_cacheable_functions": {**config.unsafe_marked_cacheable_functions, name: torch.__version__}}


def step_peak_settings(step_pass: Any) -> tuple[dict[str, Any], str]:
    """The setting that runs ``step_pass`` on each fused schedule if free; Inductor's cache dir."""
    from torch._inductor import config
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    free = getattr(config, "_post_fusion_custom_pass", 0) is None and step_pass is not None
    return ({"_post_fusion_custom_pass": step_pass} if free else {}), str(cache_dir())


def scheduled_buffers(nodes: list[Any]) -> tuple[Any, list[set[str]], list[tuple[Any, ...]]]:
    """A fused schedule's FX graph, the FX names of each step in the order Inductor will run
    them, and per buffer (alloc, free, first step, last or -1, input name or ""), by its model."""
    from torch._inductor import config, memory
    from torch.utils._ordered_set import OrderedSet
    g = torch._inductor.virtualized.V.graph
    s, ins, outs = g.scheduler, OrderedSet(g.graph_inputs), OrderedSet(g.get_output_names())
    memory.prepare_planning_info(nodes, s.name_to_buf, s.name_to_fused_node, ins, outs)
    if config.reorder_for_peak_memory:  # what Scheduler does next to the same nodes
        nodes = memory.reorder_for_peak_memory(list(nodes), s.name_to_buf, s.name_to_fused_node, ins, outs)
    infos, _, _ = memory.compute_memory_timeline(nodes, memory.get_freeable_input_buf(nodes, ins), outs)
    names = [{o.name for m in n.get_nodes() for o in getattr(m.node, "origins", ())} for n in nodes]
    return g.module, names, [(b.size_alloc, b.size_free, b.start_step, b.end_step, b.buffer.get_name()
                              if isinstance(b.buffer, memory.FreeableInputBuffer) else "") for b in infos]


def inductor_channels_last_nodes(fw: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes of a training forward whose 4-D values Inductor lays out channels-last."""
    from types import SimpleNamespace

    from torch._inductor.graph import GraphLowering
    if not GraphLowering.decide_layout_opt(fw, is_inference=False):
        return set()
    return set(GraphLowering.find_nodes_prefer_channels_last(SimpleNamespace(module=fw)))  # type: ignore[arg-type]


def non_overlapping_and_dense(val: torch.Tensor) -> bool:
    """Whether ``val``'s elements fill its extent once each (False where symbols decide)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false
    return bool(is_non_overlapping_and_dense_or_false(val))


def inductor_mode_options() -> dict[str, dict[str, Any]]:
    """``torch.compile``'s ``mode`` names and the Inductor settings each stands for."""
    from torch._inductor import list_mode_options
    return dict(list_mode_options())


# Size symbols, the shape environment and fake tensors.
def symbol_hints(shape_env: Any) -> dict[Any, Any]:
    """Each backed size symbol's value in the call being compiled."""
    # backed_var_to_val in 2.13 (var_to_val is its deprecated alias); var_to_val in 2.11.
    values = getattr(shape_env, "backed_var_to_val", None)
    return dict(values if values is not None else shape_env.var_to_val)


def symbol_upper_bound(shape_env: Any, symbol: Any) -> int | None:
    """The largest value dynamo allows ``symbol``, or None where it is unbounded."""
    import sympy
    upper = getattr(shape_env.var_to_range.get(symbol), "upper", None)
    # Unbounded is torch's int_oo, which calls itself finite but is no sympy.Integer.
    return int(upper) if isinstance(upper, sympy.Integer) else None


def symbol_lower_bound(shape_env: Any, symbol: Any) -> int:
    """The smallest value dynamo allows ``symbol`` (2 for an unmarked dynamic size)."""
    import sympy
    lower = getattr(shape_env.var_to_range.get(symbol), "lower", None)
    return int(lower) if isinstance(lower, sympy.Integer) else 0


def symbol_source(shape_env: Any, symbol: Any) -> str:
    """The input dimension a size symbol stands for, as dynamo names it (``L['x'].size()[1]``)."""
    sources = getattr(shape_env, "var_to_sources", {}).get(symbol)
    if not sources:
        return str(symbol)
    name = sources[0].name  # a property in 2.13, a method before
    return str(name() if callable(name) else name)


def free_unbacked(expr: Any) -> bool:
    """Whether ``expr`` has data-dependent (unbacked) symbols, which no guard can test."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    return bool(free_unbacked_symbols(expr))


def size_hint(value: Any, fallback: int) -> int:
    """An int for a possibly symbolic size, without installing a guard."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    from torch.fx.experimental import symbolic_shapes as ss
    # 2.13's name, then 2.11's (whose hint_int is a deprecated alias that warns).
    for name in ("optimization_hint", "size_hint"):
        fn = getattr(ss, name, None)
        if fn is not None:
            return int(fn(value, fallback=fallback))
    hint = value.node.hint
    return int(hint) if hint is not None else fallback


def size_expr(size: Any) -> Any:
    """A size as sympy sees it: a symbolic size's expression, a plain int as itself."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def tensor_version(t: torch.Tensor) -> int:
    """The counter torch bumps at each in-place write to ``t``'s data (autograd's check)."""
    return int(t._version)


def static_fake_mode() -> Any:
    """A fake mode with no shape environment: every size it makes is a plain int."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(allow_non_fake_inputs=True)


# Re-planning a graph at run time (fxckpt.adapt) re-runs its compile outside dynamo.
def fake_inputs(example_inputs: Any) -> tuple[Any, list[Any]] | None:
    """The fake mode of the backend compile running now, and fake copies of its example inputs
    as AOTAutograd makes them; None for tensor subclasses or fakes of another mode."""
    from torch._guards import TracingContext
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.nn import Parameter
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    ctx = TracingContext.try_get()
    mode = ctx.fake_mode if ctx is not None and ctx.fake_mode is not None else None
    contexts = ctx.tensor_to_context if ctx is not None else {}
    if mode is None:
        found = [x.fake_mode for x in example_inputs if isinstance(x, FakeTensor)]
        mode = found[0] if found else FakeTensorMode(allow_non_fake_inputs=True)
    out: list[Any] = []
    with mode:
        for x in example_inputs:
            if not isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, FakeTensor):
                if x.fake_mode is not mode:
                    return None
                out.append(x)
            elif is_traceable_wrapper_subclass(x) or type(x) not in (torch.Tensor, Parameter):
                return None
            else:
                symbolic = contexts.get(x) if contexts else None
                source = None if symbolic is None else symbolic.tensor_source
                out.append(mode.from_tensor(x, symbolic_context=symbolic, source=source, trace=False))
    return mode, out


def recompiling(fake_mode: Any) -> Any:
    """A fresh tracing context over ``fake_mode``, for a compile outside dynamo."""
    from torch._guards import TracingContext, tracing
    return tracing(TracingContext(fake_mode))


def shape_guard_count(fake_mode: Any) -> int:
    """How many guards the shape environment of ``fake_mode`` holds (0 without one)."""
    return 0 if (env := getattr(fake_mode, "shape_env", None)) is None else len(env.guards)


def detect_fake_mode(inputs: Any) -> Any:
    """The fake mode that traced ``inputs`` (dynamo's, while it compiles), or None."""
    from torch._guards import detect_fake_mode as detect
    return detect(inputs)


def no_tracing_context() -> Any:
    """A context outside any dynamo tracing context, to compile a graph inside another's."""
    from torch._guards import tracing
    return tracing(None)


def backward_compiled_now() -> Any:
    """A context in which AOTAutograd compiles a graph's backward with its forward (not lazily,
    at the backward's first run), so that what its compiler reports of it exists at once."""
    return _functorch_config.patch(force_non_lazy_backward_lowering=True)


# Memory events: the CPU allocator's reports to the profiler, with no op recorded.
def start_memory_events() -> None:
    """Start recording the calling thread's allocator events (raises if a profiler is on)."""
    from torch._C import _autograd, _profiler

    from fxckpt._profiler_log import quiet_trace_lines
    # report_input_shapes, profile_memory, with_stack, with_flops, with_modules
    config = _profiler.ProfilerConfig(_profiler.ProfilerState.KINETO, False, True, False, False,
                                      False, _profiler._ExperimentalConfig())
    activities, older = {_profiler.ProfilerActivity.CPU}, [torch.empty(1)]
    with quiet_trace_lines():
        _autograd._prepare_profiler(config, activities)
        # The stub omits the scopes argument the binding takes.
        _autograd._enable_profiler(config, activities, {_profiler.RecordScope.STATIC_RUNTIME_MODEL})  # type: ignore[call-arg]
        older.clear()  # a block freed that predates the events: torch warns once, here, unseen


def stop_memory_events() -> list[tuple[int, int, int, str]]:
    """Stop recording; ``(time_ns, ptr, bytes, device)`` per event in time order (< 0: a free)."""
    from torch._C import _autograd, _profiler

    from fxckpt._profiler_log import quiet_trace_lines
    with quiet_trace_lines():
        result = _autograd._disable_profiler()
        stack = list(result.experimental_event_tree())
    events = []
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        f = e.extra_fields
        if isinstance(f, _profiler._ExtraFields_Allocation):
            events.append((e.start_time_ns, f.ptr, f.alloc_size, str(f.device.type)))
    events.sort(key=lambda ev: ev[0])
    return events


def profiler_enabled() -> bool:
    """Whether a torch profiler session is recording on this thread."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def storage_id(t: torch.Tensor) -> int:
    """The storage behind ``t``, by its C pointer (each ``untyped_storage()`` is a new wrapper)."""
    return int(t.untyped_storage()._cdata)


cuda_sleep = torch.cuda._sleep  # (cycles): keep the current CUDA stream busy about that long
SDPA_FLASH = torch.ops.aten._scaled_dot_product_flash_attention  # a GPU's two SDPA kernels
SDPA_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention
