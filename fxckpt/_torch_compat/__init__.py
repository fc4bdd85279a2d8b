"""Every torch internal fxckpt touches, in one place: this package, and nowhere else.

fxckpt supports torch 2.11 up to (not including) 2.16. The names below moved before 2.11 and
may move again; when they do, this package is the only code to change. Callers import it as
``compat`` and name everything ``compat.<name>``: partitioning and graph hygiene here,
Inductor in :mod:`.inductor`, size symbols and fake tensors in :mod:`.shapes`, the CPU
allocator's events in :mod:`.profiler`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
MIN_TORCH = (2, 11)
MAX_TORCH_EXCLUSIVE = (2, 16)

if not (MIN_TORCH <= TORCH_VERSION < MAX_TORCH_EXCLUSIVE):  # pragma: no cover
    raise ImportError(
        f"fxckpt supports torch >=2.11,<2.16; found torch {torch.__version__}. "
        "Install a supported torch, for example `pip install torch==2.13.0`."
    )

# Partitioning.
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

# aot_eager's no-op compiler: the graph takes its inputs as one list and lets go of each at
# its last use (_BoxedCodeGen). make_boxed_func(gm.forward) alone unpacks the list into the
# frame, which then holds every saved tensor until the whole backward has run.
from torch._dynamo.backends.debugging import boxed_nop  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402
from torch._inductor.custom_graph_pass import CustomPartitionerFn  # noqa: E402

# Graph hygiene.
from torch.fx.node import has_side_effect  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402

# Offload policies users can return from a selective-checkpoint policy. torch defines them
# but no torch partitioner reads them (they act as a plain save); fxckpt gives them meaning.
OFFLOAD_POLICIES = frozenset(
    {CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD}
)


def flop_formula(target: Any) -> Any:
    """``FlopCounterMode``'s formula for an aten op, or None when it has none.

    The formulas take the op's (fake) arguments and ``out_val=`` its output and read only
    their shapes, so calling one directly counts FLOPs without running the op.
    """
    from torch.utils.flop_counter import flop_registry

    packet = getattr(target, "_overloadpacket", None)
    return None if packet is None else flop_registry.get(packet)


def lazy_graph_modules() -> Any:
    """A context in which new graph modules generate their Python code on first call, not
    when built, as under Inductor. min-cut builds about ten modules per run; fxckpt discards
    most of them (the baseline partition, superseded plans) and never runs them."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def make_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """``GraphModule(root, graph)``, lazy inside :func:`lazy_graph_modules`."""
    from torch.fx._lazy_graph_module import _make_graph_module

    return _make_graph_module(root, graph)


def dedup_joint(joint: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """``joint`` after the common-subexpression pass min-cut starts with, as a new module,
    or None when the user turned that pass off (``torch._functorch.config.cse = False``).

    The pass reaches its fixed point in one run, so partitioning its result with the pass off
    (:func:`min_cut_without_cse`) gives the partition min-cut gives ``joint``.
    """
    from torch._functorch import config
    from torch._functorch.compile_utils import fx_graph_cse

    if not config.cse:
        return None
    return make_graph_module(joint, fx_graph_cse(joint.graph))


def min_cut_without_cse(
    joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """min-cut on a joint graph :func:`dedup_joint` already deduplicated."""
    from torch._functorch import config

    with config.patch(cse=False):
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def min_cut_keywords(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The keyword arguments a partitioner received that min-cut takes, and the names of the
    others.

    A partitioner is called with whatever the calling torch passes: 2.11 to 2.15 pass
    ``num_fwd_outputs``, ``static_lifetime_input_indices`` and (Inductor) ``compiler``; newer
    ones may add metadata such as ``fw_metadata`` (pytorch#174823). min-cut's signature names
    what it takes; one that takes ``**kwargs`` takes everything.
    """
    params = inspect.signature(min_cut_rematerialization_partition).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs), []
    taken = {k: v for k, v in kwargs.items() if k in params}
    return taken, sorted(k for k in kwargs if k not in params)


def outside_fake_mode() -> Any:
    """A context in which tensors are real: every active torch dispatch mode is set aside.

    A partitioner runs inside AOTAutograd's ``FakeTensorMode``, where ``torch.empty`` returns
    a FakeTensor and a copy takes no time: a bandwidth probe there measured a rate ~56x the
    real one on the CPU, and on CUDA ``copy_`` into page-locked memory raised. The modes come
    back when the block ends (``torch.utils._python_dispatch._disable_current_modes``, in
    2.11 and 2.13).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


OpOverload = torch._ops.OpOverload  # an aten/custom op at one overload: FX call targets


def is_fake_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` has no real storage: a FakeTensor (or a functional wrapper of one), as a
    compiled submodule receives when dynamo's DDP optimizer runs it to propagate shapes
    (``torch._subclasses.fake_tensor.is_fake``, in 2.11 to 2.15)."""
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(t))


def register_backend_name(name: str, target: str) -> None:
    """Make ``torch.compile(backend=name)`` resolve to ``target`` (``"module:attribute"``)
    where no installed entry point has claimed the name yet: running from a source tree.

    torch reads the ``torch_dynamo_backends`` entry points lazily, on the first lookup of a
    name it does not know (``_dynamo/backends/registry.py``, the same in 2.11 and 2.13), and
    registers a backend when it first loads it. Calling ``register_backend`` here instead
    would break installed copies: torch's lookup loads the entry point, which imports this
    package, which would register the name first, and torch's own ``register_backend`` call
    then asserts on the duplicate. So the name is entered the way an installed entry point
    is, as an unloaded ``EntryPoint``, and only where the registry holds nothing for it: an
    installed entry point that torch discovers later replaces it, and both load ``target``.
    """
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
        _internal.register_artifact(
            "fxckpt_plan", "fxckpt's keep/recompute/offload plan for each compiled graph"
        )


def trace_plan_artifact(name: str, payload: str) -> None:
    """Emit a plan as a structured-trace artifact, so tlparse shows it beside the graphs."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"fxckpt_plan_{name}", "encoding": "json"},
        payload_fn=lambda: payload,
    )


def saved_tensors_hooks_free() -> bool:
    """Whether a ``saved_tensors_hooks`` pack hook pushed now would see every saved tensor and
    hide none from the caller's own: hooks are enabled, and none are active."""
    autograd = torch._C._autograd
    return bool(
        autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]
        and autograd._top_saved_tensors_default_hooks(False) is None
    )


def compile_call_owner() -> Any:
    """The object dynamo holds for the ``torch.compile`` call compiling now (its wrapped
    backend), or ``None`` outside dynamo: a step budget's state lives with it. Every frame,
    graph break and recompile of one call sees the same object (2.11 to 2.15)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except (AttributeError, IndexError, AssertionError, RuntimeError):
        return None
    output = getattr(tx, "output", None) if tx is not None else None
    return getattr(output, "compiler_fn", None)


def current_compile_id() -> Any:
    """Dynamo's id of the graph compiling now (``frame_id``, ``frame_compile_id``) or None."""
    from torch._guards import CompileContext

    return CompileContext.current_compile_id()


def reset_dynamo() -> None:
    """Forget every compiled frame, so the next call compiles anew."""
    torch._dynamo.reset()


def backend_failure() -> type[Exception]:
    """The exception dynamo wraps a backend's error in (its ``inner_exception`` is the error)."""
    from torch._dynamo.exc import BackendCompilerFailed

    return BackendCompilerFailed


@contextlib.contextmanager
def composite_ops_decompose_on_meta() -> Iterator[None]:
    """Let CompositeImplicitAutograd ops decompose on meta tensors, as they do on real ones.

    torch._meta_registrations registers a Python Meta kernel for some composite ops (nll_loss,
    var_mean, ...). Under the Python dispatcher, which AOTAutograd enables while tracing the
    joint graph, that kernel makes ``torch._ops.resolve_key`` see a backend kernel for Meta,
    so AutogradMeta resolves to the autograd fallback instead of the decomposition: the op gets
    no gradient and the backward graph comes out empty. Eager meta tensors never consult these
    kernels, so hiding them while planning changes nothing else.
    """
    removed: list[tuple[Any, Any]] = []
    meta_key = torch._C.DispatchKey.Meta
    for name in dir(torch.ops.aten):  # the packets loaded so far; the registrations load them
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if meta_key in op.py_kernels and torch._C._dispatch_has_kernel_for_dispatch_key(
                op.name(), "CompositeImplicitAutograd"
            ):
                removed.append((op, op.py_kernels.pop(meta_key)))
                op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in removed:
            op.py_kernels[meta_key] = kernel
            op._dispatch_cache.clear()


# Inductor; the shape environment and fake tensors; the allocator's events. Re-exported: callers name
# them ``compat.<name>`` like the rest.
from fxckpt._torch_compat.inductor import (  # noqa: E402
    assume_aligned_outputs,
    cache_pinned_graphs,
    compile_fx,
    inductor_channels_last_nodes,
    inductor_mode_options,
    non_overlapping_and_dense,
    run_after,
)
from fxckpt._torch_compat.profiler import (  # noqa: E402
    profiler_enabled,
    start_memory_events,
    stop_memory_events,
)
from fxckpt._torch_compat.shapes import (  # noqa: E402
    detect_fake_mode,
    fake_inputs,
    free_unbacked,
    no_tracing_context,
    recompiling,
    shape_guard_count,
    size_hint,
    symbol_hints,
    symbol_lower_bound,
    symbol_source,
    symbol_upper_bound,
)

__all__ = [
    "aot_autograd",
    "assume_aligned_outputs",
    "backend_failure",
    "boxed_nop",
    "cache_pinned_graphs",
    "CheckpointPolicy",
    "compile_call_owner",
    "compile_fx",
    "composite_ops_decompose_on_meta",
    "current_compile_id",
    "CustomPartitionerFn",
    "dedup_joint",
    "detect_fake_mode",
    "fake_inputs",
    "flop_formula",
    "free_unbacked",
    "has_side_effect",
    "inductor_channels_last_nodes",
    "inductor_mode_options",
    "is_fake_tensor",
    "lazy_graph_modules",
    "make_boxed_func",
    "make_graph_module",
    "min_cut_keywords",
    "min_cut_rematerialization_partition",
    "min_cut_without_cse",
    "no_tracing_context",
    "non_overlapping_and_dense",
    "OFFLOAD_POLICIES",
    "OpOverload",
    "outside_fake_mode",
    "profiler_enabled",
    "recompiling",
    "register_backend_name",
    "register_logging",
    "reset_dynamo",
    "run_after",
    "saved_tensors_hooks_free",
    "shape_guard_count",
    "size_hint",
    "start_memory_events",
    "stop_memory_events",
    "symbol_hints",
    "symbol_lower_bound",
    "symbol_source",
    "symbol_upper_bound",
    "TORCH_VERSION",
    "trace_plan_artifact",
]
