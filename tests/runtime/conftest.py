"""The recording CUDA double installed under the real CUDA engine, for the protocol tests."""

from __future__ import annotations

import gc

import pytest
import torch
from cuda_double import FakeCuda

from fxckpt import _cuda
from fxckpt.runtime import engine, pool, stats
from fxckpt.runtime.cuda_engine import CudaEngine

DEV = torch.device("cpu")  # the double's "device": CudaEngine runs on it unchanged


@pytest.fixture
def hw(monkeypatch: pytest.MonkeyPatch):
    """A fresh double as fxckpt's CUDA, CudaEngines on ``DEV`` (one per stream count, made
    afresh) and pinned host pools (the shared one made afresh)."""
    install_double(monkeypatch)
    stats.reset()
    yield _cuda.CUDA
    engine.configure()
    gc.collect()


def install_double(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """Run the CUDA engine and pinned pools on ``DEV`` against a fresh recording double."""
    double = FakeCuda()
    monkeypatch.setattr(_cuda, "CUDA", double)
    engine.configure()
    monkeypatch.setattr(engine, "_engines", {})
    monkeypatch.setattr(engine, "new_engine", lambda device, streams: CudaEngine(device, streams))
    monkeypatch.setattr(pool, "PINNED_TYPES", {"cuda", "cpu"})
    monkeypatch.setattr(pool, "_pools", {("cpu", pool.SHARED): pool.HostPool(pinned=True)})
    return double


# The slice of runtime tests that runs twice: once with copies at memcpy speed, once through
# an emulated host link, where every copy takes at least a millisecond and completes only
# when its window closes. Ordering bugs that only show when copies are slow fail there.
EMULATED = "20MB/s,1ms"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "link_mode" in metafunc.fixturenames:
        metafunc.parametrize("link_mode", ["memcpy", "emulated"], indirect=True)


@pytest.fixture
def link_mode(request: pytest.FixtureRequest):
    import fxckpt

    if request.param == "memcpy":
        yield None
        return
    rate, overhead = EMULATED.split(",")
    with fxckpt.emulate_link(rate, overhead_ms=overhead) as link:
        yield link
