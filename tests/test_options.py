"""Options: parsing, validation, normalisation, budget resolution and the environment hook."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fxckpt
from fxckpt import _capacity, _host
from fxckpt.errors import OptionsError
from fxckpt.options import (
    AUTO_MARGIN,
    AUTO_MARGIN_BYTES,
    OPTION_NAMES,
    REMOVED,
    Options,
    auto_budget,
    options_from_env,
    parse_bandwidth,
    parse_bytes,
)

GiB = 2**30
MiB = 2**20
NAN = float("nan")
INF = float("inf")

# (extra valid options, the option that is wrong, its bad value). Every option appears, with
# each kind of mistake that applies to it.
BAD_CASES: list[tuple[dict[str, Any], str, Any]] = [
    *(({}, "memory_budget", v) for v in [
        True, False, 0, -1, 0.0, -0.5, NAN, INF, -INF, 1.5, 1e9, "0", "0B", "-5GB",
        "12 GiBs", "12 XB", "12G", "lots", "", "Auto", "1.5B", "1e999", [1], {"a": 1}, b"12GiB",
    ]),
    *(({}, "segment_stride", v) for v in [-1, 2.0, True, False, "2", None, NAN]),
    *(({}, "segment_width", v) for v in [-1, 1.5, True, "1", NAN]),
    ({"segment_stride": 2}, "segment_width", 3),  # width > stride
    ({"segment_stride": 0}, "segment_width", 1),  # width > stride when segmenting is off
    *(({}, "offload", v) for v in ["sometimes", "Never", "", None, 1, True]),
    *(({}, "min_offload_bytes", v) for v in [
        -1, None, True, 1.5, NAN, INF, -1.0, "12 GiBs", "12 XB", "1MB/s", "big", "1.5B", [],
    ]),
    *(({}, "prefetch", v) for v in ["early", "JIT", None, 0]),
    *(({}, "coalesce", v) for v in ["always", "Never", None, True]),
    *(({}, "copy_streams", v) for v in [0, -1, 33, True, 1.0, "2", None, NAN]),
    *(({}, "pinned_pool_bytes", v) for v in [-1, True, NAN, INF, 0.5, "12 XB", "12 GiBs", []]),
    ({"host_budget": 4096}, "pinned_pool_bytes", 8192),  # an alias that says otherwise
    *(({}, "host_budget", v) for v in [
        -1, True, NAN, INF, -INF, 0.0, -0.5, 1.5, 12e9, "12 XB", "12 GiBs", "-4KiB", "Auto",
        "lots", "", [], b"64GiB",
    ]),
    *(({}, "offload_dir", v) for v in [3, 1.5, True, b"/tmp", [], "", "   ", "/tmp/a\0b"]),
    ({"offload": "never"}, "offload_dir", "/tmp"),  # nothing would ever reach it
    *(({}, "offload_dir_bandwidth", v) for v in [0, -1, NAN, INF, True, "fast", "2GB/h", []]),
    *(({}, "bandwidth", v) for v in [
        0, 0.0, -1, -1e9, NAN, INF, True, False, "fast", "25GB/h", "0GB/s", "-1GB/s",
        "25 XB/s", [], 10**400,
    ]),
    *(({}, "cost_model", v) for v in ["time", "FLOPS", None, 1]),
    *(({}, "compiler", v) for v in ["aot_eager", "Inductor", None, False]),
    *(({}, "on_infeasible", v) for v in ["ignore", "Raise", None, False]),
    *(({}, "adapt", v) for v in ["always", "Auto", None, True, 2]),
    *(({}, "blocks", v) for v in ["(", "layers[", "*", "", 3, b"layers", ["layers"]]),
    *(({}, "block_index", v) for v in [-1, "0", 1.0, True]),
    ({"blocks": "layers"}, "block_index", 0),
    # Unknown keys: the error names the key and the value it was given.
    ({}, "memory_budjet", "12GiB"),
    ({}, "segment_strid", 2),
    ({}, "Offload", "all"),
    ({}, "no_such_option", None),
]  # fmt: skip


def _case_id(case: tuple[dict[str, Any], str, Any]) -> str:
    extra, name, value = case
    prefix = ",".join(f"{k}={v!r}" for k, v in extra.items())
    return f"{prefix + ',' if prefix else ''}{name}={value!r}"[:60]


def test_every_option_has_a_bad_case() -> None:
    covered = {name for _, name, _ in BAD_CASES}
    assert set(OPTION_NAMES) <= covered, set(OPTION_NAMES) - covered


@pytest.mark.parametrize("case", BAD_CASES, ids=[_case_id(c) for c in BAD_CASES])
def test_bad_value_names_option_and_value(case: tuple[dict[str, Any], str, Any]) -> None:
    extra, name, value = case
    with pytest.raises(OptionsError) as info:
        Options.from_mapping({**extra, name: value})
    message = str(info.value)
    assert info.value.option == name
    assert repr(name) in message
    assert repr(value) in message
    assert info.value.accepted and info.value.accepted in message


@pytest.mark.parametrize("case", [c for c in BAD_CASES if c[1] in OPTION_NAMES], ids=_case_id)
def test_bad_value_raises_from_constructor_too(case: tuple[dict[str, Any], str, Any]) -> None:
    extra, name, value = case
    with pytest.raises(OptionsError) as info:
        Options(**{**extra, name: value})
    assert info.value.option == name


def test_options_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="segment_stride"):
        Options(segment_stride=-1)


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [("memory_budjet", "memory_budget"), ("segment_strid", "segment_stride"),
     ("Offload", "offload"), ("copystreams", "copy_streams"), ("block", "blocks"),
     # A user who writes budget means the device budget, not host_budget (the closer spelling).
     ("budget", "memory_budget"), ("Budget", "memory_budget"), ("mem_budget", "memory_budget"),
     ("stride", "segment_stride"), ("width", "segment_width")],
)  # fmt: skip
def test_unknown_key_suggests_nearest(key: str, suggestion: str) -> None:
    with pytest.raises(OptionsError) as info:
        Options.from_mapping({key: 1})
    message = str(info.value)
    assert f"unknown option {key!r}; did you mean {suggestion!r}?" in message
    assert all(name in message for name in OPTION_NAMES)  # lists the valid options


def test_unknown_key_without_near_name_has_no_suggestion() -> None:
    with pytest.raises(OptionsError) as info:
        Options.from_mapping({"zzzzzz": 1})
    assert "did you mean" not in str(info.value)
    assert "unknown option 'zzzzzz'" in str(info.value)


def test_width_above_stride_names_the_stride() -> None:
    with pytest.raises(OptionsError) as info:
        Options(segment_stride=2, segment_width=3)
    assert info.value.option == "segment_width"
    assert "segment_stride=2" in str(info.value)


def test_float_budget_above_one_explains_fractions() -> None:
    with pytest.raises(OptionsError, match=r"a float is a fraction in \(0, 1\]; for bytes write"):
        Options(memory_budget=12e9)


def test_enum_typo_suggests_choice() -> None:
    with pytest.raises(OptionsError, match="did you mean 'never'"):
        Options(offload="Never")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12GiB", 12 * GiB), ("800MB", 800_000_000), ("12 GB", 12_000_000_000),
        ("1.5GiB", 3 * GiB // 2), ("1024", 1024), ("64KiB", 64 * 1024), ("0", 0),
        ("12gib", 12 * GiB), ("12gb", 12_000_000_000), ("5b", 5), ("5B", 5), ("2TiB", 2 * 2**40),
        ("3TB", 3 * 10**12), ("7KB", 7000), ("1MiB", MiB), ("  12 GiB  ", 12 * GiB),
        ("1e9", 10**9), ("0.5KB", 500), ("1.3GiB", math.floor(1.3 * GiB)), (".5MiB", MiB // 2),
        (1e9, 10**9), (0, 0), (12 * GiB, 12 * GiB), (0.0, 0),
    ],
)  # fmt: skip
def test_parse_bytes_exact(text: Any, expected: int) -> None:
    result = parse_bytes(text, "x")
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    "value", ["12 GiBs", "12 XB", "1.5B", "1.5", "-1", "GiB", "", "1e", "1 2", -1, 1.5, NAN, True]
)
def test_parse_bytes_rejects(value: Any) -> None:
    with pytest.raises(OptionsError) as info:
        parse_bytes(value, "some_option")
    assert info.value.option == "some_option"
    assert repr(value) in str(info.value)
    assert '"12GiB"' in str(info.value)  # shows the accepted forms


def test_parse_bytes_none() -> None:
    assert parse_bytes(None, "x", allow_none=True) is None
    with pytest.raises(OptionsError):
        parse_bytes(None, "x")


@given(st.integers(min_value=0, max_value=2**80))
def test_parse_bytes_round_trips_ints(n: int) -> None:
    assert parse_bytes(f"{n}B", "x") == n
    assert parse_bytes(n, "x") == n
    assert parse_bytes(f"{n} KiB", "x") == n * 1024
    assert parse_bytes(f"{n}kb", "x") == n * 1000


@pytest.mark.parametrize(
    ("value", "expected"),
    [("25GB/s", 25e9), ("12 GiB/s", 12.0 * GiB), ("25GB", 25e9), ("1 MB / S", 1e6),
     (1e9, 1e9), (3, 3.0), (None, None)],
)  # fmt: skip
def test_parse_bandwidth(value: Any, expected: float | None) -> None:
    assert parse_bandwidth(value, "bandwidth") == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("auto", "auto"), (0.5, 0.5), (1.0, 1.0), (1, 1), (4096, 4096),
     ("12GiB", 12 * GiB), ("800MB", 800_000_000), (1e-3, 1e-3)],
)  # fmt: skip
def test_memory_budget_normalised(value: Any, expected: Any) -> None:
    budget = Options(memory_budget=value).memory_budget
    assert budget == expected
    assert type(budget) is type(expected)


def test_defaults() -> None:
    o = Options()
    assert o.to_dict() == {
        "memory_budget": None, "segment_stride": 0, "segment_width": 0, "offload": "auto",
        "min_offload_bytes": 0, "prefetch": "auto", "coalesce": "auto", "copy_streams": 1,
        "host_budget": None, "offload_dir": None, "offload_dir_bandwidth": None,
        "bandwidth": None, "cost_model": "flops",
        "compiler": "inductor", "on_infeasible": "raise", "adapt": "auto", "blocks": None,
        "block_index": None,
    }  # fmt: skip


@pytest.mark.parametrize(("stride", "width", "expected"), [(2, None, 2), (3, 1, 1), (4, 0, 0)])
def test_segment_width_defaults_to_stride(stride: int, width: int | None, expected: int) -> None:
    o = Options(segment_stride=stride, segment_width=width)
    assert (o.segment_stride, o.segment_width) == (stride, expected)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [("offload", "never", "never"), ("offload", "all", "all"), ("prefetch", "jit", "jit"),
     ("coalesce", "never", "never"),
     ("cost_model", "profile", "profile"), ("cost_model", "unit", "unit"),
     ("compiler", "eager", "eager"), ("on_infeasible", "warn", "warn"),
     ("adapt", "never", "never"), ("adapt", "measure", "measure"),
     ("memory_budget", "auto", "auto"), ("block_index", 3, 3),
     ("copy_streams", 32, 32), ("min_offload_bytes", "64KiB", 64 * 1024),
     ("min_offload_bytes", 0, 0), ("pinned_pool_bytes", "8GiB", 8 * GiB),
     ("host_budget", "64GiB", 64 * GiB), ("host_budget", 0, 0), ("host_budget", 0.25, 0.25),
     ("host_budget", "auto", "auto"), ("offload_dir_bandwidth", "2GB/s", 2e9),
     ("bandwidth", "25GB/s", 25e9), ("blocks", r"layers\.\d+$", r"layers\.\d+$")],
)  # fmt: skip
def test_good_values(name: str, value: Any, expected: Any) -> None:
    assert getattr(Options.from_mapping({name: value}), name) == expected


def test_from_mapping_passthrough_and_none() -> None:
    o = Options(segment_stride=2)
    assert Options.from_mapping(o) is o
    assert Options.from_mapping(None) == Options()
    assert Options.from_mapping({}) == Options()
    with pytest.raises(OptionsError) as info:
        Options.from_mapping([("segment_stride", 2)])  # type: ignore[arg-type]
    assert info.value.option == "options"


def test_options_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        Options("12GiB")  # type: ignore[misc]


def test_frozen() -> None:
    o = Options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.memory_budget = 5  # type: ignore[misc]
    assert o.memory_budget is None


def test_to_dict_round_trips_through_json() -> None:
    o = Options.from_mapping(
        {"memory_budget": 0.5, "segment_stride": 3, "segment_width": 1, "bandwidth": "25GB/s",
         "blocks": r"h\.\d+", "pinned_pool_bytes": "1GiB"}
    )  # fmt: skip
    d = json.loads(json.dumps(o.to_dict()))
    assert Options.from_mapping(d) == o


def test_cache_key_is_sha256_of_sorted_json() -> None:
    o = Options(memory_budget="12GiB")
    doc = {**o.to_dict(), "explicit": []}  # memory_budget is no default the planner relaxes
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    assert o.cache_key() == hashlib.sha256(text.encode()).hexdigest()


def test_cache_key_equal_for_equal_options() -> None:
    a = Options.from_mapping({"memory_budget": "12GiB", "segment_stride": 2, "bandwidth": "25GB/s"})
    b = Options.from_mapping(
        {"bandwidth": 25e9, "segment_width": 2, "segment_stride": 2, "memory_budget": 12 * GiB}
    )
    assert a == b
    assert a.cache_key() == b.cache_key()
    assert hash(a) == hash(b)


@pytest.mark.parametrize(
    "changes",
    [{"memory_budget": 1}, {"memory_budget": 1.0}, {"segment_stride": 1}, {"offload": "all"},
     {"min_offload_bytes": MiB}, {"prefetch": "jit"}, {"copy_streams": 2},
     {"pinned_pool_bytes": 0}, {"host_budget": 0.5}, {"host_budget": "auto"},
     {"offload_dir": "/tmp"}, {"offload_dir_bandwidth": "1GB/s"}, {"bandwidth": 1},
     {"cost_model": "unit"},
     {"compiler": "eager"}, {"on_infeasible": "warn"}, {"adapt": "never"},
     {"memory_budget": "auto"}, {"block_index": 0}, {"blocks": "x"}],
)  # fmt: skip
def test_cache_key_differs_for_different_options(changes: dict[str, Any]) -> None:
    assert Options.from_mapping(changes).cache_key() != Options().cache_key()


def test_options_know_what_was_set_explicitly() -> None:
    assert Options().explicit == frozenset()
    set_ = Options(segment_stride=0, memory_budget=0.5)
    assert set_.explicit == {"segment_stride", "memory_budget"}
    assert Options.from_mapping({"offload": "auto"}).is_explicit("offload")
    # The same values, one set on purpose: a plan may relax only the default.
    assert set_ == Options(memory_budget=0.5) and set_.cache_key() != Options(memory_budget=0.5).cache_key()
    assert pickle.loads(pickle.dumps(set_)).explicit == set_.explicit  # travels in cache keys


def test_explicit_is_what_was_passed_not_what_differs() -> None:
    # A default passed on purpose counts; the alias is named as passed; a default left alone
    # leaves no marker behind (every field holds its plain value, the dataclass's own __init__).
    assert Options(memory_budget=None, pinned_pool_bytes=None).explicit == {"memory_budget", "pinned_pool_bytes"}
    assert not hasattr(Options.__init__, "__wrapped__")
    assert all(type(v).__name__ != "_Default" for v in vars(Options()).values())
    # dataclasses.replace passes every field (and the alias, read back as host_budget) again.
    replaced = dataclasses.replace(Options(memory_budget=0.5), segment_stride=2)
    assert replaced.explicit == {*(f.name for f in dataclasses.fields(Options)), "pinned_pool_bytes"}


def test_cache_key_distinguishes_int_from_fraction() -> None:
    assert Options(memory_budget=1).cache_key() != Options(memory_budget=1.0).cache_key()


def test_option_names() -> None:
    fields = tuple(f.name for f in dataclasses.fields(Options))
    assert OPTION_NAMES == (*fields, "pinned_pool_bytes")  # the alias is accepted, not kept
    assert len(fields) == 18
    assert not set(REMOVED) & set(OPTION_NAMES)  # the removed options are no longer accepted


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(None, None), (4096, 4096), ("1KiB", 1024), ("12GiB", 12 * GiB), (1, 1),
     # A fraction is resolved by each graph against its own range of plans, not here.
     (0.5, None), (1e-3, None), (1.0, None)],
)  # fmt: skip
def test_resolve_budget(budget: Any, expected: int | None) -> None:
    options = Options(memory_budget=budget)
    resolved = options.resolve_budget()
    assert resolved == expected
    assert resolved is None or type(resolved) is int
    # Bytes are bytes on any device: only "auto" reads the device.
    assert options.resolve_budget(device="meta") == expected


def test_resolve_budget_takes_only_a_keyword_device() -> None:
    with pytest.raises(TypeError):
        Options(memory_budget=4096).resolve_budget(100)  # type: ignore[misc]


@pytest.fixture
def no_stated_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """No capacity stated for the CPU: none in the environment, none read from it yet."""
    monkeypatch.delenv(_capacity.ENV_VAR, raising=False)
    monkeypatch.setattr(_capacity, "_stated", [])


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


@pytest.mark.usefixtures("no_stated_capacity")
@pytest.mark.parametrize("device", [None, "cpu"])
def test_auto_budget_on_cpu_needs_a_stated_capacity(device: str | None) -> None:
    # The CPU has no card: "auto" does not guess from the machine's RAM.
    with pytest.raises(OptionsError) as info:
        Options(memory_budget="auto").resolve_budget(device=device)
    assert info.value.option == "memory_budget"
    assert "emulate_device_memory" in info.value.accepted
    assert _capacity.ENV_VAR in info.value.accepted


@pytest.mark.usefixtures("no_stated_capacity")
def test_auto_budget_on_cpu_with_an_emulated_capacity() -> None:
    options = Options(memory_budget="auto")
    with fxckpt.emulate_device_memory("64MiB") as stated:
        assert stated.bytes == 64 * MiB
        assert options.resolve_budget() == auto_budget(64 * MiB) == 60397977
        assert options.resolve_budget(device="cpu") == auto_budget(64 * MiB)
    # Out of the with statement, the capacity stated before (none) comes back.
    with pytest.raises(OptionsError):
        options.resolve_budget()
    fxckpt.emulate_device_memory(2 * GiB)  # without with: stays stated
    assert options.resolve_budget() == auto_budget(2 * GiB)
    fxckpt.emulate_device_memory(None)
    with pytest.raises(OptionsError):
        options.resolve_budget()


@pytest.mark.usefixtures("no_stated_capacity")
def test_auto_budget_on_cpu_reads_the_capacity_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(_capacity.ENV_VAR, "24GiB")
    assert Options(memory_budget="auto").resolve_budget() == auto_budget(24 * GiB)


@pytest.mark.usefixtures("no_stated_capacity")
@pytest.mark.parametrize("text", ["lots", "12 XB", "-1GiB", "0", "1.5B"])
def test_bad_device_memory_env_names_the_variable(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(_capacity.ENV_VAR, text)
    with pytest.raises(OptionsError) as info:
        Options(memory_budget="auto").resolve_budget()
    assert info.value.option == "FXCKPT_DEVICE_MEMORY"
    assert repr(text) in str(info.value)
    assert '"24GiB"' in info.value.accepted


@pytest.mark.parametrize("capacity", [0, "0B", -1, "lots"])
def test_emulate_device_memory_refuses_no_capacity(capacity: Any) -> None:
    before = _capacity.stated()
    with pytest.raises(OptionsError) as info:
        fxckpt.emulate_device_memory(capacity)
    assert info.value.option == "capacity"
    assert _capacity.stated() == before  # a refused capacity states nothing


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [(1, 0), (64 * MiB, 60397977),
     # 5 % of 20 GiB is the 1 GiB cap: over 20 GiB the fixed part stays at 1 GiB.
     (20 * GiB, 18 * GiB), (80 * GiB, 75 * GiB), (24 * GiB, 23407571763)],
)  # fmt: skip
def test_auto_budget_margin(capacity: int, expected: int) -> None:
    assert auto_budget(capacity) == expected
    fixed = min(AUTO_MARGIN_BYTES, int(capacity * AUTO_MARGIN))
    assert expected == max(0, int(capacity * (1 - AUTO_MARGIN)) - fixed)
    with fxckpt.emulate_device_memory(capacity):
        assert Options(memory_budget="auto").resolve_budget(device="cpu") == expected


def test_auto_budget_on_unmeasurable_device() -> None:
    with fxckpt.emulate_device_memory("64MiB"):  # a capacity stated for the CPU is not meta's
        with pytest.raises(OptionsError) as info:
            Options(memory_budget="auto").resolve_budget(device="meta")
    assert info.value.option == "memory_budget"
    assert "meta" in str(info.value)


# ---------------------------------------------------------------------------------------------
# Removed options
# ---------------------------------------------------------------------------------------------

# Each removed option with what it used to take and a word of what to write instead.
REMOVED_CASES: list[tuple[str, Any, str]] = [
    ("peak_budget", "20GiB", "memory_budget"), ("peak_budget", 0.5, "memory_budget"),
    ("peak_budget", None, "memory_budget"), ("device_budget", "6GiB", "memory_budget"),
    ("device_budget", 4096, "memory_budget"), ("budget_scope", "graph", "nothing"),
    ("budget_scope", "step", "nothing"),
]  # fmt: skip


def test_every_removed_option_has_a_case() -> None:
    assert set(REMOVED) == {"peak_budget", "device_budget", "budget_scope"}
    assert {name for name, _, _ in REMOVED_CASES} == set(REMOVED)


def _check_removed(err: BaseException, name: str, value: Any, word: str) -> None:
    assert isinstance(err, OptionsError), type(err)
    message = str(err)
    assert err.option == name and err.value == value
    assert err.accepted == REMOVED[name] and err.accepted.startswith(word)
    assert f"{name!r} was removed" in message
    assert f"expected {REMOVED[name]}" in message
    assert "#migrating-from-peak_budget-device_budget-and-budget_scope" in message


@pytest.mark.parametrize(("name", "value", "word"), REMOVED_CASES)
def test_removed_option_says_what_to_write_instead(name: str, value: Any, word: str) -> None:
    with pytest.raises(OptionsError) as info:
        Options.from_mapping({name: value})
    _check_removed(info.value, name, value, word)
    # With valid options beside it, and through the validated backend object, the same.
    with pytest.raises(OptionsError) as info:
        Options.from_mapping({"memory_budget": "1GiB", name: value})
    _check_removed(info.value, name, value, word)
    with pytest.raises(OptionsError) as info:
        fxckpt.backend(**{name: value})
    _check_removed(info.value, name, value, word)


def _inner(exc: BaseException) -> BaseException:
    inner = getattr(exc, "inner_exception", None)
    assert inner is not None, exc
    return inner


@pytest.mark.parametrize(("name", "value", "word"), REMOVED_CASES[::2])
def test_removed_option_refuses_through_torch_compile_and_the_env(
    monkeypatch: pytest.MonkeyPatch, name: str, value: Any, word: str
) -> None:
    import torch

    def run(options: dict[str, Any] | None) -> None:
        torch._dynamo.reset()
        x = torch.randn(3, requires_grad=True)
        torch.compile(lambda t: t.sin().sum(), backend="fxckpt", options=options)(x)

    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        run({"compiler": "eager", name: value})
    _check_removed(_inner(info.value), name, value, word)
    monkeypatch.setenv("FXCKPT_OPTIONS", json.dumps({"compiler": "eager", name: value}))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        run(None)
    _check_removed(_inner(info.value), name, value, word)


def test_removed_options_are_not_options() -> None:
    for name in REMOVED:
        assert name not in Options().to_dict()
        with pytest.raises(TypeError):
            Options(**{name: None})


def test_import_does_not_initialise_cuda() -> None:
    code = "import fxckpt.options, torch; print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_options_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FXCKPT_OPTIONS", raising=False)
    assert options_from_env() == {}
    monkeypatch.setenv("FXCKPT_OPTIONS", "  ")
    assert options_from_env() == {}
    monkeypatch.setenv("FXCKPT_OPTIONS", '{"memory_budget": "12GiB", "segment_stride": 2}')
    assert options_from_env() == {"memory_budget": "12GiB", "segment_stride": 2}
    assert Options.from_mapping(options_from_env()).memory_budget == 12 * GiB
    monkeypatch.setenv("MY_OPTS", '{"offload": "never"}')
    assert options_from_env("MY_OPTS") == {"offload": "never"}


@pytest.mark.parametrize("text", ["{memory_budget: 1}", '{"a": ', "[1, 2]", '"12GiB"', "3"])
def test_options_from_env_rejects(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("FXCKPT_OPTIONS", text)
    with pytest.raises(OptionsError) as info:
        options_from_env()
    assert info.value.option == "FXCKPT_OPTIONS"
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("total", [8 * GiB, 64 * GiB])
@pytest.mark.parametrize("available", [0, 512 * MiB, 40 * GiB])
def test_resolve_host_budget(monkeypatch: pytest.MonkeyPatch, total: int, available: int) -> None:
    from fxckpt.options import HOST_AUTO_MARGIN, HOST_AUTO_MARGIN_BYTES

    monkeypatch.setattr(_host, "total_bytes", lambda: total)
    monkeypatch.setattr(_host, "available_bytes", lambda option="x": available)
    monkeypatch.setattr(_host, "_auto", [])  # resolved anew for this machine
    assert Options().resolve_host_budget() is None
    assert Options(host_budget="3GiB").resolve_host_budget() == 3 * GiB
    assert Options(pinned_pool_bytes=4096).resolve_host_budget() == 4096
    assert Options(host_budget=0.25).resolve_host_budget() == total // 4
    auto = max(0, int(available * (1 - HOST_AUTO_MARGIN)) - HOST_AUTO_MARGIN_BYTES)
    assert Options(host_budget="auto").resolve_host_budget() == auto


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="needs /proc/meminfo")
def test_host_budget_auto_and_fractions_read_this_machine() -> None:
    auto = Options(host_budget="auto").resolve_host_budget()
    whole = Options(host_budget=1.0).resolve_host_budget()
    assert auto is not None and whole is not None
    assert 0 <= auto < _mem_available() <= whole


def test_pinned_pool_bytes_is_an_alias_of_host_budget() -> None:
    a = Options(pinned_pool_bytes="1GiB")
    assert a == Options(host_budget=GiB) and a.pinned_pool_bytes == GiB
    assert "pinned_pool_bytes" not in a.to_dict()
    assert Options(host_budget=GiB, pinned_pool_bytes="1GiB").host_budget == GiB  # the same: fine
    assert Options.from_mapping({"pinned_pool_bytes": 4096}).host_budget == 4096


def test_offload_dir_is_made_absolute() -> None:
    o = Options(offload_dir="rel/dir")
    assert o.offload_dir is not None and Path(o.offload_dir).is_absolute()
    assert o.offload_dir.endswith("rel/dir")


def test_every_option_is_documented() -> None:
    import dataclasses
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "options.md").read_text()
    from fxckpt import Options

    names = [f.name for f in dataclasses.fields(Options)]
    assert names and [n for n in names if f"`{n}`" not in text] == []
