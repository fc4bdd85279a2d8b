"""Fault injection: host allocations that fail mid-step, a forward that raises after some
offloads, copies that fail in the engine. Each ends with right gradients or a clear error,
never a hang, a leaked host buffer or a broken next step."""

from __future__ import annotations

import copy
import gc
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from equality import step
from models import GPT, gpt_inputs

import fxckpt
from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import engine, ops, pool
from fxckpt.runtime.pool import HostMemoryWarning

ALL = {"compiler": "eager", "offload": "all", "min_offload_bytes": 0, "cost_model": "unit"}
HANG_S = 60.0


@pytest.fixture(autouse=True)
def _clean_runtime():
    engine.configure()
    pool.set_pool_cap(None)
    yield
    engine.configure()
    pool.set_pool_cap(None)


def _in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` so that a hang fails the test instead of stalling the suite."""
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(fn).result(timeout=HANG_S)


def _books() -> tuple[int, int]:
    """(live handles, host bytes in use), after a collection."""
    gc.collect()
    return ops.live_handles(), pool.get_pool("cpu").usage()["in_use_bytes"]


def _compare(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    torch.testing.assert_close(got[0], want[0])
    assert got[1].keys() == want[1].keys() and got[1]
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], msg=lambda m, n=name: f"{n}: {m}")


class _FailingTorch:
    """Stands in for ``torch`` inside the pool module: ``empty`` fails once ``budget`` host
    allocations have been made (``pin_memory=True`` fails the same way on a machine whose
    pinned memory runs out)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.failures = 0

    def empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.budget <= 0:
            self.failures += 1
            raise RuntimeError("CUDA error: out of memory (injected host allocation failure)")
        self.budget -= 1
        return torch.empty(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# ---------------------------------------------------------------------------------------------
# Host allocation fails mid-step
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("allowed", [0, 3], ids=["fails-at-once", "fails-mid-step"])
def test_host_allocation_failure_keeps_tensors_on_the_device_warns_once_and_stays_exact(
    monkeypatch: pytest.MonkeyPatch, allowed: int
) -> None:
    torch.manual_seed(0)
    model = GPT(n_layers=2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxckpt.backend(**ALL))
    # No idle buffers: every acquire must allocate. Collected first: a handle an earlier test
    # of this worker left to the collector returns its buffer when collected, and a buffer
    # returned after the trim would serve an acquire without an allocation.
    gc.collect()
    pool.get_pool("cpu").trim()
    failing = _FailingTorch(allowed)
    monkeypatch.setattr(pool, "torch", failing)
    handles, in_use = _books()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            inputs = gpt_inputs(seed=i)
            _compare(step(model, inputs, compiled), step(ref, inputs, ref))
    ours = [w for w in caught if issubclass(w.category, HostMemoryWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "allocating" in str(ours[0].message) and "stays on the device" in str(ours[0].message)
    s = fxckpt.stats()
    assert failing.failures > 0 and s["fallbacks"] == failing.failures
    (plan,) = fxckpt.last_plans()
    rows = sum(r.decision.kind == "offload" for r in plan.activations)
    assert s["offload_calls"] == 3 * rows
    if allowed:
        assert 0 < s["offloaded_bytes"]  # the first allocations worked and were used
    else:
        assert s["offloaded_bytes"] == 0
    assert s["offloaded_bytes"] == s["prefetched_bytes"]
    assert _books() == (handles, in_use)

    # Allocations work again: the next steps offload, still exactly.
    monkeypatch.setattr(pool, "torch", torch)
    fxckpt.reset_stats()
    inputs = gpt_inputs(seed=7)
    _compare(step(model, inputs, compiled), step(ref, inputs, ref))
    assert fxckpt.stats()["fallbacks"] == 0 and fxckpt.stats()["offloaded_bytes"] > 0


# ---------------------------------------------------------------------------------------------
# The forward raises after some offloads
# ---------------------------------------------------------------------------------------------


def test_forward_that_raises_after_offloads_returns_every_buffer_and_the_next_step_works() -> None:
    torch.manual_seed(0)
    model = GPT(n_layers=2, vocab=64)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxckpt.backend(**ALL))
    idx, tgt = gpt_inputs()
    step(model, (idx, tgt), compiled)  # compile, and warm the pool
    handles, in_use = _books()
    fxckpt.reset_stats()

    bad = tgt.clone()
    bad[0, -1] = 64  # out of range: nll_loss raises at the very end of the forward
    for _ in range(3):
        with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
            compiled(idx, bad)
    offloads = fxckpt.stats()["offload_calls"]
    assert offloads > 0  # the failing forwards did offload before they raised
    assert fxckpt.stats()["prefetched_bytes"] == 0
    assert _books() == (handles, in_use)

    got = step(model, (idx, tgt), compiled)
    _compare(got, step(ref, (idx, tgt), ref))


def test_graph_break_raise_after_an_offloading_graph_returns_every_buffer() -> None:
    # The first graph offloads, then plain Python raises between graphs: autograd drops the
    # first graph's saved handles, and with them the host buffers.
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)
    fail = {"now": False}

    def fwd(x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(lin1(x))
        torch._dynamo.graph_break()
        if fail["now"]:
            raise ValueError("user code failed between graphs")
        return lin2(h).square().mean()

    compiled = torch.compile(fwd, backend=fxckpt.backend(**ALL))
    x = torch.randn(8, 16, requires_grad=True)
    compiled(x).backward()
    handles, in_use = _books()
    fxckpt.reset_stats()
    fail["now"] = True
    with pytest.raises(ValueError, match="between graphs"):
        compiled(x)
    assert fxckpt.stats()["offload_calls"] > 0
    assert _books() == (handles, in_use)
    fail["now"] = False
    x.grad = None
    compiled(x).backward()
    want = x.detach().clone().requires_grad_()
    lin2(F.gelu(lin1(want))).square().mean().backward()
    torch.testing.assert_close(x.grad, want.grad)


# ---------------------------------------------------------------------------------------------
# A copy fails in the engine
# ---------------------------------------------------------------------------------------------


def _train_step(compiled: Any, inputs: tuple[Any, ...]) -> None:
    compiled(*inputs).backward()


@pytest.mark.parametrize(
    ("direction", "failures", "cost_model"),
    [("device-to-host", 1, "unit"), ("device-to-host", 4, "unit"), ("host-to-device", 1, "unit"),
     ("host-to-device", 4, "unit"),
     # Flops costs price a per-copy overhead: a block's tensors travel as one copy bucket.
     ("device-to-host", 1, "flops"), ("host-to-device", 1, "flops")],
)
def test_a_failed_copy_is_a_clear_error_not_a_hang_and_the_next_step_works(
    direction: str, failures: int, cost_model: str
) -> None:
    torch.manual_seed(0)
    model = GPT(n_layers=2)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxckpt.backend(**{**ALL, "cost_model": cost_model}))
    inputs = gpt_inputs()
    step(model, inputs, compiled)
    handles, in_use = _books()

    def failing_step() -> None:
        model.zero_grad(set_to_none=True)
        d2h = failures if direction == "device-to-host" else 0
        engine.configure(copy_delay_s=0.002, fail_next_copies=d2h)
        loss = compiled(*inputs)
        if direction == "host-to-device":
            engine.configure(copy_delay_s=0.002, fail_next_copies=failures)
        loss.backward()

    with pytest.raises(RuntimeCopyError) as info:
        _in_thread(failing_step)
    message = str(info.value)
    assert direction in message and "injected" in message
    assert "handle" in message and "bytes" in message  # says which tensor
    del info
    engine.configure()
    assert _books() == (handles, in_use)
    _compare(step(model, inputs, compiled), step(ref, inputs, ref))
