"""Bad options through the two ways in: ``fxckpt.backend(**kw)`` and ``torch.compile(options=)``.

tests/test_options.py covers ``Options`` itself; here every option meets every kind of bad
value that applies to it, at both entry points. ``fxckpt.backend`` refuses at once; through
``torch.compile`` the refusal comes when dynamo calls the backend, and dynamo wraps it in
``BackendCompilerFailed`` with the ``OptionsError`` as ``inner_exception`` (and
``__context__``), its message repeated in dynamo's. Infeasible budgets raise ``BudgetError``
with the smallest figure the planner reaches, and that figure is itself a budget that works.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from models import GPT, gpt_inputs

import fxckpt
from fxckpt.errors import BudgetError, OptionsError
from fxckpt.options import OPTION_NAMES, REMOVED

NAN = float("nan")
INF = float("inf")

# kind -> option -> bad values. ``None`` marks a kind that does not apply to the option (a
# choice has no unit; a fraction has no "wrong unit" beyond its string form).
MATRIX: dict[str, dict[str, list[Any] | None]] = {
    "wrong type": {
        "memory_budget": [[1], {"a": 1}, b"12GiB", True],
        "segment_stride": ["2", 2.0, True, None],
        "segment_width": ["1", 1.5, False],
        "offload": [1, None, True],
        "min_offload_bytes": [[], None, True, 1.5],
        "prefetch": [0, None],
        "coalesce": [True, None],
        "copy_streams": ["2", 1.0, None, True],
        "pinned_pool_bytes": [[], True, 0.5],
        "host_budget": [[], True, b"64GiB", {"a": 1}],
        "offload_dir": [3, True, b"/tmp", ["/tmp"]],
        "offload_dir_bandwidth": [[], True, b"2GB/s"],
        "bandwidth": [[], True, b"25GB/s"],
        "cost_model": [1, None],
        "compiler": [False, None],
        "on_infeasible": [None, 0],
        "blocks": [3, ["layers"], b"layers"],
        "block_index": ["0", 1.0, True, [0]],
        "adapt": [1, None, True],
    },
    "out of range": {
        "memory_budget": [0, -1, 0.0, -0.5, 1.5, 12e9, "0B", "-5GB", "1.5B", "1e999", "lots", ""],
        "segment_stride": [-1, -100],
        "segment_width": [-1],
        "offload": ["sometimes", "Never", ""],
        "min_offload_bytes": [-1, -1.0, "-1KiB", "big"],
        "prefetch": ["early", "JIT"],
        "coalesce": ["always", "Never"],
        "copy_streams": [0, -1, 33],
        "pinned_pool_bytes": [-1, "-4KiB"],
        "host_budget": [-1, "-4KiB", 0.0, 1.5, 12e9, "lots", "Auto"],
        "offload_dir": ["", "   ", "/tmp/a\0b"],
        "offload_dir_bandwidth": [0, -1, "0GB/s"],
        "bandwidth": [0, 0.0, -1, -1e9, "0GB/s", "-1GB/s", 10**400],
        "cost_model": ["time", "FLOPS"],
        "compiler": ["aot_eager", "Inductor", "cudagraphs"],
        "on_infeasible": ["ignore", "Raise"],
        "blocks": ["(", "layers[", "*", ""],
        "block_index": [-1, -8],
        "adapt": ["sometimes", "Auto", ""],
    },
    "NaN or infinite": {
        "memory_budget": [NAN, INF, -INF],
        "segment_stride": [NAN, INF],
        "segment_width": [NAN],
        "offload": [NAN],
        "min_offload_bytes": [NAN, INF],
        "prefetch": [NAN],
        "coalesce": [NAN],
        "copy_streams": [NAN],
        "pinned_pool_bytes": [NAN, INF],
        "host_budget": [NAN, INF, -INF],
        "offload_dir": [NAN],
        "offload_dir_bandwidth": [NAN, INF],
        "bandwidth": [NAN, INF, "infGB/s"],
        "cost_model": [NAN],
        "compiler": [NAN],
        "on_infeasible": [NAN],
        "blocks": [NAN],
        "block_index": [NAN, INF],
        "adapt": [NAN],
    },
    "unknown unit": {
        "memory_budget": ["12 XB", "12 GiBs", "12G", "12 parsecs"],
        "segment_stride": None,
        "segment_width": None,
        "offload": None,
        "min_offload_bytes": ["12 XB", "1MB/s", "1 KiBi"],
        "prefetch": None,
        "coalesce": None,
        "copy_streams": None,
        "pinned_pool_bytes": ["12 XB", "12 GiBs"],
        "host_budget": ["12 XB", "64 GiBs"],
        "offload_dir": None,
        "offload_dir_bandwidth": ["2 XB/s", "2GB/h"],
        "bandwidth": ["25 XB/s", "25GB/h"],
        "cost_model": None,
        "compiler": None,
        "on_infeasible": None,
        "blocks": None,
        "block_index": None,
        "adapt": None,
    },
}

# Options that contradict each other: (options, the option blamed, a word the message must
# contain, naming the other option)
CONTRADICTIONS: list[tuple[dict[str, Any], str, str]] = [
    ({"segment_stride": 2, "segment_width": 3}, "segment_width", "segment_stride=2"),
    ({"segment_stride": 0, "segment_width": 1}, "segment_width", "segment_stride=0"),
    ({"segment_stride": 1, "segment_width": 5}, "segment_width", "segment_stride=1"),
    ({"blocks": r"layers\.\d+$", "block_index": 3}, "block_index", "blocks="),
    ({"offload": "never", "offload_dir": "/tmp"}, "offload_dir", "offload='never'"),
    ({"host_budget": "1GiB", "pinned_pool_bytes": "2GiB"}, "pinned_pool_bytes", "host_budget"),
]
# Options of earlier versions, each with a value it used to take: refused, naming the option
# and saying what to write instead (REMOVED).
REMOVED_VALUES: dict[str, Any] = {"peak_budget": "20GiB", "device_budget": "6GiB",
                                  "budget_scope": "graph"}
UNKNOWN_KEYS: list[tuple[str, str | None]] = [
    ("memory_budjet", "memory_budget"),
    ("segment_strid", "segment_stride"),
    ("Offload", "offload"),
    ("copystreams", "copy_streams"),
    ("block", "blocks"),
    ("pinned_pool", "pinned_pool_bytes"),
    ("zzzzzz", None),
]


def _cases() -> list[tuple[str, dict[str, Any], str]]:
    """(case id, options, the option the error must name)."""
    out = []
    for kind, per_option in MATRIX.items():
        for name, values in per_option.items():
            for value in values or ():
                out.append((f"{kind}:{name}={value!r}"[:70], {name: value}, name))
    for opts, name, _ in CONTRADICTIONS:
        out.append((f"contradiction:{opts}", opts, name))
    for key, _ in UNKNOWN_KEYS:
        out.append((f"unknown key:{key}", {key: 1}, key))
    for key, value in REMOVED_VALUES.items():
        out.append((f"removed:{key}={value!r}", {key: value}, key))
    return out


CASES = _cases()
IDS = [c[0] for c in CASES]


def test_the_matrix_covers_every_option_with_every_kind() -> None:
    assert set(MATRIX) == {"wrong type", "out of range", "NaN or infinite", "unknown unit"}
    for kind, per_option in MATRIX.items():
        assert set(per_option) == set(OPTION_NAMES), (kind, set(OPTION_NAMES) ^ set(per_option))
    byte_options = {"memory_budget", "min_offload_bytes", "pinned_pool_bytes", "bandwidth",
                    "host_budget", "offload_dir_bandwidth"}
    assert {n for n, v in MATRIX["unknown unit"].items() if v} == byte_options
    for kind in ("wrong type", "out of range", "NaN or infinite"):
        assert all(MATRIX[kind][n] for n in OPTION_NAMES), kind
    assert len(IDS) == len(set(IDS)), "case ids must be unique"
    # The removed options are no options, and each of them has its case at both entries.
    assert not set(REMOVED) & set(OPTION_NAMES) and set(REMOVED_VALUES) == set(REMOVED)


def _check_message(err: OptionsError, name: str) -> None:
    message = str(err)
    assert err.option == name
    assert repr(name) in message  # names the option
    assert err.accepted and err.accepted in message  # and the accepted forms


def _inner(exc: BaseException) -> BaseException | None:
    """The exception a backend raised, out of dynamo's BackendCompilerFailed."""
    seen = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, fxckpt.FxckptError):
            return err
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
    return None


def _compile_and_run(options: Any, backend: Any = "fxckpt", **kw: Any) -> None:
    torch._dynamo.reset()
    x = torch.randn(3, requires_grad=True)
    torch.compile(lambda t: t.sin().sum(), backend=backend, options=options, **kw)(x)


@pytest.mark.parametrize(("case", "options", "name"), CASES, ids=IDS)
def test_fxckpt_backend_refuses(case: str, options: dict[str, Any], name: str) -> None:
    with pytest.raises(OptionsError) as info:
        fxckpt.backend(**options)
    _check_message(info.value, name)


@pytest.mark.parametrize(("case", "options", "name"), CASES, ids=IDS)
def test_torch_compile_options_refuse_as_dynamos_inner_exception(
    case: str, options: dict[str, Any], name: str
) -> None:
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        _compile_and_run(options)
    inner = info.value.inner_exception
    assert isinstance(inner, OptionsError), type(inner)
    # Where docs/options.md ("Errors through torch.compile") says the original sits, on
    # every supported torch: dynamo raises the wrapper `from None`.
    assert info.value.__context__ is inner and info.value.__cause__ is None
    assert str(info.value).startswith("backend='fxckpt' raised:")
    _check_message(inner, name)
    assert str(inner) in str(info.value)  # the user reads fxckpt's message in dynamo's


@pytest.mark.parametrize(("key", "suggestion"), UNKNOWN_KEYS)
def test_unknown_key_suggests_the_nearest_option_at_both_entries(key: str, suggestion: str | None) -> None:
    with pytest.raises(OptionsError) as direct:
        fxckpt.backend(**{key: 1})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as wrapped:
        _compile_and_run({key: 1})
    for message in (str(direct.value), str(wrapped.value)):
        assert f"unknown option {key!r}" in message
        if suggestion is None:
            assert "did you mean" not in message
        else:
            assert f"did you mean {suggestion!r}?" in message


@pytest.mark.parametrize(("options", "name", "word"), CONTRADICTIONS)
def test_contradicting_options_name_the_other_option_at_both_entries(
    options: dict[str, Any], name: str, word: str
) -> None:
    with pytest.raises(OptionsError, match=word):
        fxckpt.backend(**options)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=word):
        _compile_and_run(options)


def test_options_given_twice_are_refused() -> None:
    # fxckpt.backend(...) already holds its options; torch.compile(options=) must not add more.
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        _compile_and_run({"segment_stride": 1}, backend=fxckpt.backend(compiler="eager"))
    inner = _inner(info.value)
    assert isinstance(inner, OptionsError) and inner.option == "options"
    assert "fxckpt.backend(...)" in str(inner)


def test_a_mode_with_the_eager_compiler_is_refused() -> None:
    torch._dynamo.reset()
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(lambda t: t.sin().sum(), backend=fxckpt.backend(compiler="eager"), mode="max-autotune")(x)
    inner = _inner(info.value)
    assert isinstance(inner, OptionsError) and inner.option == "mode"
    assert "compiler='eager'" in str(inner)


def test_an_unknown_mode_is_refused_with_the_modes_there_are() -> None:
    torch._dynamo.reset()
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(lambda t: t.sin().sum(), backend=fxckpt.backend(), mode="reduce_overhead")(x)
    inner = _inner(info.value)
    assert isinstance(inner, OptionsError) and inner.option == "mode"
    assert inner.value == "reduce_overhead"
    assert "'reduce-overhead'" in inner.accepted and "'max-autotune'" in inner.accepted


@pytest.mark.parametrize(
    ("env", "name"),
    [('{"segment_stride": -1}', "segment_stride"), ("{not json", "FXCKPT_OPTIONS"),
     ('["segment_stride", 1]', "FXCKPT_OPTIONS"), ('{"memory_budjet": "1GiB"}', "memory_budjet")],
)  # fmt: skip
def test_bad_fxckpt_options_env_refuses_through_torch_compile(
    monkeypatch: pytest.MonkeyPatch, env: str, name: str
) -> None:
    # The Hugging Face Trainer can only say backend="fxckpt"; options then come from the env.
    monkeypatch.setenv("FXCKPT_OPTIONS", env)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        _compile_and_run(None)
    inner = _inner(info.value)
    assert isinstance(inner, OptionsError)
    _check_message(inner, name)
    # The user wrote it in the environment, not in code: the message says where to look.
    assert "FXCKPT_OPTIONS" in str(inner)


def test_explicit_options_override_a_bad_env_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXCKPT_OPTIONS", json.dumps({"segment_stride": -1}))
    _compile_and_run({"segment_stride": 1, "compiler": "eager"})
    assert len(fxckpt.last_plans()) == 1


# ---------------------------------------------------------------------------------------------
# Infeasible budgets
# ---------------------------------------------------------------------------------------------


def _gpt_steps(options: dict[str, Any], steps: int = 4) -> None:
    """Train ``steps`` steps: a budget the step cannot meet raises at the start of the step
    after the one whose eager code was measured (the third, here)."""
    torch._dynamo.reset()
    fxckpt.reset_stats()
    torch.manual_seed(0)
    model = GPT(n_layers=2, d=32)
    compiled = torch.compile(model, backend="fxckpt", options=options)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        compiled(*gpt_inputs(seq=32)).backward()


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"memory_budget": 1000, "offload": "never"}, id="bytes-never"),
        pytest.param({"memory_budget": "1KiB", "offload": "auto", "min_offload_bytes": "1MiB"}, id="kib-auto"),
        pytest.param({"memory_budget": "100KiB", "offload": "never", "segment_stride": 1}, id="kib-stride"),
    ],
)
def test_infeasible_budget_raises_budget_error_with_the_smallest_figure(options: dict[str, Any]) -> None:
    options = {"compiler": "eager", "cost_model": "unit", **options}
    # The error waits for the step's graphs, its runs and what eager code holds to be known:
    # the start of the third step; the steps before it run the lowest plan.
    with pytest.raises(BudgetError) as info:
        _gpt_steps(options)
    err = info.value
    assert err.scope == "step"
    assert 0 < err.budget_bytes < err.smallest_bytes
    assert f"cannot meet memory_budget={err.budget_bytes} bytes" in str(err)
    assert f"the smallest budget it runs under is memory_budget={err.smallest_bytes}" in str(err)
    assert "on_infeasible='warn'" in str(err)
    # The smallest figure covers the step's predicted peak there, split into its parts.
    parts = err.parts
    assert parts["start_bytes"] + parts["gradients_bytes"] + parts["activations_bytes"] == parts["total_bytes"]
    assert parts["total_bytes"] <= err.smallest_bytes
    assert parts["start_bytes"] > 0 and parts["activations_bytes"] > 0
    # The smallest figure is achievable: as the budget, the steps run and the plan meets it.
    _gpt_steps({**options, "memory_budget": err.smallest_bytes})
    plan = fxckpt.last_plans()[-1]
    assert plan.budget_bytes == err.smallest_bytes
    assert plan.step is not None and plan.step["total_bytes"] <= err.smallest_bytes
    # And it is near the smallest (it adds 1 % and the headroom to the lowest plan's figure):
    # a budget 3 % below it does not run.
    with pytest.raises(BudgetError):
        _gpt_steps({**options, "memory_budget": err.smallest_bytes * 97 // 100})


@pytest.mark.parametrize("fraction", [0.001, 0.5, 1.0])
def test_every_fraction_is_feasible(fraction: float) -> None:
    # A fraction spans the graph's own plans, from the lowest (near 0) to plain min-cut's
    # (1.0): no fraction is infeasible, however small, even with offloading off.
    _gpt_steps({"compiler": "eager", "cost_model": "unit", "memory_budget": fraction,
                "offload": "never", "segment_stride": 1}, steps=1)
    (plan,) = fxckpt.last_plans()
    assert plan.step is not None and plan.target is not None
    # The budget in bytes is the start level plus the graph's own target.
    largest = max(plan.target["forward_bytes"], plan.target["backward_bytes"])
    assert plan.budget_bytes == plan.step["start_bytes"] + largest
    assert plan.step["total_bytes"] <= plan.budget_bytes
    assert plan.offloaded_bytes == 0


def test_infeasible_budget_from_fxckpt_backend_is_the_same_error() -> None:
    torch.manual_seed(0)
    backend = fxckpt.backend(compiler="eager", cost_model="unit", memory_budget=1000, offload="never")
    model = GPT(n_layers=2)
    compiled = torch.compile(model, backend=backend)
    with pytest.raises(BudgetError) as info:
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            compiled(*gpt_inputs(seq=32)).backward()
    err = info.value
    assert err.budget_bytes == 1000 and err.smallest_bytes > 1000
    assert "offload='auto'" in err.suggestions
