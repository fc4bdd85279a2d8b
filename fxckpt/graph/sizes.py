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
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import sympy
import torch

from fxckpt._torch_compat import size_hint, symbol_hints, symbol_source

_PLANNING_AT: contextvars.ContextVar[Mapping[sympy.Symbol, int] | None] = contextvars.ContextVar(
    "fxckpt_planning_at", default=None
)


@contextlib.contextmanager
def planning_at(values: Mapping[sympy.Symbol, int]) -> Iterator[None]:
    """Within the block, :func:`concrete` reads each symbol in ``values`` as that value."""
    token = _PLANNING_AT.set(dict(values) if values else None)
    try:
        yield
    finally:
        _PLANNING_AT.reset(token)


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
