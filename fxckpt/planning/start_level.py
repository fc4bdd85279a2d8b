"""What the device holds when a step starts: the start level ``memory_budget`` counts.

On a GPU it is the allocator's figure when a step's first forward begins
(``torch.cuda.memory_allocated``): parameters, optimizer state, inputs, anything else kept
there. The CPU keeps no such counter, so there it is what the step is given: the storages of
the parameters, buffers and inputs its graphs take, the parameters and buffers of the module
``torch.compile`` wraps (eager code between graphs uses some of them), their gradients, and
the state of any optimizer handed to :func:`watch`.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxckpt import _torch_compat as compat
from fxckpt._torch_compat import pytree

log = logging.getLogger(__name__)


class StartLevel:
    """What the device holds when a step starts: the allocator's figure on a GPU; on the CPU
    the storages of what the step is given (module docstring)."""

    def __init__(self, held: Callable[[Any, torch.device], int] | None = None) -> None:
        # Bytes of the storages on the device that a collection of tensors reaches, each once
        # (the meter's own count, fxckpt.meter.held_on_device, which leaves out fxckpt's host
        # memory and adds the streamed weights' copies kept on the device); by default, every
        # storage.
        self.held = held or _storages
        self.device = torch.device("cpu")
        self.leaves: list[weakref.ref[torch.Tensor]] = []  # parameters
        self.batch: dict[object, int] = {}  # per graph: bytes of its other inputs (buffers, batch)

    def take(self, key: object, example_inputs: Sequence[Any]) -> None:
        """Note what a graph is given (its real example inputs, at its compile), and the
        parameters of the module ``torch.compile`` wraps, where one is being called: eager
        code (a loss that dynamo leaves out of every graph) uses some of them."""
        module = _compiling_module()
        if isinstance(module, torch.nn.Module) and not self.leaves:
            self.leaves += [weakref.ref(t) for t in module.parameters()]
            self.leaves += [weakref.ref(t) for t in module.buffers()]
        batch = 0
        for t in example_inputs:
            if not isinstance(t, torch.Tensor) or t.grad_fn is not None:
                continue
            if t.device.type != "cpu":
                self.device = t.device
            if t.requires_grad or any(r() is t for r in self.leaves):  # the same every step
                self.leaves.append(weakref.ref(t))
            else:
                batch += storage_bytes(t)
        self.batch[key] = batch

    def new_gradients(self) -> int:
        """Bytes of the gradients the step's backward creates for every parameter known."""
        return new_gradients([t for ref in self.leaves if (t := ref()) is not None])

    def measure(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return self.given()

    def given(self) -> int:
        """The CPU's figure (any device: what the step is given, as the CPU counts it; on
        the meta device, where fxckpt inspect plans, what the step would be given)."""
        alive = [t for ref in self.leaves if (t := ref()) is not None]
        self.leaves = [weakref.ref(t) for t in alive]
        tensors = [*alive, *(t.grad for t in alive if t.grad is not None), *watched_state()]
        return self.held(tensors, self.device) + sum(self.batch.values())


def _storages(tensors: Any, device: torch.device) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == device.type:
            storage = t.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


class EagerBytes:
    """What eager code between a step's graphs holds at the step's peak (an embedding or a
    loss dynamo left out of every graph, a key/value cache): in no graph's plan, so measured.

    The first step in which nothing compiles (and, after the plans change, the first after
    that: :meth:`again`) is measured whole by ``meter`` (a factory
    of :class:`fxckpt.meter.Meter`, made for this: another meter the user starts takes
    precedence, and this one measures a later step); its peak over what the graphs' plans
    predict for the step is :attr:`bytes`, which the start level counts from then on. The
    meter ends where the step's backward ended (torch's profiler, the CPU's meter, cannot
    stop inside a backward: it stops at the next forward, or when another meter starts, and
    leaves out what came after)."""

    def __init__(self, meter: Callable[[torch.device], Any] | None) -> None:
        self.meter = meter
        self.bytes = 0
        self.done = meter is None
        self.known = meter is None  # measured (or nothing to measure with)
        self._running: Any = None
        self._quiet = False

    @property
    def measuring(self) -> bool:
        return self._running is not None

    def again(self) -> None:
        """The plans changed: measure a later step too, and count its figure instead (under
        Inductor what the step holds beyond its plans moves with the plans, either way: a
        lower plan's figure need not be the higher one's)."""
        if self.meter is not None and self._running is None:
            self.done = self.known = False

    def measure(self, device: torch.device) -> None:
        """A step starts: measure it, unless one was measured already."""
        if self.done or self.meter is None or self._running is not None:
            return
        meter = self.meter(device)
        try:
            meter.__enter__()
        except Exception:  # a meter or profiler of the user's own is recording: a later step
            return
        self.done = True
        self._running = meter

    def step_ended(self, *, quiet: bool) -> None:
        """The measured step's backward ended; ``quiet``: nothing compiled in it."""
        if self._running is not None:
            self._running.step_ended()
            self._quiet = quiet

    def measured(self, predicted: int, over_read: int = 0) -> None:
        """The next step starts: what the measured one allocated at its peak over
        ``predicted`` (the graphs' plans' figure, start level left out) is eager code's. A
        peak below ``predicted`` takes back up to ``over_read``: what a compiler's own figures
        (Inductor's schedule) in ``predicted`` add to the plans' liveness, and read high."""
        meter, self._running = self._running, None
        quiet = self._quiet and meter.ended_ns is not None
        meter.__exit__(None, None, None)
        if not quiet or meter.result is None:  # a compile inside it, or the user's own meter
            self.done = False  # measure a later step
            return
        self.known = True
        unseen = int(meter.result.peak_bytes) - predicted
        self.bytes = unseen if unseen > _NOISE else 0
        if unseen < -_NOISE and over_read > 0:
            self.bytes = max(unseen, -over_read)
            log.info("fxckpt: the step peaked %s below its graphs' figures, whose compiler's "
                     "schedule reads high; counted from now on", -self.bytes)
        elif self.bytes:
            log.info("fxckpt: the step allocated %s more at its peak than its graphs' plans "
                     "count (eager code between graphs); counted from now on", unseen)


# Less than this over the plans' figure is the allocator's noise, not eager code's tensors.
_NOISE = 4096


def _compiling_module() -> Any:
    """The module whose ``torch.compile`` wrapper this thread is calling now (found in the
    Python frames out from here, at compile time only), or None for a compiled function."""
    frame = inspect.currentframe()
    while frame is not None:
        found = compat.compiled_module_of(frame.f_locals.get("self"))
        if found is not None:
            return found
        frame = frame.f_back
    return None


def storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return 0


def alive(refs: Sequence[weakref.ref[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for r in refs if (t := r()) is not None]


def new_gradients(example_inputs: Sequence[Any]) -> int:
    """Bytes of the ``.grad`` tensors a graph's backward creates: its leaf inputs that require
    a gradient and have none yet (an existing one is accumulated into, in the start level)."""
    seen: dict[int, int] = {}
    for t in example_inputs:
        if (isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is None
                and t.grad is None):
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


_watched: weakref.WeakSet[Any] = weakref.WeakSet()


def watch(*objects: Any) -> Any:
    """Count each module's parameters and buffers and each optimizer's parameters and state in
    the start level of the steps that follow; returns the first object given.

    On a GPU the allocator already counts all of it (this changes nothing there). On the CPU
    the start level is what the step is given, and a graph sees only the parameters it takes:
    not those that eager code uses (a loss after a graph break that dynamo runs eagerly), nor
    an optimizer's state (AdamW's two moments, from its first ``step()`` on).
    ``fxckpt.watch(model, optimizer)`` makes a plan see them, and see the state grow.
    """
    if not objects:
        raise TypeError("fxckpt.watch takes modules and optimizers, got nothing")
    for obj in objects:
        if not isinstance(obj, torch.nn.Module) and not hasattr(obj, "param_groups"):
            raise TypeError("fxckpt.watch takes torch.nn.Module and torch.optim.Optimizer "
                            f"objects, got {type(obj).__name__}")
        _watched.add(obj)
    return objects[0]


def forget(*objects: Any) -> None:
    """Stop counting objects :func:`watch` was given (``None`` is skipped)."""
    for obj in objects:
        if obj is not None:
            _watched.discard(obj)


def watched_state() -> list[torch.Tensor]:
    """The tensors of every watched module (parameters, buffers) and optimizer (parameters,
    state)."""
    out: list[torch.Tensor] = []
    for obj in list(_watched):
        if isinstance(obj, torch.nn.Module):
            out += [*obj.parameters(), *obj.buffers()]
            out += [p.grad for p in obj.parameters() if p.grad is not None]
            continue
        for group in obj.param_groups:
            params = [p for p in group["params"] if isinstance(p, torch.Tensor)]
            out += params + [p.grad for p in params if p.grad is not None]
        for state in obj.state.values():
            out += [v for v in pytree.tree_leaves(state) if isinstance(v, torch.Tensor)]
    return out
