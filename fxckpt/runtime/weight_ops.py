"""The ``fxckpt::`` operators of streamed weights (:func:`fxckpt.stream_weights`).

A streamed parameter lives in fxckpt's host memory (pinned on a GPU machine). Its module reads
it through ``fxckpt::stream_in``, which returns a device copy; that is the one op a traced
model shows, and, run as it is (eager, or a graph fxckpt did not rewrite), it copies at once
on the compute side. The backend splits each ``stream_in`` of a compiled graph into
``fxckpt::weight_prefetch``, issued ahead of the use on the copy engine's host-to-device
queue, and the activations' own ``fxckpt::wait`` before the use (:mod:`fxckpt.passes.weights`).
The device copy is an ordinary tensor of the graph, freed after its last use.

Where a device budget leaves room, the plan keeps a weight's device copy across steps instead:
``fxckpt::resident_weight`` returns one copy per host weight, made at the first use and made
again only after the host weight is written (its version counter moves: the optimizer's step,
``load_state_dict``). It is dropped with the host weight.

A trainable weight's gradient leaves the device through ``fxckpt::stream_out``, the backward
of ``stream_in``: a device-to-host copy into a new host tensor that autograd accumulates into
the host parameter's ``.grad``, made on the compute side. In a compiled backward the backend
splits it in three (:mod:`fxckpt.passes.weight_grads`): ``fxckpt::grad_offload`` starts the copy
on the engine's device-to-host queue where the gradient is produced; the activations' join,
``fxckpt::offload_done``, makes compute wait for it a few gradients later, after which the
device gradient may be freed; ``fxckpt::grad_host``, at the backward's end, waits on the host
side too and hands autograd the host tensor. So every gradient is complete in its host
``.grad`` when the backward returns, as after ``stream_out``.

Ordering with the optimizer, which writes host weights: every host-to-device copy of a weight
is recorded until it is known complete; :func:`fence` blocks until all are, and fxckpt runs it
before every optimizer step that holds a streamed weight (a global step pre-hook, installed by
:func:`fxckpt.stream_weights`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from fxckpt import _cuda, _link
from fxckpt import _torch_compat as compat
from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import copy_meter, host_marks, pool, profiles, stats
from fxckpt.runtime.engine import Part, Transfer
from fxckpt.runtime.engine import _config as engine_config
from fxckpt.runtime.handles import lookup, next_id, register, span_of
from fxckpt.runtime.transfer import UNSAFE, start_prefetch

# Storage address -> bytes of every live host tensor fxckpt made for a streamed weight or its
# gradient. The CPU meter leaves these out, as on a GPU they would be host memory.
_HOST: dict[int, int] = {}
_HOST_LOCK = threading.Lock()
# The completions (futures, CUDA events) of weight copies that may still be reading host
# memory; a record's own may be cleared when its handle dies, before the copy is known done.
_IN_FLIGHT: list[object] = []
# (host storage address, offset, shape, stride, device) -> (the host weight's version when
# copied, its device copy): the copies the plan keeps on the device across steps.
_RESIDENT: dict[tuple[object, ...], tuple[int, torch.Tensor]] = {}
_DONE: Future[None] = Future()
_DONE.set_result(None)


def host_ptrs() -> set[int]:
    """Addresses of the live host storages of streamed weights and their gradients."""
    with _HOST_LOCK:
        return set(_HOST)


# The adopted tensors themselves: on the meta device (planning offline) storages have no
# address to tell host memory by.
_HOST_TENSORS: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> the tensor (tensors compare
# elementwise, so no set of them)


def mark_host(t: torch.Tensor) -> None:
    """Count the meta tensor ``t`` as host memory when a step is planned offline."""
    key = id(t)

    def gone(_: object, k: int = key) -> None:
        _HOST_TENSORS.pop(k, None)

    _HOST_TENSORS[key] = weakref.ref(t, gone)


def is_host_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor fxckpt adopted as host memory (a streamed weight)."""
    ref = _HOST_TENSORS.get(id(t))
    return ref is not None and ref() is t


def adopt_host(t: torch.Tensor) -> torch.Tensor:
    """Count ``t``'s storage as fxckpt host memory for as long as the tensor ``t`` lives (a
    storage's Python object is made afresh at each ``untyped_storage()``, so the tensor, or the
    parameter made over it, is what is watched)."""
    mark_host(t)
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    host_marks.note(ptr)
    with _HOST_LOCK:
        _HOST[ptr] = storage.nbytes()
    weakref.finalize(t, _forget, ptr).atexit = False
    return t


def _forget(ptr: int) -> None:
    # Runs from weakref.finalize: possibly inside the garbage collector, on any thread, and on
    # this one while it holds _HOST_LOCK (a collection can start at any allocation there). It
    # takes no lock: dict.pop is atomic, and so is list() of a dict's keys.
    _HOST.pop(ptr, None)
    for key in list(_RESIDENT):
        if key[0] == ptr:
            _RESIDENT.pop(key, None)


def is_host(t: torch.Tensor) -> bool:
    with _HOST_LOCK:
        return t.untyped_storage().data_ptr() in _HOST


def _check_host(w: torch.Tensor, op: str) -> None:
    if w.device.type != "cpu" or not is_host(w):
        raise RuntimeCopyError(
            f"fxckpt::{op}: a streamed weight ({list(w.shape)} {w.dtype}) is on {w.device}, not "
            "in fxckpt's host memory. Something moved it after fxckpt.stream_weights (for "
            "example model.to(device)). Write model.to(device) first, then "
            "fxckpt.stream_weights(model, device=...)."
        )


def _copy(dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
    """One copy on the compute side, complete on return (so the optimizer may write the host
    weight at once after); through the emulated link, when there is one. The copies the plan
    hides behind compute are the engine's (``weight_prefetch``), not these."""
    link = _link.current()
    if link is not None and dst.device.type == "cpu" and src.device.type == "cpu":
        stats.add("copy_seconds", link.copy(direction, src.nbytes, lambda: dst.copy_(src)))
    else:
        dst.copy_(src)


@torch.library.custom_op("fxckpt::stream_in", mutates_args=(), schema="(Tensor w, Device device) -> Tensor",
                         tags=UNSAFE)
def stream_in(w: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of the streamed host weight ``w``, copied now, on the compute side."""
    _check_host(w, "stream_in")
    out = torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device=device)
    _copy(out, w, "h2d")
    stats.add("weight_h2d_bytes", w.nbytes)
    return out


@stream_in.register_fake
def _(w: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device=device)


@torch.library.custom_op("fxckpt::resident_weight", mutates_args=(),
                         schema="(Tensor w, Device device) -> Tensor", tags=UNSAFE)  # fmt: skip
def resident_weight(w: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The device copy of the streamed host weight ``w`` that the plan keeps across steps:
    copied at the first use, and again after each write to ``w``; otherwise the same tensor.

    Only the backend's rewritten graphs call it, forward and backward alike, with autograd
    outside them. Inductor neither reuses nor writes into an extern kernel's output, so the
    kept copy is only ever read."""
    _check_host(w, "resident_weight")
    dev = torch.device(device)
    key = (w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), tuple(w.stride()), str(dev))
    kept, version = _RESIDENT.get(key), compat.tensor_version(w)
    if kept is not None and kept[0] == version:
        return kept[1]
    out = torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device=dev)
    _copy(out, w, "h2d")
    stats.add("weight_h2d_bytes", w.nbytes)
    _RESIDENT[key] = (version, out)
    return out


@resident_weight.register_fake
def _(w: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device=device)


def resident_copies() -> list[torch.Tensor]:
    """The weights' device copies kept across steps."""
    return [t for _, t in list(_RESIDENT.values())]


def _backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return torch.ops.fxckpt.stream_out(grad), None


stream_in.register_autograd(_backward)  # the backward needs nothing saved


@torch.library.custom_op("fxckpt::stream_out", mutates_args=(), schema="(Tensor grad) -> Tensor",
                         tags=UNSAFE)
def stream_out(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` copied to a new host tensor (counted as fxckpt host memory), complete on return:
    autograd accumulates it into the host parameter's ``.grad`` on the CPU at once."""
    out = adopt_host(torch.empty(grad.shape, dtype=grad.dtype, device="cpu"))
    if grad.device.type == "cpu":
        _copy(out, grad.contiguous(), "d2h")
    else:
        out.copy_(grad)  # blocking: the host side reads it next
    stats.add("weight_d2h_bytes", grad.nbytes)
    return out


@stream_out.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty(grad.shape, dtype=grad.dtype, device="cpu")


@torch.library.custom_op("fxckpt::grad_offload", mutates_args=(),
                         schema="(Tensor grad, Tensor[]? after=None, *, str? profile=None) -> Tensor",
                         tags=UNSAFE)  # fmt: skip
def grad_offload(grad: torch.Tensor, after: Sequence[torch.Tensor] | None = None, *,
                 profile: str | None = None) -> torch.Tensor:
    """Start copying a streamed weight's gradient into a new host tensor (fxckpt host memory)
    on the copy engine's device-to-host queue; returns the handle that ``fxckpt::offload_done``
    joins and ``fxckpt::grad_host`` takes the host tensor from. ``after``: for ordering only."""
    src = grad.contiguous()  # kept (rec.src) until the join
    pinned = src.device.type in pool.PINNED_TYPES  # a copy from pageable memory would block
    host = adopt_host(_cuda.CUDA.pinned_empty(src.shape, src.dtype) if pinned
                      else torch.empty(src.shape, dtype=src.dtype, device="cpu"))  # fmt: skip
    rec = Transfer(
        hid=next_id(),
        parts=(Part(tuple(src.shape), tuple(src.stride()), src.numel(), 0, src.nbytes),),
        dtype=src.dtype,
        device=src.device,
        nbytes=src.nbytes,
        profile=profiles.lookup(profile),
        borrowed=True,
        landing=host,
    )
    if src.nbytes:
        rec.host, rec.src = host.view(-1).view(torch.uint8), src
        rec.meter = copy_meter.active()
        rec.profile.engine(src.device).start_offload(rec, [(src.view(-1).view(torch.uint8), rec.host)])
        stats.add("weight_d2h_bytes", src.nbytes)
    return register(rec)


@grad_offload.register_fake
def _(grad: torch.Tensor, after: Sequence[torch.Tensor] | None = None, *,
      profile: str | None = None) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("fxckpt::grad_host", mutates_args=(),
                         schema="(Tensor handle, SymInt[] size, ScalarType dtype, Tensor[]? after=None) -> Tensor",
                         tags=UNSAFE)  # fmt: skip
def grad_host(handle: torch.Tensor, size: Sequence[int], dtype: torch.dtype,
              after: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """The host tensor ``fxckpt::grad_offload`` filled, once the host has seen its copy
    complete (not only compute: autograd accumulates it on the CPU next)."""
    rec = lookup(handle)
    if rec.d2h is not None and not engine_config.unsafe_skip_waits:
        started, done = time.perf_counter(), _finished(rec.d2h)
        rec.profile.engine(rec.device).wait_copied(rec.d2h, rec)
        if not done:
            stats.add("stall_seconds", time.perf_counter() - started)
    out, rec.landing = rec.landing, None
    if out is None:
        raise RuntimeCopyError(f"fxckpt::grad_host: {rec.describe()} was taken already")
    return out


@grad_host.register_fake
def _(handle: torch.Tensor, size: Sequence[int], dtype: torch.dtype,
      after: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device="cpu")


@torch.library.custom_op(
    "fxckpt::weight_prefetch",
    mutates_args=(),
    schema="(Tensor w, Device device, Tensor[]? after=None, *, str? profile=None) -> Tensor",
    tags=UNSAFE,
)
def weight_prefetch(
    w: torch.Tensor, device: torch.device, after: Sequence[torch.Tensor] | None = None, *,
    profile: str | None = None,
) -> torch.Tensor:
    """Start copying the streamed host weight ``w`` to ``device`` on the copy engine's
    host-to-device queue; returns the handle that ``fxckpt::wait`` takes (as handle and as
    ticket). ``after``: outputs of the node the plan issues the copy after.

    A device copy an earlier plan kept of ``w`` is let go here: the plan running now streams
    ``w`` (a re-plan kept fewer weights), and the kept copy would only hold device memory."""
    _check_host(w, "weight_prefetch")
    if _RESIDENT:
        ptr = w.untyped_storage().data_ptr()
        for key in [k for k in list(_RESIDENT) if k[0] == ptr]:
            _RESIDENT.pop(key, None)
    span = span_of(w)
    nbytes = span * w.element_size()
    rec = Transfer(
        hid=next_id(),
        parts=(Part(tuple(w.shape), tuple(w.stride()), span, 0, nbytes),),
        dtype=w.dtype,
        device=torch.device(device),
        nbytes=nbytes,
        profile=profiles.lookup(profile),
        borrowed=True,
    )
    if nbytes:
        rec.host = w.detach().as_strided((span,), (1,), w.storage_offset()).view(torch.uint8)
        rec.d2h = _DONE if rec.device.type == "cpu" else None  # already on the host
        rec.meter = copy_meter.active()
        start_prefetch(rec)
        _pending(rec.h2d)
        stats.add("weight_h2d_bytes", nbytes)
    return register(rec)


@weight_prefetch.register_fake
def _(
    w: torch.Tensor, device: torch.device, after: Sequence[torch.Tensor] | None = None, *,
    profile: str | None = None,
) -> torch.Tensor:
    # On meta (planning offline) the handle is meta too, so the wait that takes it runs its
    # meta kernel instead of looking up a copy that never ran.
    return torch.empty((), dtype=torch.int64, device="meta" if w.device.type == "meta" else "cpu")


def _finished(done: object) -> bool:
    return done.done() if isinstance(done, Future) else bool(done.query())  # type: ignore[attr-defined]


def _pending(done: object) -> None:
    with _HOST_LOCK:
        _IN_FLIGHT[:] = [d for d in _IN_FLIGHT if not _finished(d)]
        _IN_FLIGHT.append(done)


def fence() -> None:
    """Block until no host-to-device copy of a streamed weight is still reading host memory.

    The optimizer writes host weights; a copy that has not read its bytes yet would carry the
    new values into a backward that the old ones began."""
    with _HOST_LOCK:
        pending, _IN_FLIGHT[:] = list(_IN_FLIGHT), []
    for done in pending:
        if isinstance(done, Future):
            done.exception()  # waits; a failed copy raised in its own wait already
        else:
            done.synchronize()  # type: ignore[attr-defined]


OPS = (
    torch.ops.fxckpt.stream_in.default,
    torch.ops.fxckpt.resident_weight.default,
    torch.ops.fxckpt.stream_out.default,
    torch.ops.fxckpt.weight_prefetch.default,
    torch.ops.fxckpt.grad_offload.default,
    torch.ops.fxckpt.grad_host.default,
)
for _op in OPS[3:]:  # never dead code: a handle may go unused until its wait or join
    torch.fx.node.has_side_effect(_op)
