"""Every CUDA call fxckpt makes, behind one replaceable object.

The copy engine, the pinned host pool and the bandwidth probe call ``CUDA.<method>`` and
nothing else of ``torch.cuda``. Tests put a recording double of the hardware in its place
(``tests/cuda_double.py``), so the real engine code runs, and its stream ordering is checked,
on a machine without a GPU. Nothing here runs at import: no context, stream or pinned page
exists before the first call.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fxckpt import _torch_compat as compat

log = logging.getLogger("fxckpt.runtime")

PAGE_BYTES = mmap.PAGESIZE
# cudaHostRegisterPortable: the pages count as pinned for every device, so one host pool
# serves a model spread over several GPUs.
_HOST_REGISTER_PORTABLE = 1
_CU_STREAM_NON_BLOCKING = 1
# compat.cuda_sleep spins for a number of GPU clock cycles; ~1.5 GHz turns seconds into cycles
# closely enough for an injected delay.
_CYCLES_PER_S = 1_500_000_000


class TorchCuda:
    """The real thing: ``torch.cuda`` plus two driver calls torch does not expose."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copy_streams: dict[tuple[int, int], Any] = {}

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def copy_stream(self, device: torch.device, slot: int) -> Any:
        """The ``slot``-th copy stream of ``device``, made once per process.

        ``torch.cuda.Stream()`` hands out streams round-robin from a pool of 32 per priority
        per device (``c10/cuda/CUDAStream.h``), the same pool that NCCL and FSDP draw their
        streams from: a copy could then queue behind a collective. A stream created through
        the driver and wrapped in ``ExternalStream`` belongs to fxckpt alone. It must be
        non-blocking: a plain ``cudaStreamCreate`` stream (the only one ``torch.cuda.cudart()``
        offers) synchronizes with the legacy default stream, which is torch's compute stream
        unless the user set another, and every copy would serialize with compute.
        """
        index = _index(device)
        with self._lock:
            stream = self._copy_streams.get((index, slot))
            if stream is None:
                raw = _driver_stream(index)
                if raw is None:
                    log.info(
                        "fxckpt: no driver stream on cuda:%d; copy stream %d comes from torch's "
                        "stream pool and may be shared with collectives",
                        index,
                        slot,
                    )
                    stream = torch.cuda.Stream(index)
                else:
                    stream = torch.cuda.ExternalStream(raw, device=index)
                self._copy_streams[(index, slot)] = stream
            return stream

    def event(self, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(_index(device))

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Device memory from the caching allocator, tied to the current stream."""
        return torch.empty(numel, dtype=dtype, device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """An asynchronous copy on the current stream of the device side's device."""
        dst.copy_(src, non_blocking=True)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def sleep(self, seconds: float) -> None:
        """Keep the current stream busy for about ``seconds`` (injected copy delays)."""
        compat.cuda_sleep(int(seconds * _CYCLES_PER_S))

    def page_locked(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` (a multiple of the page size) of host memory, page-locked exactly.

        An anonymous private mapping is page-aligned, and the driver's ``cuMemHostRegister``
        pins exactly its pages; ``torch.empty(pin_memory=True)`` would round the request up
        to a power of two. Registered memory reports ``is_pinned()``,
        so copies from it are truly asynchronous.

        The driver, not the runtime: a failed ``cudaHostRegister`` leaves the runtime's
        last error set, and the next kernel launch check (``cudaGetLastError``) then raises
        an unrelated "CUDA error" in the user's step. A driver call returns its status and
        sets nothing. MAP_PRIVATE: plain anonymous memory, not a shared-memory object that
        counts against ``/dev/shm`` and survives into forked workers.
        """
        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf = torch.frombuffer(area, dtype=torch.uint8)  # keeps ``area`` alive
        err = _DRIVER.call(torch.cuda.current_device(), "cuMemHostRegister_v2",
                           ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(nbytes),
                           ctypes.c_uint(_HOST_REGISTER_PORTABLE))  # fmt: skip
        if err != 0:
            raise RuntimeError(f"cuMemHostRegister of {nbytes} bytes failed with CUresult {err}")
        return buf

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor from torch's pinned host allocator (which caches its blocks, so one
        step's tensors serve the next): a streamed weight's gradient lands there."""
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def unlock(self, buf: torch.Tensor) -> None:
        """Undo :meth:`page_locked`; the memory goes once the last view of ``buf`` dies."""
        _DRIVER.call(torch.cuda.current_device(), "cuMemHostUnregister",
                     ctypes.c_void_p(buf.data_ptr()))


class Driver:
    """Calls into ``libcuda`` with device ``index``'s primary context current.

    The primary context is the one the runtime (and so torch) uses; pushing it makes each
    call independent of whatever context the calling thread has current (a finalizer may run
    on any thread). ``lib`` is loaded on first use; tests put a recording stand-in there.
    """

    def __init__(self) -> None:
        self.lib: Any = None
        self._contexts: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _library(self) -> Any:
        if self.lib is None:
            self.lib = ctypes.CDLL("libcuda.so.1")
        return self.lib

    def _context(self, lib: Any, index: int) -> Any:
        with self._lock:
            ctx = self._contexts.get(index)
            if ctx is None:
                dev, ctx = ctypes.c_int(), ctypes.c_void_p()
                err = lib.cuDeviceGet(ctypes.byref(dev), index)
                if err == 0:
                    err = lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
                if err != 0:
                    return err
                self._contexts[index] = ctx  # retained once, for the process's life
            return ctx

    def call(self, index: int, name: str, *args: Any) -> int:
        """``lib.<name>(*args)`` under the primary context of device ``index``; its CUresult
        (or a nonzero one when the context cannot be had)."""
        try:
            lib = self._library()
        except OSError:
            return -1
        ctx = self._context(lib, index)
        if isinstance(ctx, int):
            return ctx
        err = lib.cuCtxPushCurrent_v2(ctx)
        if err != 0:
            return int(err)
        try:
            return int(getattr(lib, name)(*args))
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


_DRIVER = Driver()


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _driver_stream(index: int) -> int | None:
    """A new non-blocking stream on device ``index``, made through the driver; None if not."""
    raw = ctypes.c_void_p()
    try:
        err = _DRIVER.call(index, "cuStreamCreateWithPriority", ctypes.byref(raw),
                           _CU_STREAM_NON_BLOCKING, 0)  # fmt: skip
    except AttributeError:
        return None
    return raw.value if err == 0 and raw.value else None


CUDA: Any = TorchCuda()


@contextlib.contextmanager
def replaced(double: Any) -> Iterator[Any]:
    """Route every CUDA call through ``double`` for the ``with`` block (tests)."""
    global CUDA
    saved, CUDA = CUDA, double
    try:
        yield double
    finally:
        CUDA = saved
