"""Inductor's internals: its entry point, lowering, cache settings and layout rules (part of
:mod:`fxckpt._torch_compat`)."""

from __future__ import annotations

from typing import Any

import torch


def compile_fx(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's entry point, imported late because it pulls in all of Inductor."""
    from torch._inductor.compile_fx import compile_fx as _compile_fx

    return _compile_fx(gm, example_inputs, **kwargs)


def run_after(graph: torch.fx.Graph, deps: dict[torch.fx.Node, list[torch.fx.Node]]) -> None:
    """Make each key node of ``graph`` run after the nodes listed for it, in any scheduler.

    Inductor's ``preserve_node_ordering`` (``_inductor/fx_passes/control_dependencies``, in
    2.11 and 2.13) wraps each key node in the ``control_deps`` higher-order op; lowering turns
    the listed nodes into ordering-only dependencies of the operations the key node lowers
    to: they neither extend a buffer's lifetime nor copy anything. A listed node must lower
    to a tensor (2.11 drops other dependencies without a word), and a key node must lower to
    at least one operation of its own (a view or a getitem lowers to none).
    """
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    _control_deps_kernels()
    preserve_node_ordering(graph, {node: OrderedSet(after) for node, after in deps.items()})


def _control_deps_kernels() -> None:
    """Give ``control_deps`` the autograd and eager kernels torch 2.13 gives it.

    torch 2.11 registers only its fake kernel. Inductor's ``FakeTensorProp`` of the graph runs
    with grad mode on, so the call dispatches through the autograd key first and fails
    ("could not find kernel for HigherOrderOperator control_deps at dispatch key
    AutogradCPU"): every pinned graph failed to compile on 2.11. Both kernels run the wrapped
    subgraph, as torch 2.13's do; where torch has them, nothing is registered.
    """
    from torch._C import DispatchKey
    from torch._inductor.fx_passes.control_dependencies import control_deps

    def run(additional_deps: Any, subgraph: Any, *args: Any, **kwargs: Any) -> Any:
        return subgraph(*args, **kwargs)

    for key in (DispatchKey.CompositeExplicitAutograd, DispatchKey.Autograd):
        if key not in control_deps.py_kernels:
            control_deps.py_impl(key)(run)


def assume_aligned_outputs(op: Any) -> None:
    """Let Inductor assume that the tensors ``op`` returns are aligned (once per process).

    Inductor marks every output of a fallback op "assumed to be not aligned" when any tensor
    argument is unaligned (``FallbackKernel.create``, ``has_unaligned_input``), and a graph
    input on the CPU, such as a transfer's handle, always is (``should_assume_input_aligned``).
    The flag spreads to kernels that read the output, which on a GPU then lose vectorised
    loads. fxckpt's ``wait`` always returns a fresh allocation at offset 0, so its lowering
    here is Inductor's own fallback with that flag cleared; Inductor then asserts the
    alignment at run time (``assert_alignment``) instead of assuming the worst.
    """
    from torch._inductor import ir, lowering
    from torch._inductor.virtualized import V
    from torch.utils import _pytree as pytree

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
    """The per-compile Inductor setting that lets the FX graph cache store graphs in which
    :func:`run_after` wrapped nodes.

    ``control_deps`` is a higher-order op marked not cacheable (``HigherOrderOperator.
    cacheable``), so without this every compile of a pinned graph bypasses the cache
    ("Can't cache HigherOrderOperator: control_deps") and a warm process recompiles. The
    wrapped subgraphs are submodules of the graph module, whose code the cache key hashes,
    so a cached graph is keyed by what it runs. Adds to the user's own entries.
    """
    from torch._inductor import config
    from torch._inductor.fx_passes.control_dependencies import control_deps

    name = f"{control_deps.__module__}.{control_deps.__name__}"
    return {
        "unsafe_marked_cacheable_functions": {
            **config.unsafe_marked_cacheable_functions, name: torch.__version__
        }
    }


def inductor_channels_last_nodes(fw: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes of a training forward whose 4-D values Inductor lays out channels-last, by
    Inductor's own rules: none where ``GraphLowering.decide_layout_opt`` turns layout
    optimization off for the graph, else ``find_nodes_prefer_channels_last``, which reads
    only the graph (``self.module.graph``). The same in torch 2.11, 2.13 and 2.15."""
    from types import SimpleNamespace

    from torch._inductor.graph import GraphLowering

    if not GraphLowering.decide_layout_opt(fw, is_inference=False):
        return set()
    return set(GraphLowering.find_nodes_prefer_channels_last(SimpleNamespace(module=fw)))  # type: ignore[arg-type]


def non_overlapping_and_dense(val: torch.Tensor) -> bool:
    """Whether ``val``'s elements fill its extent once each (``False`` where that depends on
    symbols), as Inductor decides before it re-lays out an output."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return bool(is_non_overlapping_and_dense_or_false(val))


def inductor_mode_options() -> dict[str, dict[str, Any]]:
    """``torch.compile``'s ``mode`` names and the Inductor settings each stands for."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options())
