"""``Options``: every fxckpt knob, parsed and validated once at the backend's entry.

The backend builds one :class:`Options` and passes it down; no pass reads globals. Importing
this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import InitVar
from typing import TYPE_CHECKING, Any, TypeVar, cast

from fxckpt import _host
from fxckpt._host import HOST_AUTO_MARGIN, HOST_AUTO_MARGIN_BYTES  # noqa: F401  (documented here)
from fxckpt.errors import OptionsError
from fxckpt.runtime.settings import RuntimeSettings
from fxckpt.units import parse_bandwidth, parse_bytes

if TYPE_CHECKING:
    import torch

# memory_budget="auto" is the device's capacity less a margin for what the allocator's figure
# does not see but the card must hold: the CUDA context and library workspaces (cuBLAS,
# cuDNN, NCCL), and the caching allocator's fragmentation (reserved over allocated). 5 % of
# the capacity scales with the card; 1 GiB more covers the fixed-size part (on a card under
# 20 GiB, or a small capacity stated for the CPU, another 5 % instead).
AUTO_MARGIN = 0.05
AUTO_MARGIN_BYTES = 2**30

_BUDGET_ACCEPTED = (
    'None, a positive int number of bytes (the step\'s device peak), a string such as "12GiB" '
    'or "800MB", a float fraction in (0, 1] (from the lowest plan\'s step peak to plain '
    'torch.compile\'s), or "auto" (the device\'s capacity less a margin)'
)
_AUTO_FALLBACK = "an explicit budget in bytes or a fraction"
# Options of earlier versions that memory_budget replaces, and what to write instead.
REMOVED: dict[str, str] = {
    "peak_budget": (
        "memory_budget with the same bytes plus what the device holds when the step starts "
        "(memory_budget is now the step's absolute device peak, weights and optimizer state "
        "included); docs/options.md#migrating-from-peak_budget-device_budget-and-budget_scope"
    ),
    "device_budget": (
        "memory_budget (the step's device peak now counts the streamed weights' device copies "
        "and keeps resident the weights it has room for); "
        "docs/options.md#migrating-from-peak_budget-device_budget-and-budget_scope"
    ),
    "budget_scope": (
        "nothing: memory_budget always bounds the whole step, every graph and every run of a "
        "graph counted; docs/options.md#migrating-from-peak_budget-device_budget-and-budget_scope"
    ),
}
_HOST_BUDGET_ACCEPTED = (
    'None (no limit), an int number of bytes, a string such as "64GiB", a float fraction in '
    '(0, 1] of the machine\'s RAM, or "auto"'
)
_DIR_ACCEPTED = "None or the path of an existing, writable directory (ideally on NVMe)"
_MAX_COPY_STREAMS = 32  # the CUDA stream pool holds 32 streams per priority
# Options whose default the planner relaxes when only it stands between a budget and a plan
# that meets it: with no segment_stride of the user's own, the planner recomputes blocks.
RELAXABLE: tuple[str, ...] = ("segment_stride",)
_CHOICES: dict[str, tuple[str, ...]] = {
    "offload": ("auto", "never", "all"),
    "prefetch": ("auto", "jit"),
    "coalesce": ("auto", "never"),
    "cost_model": ("flops", "profile", "unit"),
    "compiler": ("inductor", "eager"),
    "on_infeasible": ("raise", "warn"),
    "adapt": ("auto", "never", "measure"),
}


def _parse_int(value: Any, option: str, low: int, high: int | None = None) -> int:
    accepted = f"an int >= {low}" if high is None else f"an int from {low} to {high}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionsError(option, value, accepted, f"a {type(value).__name__} is not an int")
    number = int(value)
    if number < low or (high is not None and number > high):
        raise OptionsError(option, value, accepted, "out of range")
    return number


def _parse_choice(value: Any, option: str, choices: tuple[str, ...]) -> str:
    accepted = "one of " + ", ".join(repr(c) for c in choices)
    if isinstance(value, str) and value in choices:
        return value
    near = difflib.get_close_matches(str(value).lower(), choices, n=1)
    raise OptionsError(option, value, accepted, f"did you mean {near[0]!r}?" if near else "")


def _parse_budget(value: Any) -> int | float | str | None:
    option, accepted = "memory_budget", _BUDGET_ACCEPTED
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value <= 0:
            raise OptionsError(option, value, accepted, "a float is a fraction in (0, 1]")
        if value > 1:
            detail = "a float is a fraction in (0, 1]; for bytes write an int or a string like "
            detail += "'12GiB'"
            raise OptionsError(option, value, accepted, detail)
        return value
    try:
        budget = parse_bytes(value, option)
    except OptionsError as e:
        raise OptionsError(option, value, accepted, e.detail) from None
    if budget == 0:
        raise OptionsError(option, value, accepted, "a zero budget; use None for no limit")
    return budget


def _parse_host_budget(value: Any) -> int | float | str | None:
    option, accepted = "host_budget", _HOST_BUDGET_ACCEPTED
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or not 0 < value <= 1:
            detail = "a float is a fraction in (0, 1] of the machine's RAM; for bytes write an "
            detail += "int or a string like '64GiB'"
            raise OptionsError(option, value, accepted, detail)
        return value
    try:
        return parse_bytes(value, option)
    except OptionsError as e:
        raise OptionsError(option, value, accepted, e.detail) from None


def _parse_dir(value: Any) -> str | None:
    option = "offload_dir"
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        detail = f"a {type(value).__name__} is not a path"
        raise OptionsError(option, value, _DIR_ACCEPTED, detail)
    path = os.fspath(value)
    if not isinstance(path, str) or not path.strip():
        raise OptionsError(option, value, _DIR_ACCEPTED, "an empty path")
    if "\0" in path:
        raise OptionsError(option, value, _DIR_ACCEPTED, "a NUL character in the path")
    return os.path.abspath(os.path.expanduser(path))


_T = TypeVar("_T")


class _Default:
    """The default of an :class:`Options` field, told apart from the same value passed on
    purpose; ``Options.__post_init__`` unwraps it, so no instance ever holds one."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:  # what help(Options) and inspect.signature show as the default
        return repr(self.value)


def _default(value: _T) -> _T:
    """A field's default, marked so that ``__post_init__`` can leave it out of ``explicit``.

    Typed as the value, so type checkers see the field's real default. A mutable value is
    refused as dataclasses refuses it (the marker would hide it from that check); such a field
    takes ``field(default_factory=lambda: _Default([]))``, which ``__post_init__`` unwraps too.
    """
    if type(value).__hash__ is None:
        raise ValueError(f"mutable default {type(value).__name__} for an option: use a factory")
    return cast(_T, _Default(value))


def _unwrap(value: Any) -> tuple[Any, bool]:
    """``(value, explicit)``: the value a field holds once a :class:`_Default` is unwrapped, and
    whether the caller passed it (rather than taking the default)."""
    return (value.value, False) if isinstance(value, _Default) else (value, True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """Every fxckpt option, validated and normalised on construction (docs/options.md).

    After ``__post_init__``: ``memory_budget`` is ``None``, a positive int of bytes, a float in
    (0, 1] or ``"auto"``; ``segment_width`` is an int ≤ ``segment_stride``; byte options are
    ints; ``bandwidth`` is a float or ``None``. ``dataclasses.replace`` re-validates, but a
    defaulted ``segment_width`` has already been set to the old stride, and every option it
    passes counts as set explicitly.

    :attr:`explicit` names the options the caller set. A default is not a constraint: where
    only a default stands between a budget and a plan that meets it, the planner relaxes it
    (and says so in the plan's notes); an option set explicitly is kept, and a budget it makes
    impossible raises :class:`~fxckpt.errors.BudgetError`.
    """

    # Each default is a _default(...): __post_init__ unwraps it and records the rest as explicit.
    memory_budget: int | float | str | None = _default(None)
    segment_stride: int = _default(0)
    segment_width: int | None = _default(None)
    offload: str = _default("auto")
    min_offload_bytes: int = _default(0)
    prefetch: str = _default("auto")
    coalesce: str = _default("auto")
    copy_streams: int = _default(1)
    host_budget: int | float | str | None = _default(None)
    offload_dir: str | None = _default(None)
    offload_dir_bandwidth: float | None = _default(None)
    # A documented alias of host_budget that takes bytes only (the name of earlier versions).
    pinned_pool_bytes: InitVar[int | str | None] = _default(None)
    bandwidth: float | None = _default(None)
    cost_model: str = _default("flops")
    compiler: str = _default("inductor")
    on_infeasible: str = _default("raise")
    # Re-plan a graph whose measured copies contradict its plan's assumptions (fxckpt.adapt).
    adapt: str = _default("auto")
    blocks: str | None = _default(None)
    block_index: int | None = _default(None)

    def __post_init__(self, pinned_pool_bytes: int | str | None = None) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)  # the dataclass is frozen

        # Every value the caller passed counts as explicit, a default's own value included
        # (Options(memory_budget=None) sets it); a default left alone arrives as a _Default.
        # A sorted tuple, not a set: Inductor pickles the options into its cache key, and a
        # set of strings pickles in an order that changes from one process to the next.
        explicit = []
        for f in dataclasses.fields(self):
            value, passed = _unwrap(getattr(self, f.name))
            put(f.name, value)
            if passed:
                explicit.append(f.name)
        pinned_pool_bytes, passed = _unwrap(pinned_pool_bytes)
        if passed:
            explicit.append("pinned_pool_bytes")
        put("_explicit", tuple(sorted(explicit)))

        put("memory_budget", _parse_budget(self.memory_budget))
        stride = _parse_int(self.segment_stride, "segment_stride", 0)
        put("segment_stride", stride)
        width = stride if self.segment_width is None else self.segment_width
        width = _parse_int(width, "segment_width", 0)
        if width > stride:
            accepted = f"None or an int from 0 to segment_stride ({stride})"
            detail = f"segment_width must not exceed segment_stride={stride}"
            raise OptionsError("segment_width", width, accepted, detail)
        put("segment_width", width)
        put("min_offload_bytes", parse_bytes(self.min_offload_bytes, "min_offload_bytes"))
        put("copy_streams", _parse_int(self.copy_streams, "copy_streams", 1, _MAX_COPY_STREAMS))
        put("host_budget", _parse_host_budget(self.host_budget))
        alias = parse_bytes(pinned_pool_bytes, "pinned_pool_bytes", allow_none=True)
        if alias is not None:
            if self.host_budget is not None and self.host_budget != alias:
                accepted = f"only one of the two, or the same bytes as host_budget={self.host_budget!r}"
                detail = "pinned_pool_bytes is an alias of host_budget"
                raise OptionsError("pinned_pool_bytes", pinned_pool_bytes, accepted, detail)
            put("host_budget", alias)
        put("offload_dir", _parse_dir(self.offload_dir))
        rate = parse_bandwidth(self.offload_dir_bandwidth, "offload_dir_bandwidth")
        put("offload_dir_bandwidth", rate)
        put("bandwidth", parse_bandwidth(self.bandwidth, "bandwidth"))
        for name, choices in _CHOICES.items():
            put(name, _parse_choice(getattr(self, name), name, choices))
        if self.offload_dir is not None and self.offload == "never":
            accepted = "None when offload='never' (nothing is offloaded, so nothing reaches it)"
            detail = "offload='never' and an offload_dir contradict each other"
            raise OptionsError("offload_dir", self.offload_dir, accepted, detail)
        _check_blocks(self.blocks)
        if self.block_index is not None:
            put("block_index", _parse_int(self.block_index, "block_index", 0))
            if self.blocks is not None:
                accepted = "None when blocks is given (block_index makes the graph one block)"
                detail = f"block_index and blocks={self.blocks!r} both say where blocks are"
                raise OptionsError("block_index", self.block_index, accepted, detail)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | Options | None) -> Options:
        """Build Options from ``torch.compile(options=...)``; an Options instance is returned as is.

        An unknown key raises :class:`OptionsError` that suggests the nearest valid name.
        """
        if mapping is None:
            return cls()
        if isinstance(mapping, Options):
            return mapping
        if not isinstance(mapping, Mapping):
            raise OptionsError("options", mapping, "a mapping of option names to values")
        for key, value in mapping.items():
            if key in REMOVED:
                raise OptionsError(str(key), value, REMOVED[key], f"{key!r} was removed")
            if key not in OPTION_NAMES:
                near = suggest_option(str(key))
                hint = f"; did you mean {near[0]!r}?" if near else ""
                detail = f"unknown option {key!r}{hint}"
                raise OptionsError(str(key), value, "one of " + ", ".join(OPTION_NAMES), detail)
        return cls(**mapping)

    @property
    def explicit(self) -> frozenset[str]:
        """The names of the options the caller set, defaults left out."""
        return frozenset(self._explicit)  # type: ignore[attr-defined]

    def is_explicit(self, name: str) -> bool:
        return name in self.explicit

    def to_dict(self) -> dict[str, Any]:
        """Every option by name; the values are JSON-friendly (None, int, float, str)."""
        return dataclasses.asdict(self)

    def cache_key(self) -> str:
        """A stable sha256 hex digest of the options, for compile-cache keys; with them, which
        of :data:`RELAXABLE` were set explicitly (a plan may relax a default, not a choice)."""
        doc = {**self.to_dict(), "explicit": sorted(self.explicit & set(RELAXABLE))}
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def resolve_budget(self, *, device: torch.device | str | None = None) -> int | None:
        """The step's budget in bytes, or ``None`` where there is no limit or it is a fraction
        (each graph resolves a fraction against its own range of plans).

        ``"auto"`` is ``device``'s capacity (:func:`fxckpt._capacity.capacity_bytes`) less
        ``AUTO_MARGIN`` of it and ``AUTO_MARGIN_BYTES``, never below 0.
        """
        budget = self.memory_budget
        if budget is None or isinstance(budget, (int, float)) and not isinstance(budget, bool):
            return budget if isinstance(budget, int) else None
        from fxckpt._capacity import capacity_bytes

        total = capacity_bytes("cpu" if device is None else device)
        return auto_budget(total)

    def resolve_host_budget(self) -> int | None:
        """The host budget in bytes, or ``None`` when there is no limit
        (:func:`fxckpt._host.resolve_host_budget`: ``"auto"`` is resolved once per process)."""
        return _host.resolve_host_budget(self.host_budget)

    def runtime_settings(self) -> RuntimeSettings:
        """The options the runtime carries out (one runtime profile per distinct set)."""
        return RuntimeSettings(self.copy_streams, self.host_budget, self.offload_dir)


# Read as an attribute, the alias gives the option it sets (earlier versions read it so).
Options.pinned_pool_bytes = property(  # type: ignore[attr-defined]
    lambda self: self.host_budget, doc="Alias of ``host_budget`` (bytes only when given)."
)


def _check_blocks(blocks: Any) -> None:
    accepted = "None or a regular expression over module paths, such as r'layers\\.\\d+$'"
    if blocks is None:
        return
    if not isinstance(blocks, str):
        raise OptionsError("blocks", blocks, accepted, f"a {type(blocks).__name__} is not a regex")
    if not blocks:
        raise OptionsError("blocks", blocks, accepted, "an empty regex matches every module")
    try:
        re.compile(blocks)
    except re.error as e:
        raise OptionsError("blocks", blocks, accepted, f"invalid regex: {e}") from None


def auto_budget(capacity: int) -> int:
    """``memory_budget="auto"`` on a device of ``capacity`` bytes."""
    fixed = min(AUTO_MARGIN_BYTES, int(capacity * AUTO_MARGIN))
    return max(0, int(capacity * (1 - AUTO_MARGIN)) - fixed)


# Names that Options accepts but does not keep: each sets the option it maps to.
ALIASES: dict[str, str] = {"pinned_pool_bytes": "host_budget"}
OPTION_NAMES: tuple[str, ...] = (*(f.name for f in dataclasses.fields(Options)), *ALIASES)


def suggest_option(key: str) -> list[str]:
    """The option names a mistyped ``key`` most likely meant, best first (at most two).

    A name the key is part of, or that is part of the key, comes before a merely similar
    spelling, and among those the options come in the order of :class:`Options`, most used
    first: ``budget`` means ``memory_budget`` before ``host_budget``, ``stride`` means
    ``segment_stride``.
    """
    norm = key.strip().lower().replace("-", "_")
    if not norm:
        return []
    names = list(OPTION_NAMES)
    found = [n for n in names if norm in n or n in norm]
    for n in difflib.get_close_matches(norm, names, n=2):
        if n not in found:
            found.append(n)
    return found[:2]


# The environment variable that carries options where code cannot pass them (a JSON object).
ENV_OPTIONS = "FXCKPT_OPTIONS"


def options_from_env(env_var: str = ENV_OPTIONS) -> dict[str, Any]:
    """Return the JSON object in ``env_var``, or ``{}`` when it is unset or empty.

    For callers such as the HF Trainer, which cannot pass ``options=``. The keys and values are
    validated later by :meth:`Options.from_mapping`.
    """
    text = os.environ.get(env_var, "")
    if not text.strip():
        return {}
    accepted = 'a JSON object such as {"memory_budget": "12GiB", "segment_stride": 2}'
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise OptionsError(env_var, text, accepted, f"invalid JSON: {e}") from None
    if not isinstance(parsed, dict):
        detail = f"a JSON {type(parsed).__name__}, not an object"
        raise OptionsError(env_var, text, accepted, detail)
    return parsed
