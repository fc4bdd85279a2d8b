"""Size symbols, the shape environment and fake tensors (part of :mod:`fxckpt._torch_compat`)."""

from __future__ import annotations

from typing import Any

import torch


def symbol_hints(shape_env: Any) -> dict[Any, Any]:
    """Each backed size symbol's value in the call being compiled."""
    # backed_var_to_val in 2.13 (var_to_val is its deprecated alias); var_to_val in 2.11.
    values = getattr(shape_env, "backed_var_to_val", None)
    return dict(values if values is not None else shape_env.var_to_val)


def symbol_upper_bound(shape_env: Any, symbol: Any) -> int | None:
    """The largest value dynamo allows ``symbol`` (``mark_dynamic``'s max, or a range it
    derived), or None where it is unbounded."""
    import sympy

    vr = shape_env.var_to_range.get(symbol)
    upper = getattr(vr, "upper", None)
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


# Re-planning a graph at run time (fxckpt.adapt) re-runs its compile outside dynamo.


def fake_inputs(example_inputs: Any) -> tuple[Any, list[Any]] | None:
    """The fake mode a backend compile runs in, and fake copies of its example inputs made as
    AOTAutograd makes them (``_aot_autograd.frontend_utils.process_inputs``): each real tensor
    with the symbolic context dynamo gave it, so a later compile from these fakes is made
    for the same symbolic sizes, under the same shape environment. None for inputs it cannot
    copy that way (tensor subclasses, fakes of another mode).

    Called inside dynamo's backend call, before the compile: the fake mode's memo then
    hands AOTAutograd these same fakes.
    """
    from torch._guards import TracingContext
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
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
            elif is_traceable_wrapper_subclass(x) or type(x) not in (torch.Tensor,
                                                                     torch.nn.Parameter):
                return None
            else:
                symbolic = contexts.get(x) if contexts else None
                source = None if symbolic is None else symbolic.tensor_source
                out.append(mode.from_tensor(x, symbolic_context=symbolic, source=source,
                                            trace=False))
    return mode, out


def recompiling(fake_mode: Any) -> Any:
    """A fresh tracing context over ``fake_mode``, for a compile outside dynamo."""
    from torch._guards import TracingContext, tracing

    return tracing(TracingContext(fake_mode))


def shape_guard_count(fake_mode: Any) -> int:
    """How many guards the shape environment of ``fake_mode`` holds (0 without one)."""
    env = getattr(fake_mode, "shape_env", None)
    return 0 if env is None else len(env.guards)


def detect_fake_mode(inputs: Any) -> Any:
    """The fake mode that traced ``inputs`` (dynamo's, while it compiles), or None."""
    from torch._guards import detect_fake_mode as detect

    return detect(inputs)


def no_tracing_context() -> Any:
    """A context outside any dynamo tracing context, for compiling another graph again from
    inside one graph's compile (AOTAutograd would otherwise write into the outer one's)."""
    from torch._guards import tracing

    return tracing(None)
