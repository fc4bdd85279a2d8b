"""The disk tier: offloaded tensors that the host budget cannot hold live in files.

The plan marks such a tensor ``offload → disk`` and its ``fxckpt::offload`` op carries
``tier=1``. Its life, and the ordering rules that keep its bytes right (each has a test that
fails without it, ``tests/runtime/test_disk.py``; the CUDA ones also run against the recording
double, ``tests/runtime/test_disk_protocol.py``):

- **offload** (compute thread): take a staging slot and a host buffer from the pool of the
  transfer's runtime profile (its host budget covers staging too), and start the engine's
  usual device-to-host copy into it. The file goes to that profile's ``offload_dir``.
  At most ``STAGING_SLOTS`` buffers are in flight; a third offload waits for a write to end
  (counted in ``stall_seconds``).
- **write** (writer thread): W1 wait until the device-to-host copy is complete; write the
  buffer to a new file in this process's folder; W2 only then give the buffer back.
- **prefetch** (compute thread, ahead of use by the disk's read time): queue the read.
- **read** (reader thread): R1 wait until the write ended (the file is whole); take a slot
  and a buffer, read the file, copy to a fresh device buffer (the engine's ``restore_sync``);
  R2 give the buffer back only after that copy completed.
- **wait** (compute thread): R3 wait for the read and its copy; hand the device buffer over.
- **the handle dies**: F1 the file goes only now (a second backward reads it again), removed
  by whoever next touches the tier (a worker, an op, ``fxckpt.stats()``), never inside the
  garbage collector's callback.

Faults: a write that fails (``ENOSPC``: the disk is full) keeps the buffer as the host copy,
over the budget, with one warning; a staging buffer that cannot be had at all keeps the tensor
on the device, with one warning; a file deleted or truncated before its read raises
:class:`RuntimeCopyError` naming the file, never a wrong value.
"""

from __future__ import annotations

import collections
import errno
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from fxckpt import _files
from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import disk_dir, profiles, stats
from fxckpt.runtime.engine import Transfer
from fxckpt.runtime.staging import Staging, drain_all, staged_bytes, staging_of
from fxckpt.runtime.staging import give_back as _give_back

HOST, DISK = 0, 1


class DiskTierWarning(UserWarning):
    """The disk tier could not take an activation; it stayed in host or device memory."""


@dataclass(eq=False)
class DiskCopy:
    """Where one offloaded tensor's bytes are on their way to and from its file."""

    where: disk_dir.DiskDir
    buf: torch.Tensor | None  # pool buffer while staged (or the host copy, when ``hosted``)
    # Its page-aligned whole pages. A view keeps its base alive (``Tensor._base``): it goes
    # with ``buf``, or the memory would outlive the pool's accounting of it.
    view: torch.Tensor | None
    written: Future[None] | None = None
    reading: Future[torch.Tensor] | None = None
    path: str | None = None
    hosted: bool = False  # the write failed: ``buf`` holds the only copy
    error: str | None = None  # the device-to-host copy failed: nothing to restore
    jobs: int = 0
    dead: bool = False
    cleaned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


_dead: collections.deque[tuple[Transfer, DiskCopy]] = collections.deque()
_executors: dict[str, Any] = {}
_executors_lock = threading.Lock()
_inline = False


class _Inline:
    """Runs each job at once on the caller's thread (tests against the single-threaded CUDA
    double)."""

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001  (the future carries it, as a thread's would)
            fut.set_exception(err)
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def _executor(kind: str) -> Any:
    ex = _executors.get(kind)
    if ex is None:
        with _executors_lock:
            ex = _executors.get(kind)
            if ex is None:
                ex = _Inline() if _inline else ThreadPoolExecutor(1, f"fxckpt-disk-{kind}")
                _executors[kind] = ex
    return ex


def use_directory(root: str | None) -> disk_dir.DiskDir | None:
    """Give the default runtime profile a disk tier in ``root`` (``None``: none), for tests
    and tools that call the ops without compiling; a compile's ``offload_dir`` goes to its
    own profile instead.

    Validates the directory (:class:`OptionsError` naming ``offload_dir``), removes what
    killed processes left there, and re-arms the default profile's one-time warning.
    """
    default = profiles.default()
    default.disk = where = disk_dir.use_directory(root) if root is not None else None
    default.disk_warned = False
    return where


def current() -> disk_dir.DiskDir | None:
    """The default profile's folder (:func:`use_directory`)."""
    return profiles.default().disk


def _staging(rec: Transfer) -> Staging:
    return staging_of(rec.profile.pool(rec.device.type))


def wait_for_staging(staging: Staging | None = None) -> float:
    """Wait for the disk tier's staging buffers to be back in their pool (``None``: every
    pool's). The host tier asks when its pool is full: staging in flight is the only part of
    it that will come back without the step going on. Returns the seconds waited; 0 when none
    was in flight."""
    return drain_all() if staging is None else staging.drain()


def configure(*, inline: bool = False) -> None:
    """Tests: ``inline`` runs the writer and reader jobs on the calling thread."""
    global _inline
    shutdown()
    _inline = inline


def shutdown() -> None:
    """Finish queued jobs and stop the worker threads; later calls start them afresh."""
    with _executors_lock:
        exs = list(_executors.values())
        _executors.clear()
    for ex in exs:
        ex.shutdown(wait=True)
    collect()


def warn_once(rec: Transfer, reason: str) -> None:
    """Count a disk-tier fallback of ``rec``, and warn of the first one of its profile."""
    profile = rec.profile
    first, profile.disk_warned = not profile.disk_warned, True
    stats.add("disk_fallbacks", 1)
    if first:
        warnings.warn(
            f"fxckpt: {reason}. Results are unaffected. (Warned once.)", DiskTierWarning, stacklevel=4
        )


# ---------------------------------------------------------------------------------------------
# Offload and write
# ---------------------------------------------------------------------------------------------


def start_offload(rec: Transfer, span: torch.Tensor) -> bool:
    """Stage ``span`` (the source's bytes, on the device) for a file; False: no staging to be
    had, and the caller keeps the tensor elsewhere."""
    where = rec.profile.disk
    if where is None:
        return False
    collect()
    buf, waited = _staging(rec).take(rec.nbytes)
    if waited:
        stats.add("stall_seconds", waited)
    if buf is None:
        return False
    view = _files.aligned_view(buf, _files.whole_pages(rec.nbytes))
    copy = DiskCopy(where, buf, view)
    rec.disk = copy
    try:
        rec.profile.engine(rec.device).start_offload(
            rec, [(span.view(torch.uint8), view[: rec.nbytes])])
    except Exception:
        rec.disk = None
        del copy, view
        _staging(rec).give([buf])
        raise
    copy.jobs = 1
    copy.written = _executor("w").submit(_write, rec, copy, rec.d2h)
    return True


def _write(rec: Transfer, copy: DiskCopy, d2h: Any) -> None:
    try:
        rec.profile.engine(rec.device).wait_copied(d2h, rec)  # W1
    except Exception as err:  # noqa: BLE001  (restoring reports it)
        copy.error = repr(err)
    if copy.error is None and not copy.dead:
        _write_file(rec, copy)
    with copy.lock:
        if copy.hosted:
            _staging(rec).give([])  # the buffer stays, as the host copy
        else:
            held = [copy.buf] if copy.buf is not None else []
            copy.buf = copy.view = None
            _staging(rec).give(held)  # W2
        copy.jobs -= 1
        if copy.dead:
            _clean(rec, copy)
    collect()


def _write_file(rec: Transfer, copy: DiskCopy) -> None:
    where = copy.where
    path = where.new_file()
    start = time.perf_counter()
    assert copy.view is not None
    data = _files.memory_of(copy.view)
    try:
        try:
            _files.FILES.write(path, data, where.direct)
        except OSError as err:
            if err.errno != errno.EINVAL or not where.direct:
                raise
            where.direct = False  # the file system refused O_DIRECT after all: buffered I/O
            _files.FILES.write(path, data, False)
    except OSError as err:
        copy.hosted = True
        why = err.strerror or repr(err)
        code = errno.errorcode.get(err.errno or 0, "")
        warn_once(
            rec,
            f"writing an offloaded activation to offload_dir={where.root!r} failed "
            f"({code + ': ' if code else ''}{why}); it stays in host memory, over host_budget"
        )
        return
    stats.add("disk_write_seconds", time.perf_counter() - start)
    stats.add("disk_bytes", rec.nbytes)
    stats.add("disk_files", 1)
    copy.path = path


# ---------------------------------------------------------------------------------------------
# Prefetch, read and wait
# ---------------------------------------------------------------------------------------------


def start_prefetch(rec: Transfer) -> None:
    """Queue the read of ``rec``'s file (idempotent until ``finish_prefetch`` takes it)."""
    copy = rec.disk
    assert copy is not None
    if copy.reading is not None:
        return
    collect()
    with copy.lock:
        copy.jobs += 1
    copy.reading = _executor("r").submit(_read, rec, copy)


def _read(rec: Transfer, copy: DiskCopy) -> torch.Tensor:
    try:
        assert copy.written is not None
        copy.written.exception()  # R1: the write job never raises; this waits for it
        if copy.error is not None:
            raise RuntimeCopyError(
                f"fxckpt: the device-to-host copy of offloaded {rec.describe()} failed earlier, "
                f"so it cannot be restored: {copy.error}"
            )
        engine = rec.profile.engine(rec.device)
        if copy.hosted:
            assert copy.view is not None
            return engine.restore_sync(rec, copy.view[: rec.nbytes])
        buf, _ = _staging(rec).take(rec.nbytes)
        if buf is None:
            # The pool is full of live host copies: read through a buffer of its own (over
            # the budget for this one read) rather than fail the step.
            warn_once(rec, "no staging buffer fits host_budget for a read from the disk tier; "
                      "one read used memory outside it")
            return _read_into(rec, copy, [torch.empty(staged_bytes(rec.nbytes), dtype=torch.uint8)])
        held = [buf]
        del buf
        try:
            return _read_into(rec, copy, held)
        finally:
            _staging(rec).give(held)  # R2: _read_into returned after the copy
    finally:
        with copy.lock:
            copy.jobs -= 1
            if copy.dead:
                _clean(rec, copy)


def _read_into(rec: Transfer, copy: DiskCopy, held: list[torch.Tensor]) -> torch.Tensor:
    view = _files.aligned_view(held[0], _files.whole_pages(rec.nbytes))
    assert copy.path is not None
    start = time.perf_counter()
    try:
        _files.FILES.read(copy.path, _files.memory_of(view), copy.where.direct)
    except (FileNotFoundError, _files.ShortFile) as err:
        what = "deleted" if isinstance(err, FileNotFoundError) else f"truncated ({err.strerror})"
        raise RuntimeCopyError(
            f"fxckpt: {copy.path}, the file holding offloaded {rec.describe()}, was {what} "
            "before the backward read it back, so this step cannot finish. Something other "
            f"than fxckpt removed files in offload_dir={copy.where.root!r}; give fxckpt a "
            "directory of its own."
        ) from None
    except OSError as err:
        raise RuntimeCopyError(
            f"fxckpt: reading {copy.path} back for offloaded {rec.describe()} failed: {err!r}"
        ) from None
    stats.add("disk_read_seconds", time.perf_counter() - start)
    return rec.profile.engine(rec.device).restore_sync(rec, view[: rec.nbytes])


def finish_prefetch(rec: Transfer) -> tuple[torch.Tensor, float]:
    """The restored span on the device, and the seconds compute waited for it."""
    copy = rec.disk
    assert copy is not None
    if copy.reading is None:
        start_prefetch(rec)
    fut = copy.reading
    assert fut is not None
    start = None if fut.done() else time.perf_counter()
    err = fut.exception()  # R3
    copy.reading = None  # a second backward (retain_graph=True) reads the file again
    if isinstance(err, RuntimeCopyError):
        raise RuntimeCopyError(str(err)) from None
    if err is not None:
        raise RuntimeCopyError(f"fxckpt: restoring {rec.describe()} failed: {err!r}") from None
    dev = rec.profile.engine(rec.device).adopt(rec, fut.result())
    return dev, 0.0 if start is None else time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Handles dying
# ---------------------------------------------------------------------------------------------


def release(rec: Transfer) -> None:
    """The handle died. Lock-free (it runs inside garbage-collector callbacks): the record
    is queued, and :func:`collect` or the last job removes its file."""
    copy = rec.disk
    if copy is not None:
        copy.dead = True
        _dead.append((rec, copy))


def collect() -> None:
    """Remove the files (and host copies) of dead handles whose jobs are done."""
    while _dead:
        try:
            rec, copy = _dead.popleft()
        except IndexError:
            return
        with copy.lock:
            if copy.jobs == 0:
                _clean(rec, copy)  # else the last job cleans it (it sees ``dead``)


def _clean(rec: Transfer, copy: DiskCopy) -> None:
    # Under copy.lock, with no job running.
    if copy.cleaned:
        return
    copy.cleaned = True
    if copy.path is not None:
        _files.FILES.remove(copy.path)  # F1
        copy.path = None
        stats.add("disk_files", -1)
    if copy.buf is not None:  # a host copy left by a failed write
        held, copy.buf, copy.view = [copy.buf], None, None
        _give_back(rec.profile.pool(rec.device.type), held)


stats.add_collector(collect)
