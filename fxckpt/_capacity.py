"""The device's memory capacity, for ``memory_budget="auto"``.

On CUDA it is the card's total memory, as the driver reports it. On the CPU there is no card,
so the capacity must be stated: :func:`fxckpt.emulate_device_memory` sets it (the CPU then
stands for a card of that size), or ``FXCKPT_DEVICE_MEMORY="24GiB"`` for a whole process, read
here on first use and nowhere else. Nothing here runs at import.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType
from typing import Any

from fxckpt.errors import OptionsError
from fxckpt.units import parse_bytes

ENV_VAR = "FXCKPT_DEVICE_MEMORY"

_lock = threading.Lock()
_stated: list[int | None] = []  # empty: not read yet; [None]: none stated


def _from_env() -> int | None:
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return None
    try:
        value = parse_bytes(text, ENV_VAR)
    except OptionsError as e:
        raise OptionsError(ENV_VAR, text, 'a size such as "24GiB"; empty or unset: none stated',
                           e.detail) from None
    if not value:
        raise OptionsError(ENV_VAR, text, 'a positive size such as "24GiB"', "zero bytes")
    return value


def stated() -> int | None:
    """The capacity stated for the CPU (:func:`emulate_device_memory` or the environment)."""
    with _lock:
        if not _stated:
            _stated.append(_from_env())
        return _stated[0]


class EmulatedDeviceMemory:
    """The stated capacity; in a ``with`` statement, the previous one comes back at its end."""

    def __init__(self, previous: int | None, now: int | None) -> None:
        self.previous, self.bytes = previous, now

    def __enter__(self) -> EmulatedDeviceMemory:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _set(self.previous)

    def __repr__(self) -> str:
        return f"fxckpt.emulate_device_memory({self.bytes!r})"


def _set(value: int | None) -> None:
    with _lock:
        _stated[:] = [value]


def emulate_device_memory(capacity: Any) -> EmulatedDeviceMemory:
    """State the device's capacity on the CPU (bytes, or ``"24GiB"``); ``None`` states none.

    ``memory_budget="auto"`` is then that capacity less the margin, as on a card of that size.
    CUDA devices ignore it: their capacity is the driver's figure.
    """
    value = parse_bytes(capacity, "capacity", allow_none=True)
    if value == 0:
        raise OptionsError("capacity", capacity, 'a positive size such as "24GiB", or None',
                           "zero bytes")
    previous = stated()
    _set(value)
    return EmulatedDeviceMemory(previous, value)


def capacity_bytes(device: Any) -> int:
    """The memory capacity of ``device`` (a ``torch.device`` or its name)."""
    import torch  # lazily: importing fxckpt must not initialise CUDA

    dev = torch.device(device)
    if dev.type == "cpu":
        value = stated()
        if value is None:
            raise OptionsError(
                "memory_budget", "auto",
                "on the CPU, a stated capacity: fxckpt.emulate_device_memory('8GiB') or "
                f"{ENV_VAR}=8GiB; or a budget in bytes or a fraction",
                "the CPU has no card whose capacity 'auto' could read",
            )
        return value
    backend = getattr(torch, dev.type, None)
    mem_get_info = getattr(backend, "mem_get_info", None)  # torch.cuda, torch.xpu
    if mem_get_info is None:
        raise OptionsError("memory_budget", "auto", "an explicit budget in bytes or a fraction",
                           f"cannot read the capacity of device {str(dev)!r}")
    return int(mem_get_info(dev)[1])
