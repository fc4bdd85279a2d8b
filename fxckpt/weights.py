"""Streamed weights: parameters that live in host memory and come to the device per use.

``fxckpt.stream_weights(model, device="cuda")``, before ``torch.compile``, moves the chosen
parameters into fxckpt's host memory (pinned on a GPU machine) and puts a parametrization on
each: reading ``module.weight`` then returns ``fxckpt::stream_in(host_weight, device)``, a
device copy. Dynamo traces it like any op (one graph for a block loop), and the backend
schedules those copies: each use is a host-to-device copy issued ahead of the use, in the
forward and again in the backward, and the device copy is freed after its last use
(:mod:`fxckpt.passes.weights`).

Gradients: a frozen weight (``requires_grad=False``, the LoRA case) only ever travels to the
device. A trainable one's gradient is copied to the host as the backward produces it and
accumulated into the host parameter's ``.grad``; the optimizer steps on the host parameters
(torch's optimizers run on CPU tensors). Before any
optimizer step that holds a streamed weight, fxckpt blocks until every host-to-device copy of a
weight has read its bytes (:func:`fxckpt.runtime.weight_ops.fence`, a global step pre-hook):
the step may then write the host weights.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fxckpt.errors import OptionsError
from fxckpt.runtime import weight_ops

DEFAULT_MIN_BYTES = 64 * 2**10
# Parameters a stream_weights call replaced: an optimizer that still holds one steps on a
# tensor the model no longer reads.
# (A dict by identity: a WeakSet would compare tensors with ==.)
_REPLACED: dict[int, weakref.ref[torch.Tensor]] = {}
_hook: Any = None


class _Streamed(nn.Module):
    """The parametrization: the host weight in, its device copy out."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def forward(self, host: torch.Tensor) -> torch.Tensor:
        return torch.ops.fxckpt.stream_in(host, self.device)

    def extra_repr(self) -> str:
        return f"device={self.device}"


@dataclasses.dataclass(frozen=True)
class StreamedWeights:
    """What :func:`stream_weights` moved: parameter names (as ``model.named_parameters()``
    named them before), their bytes, and the device their copies go to."""

    names: tuple[str, ...]
    nbytes: int
    resident: tuple[str, ...]  # parameters left on the device
    device: torch.device

    def __repr__(self) -> str:
        return (f"StreamedWeights({len(self.names)} parameters, {self.nbytes} bytes streamed to "
                f"{self.device}; {len(self.resident)} resident)")


def stream_weights(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    modules: str | None = None,
    frozen_only: bool = False,
    min_bytes: int | None = None,
) -> StreamedWeights:
    """Keep ``model``'s parameters in host memory and stream them to ``device`` per use.

    - ``device``: where compute runs (default: where the parameters are now). The parameters
      may be on the device or on the CPU when this is called; each chosen one is copied into
      host memory and the original is released.
    - ``modules``: a regular expression; only parameters of modules whose path
      (``model.named_modules()``) it matches (``re.search``) are streamed. ``None``: all.
    - ``frozen_only``: stream only parameters that do not require grad (a LoRA base).
    - ``min_bytes``: smaller parameters stay resident (one copy per use costs a fixed overhead;
      biases and norms are not worth it). Default 64 KiB; when the default leaves nothing to
      stream, it is lowered to 0 and a warning says so.

    Call it once, after ``model.to(device)`` and before ``torch.compile`` and before building
    the optimizer (which must hold the host parameters: ``model.parameters()`` yields them).
    """
    dev = _device(model, device)
    pattern = _pattern(modules)
    if min_bytes is not None and (not isinstance(min_bytes, int) or isinstance(min_bytes, bool)
                                  or min_bytes < 0):
        raise OptionsError("min_bytes", min_bytes, "an int >= 0 (bytes), or None for 64 KiB")
    owners = _owners(model)
    chosen = _choose(owners, pattern, frozen_only, DEFAULT_MIN_BYTES if min_bytes is None else min_bytes)
    if not chosen and min_bytes is None:
        chosen = _choose(owners, pattern, frozen_only, 0)
        if chosen:
            warnings.warn(
                "fxckpt.stream_weights: every chosen parameter is under the default min_bytes "
                "(64 KiB); streaming them all (min_bytes=0). Pass min_bytes to choose.",
                stacklevel=2,
            )
    if not chosen:
        raise OptionsError("modules", modules, "a pattern that matches a module with parameters",
                           "no parameter to stream")  # fmt: skip
    _check_tied(owners, chosen, pattern)
    pinned = dev.type == "cuda"
    names, nbytes = [], 0
    for pid in chosen:
        places = owners[pid]
        old = places[0][2]
        if old.device.type == "meta":  # planning offline (fxckpt inspect): shapes, no data
            new = nn.Parameter(torch.empty_like(old, device="meta"), requires_grad=old.requires_grad)
            weight_ops.mark_host(new)  # host memory on the machine it plans for
        else:
            host = torch.empty(old.shape, dtype=old.dtype, device="cpu", pin_memory=pinned)
            with torch.no_grad():
                host.copy_(old.detach())
            new = nn.Parameter(host, requires_grad=old.requires_grad)
            weight_ops.adopt_host(new)
        _remember_replaced(old)
        for path, module, _ in places:
            name = path.rpartition(".")[2]
            module._parameters[name] = new
            parametrize.register_parametrization(module, name, _Streamed(dev), unsafe=True)
            names.append(path)
        nbytes += new.nbytes
    _install_fence()
    streamed = set(names)
    resident = tuple(p for p in _all_paths(owners) if p not in streamed)
    return StreamedWeights(tuple(names), nbytes, resident, dev)


def _remember_replaced(old: torch.Tensor) -> None:
    key = id(old)
    _REPLACED[key] = weakref.ref(old, lambda _: _REPLACED.pop(key, None))


def _device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is None:
        first = next(iter(model.parameters()), None)
        return first.device if first is not None else torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise OptionsError("device", device, 'a torch device, such as "cuda" or "cpu"') from err


def _pattern(modules: str | None) -> re.Pattern[str] | None:
    if modules is None:
        return None
    if not isinstance(modules, str):
        raise OptionsError("modules", modules, 'a regular expression over module paths, such as "blocks\\.\\d+"')
    try:
        return re.compile(modules)
    except re.error as err:
        raise OptionsError("modules", modules, "a valid regular expression", str(err)) from err


def _owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, torch.Tensor]]]:
    """Each parameter (by identity): every (path, owning module, tensor) it appears at."""
    owners: dict[int, list[tuple[str, nn.Module, torch.Tensor]]] = {}
    for mpath, module in model.named_modules(remove_duplicate=False):
        if parametrize.is_parametrized(module):
            raise OptionsError("model", type(model).__name__,
                               "a model fxckpt.stream_weights has not been called on",
                               f"module {mpath or '(root)'} is parametrized already")  # fmt: skip
        for pname, p in module._parameters.items():
            if p is not None:
                path = f"{mpath}.{pname}" if mpath else pname
                owners.setdefault(id(p), []).append((path, module, p))
    return owners


def _choose(owners: dict[int, list[tuple[str, nn.Module, torch.Tensor]]],
            pattern: re.Pattern[str] | None, frozen_only: bool, min_bytes: int) -> list[int]:
    chosen = []
    for pid, places in owners.items():
        p = places[0][2]
        if frozen_only and p.requires_grad:
            continue
        if p.nbytes < min_bytes or p.numel() == 0:
            continue
        if pattern is not None and not any(pattern.search(path.rpartition(".")[0]) for path, _, _ in places):
            continue
        chosen.append(pid)
    return chosen


def _check_tied(owners: dict[int, list[tuple[str, nn.Module, torch.Tensor]]], chosen: Iterable[int],
                pattern: re.Pattern[str] | None) -> None:
    """A tied parameter streams at all its places or none: half-streamed, its resident places
    would read a tensor the model no longer updates."""
    for pid in chosen:
        paths = [path for path, _, _ in owners[pid]]
        if pattern is not None and not all(pattern.search(p.rpartition(".")[0]) for p in paths):
            raise OptionsError(
                "modules", paths,
                "a choice that streams all of a tied parameter's places or none (or untie "
                "them first)", f"the parameter at {paths[0]} is tied to {', '.join(paths[1:])}",
            )  # fmt: skip


def _all_paths(owners: dict[int, list[tuple[str, nn.Module, torch.Tensor]]]) -> list[str]:
    return [path for places in owners.values() for path, _, _ in places]


def _install_fence() -> None:
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    streamed = False
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _REPLACED.get(id(p))
            if ref is not None and ref() is p:
                raise OptionsError(
                    "optimizer", type(optimizer).__name__,
                    "an optimizer built after fxckpt.stream_weights, over model.parameters()",
                    "it holds a parameter that stream_weights moved to host memory; the model "
                    "no longer reads it",
                )  # fmt: skip
            streamed = streamed or weight_ops.is_host(p)
    if streamed:
        weight_ops.fence()
