"""What a compiled forward really holds for its backward, measured on its first training call.

A plan counts the tensors the partitioned forward saves. What the backward holds is decided
later, by whatever compiles that forward: a compiler may save a copy in another layout, pad a
tensor's strides, or save something the plan never saw. fxckpt accounts for what it knows
(:mod:`fxckpt.passes.saved_layout`); this module catches the rest.

On a compiled graph's first call with autograd recording, every tensor autograd saves for
the backward passes through a ``saved_tensors_hooks`` pack hook, which notes its storage.
Storages shared with the call's inputs (parameters, buffers, the model's inputs) are left
out: they are alive whatever the plan says. What remains, on the graph's device, is what
the forward left behind for the backward: the measured held bytes. They are compared with
the plan the forward's note reported; where a budget the plan met is exceeded,
:class:`~fxckpt.runtime.stats.BudgetOverrunWarning` says so once, with the figures and the
largest tensors the plan did not count. Later calls go straight through.

The check reads real tensors, never the plan's figures, and costs one hook call per saved
tensor, once. It stands aside where the caller has saved-tensor hooks of its own (they must
see every tensor) or has disabled them, and under ``torch.no_grad``, and tries again at the
next call, and so it does for a call on fake tensors (dynamo's DDP optimizer runs each
compiled submodule on fake inputs while it compiles the next).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from fxckpt._torch_compat import is_fake_tensor, pytree, saved_tensors_hooks_free
from fxckpt.runtime import stats
from fxckpt.runtime.handles import handle_ptrs


def _fake(args: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and is_fake_tensor(t) for t in pytree.tree_leaves(args))


def _device_of(args: Any) -> torch.device:
    for leaf in pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor) and leaf.device.type not in ("cpu", "meta"):
            return leaf.device
    return torch.device("cpu")


class _Saved:
    """The storages autograd saved during one call, graph inputs left out."""

    def __init__(self, args: Any, device: torch.device) -> None:
        self.device = device
        self.inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves(args)
            if isinstance(t, torch.Tensor) and t.layout == torch.strided
        }
        self.storages: dict[int, tuple[int, torch.Size, tuple[int, ...], torch.dtype]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if (
            t.layout == torch.strided
            and t.device.type == self.device.type
            and (self.device.index is None or t.device.index == self.device.index)
        ):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.inputs and ptr not in self.storages:
                self.storages[ptr] = (storage.nbytes(), t.shape, t.stride(), t.dtype)
        return t

    def held(self, exclude: set[int]) -> dict[int, tuple[int, torch.Size, tuple[int, ...], torch.dtype]]:
        return {p: v for p, v in self.storages.items() if p not in exclude}


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def checked(
    compiled: Callable[..., Any], on_plan: Callable[[str], None] | None = None
) -> Callable[..., Any]:
    """``compiled``, measured on its first call that records autograd (see the module doc).

    ``on_plan`` receives the plan payload that call reported (a step budget learns there what
    a graph from a warm compile cache holds)."""
    armed = [True]

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        if (not armed[0] or not torch.is_grad_enabled() or not saved_tensors_hooks_free()
                or _fake((args, kwargs))):
            # A fake call (dynamo's DDP optimizer propagating shapes) has no storages to read.
            return compiled(*args, **kwargs)
        armed[0] = False
        device = _device_of((args, kwargs))
        saved = _Saved((args, kwargs), device)
        stats.take_note()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack):
            out = compiled(*args, **kwargs)
        note = stats.take_note()
        if note is None:
            # No fxckpt plan ran: an inference graph, which saves nothing; a later call may
            # be the training one.
            armed[0] = not saved.storages
            return out
        payload, _, kept = note
        if on_plan is not None:
            on_plan(payload)
        held = saved.held(handle_ptrs() if device.type == "cpu" else set())
        unplanned = [
            (nbytes, list(shape), list(stride), str(dtype).removeprefix("torch."))
            for ptr, (nbytes, shape, stride, dtype) in held.items()
            if ptr not in kept
        ]
        stats.held_measured(payload, sum(v[0] for v in held.values()), unplanned)
        return out

    return run
