"""Concrete numbers for symbolic sizes, and the sizes a plan is made for.

Under dynamic shapes a saved tensor's bytes are an expression in the graph's size symbols
(``s0 * s1 * 128``). The planner works on numbers, so every size is read through
:func:`concrete`: by default the symbol's hint (the sizes of the call being compiled), or,
inside :func:`planning_at`, the values the plan is made for (a dimension's upper bound).
Nothing here installs a guard: reading a hint never constrains the compiled graph.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import sympy
import torch
import torch.fx as fx

from fxckpt._torch_compat import FloorDiv, size_hint, symbol_hints, symbol_source

_PLANNING_AT: contextvars.ContextVar[Mapping[sympy.Symbol, int] | None] = contextvars.ContextVar(
    "fxckpt_planning_at", default=None
)


_RANGED: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "fxckpt_ranged", default=None
)


@contextlib.contextmanager
def planning_at(values: Mapping[sympy.Symbol, int],
                ranged: frozenset[str] | None = None) -> Iterator[None]:
    """Within the block, :func:`concrete` reads each symbol in ``values`` as that value, and
    :func:`is_ranged` is true of the symbols named in ``ranged`` only (``None``: of all)."""
    token = _PLANNING_AT.set(dict(values) if values else None)
    ranged_token = _RANGED.set(ranged)
    try:
        yield
    finally:
        _RANGED.reset(ranged_token)
        _PLANNING_AT.reset(token)


def is_ranged(symbol: sympy.Symbol) -> bool:
    """Whether a bound on ``symbol``'s range fixes the plan (see :func:`planning_at`)."""
    ranged = _RANGED.get()
    return ranged is None or str(symbol) in ranged


def planning_values() -> Mapping[sympy.Symbol, int]:
    """The values :func:`planning_at` set for this block (empty outside one)."""
    return _PLANNING_AT.get() or {}


def concrete(value: Any, fallback: int = 4096) -> int:
    """An int for a size that may be symbolic: the planning value of its symbols, else their
    hints, else ``fallback``."""
    at = _PLANNING_AT.get()
    if at is None or not isinstance(value, torch.SymInt):
        return size_hint(value, fallback)
    expr = value.node.expr
    if not expr.free_symbols & at.keys():
        return size_hint(value, fallback)
    expr = expr.xreplace({s: sympy.Integer(v) for s, v in at.items()})
    expr = expr.xreplace(symbol_hints(value.node.shape_env))
    return int(expr) if expr.is_number else fallback


def numel_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s own elements (its view, not the storage behind it), sizes made
    :func:`concrete`."""
    return concrete(t.numel()) * t.element_size()


def size_symbols(values: Iterable[Any]) -> tuple[Any, set[sympy.Symbol]]:
    """The shape environment and the size symbols of ``values`` (tensors and SymInts)."""
    env, found = None, set()
    for v in values:
        dims = (*v.shape, *v.stride()) if isinstance(v, torch.Tensor) else (v,)
        for d in dims:
            if isinstance(d, torch.SymInt):
                env = d.node.shape_env
                found |= d.node.expr.free_symbols
    return env, found


def describe(shape_env: Any, values: Mapping[sympy.Symbol, int]) -> str:
    """``L['idx'].size()[1]=512, ...``: each symbol by the input dimension it stands for."""
    return ", ".join(f"{symbol_source(shape_env, s)}={v}" for s, v in sorted(values.items(), key=str))


# Symbolic sizes and strides reach ``wait`` as arithmetic over the SymInts the backward
# receives: min-cut binds every free symbol of a saved tensor to a backward input
# (``_extract_fwd_bwd_modules``), so these few operators rebuild any size or stride.
SYM_OPS: dict[type, Any] = {sympy.Add: operator.add, sympy.Mul: operator.mul, FloorDiv: operator.floordiv}


def sym_exprs(val: torch.Tensor) -> list[sympy.Expr]:
    return [
        d.node.expr for d in (*val.shape, *val.stride()) if isinstance(d, torch.SymInt)
    ]


def _expressible(expr: sympy.Expr, bound: set[sympy.Expr]) -> bool:
    if expr.is_Integer or expr in bound:
        return True
    if isinstance(expr, sympy.Pow):
        exp = expr.exp
        return bool(exp.is_Integer and exp > 0 and _expressible(expr.base, bound))
    if type(expr) in SYM_OPS:
        return all(_expressible(a, bound) for a in expr.args)
    return False


def bound_symbols(saved: Iterable[Any]) -> set[sympy.Expr]:
    """The symbolic expressions the backward receives as SymInt inputs, from the forward's
    saved outputs."""
    out = set()
    for n in saved:
        val = n.meta.get("val") if isinstance(n, fx.Node) else None
        if isinstance(val, torch.SymInt):
            out.add(val.node.expr)
    return out


def restorable(val: torch.Tensor, bound: set[sympy.Expr]) -> bool:
    """Whether ``wait`` can be handed ``val``'s sizes and strides inside the backward: each
    is an int, or sums, products, powers and floor divisions of SymInts in ``bound``."""
    return all(_expressible(e, bound) for e in sym_exprs(val))
