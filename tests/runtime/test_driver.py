"""Page-locking goes through the CUDA driver, never the runtime, on private anonymous pages.

A failed ``cudaHostRegister`` leaves the runtime's last error set, and the next kernel launch
check raises it in the user's step. The real ``TorchCuda.page_locked`` runs here against a
recording stand-in for ``libcuda`` (no GPU needed); the runtime is booby-trapped.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from fxckpt import _cuda


class FakeDriver:
    """Records every driver call; ``register_status`` is what cuMemHostRegister returns."""

    def __init__(self, register_status: int = 0) -> None:
        self.calls: list[tuple] = []
        self.register_status = register_status
        self.current: list[int] = []  # the context stack of the calling thread

    def cuDeviceGet(self, dev, index):  # noqa: N802 (the driver's names)
        dev._obj.value = index
        self.calls.append(("cuDeviceGet", index))
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx, dev):  # noqa: N802
        ctx._obj.value = 0x1000 + dev.value
        self.calls.append(("retain", dev.value))
        return 0

    def cuCtxPushCurrent_v2(self, ctx):  # noqa: N802
        self.current.append(ctx.value)
        return 0

    def cuCtxPopCurrent_v2(self, out):  # noqa: N802
        self.current.pop()
        return 0

    def cuMemHostRegister_v2(self, ptr, size, flags):  # noqa: N802
        self.calls.append(("register", ptr.value, size.value, flags.value, list(self.current)))
        return self.register_status

    def cuMemHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr.value, list(self.current)))
        return 0


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(_cuda, "_DRIVER", _cuda.Driver())
    _cuda._DRIVER.lib = fake
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def no_runtime(*args, **kwargs):
        raise AssertionError("the CUDA runtime was asked to page-lock memory")

    monkeypatch.setattr(torch.cuda, "cudart", no_runtime)
    return fake


def _mapping_flags(ptr: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return line.split()[1]
    raise AssertionError(f"{ptr:#x} is in no mapping")


def test_slabs_are_private_pages_registered_by_the_driver_in_the_primary_context(driver):
    nbytes = 16 * _cuda.PAGE_BYTES
    buf = _cuda.TorchCuda().page_locked(nbytes)
    assert buf.numel() == nbytes and buf.data_ptr() % _cuda.PAGE_BYTES == 0
    assert _mapping_flags(buf.data_ptr()) == "rw-p"  # private, not a shared-memory object
    ctx = 0x1000
    assert ("register", buf.data_ptr(), nbytes, _cuda._HOST_REGISTER_PORTABLE, [ctx]) in driver.calls
    assert driver.current == []  # popped again
    _cuda.TorchCuda().unlock(buf)
    assert driver.calls[-1] == ("unregister", buf.data_ptr(), [ctx])
    _cuda.TorchCuda().page_locked(nbytes)
    assert [c for c in driver.calls if c[0] == "retain"] == [("retain", 0)]  # retained once


def test_a_failed_registration_raises_and_leaves_the_runtime_alone(driver):
    driver.register_status = 2  # CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(RuntimeError, match="CUresult 2"):
        _cuda.TorchCuda().page_locked(4 * _cuda.PAGE_BYTES)
    assert driver.current == []


def test_a_pool_turns_a_failed_registration_into_an_exhausted_pool(driver):
    from fxckpt.runtime.pool import HostPool, PoolExhausted

    driver.register_status = 2
    monkey = _cuda.CUDA
    _cuda.CUDA = _cuda.TorchCuda()
    try:
        with pytest.raises(PoolExhausted, match="page-locking"):
            HostPool(pinned=True).acquire(1 << 20)
    finally:
        _cuda.CUDA = monkey


def test_without_a_driver_library_the_call_fails_instead_of_raising(monkeypatch):
    d = _cuda.Driver()

    def missing(name):
        raise OSError(name)

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert d.call(0, "cuMemHostRegister_v2") != 0
