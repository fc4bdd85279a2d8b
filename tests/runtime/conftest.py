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
