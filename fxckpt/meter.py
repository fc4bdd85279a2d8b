"""Measure the memory a call really uses, from the allocator's own accounting.

``fxckpt.measure(model, *inputs)`` runs one call and reports what it left allocated and its
peak. Nothing here reads a plan or fxckpt's counters: this is the yardstick plans are checked
against, so it must not share their mistakes.

- **CPU.** torch's CPU allocator keeps no counters Python can read; it reports every
  allocation and free to the profiler while memory profiling is on. The meter records those
  reports, and only those (no op events), for the calling thread, and pairs frees with
  allocations by address. On the CPU, fxckpt's host memory (the pool's buffers and the
  offload handles) lives in the same memory as the "device"; on a GPU it would be host
  memory, so the meter leaves it out: what the runtime holds when the call ends, by address,
  and what it allocated and freed inside the call, by the marks it took at each allocation
  (``fxckpt.runtime.host_marks``: address and time).
- **CUDA.** ``torch.cuda.memory_allocated`` before and after the call, and
  ``max_memory_allocated`` over it, with the peak reset at the start. Host memory, pinned or
  not, is not in those figures.

Only tensors allocated during the call count, so what it left behind is the difference it
made: saved activations, outputs, anything a runtime still holds. Memory freed during the call
that existed before it is not credited on the CPU (the profiler reports only frees of blocks it
saw allocated); on CUDA it is.

The absolute figure, ``start_bytes + peak_bytes``, also counts what the device held when the call
began: resident weights, their gradients, the inputs. CUDA's allocator knows it. The CPU's does
not, so there it is the storages of the tensors the call was given (``holding``: a model's
parameters, buffers and gradients, and tensors), each once, with fxckpt's host memory left out
(a weight fxckpt streams from host memory is not on the device), and the streamed weights'
device copies that fxckpt keeps across steps.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch

from fxckpt import _torch_compat as compat
from fxckpt._torch_compat import pytree
from fxckpt.errors import FxckptError
from fxckpt.runtime import host_marks

CPU_SOURCE = "torch CPU allocator events (profiler memory reports, calling thread)"
CUDA_SOURCE = "torch.cuda.memory_allocated / max_memory_allocated"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What one call did to the memory of ``device``.

    - ``resident_bytes``: allocated during the call and still allocated after it. For a
      forward, what it left resident: saved activations, outputs, anything held for backward.
    - ``peak_bytes``: the most bytes allocated during the call and live at once, above the
      level at its start.
    - ``output_bytes``: storages of the tensors the call returned on ``device``, each once.
    - ``held_bytes``: ``resident_bytes - output_bytes``: what the call keeps alive beyond what
      it returns (for a training forward: what waits for the backward).
    - ``start_bytes``: what the device held when the call began (CUDA: the allocator's figure;
      CPU: the storages of ``holding``, less fxckpt's host memory).
    - ``absolute_peak_bytes``: ``start_bytes + peak_bytes``, every byte on the device at the
      call's peak.
    """

    device: str
    resident_bytes: int
    peak_bytes: int
    output_bytes: int
    source: str
    output: Any = dataclasses.field(default=None, repr=False, compare=False)
    start_bytes: int = 0

    @property
    def held_bytes(self) -> int:
        return self.resident_bytes - self.output_bytes

    @property
    def absolute_peak_bytes(self) -> int:
        return self.start_bytes + self.peak_bytes

    def to_dict(self) -> dict[str, int | str]:
        return {
            "device": self.device,
            "resident_bytes": self.resident_bytes,
            "peak_bytes": self.peak_bytes,
            "output_bytes": self.output_bytes,
            "held_bytes": self.held_bytes,
            "start_bytes": self.start_bytes,
            "absolute_peak_bytes": self.absolute_peak_bytes,
            "source": self.source,
        }


def net_allocations(
    events: Iterable[tuple[int, int, int, str]], device_type: str, exclude: set[int] = frozenset(),  # type: ignore[assignment]
    marks: Iterable[tuple[int, int]] = (),
) -> tuple[dict[int, int], int]:
    """From allocator events in time order, the blocks still live (address -> bytes) and the
    peak of the live total. Frees of blocks allocated before the events began are skipped;
    addresses in ``exclude`` (host buffers live at the end) leave out the block allocated
    there last, and from then on that address: the allocator may have given the same address
    to a device tensor freed earlier in the events, which counts. ``marks`` (``(time_ns,
    address)``, :mod:`fxckpt.runtime.host_marks`) leave out the block live at that address at
    that time: host memory allocated, and perhaps freed again, inside the events."""
    events = [e for e in events if e[3] == device_type]
    # The event that allocated each excluded address's host block: its last allocation.
    host_from = {ptr: i for i, (_, ptr, nbytes, _) in enumerate(events)
                 if ptr in exclude and nbytes > 0}
    skip = _marked(events, marks)
    live: dict[int, int] = {}
    now = peak = 0
    for i, (_, ptr, nbytes, _) in enumerate(events):
        if i in skip or (ptr in exclude and i >= host_from.get(ptr, 0)):
            continue
        if nbytes > 0:
            # An address seen allocated twice without a free: the free came from a thread the
            # events do not cover. The newer block replaces the older one.
            now += nbytes - live.get(ptr, 0)
            live[ptr] = nbytes
        else:
            now -= live.pop(ptr, 0)
        peak = max(peak, now)
    return live, peak


# A mark is taken just after its allocation; the two clocks agree to well under this.
_MARK_SLACK_NS = 50_000


def _marked(events: list[tuple[int, int, int, str]], marks: Iterable[tuple[int, int]]) -> set[int]:
    """Indices of the allocation and free events of each marked block: the block at the mark's
    address whose life (allocation to free, or to the end) holds the mark's time, else the
    first allocated there within the slack after it."""
    marks = list(marks)
    if not marks:
        return set()
    wanted = {ptr for _, ptr in marks}
    lives: dict[int, list[tuple[int, float, int, int]]] = {}  # ptr -> (start, end, i, j)
    open_at: dict[int, int] = {}
    for i, (t, ptr, nbytes, _) in enumerate(events):
        if ptr not in wanted:
            continue
        if nbytes > 0:
            open_at[ptr] = i
        elif ptr in open_at:
            k = open_at.pop(ptr)
            lives.setdefault(ptr, []).append((events[k][0], t, k, i))
    for ptr, k in open_at.items():
        lives.setdefault(ptr, []).append((events[k][0], float("inf"), k, -1))
    skip: set[int] = set()
    for t, ptr in marks:
        spans = lives.get(ptr, [])
        hit = next((s for s in spans if s[0] <= t <= s[1]), None)
        if hit is None:
            hit = min((s for s in spans if t < s[0] <= t + _MARK_SLACK_NS), default=None)
        if hit is not None:
            skip |= {hit[2], hit[3]} - {-1}
    return skip


class CudaCounters:
    """The CUDA memory statistics the meter reads; tests substitute a fake."""

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def reset_peak(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def allocated(self, device: torch.device) -> int:
        return int(torch.cuda.memory_allocated(device))

    def max_allocated(self, device: torch.device) -> int:
        return int(torch.cuda.max_memory_allocated(device))


def _host_ptrs() -> set[int]:
    # From the runtime, not its counters or plans: which addresses are fxckpt's host memory
    # (pool buffers, offload handles), which on a GPU would not be device memory at all.
    from fxckpt.runtime.ops import handle_ptrs
    from fxckpt.runtime.pool import host_buffer_ptrs
    from fxckpt.runtime.weight_ops import host_ptrs

    return host_buffer_ptrs("cpu") | handle_ptrs() | host_ptrs()


def held_on_device(holding: Any, device: torch.device) -> int:
    """Bytes of the storages on ``device`` that ``holding`` reaches, each once, fxckpt's host
    memory left out: a module's parameters, buffers and their gradients, and any tensors (in
    lists, tuples, dicts); and the streamed weights' device copies fxckpt keeps across steps."""
    from fxckpt.runtime.weight_ops import is_host_tensor, resident_copies

    tensors: list[torch.Tensor] = resident_copies()
    for leaf in pytree.tree_leaves(holding):
        if isinstance(leaf, torch.nn.Module):
            params = list(leaf.parameters())
            tensors += [*params, *leaf.buffers(), *(p.grad for p in params if p.grad is not None)]
        elif isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
    host = _host_ptrs() if device.type == "cpu" else set()
    seen: dict[int, int] = {}
    for t in tensors:
        if not _same_device(t.device, device):
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in host:
            seen[ptr] = storage.nbytes()
        elif device.type == "meta" and not is_host_tensor(t):  # offline: no addresses
            seen[id(t)] = storage.nbytes()
    return sum(seen.values())


def _output_bytes(output: Any, device: torch.device, live: dict[int, int] | None) -> int:
    seen: dict[int, int] = {}
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and _same_device(leaf.device, device):
            storage = leaf.untyped_storage()
            ptr = storage.data_ptr()
            if live is None or ptr in live:
                seen[ptr] = storage.nbytes()
    return sum(seen.values())


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class _Calibrating(threading.local):
    meter: Meter | None = None
    measuring: Meter | None = None  # a user's meter running on this thread


# The step a memory budget measures once on its own (fxckpt.planning.step_budget), on this
# thread: a meter the user starts takes precedence, and cancels it.
_calibrating = _Calibrating()


class Meter:
    """``with fxckpt.Meter("cpu") as m: ...``; then ``m.result`` is a :class:`Measurement`.

    Call :meth:`set_output` inside the block to have ``output_bytes`` counted. ``holding``:
    what the device holds at the start, for ``start_bytes`` on the CPU (see the module's
    docstring); CUDA's allocator counts it itself. ``calibration``: the one step a memory
    budget measures itself; any other meter entered on the thread meanwhile cancels it
    (:attr:`cancelled`), so that the user's measurement is never disturbed.
    """

    def __init__(self, device: torch.device | str = "cpu", *, cuda: CudaCounters | None = None,
                 holding: Any = None, calibration: bool = False) -> None:
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise FxckptError(
                f"fxckpt.measure: device {str(dev)!r} has no memory meter; measure on 'cpu' or 'cuda'"
            )
        if dev.type == "cuda" and dev.index is None and cuda is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self._cuda = cuda if cuda is not None else (CudaCounters() if dev.type == "cuda" else None)
        self._output: Any = None
        self._start = 0
        self._marks_from = 0
        self._holding = holding
        self.result: Measurement | None = None
        self.calibration = calibration
        self.cancelled = False
        self.finished = False
        # A calibration's step ended here (time.time_ns(), the allocator events' clock): what
        # is allocated after it is not the step's. On CUDA, its peak statistic there.
        self.ended_ns: int | None = None
        self._ended_peak: int | None = None

    def step_ended(self) -> None:
        """The measured step ended (its backward did): what comes after is not measured."""
        self.ended_ns = time.time_ns()
        if self._cuda is not None:
            self._ended_peak = self._cuda.max_allocated(self.device)

    def set_output(self, output: Any) -> None:
        self._output = output

    def cancel(self) -> None:
        """Stop measuring and keep no result (a calibration another meter preempts)."""
        if self.cancelled:
            return
        self.cancelled = True
        if _calibrating.meter is self:
            _calibrating.meter = None
        if self._cuda is None:
            compat.stop_memory_events()
            host_marks.stop(self._marks_from)

    def __enter__(self) -> Meter:
        if _calibrating.measuring is not None and self._cuda is None:
            raise FxckptError(
                "fxckpt.measure: another fxckpt meter is measuring on this thread, and the CPU "
                "meter needs the allocator's reports to itself; measure the calls one after "
                "the other, not one inside the other"
            )
        if not self.calibration and (other := _calibrating.meter) is not None:
            if other.ended_ns is not None:  # its step is over: finish it, it has its figure
                other.__exit__(None, None, None)
            else:
                other.cancel()
        if self._cuda is not None:
            self._cuda.synchronize(self.device)
            self._cuda.reset_peak(self.device)
            self._start = self._cuda.allocated(self.device)
        else:
            if compat.profiler_enabled():
                raise FxckptError(
                    "fxckpt.measure: a torch profiler is already recording on this thread, and "
                    "the CPU meter needs the profiler's memory reports itself; measure outside "
                    "the profiler session"
                )
            self._start = held_on_device(self._holding, self.device)
            compat.start_memory_events()
            self._marks_from = host_marks.start()
        if self.calibration:
            _calibrating.meter = self
        else:
            _calibrating.measuring = self
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.cancelled or self.finished:
            return
        self.finished = True
        if _calibrating.meter is self:
            _calibrating.meter = None
        if _calibrating.measuring is self:
            _calibrating.measuring = None
        if self._cuda is not None:
            self._cuda.synchronize(self.device)
            end = self._cuda.allocated(self.device)
            top = self._ended_peak if self._ended_peak is not None else self._cuda.max_allocated(self.device)
            peak = top - self._start
            resident = end - self._start
            out = _output_bytes(self._output, self.device, None)
            source = CUDA_SOURCE
        else:
            events = compat.stop_memory_events()
            marks = host_marks.stop(self._marks_from)
            if kind is not None:
                return
            if self.ended_ns is not None:
                events = [e for e in events if e[0] <= self.ended_ns]
            live, peak = net_allocations(events, "cpu", _host_ptrs(), marks)
            resident = sum(live.values())
            out = _output_bytes(self._output, self.device, live)
            source = CPU_SOURCE
        if kind is None:
            self.result = Measurement(
                str(self.device), resident, peak, out, source, self._output, self._start
            )


def _device_of(fn: Callable[..., Any], args: Any) -> torch.device:
    for leaf in pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            return leaf.device
    if isinstance(fn, torch.nn.Module):
        for p in fn.parameters():
            return p.device
    return torch.device("cpu")


def measure(
    fn: Callable[..., Any], *args: Any, device: torch.device | str | None = None,
    holding: Any = None, **kwargs: Any,
) -> Measurement:
    """Call ``fn(*args, **kwargs)`` once and measure its memory on ``device``.

    ``device`` defaults to that of the first tensor among the arguments, else of ``fn``'s
    first parameter when it is a module, else the CPU. The result keeps the call's return value
    as ``output`` (a loss, say, whose ``backward()`` you still want to run).

    ``holding`` (default: ``fn`` and the arguments) is what the device holds when the call
    begins, for ``start_bytes`` and ``absolute_peak_bytes`` on the CPU: modules (their
    parameters, buffers and gradients) and tensors. Give the model when ``fn`` is a closure:
    ``fxckpt.measure(lambda: model(x).sum().backward(), holding=(model, x))``.

    Measure a warm call: the first call of a compiled model compiles, and its allocations
    would count. On the CPU only the calling thread's allocations are seen.
    """
    dev = torch.device(device) if device is not None else _device_of(fn, (args, kwargs))
    meter = Meter(dev, holding=(fn, args, kwargs) if holding is None else holding)
    with meter:
        meter.set_output(fn(*args, **kwargs))
    assert meter.result is not None
    return meter.result
