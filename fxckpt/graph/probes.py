"""What the cost model measures on the machine: host-device bandwidth and op timings.

Each probe runs once per device (and op) and process, and always on real tensors, outside any
fake mode (:func:`fxckpt._torch_compat.outside_fake_mode`): the partitioner that asks for
them runs inside AOTAutograd's ``FakeTensorMode``, where a copy returns at once. Nothing here
runs at import.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from fxckpt._torch_compat import outside_fake_mode

if TYPE_CHECKING:
    import torch
    import torch.fx

    from fxckpt.graph.costs import CostTable

_COPY_BYTES = 64 * 2**20


def measure_bandwidth(device: Any, table: CostTable | None = None) -> float:
    """Host↔device copy bandwidth in bytes/ms, measured once per process and device.

    CUDA: a page-locked 64 MiB host buffer copied H2D then D2H three times each on the
    device's own stream, timed with CUDA events; the slower direction wins. CPU: the best of
    three 64 MiB ``copy_`` calls between buffers written beforehand (a memcpy rate). Meta (offline
    planning): ``table``'s :attr:`~fxckpt.graph.costs.CostTable.pcie_bytes_per_ms` (None:
    :data:`~fxckpt.graph.costs.DEFAULT_COSTS`, imported here when asked for, since
    ``costs`` imports this module); pass ``bandwidth`` for another link. Safe to call inside
    a fake mode: the probe steps out of it.
    """
    name = device if isinstance(device, str) else str(device)
    if name.startswith("meta"):  # offline planning: nothing to measure
        if table is None:
            from fxckpt.graph.costs import DEFAULT_COSTS

            table = DEFAULT_COSTS
        return table.pcie_bytes_per_ms
    if name == "cuda":
        import torch

        name = f"cuda:{torch.cuda.current_device()}"
    return _bandwidth(name)


@functools.cache
def _bandwidth(device: str) -> float:
    with outside_fake_mode():
        if device.startswith("cuda"):
            import torch

            return _cuda_bandwidth(torch.device(device))
        return _cpu_bandwidth()


def _cpu_bandwidth() -> float:
    import torch

    # Both buffers written before timing: an untouched torch.empty maps every page of the
    # source to the kernel's one shared zero page, and copying from it reads the cache, not
    # memory (it measured ~900 GB/s). The device is explicit: a user's ``with
    # torch.device("cuda")`` would otherwise place the buffers.
    src = torch.full((_COPY_BYTES,), 7, dtype=torch.uint8, device="cpu")
    dst = torch.zeros_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return _COPY_BYTES / max(best * 1e3, 1e-6)


def _cuda_bandwidth(device: torch.device) -> float:
    """Bytes/ms of the slower direction between page-locked host memory and ``device``.

    Everything happens on ``device``'s own current stream, under its device guard: a copy
    runs on the stream of the device its device tensor lives on, so events recorded on the
    *current* device's stream would time nothing when the model sits on another GPU, and
    the planner would then believe copies are free.
    """
    import torch

    from fxckpt import _cuda

    cuda = _cuda.CUDA
    host = cuda.page_locked(_COPY_BYTES)  # like the pool's slabs: exactly locked pages
    try:
        with cuda.device(device):
            stream = cuda.current_stream(device)
            dev = cuda.empty(_COPY_BYTES, torch.uint8, device)
            with cuda.use_stream(stream):
                cuda.copy(dev, host)  # warm up the copy engines and the allocator
                cuda.copy(host, dev)
                slower_ms = 0.0
                for dst, src in ((dev, host), (host, dev)):
                    start, end = cuda.event(timing=True), cuda.event(timing=True)
                    start.record(stream)
                    for _ in range(3):
                        cuda.copy(dst, src)
                    end.record(stream)
                    end.synchronize()
                    slower_ms = max(slower_ms, start.elapsed_time(end) / 3)
    finally:
        cuda.unlock(host)  # every copy has completed: end.synchronize()
    return _COPY_BYTES / max(slower_ms, 1e-6)


_PROFILED: dict[tuple[Any, ...], float] = {}


def profile_ms(node: torch.fx.Node, device: str, make_args: Any, repeats: int = 5) -> float:
    """Milliseconds of ``node``'s op on random real tensors of its input shapes, on ``device``
    (CUDA), timed with events on that device's stream; once per op, shapes and device.

    ``make_args(node, real)`` returns the node's ``(args, kwargs)`` with every tensor
    replaced by ``real(its meta value)``, or None when a value is missing.
    """
    import torch

    def key_of(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), tuple(v.stride()), v.dtype)
        return repr(v)

    sig = make_args(node, key_of)
    if sig is None:
        return 0.0
    key = (str(node.target), repr(sig), device)
    got = _PROFILED.get(key)
    if got is not None:
        return got

    def real(v: torch.Tensor) -> torch.Tensor:
        if v.dtype.is_floating_point or v.dtype.is_complex:
            return torch.randn(tuple(v.shape), dtype=v.dtype, device=device)
        return torch.zeros(tuple(v.shape), dtype=v.dtype, device=device)  # safe as an index

    with outside_fake_mode(), torch.cuda.device(torch.device(device)):
        args = make_args(node, real)
        if args is None:
            return 0.0
        fn: Any = node.target
        fn(*args[0], **args[1])  # warm-up: kernels, allocator
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn(*args[0], **args[1])
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / repeats
    _PROFILED[key] = ms
    return ms
