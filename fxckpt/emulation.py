"""``fxckpt.emulate_link``: make the CPU engine a model of a GPU's host link.

    with fxckpt.emulate_link(bandwidth="200MB/s", overhead_ms=0.05):
        loss = compiled(x).sum(); loss.backward()

    fxckpt.emulate_link(target="h200-pcie5", model=model, inputs=(idx, targets))

Each copy then occupies its direction's queue (one each way, shared by every copy stream)
for ``overhead + bytes / bandwidth`` of wall time, and completes only when that has passed
(:mod:`fxckpt._link`). Plans compiled meanwhile price copies with the same figures (unless the
``bandwidth`` option says otherwise: an option wins), and their
``assumptions`` say ``"emulated"``. ``FXCKPT_EMULATE_LINK="12MB/s"`` (or ``"12MB/s,0.05ms"``)
does the same for a whole process, for scripts and the CLI; a call here overrides it.

With ``target=``, the bandwidth is derived (:mod:`fxckpt.targets`): so that ``model``'s
copy-to-compute time per block, on this machine, equals what fxckpt's cost model predicts for
the target's model on the target's GPU and link.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from fxckpt import _link
from fxckpt.errors import OptionsError
from fxckpt.units import parse_bandwidth, parse_duration_ms


class EmulatedLink:
    """The link :func:`emulate_link` installed (or ``None``'s absence of one), and the one it
    replaced; as a context manager, leaving the ``with`` block puts that one back."""

    def __init__(self, spec: _link.LinkSpec | None, previous: _link.LinkSpec | None,
                 derivation: Any = None) -> None:
        self.spec, self.previous, self.derivation = spec, previous, derivation

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second each way (None: not emulated)."""
        return None if self.spec is None else self.spec.bandwidth

    @property
    def overhead_ms(self) -> float:
        return 0.0 if self.spec is None else self.spec.overhead_s * 1e3

    def copy_seconds(self, nbytes: int) -> float:
        """How long one copy of ``nbytes`` occupies its queue on this link (0 when none)."""
        return 0.0 if self.spec is None else self.spec.copy_seconds(nbytes)

    def __enter__(self) -> EmulatedLink:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        _link.install(self.previous)

    def __repr__(self) -> str:
        return "EmulatedLink(" + ("off" if self.spec is None else self.spec.describe()) + ")"


def emulate_link(
    bandwidth: Any = None,
    *,
    overhead_ms: Any = 0.0,
    target: str | None = None,
    model: Any = None,
    inputs: Any = None,
    forward_ms: float | None = None,
    compute_scale: float = 1.0,
) -> EmulatedLink:
    """Emulate a host link of ``bandwidth`` (bytes/s each way, or ``"12MB/s"``) with
    ``overhead_ms`` per copy, from now on; ``emulate_link(None)`` turns emulation off (even
    one ``FXCKPT_EMULATE_LINK`` asked for).

    ``target``: derive the bandwidth instead (``fxckpt.targets.TARGETS`` lists the names;
    ``model`` and its example ``inputs`` are then required, and ``bandwidth`` must be None).
    The overhead is then the target's, scaled by the same compute ratio, unless given.
    ``forward_ms``: ``model``'s forward time per block as measured here; without it, fxckpt's
    CPU cost model estimates it. With it, plans compiled under the link scale their compute
    estimates to the measured figure (``compute_scale``, which may also be given directly):
    the planner then sees the copy-to-compute ratio the link was sized for.

    Returns an :class:`EmulatedLink`; used in a ``with`` statement, the previous setting comes
    back at its end.
    """
    derivation = None
    if target is not None:
        from fxckpt.targets import derive

        if bandwidth is not None:
            raise OptionsError("bandwidth", bandwidth, "None when target= is given (the target "
                               "sets the bandwidth)")
        derivation = derive(target, model, inputs, forward_ms=forward_ms)
        explicit = overhead_ms not in (0.0, None)
        ms = parse_duration_ms(overhead_ms, "overhead_ms") if explicit else derivation.overhead_ms
        spec: _link.LinkSpec | None = _link.LinkSpec(derivation.bandwidth, ms / 1e3,
                                                     f"target {target}", derivation.compute_scale)
    elif bandwidth is None:
        if model is not None or inputs is not None:
            raise OptionsError("target", None, "a target name (model= and inputs= derive its "
                               "bandwidth), or no model= and inputs=")
        spec = None
    else:
        rate = parse_bandwidth(bandwidth, "bandwidth")
        assert rate is not None
        ms = parse_duration_ms(0.0 if overhead_ms is None else overhead_ms, "overhead_ms")
        if isinstance(compute_scale, bool) or not (isinstance(compute_scale, (int, float))
                                                   and 0 < compute_scale < float("inf")):
            raise OptionsError("compute_scale", compute_scale, "a positive, finite number")
        spec = _link.LinkSpec(rate, ms / 1e3, "emulate_link", float(compute_scale))
    previous = _link.install(spec)
    return EmulatedLink(spec, previous, derivation)


def rescale_link(factor: float) -> None:
    """Copies queued from now on take ``factor`` times their emulated time, until the next
    call. For benchmarks on a shared machine: compute slows down under other processes' load
    and wall-clock copies do not, so a benchmark that re-measures compute can keep the
    copy-to-compute ratio the link stands for by rescaling it. Raises when no link is emulated.
    """
    link = _link.current()
    if link is None:
        raise OptionsError("rescale_link", factor, "a call while a link is emulated "
                           "(fxckpt.emulate_link or FXCKPT_EMULATE_LINK)")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
        raise OptionsError("factor", factor, "a positive, finite number")
    link.rescale(float(factor))


def emulated() -> EmulatedLink:
    """The link in force now (from :func:`emulate_link` or ``FXCKPT_EMULATE_LINK``), changing
    nothing; its ``spec`` is None when copies run at memcpy speed."""
    now = _link.spec()
    return EmulatedLink(now, now)


_host_thread: Any = None


def copy_on_compute(t: Any, to: str) -> Any:
    """A copy of ``t`` through the emulated link as a copy on the compute stream makes it: the
    caller waits until the copy's window has closed (``torch.autograd.graph.save_on_cpu`` and
    torch's synchronous offload copy this way). ``to="host"`` returns a host copy, allocated
    off the calling thread so that the CPU meter, like a GPU's allocator, does not count it;
    ``to="device"`` a fresh tensor allocated by the caller. Without a link, a plain memcpy.

    For benchmarks: the peers of fxckpt, measured through the same link.
    """
    import concurrent.futures

    import torch

    global _host_thread
    if to not in ("host", "device"):
        raise OptionsError("to", to, "'host' or 'device'")
    if _host_thread is None:
        _host_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fxckpt-host")
    link = _link.current()
    direction = "d2h" if to == "host" else "h2d"
    nbytes = t.untyped_storage().nbytes() if t.numel() else 0
    out = None if to == "host" else torch.empty_like(t)

    def job() -> Any:
        dst = torch.empty_like(t) if out is None else out
        if link is None:
            dst.copy_(t)
        else:
            link.copy(direction, nbytes, lambda: dst.copy_(t))
        return dst

    return _host_thread.submit(job).result()
