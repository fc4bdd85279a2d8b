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
    """A fresh double as fxckpt's CUDA, a CudaEngine on ``DEV`` and a pinned host pool."""
    double = FakeCuda()
    monkeypatch.setattr(_cuda, "CUDA", double)
    engine.configure(copy_streams=1)
    monkeypatch.setitem(engine._engines, DEV, CudaEngine(DEV))
    monkeypatch.setitem(pool._pools, "cpu", pool.HostPool(pinned=True))
    stats.reset()
    yield double
    engine.configure(copy_streams=1)
    gc.collect()


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
