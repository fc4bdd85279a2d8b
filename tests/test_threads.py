"""Two models compiled and trained from two threads at once.

The engine and the host pool are per device and shared by both threads; the counters are
process-wide. Both models must train exactly like eager while the other one's copies run on
the same workers, and the books must add up to the sum of the two.
"""

from __future__ import annotations

import copy
import gc
import threading
from typing import Any

import pytest
import torch
from equality import _fresh_inputs, step
from models import GPT, MLP, gpt_inputs

import fxckpt
from fxckpt.runtime import engine, ops, pool

ALL = {"compiler": "eager", "offload": "all", "min_offload_bytes": 0, "cost_model": "unit"}
STEPS = 10
TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def _clean_runtime():
    engine.configure()
    pool.set_pool_cap(None)
    yield
    engine.configure()
    pool.set_pool_cap(None)


def _compare(got: tuple[Any, ...], want: tuple[Any, ...], where: str) -> None:
    torch.testing.assert_close(got[0], want[0], msg=lambda m: f"{where} loss: {m}")
    assert got[1].keys() == want[1].keys() and got[1], where
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], msg=lambda m, n=name: f"{where} {n}: {m}")
    for a, b in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(a, b, msg=lambda m: f"{where} input grad: {m}")


def _workloads() -> list[tuple[str, torch.nn.Module, list[tuple[Any, ...]]]]:
    torch.manual_seed(0)
    gpt = GPT(n_layers=2)
    mlp = MLP(d=32, depth=3)
    g = torch.Generator().manual_seed(5)
    return [
        ("gpt", gpt, [gpt_inputs(seed=s) for s in range(3)]),
        ("mlp", mlp, [(torch.randn(8, 32, generator=g).requires_grad_(),) for _ in range(3)]),
    ]


@pytest.mark.skipif(
    torch.__version__ < "2.13",
    reason="torch 2.11's dynamo cannot compile from two threads at once ('FX to symbolically "
    "trace a dynamo-optimized function', and a crash seen here); fxckpt's runtime is not involved",
)
@pytest.mark.parametrize("copy_streams", [1, 2])
def test_two_models_trained_from_two_threads_at_once_stay_exact(copy_streams: int) -> None:
    engine.configure(copy_delay_s=0.0003, poison_fresh=True)
    gc.collect()
    handles_before = ops.live_handles()
    in_use_before = pool.get_pool("cpu").usage()["in_use_bytes"]
    pools_before = set(pool._pools)  # other files' compiles with host budgets made their own
    work = _workloads()
    start = threading.Barrier(len(work))
    errors: dict[str, BaseException] = {}
    losses: dict[str, list[float]] = {}

    def train(name: str, model: torch.nn.Module, batches: list[tuple[Any, ...]]) -> None:
        try:
            ref = copy.deepcopy(model)
            compiled = torch.compile(model, backend=fxckpt.backend(copy_streams=copy_streams, **ALL))
            start.wait(timeout=60)  # both compile and train at the same time
            losses[name] = []
            for i in range(STEPS):
                inputs = batches[i % len(batches)]  # fresh copies: input grads accumulate
                got = step(model, _fresh_inputs(inputs), compiled)
                _compare(got, step(ref, _fresh_inputs(inputs), ref), f"{name} step {i}")
                losses[name].append(float(got[0]))
        except BaseException as e:  # reported by the main thread
            errors[name] = e

    threads = [threading.Thread(target=train, args=w, name=f"train-{w[0]}") for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a training thread hung"
    for name, err in errors.items():
        raise AssertionError(f"thread {name} failed: {err!r}") from err
    assert {n: len(v) for n, v in losses.items()} == {"gpt": STEPS, "mlp": STEPS}

    plans = {p.name: p for p in fxckpt.last_plans()}
    assert len(plans) == 2  # one graph per model
    offloads_per_step = sum(
        sum(r.decision.kind == "offload" for r in p.activations) for p in plans.values()
    )
    s = fxckpt.stats()
    assert s["offload_calls"] == STEPS * offloads_per_step  # no call lost or counted twice
    assert s["offloaded_bytes"] == s["prefetched_bytes"] > 0
    # One engine (of the compiles' stream count) and one pool for the device, shared by both
    # threads.
    assert (torch.device("cpu"), copy_streams) in engine._engines
    assert set(pool._pools) - pools_before <= {("cpu", pool.SHARED)}
    workers = [t.name for t in threading.enumerate()
               if t.name.startswith((f"fxckpt-d2h-{copy_streams}_", f"fxckpt-h2d-{copy_streams}_"))]
    assert 0 < len(workers) <= 2 * copy_streams
    del work
    gc.collect()
    assert ops.live_handles() == handles_before
    assert pool.get_pool("cpu").usage()["in_use_bytes"] == in_use_before
