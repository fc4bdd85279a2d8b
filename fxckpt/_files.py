"""Every file-system call the disk tier makes for its data, behind one replaceable object.

The disk tier (``runtime/disk.py``) and the bandwidth probe call ``FILES.<method>`` and
nothing else of ``os`` for the bytes of offloaded tensors. Tests put a double in its place
to inject what real disks do (a full disk mid-step, an I/O error, a slow device), the way
``fxckpt._cuda.CUDA`` stands in for the GPU. Nothing here runs at import.

``O_DIRECT`` bypasses the page cache, so a tensor written to NVMe does not also occupy host
memory as cached pages (which would defeat ``host_budget``). It needs the buffer address, the
length and the file offset aligned to the device's logical block; every buffer here is
page-aligned and every length a whole number of pages, which satisfies any block size up to
the page size. A file system that refuses ``O_DIRECT`` (``EINVAL`` on open or on the first
write) gets buffered I/O instead, with ``posix_fadvise(DONTNEED)`` after each write so the
cached pages are let go.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import secrets
import shutil
import threading
import time
from typing import Any

import torch

from fxckpt.errors import OptionsError
from fxckpt.units import format_bytes

PAGE_BYTES = mmap.PAGESIZE
PROBE_BYTES = 32 * 2**20
# Linux moves at most 0x7ffff000 bytes per read/write call, whatever the count asked for.
_MAX_IO = 0x7FFFF000


class DiskProbeError(OptionsError):
    """The disk tier's bandwidth probe could not write or read its file in ``offload_dir``
    (``errno.ENOSPC``: less free space than the probe's :data:`PROBE_BYTES`)."""

    def __init__(self, directory: str, where: str, code: int | None, why: str) -> None:
        self.errno = code
        try:
            free = f"{format_bytes(shutil.disk_usage(where).free)} free there"
        except OSError:
            free = "its free space unknown"
        place = "" if where == directory else f" in {where}"
        super().__init__(
            "offload_dir", directory,
            "a directory with room for the tensors sent to disk, or no offload_dir",
            f"writing the {format_bytes(PROBE_BYTES)} bandwidth probe{place} failed: {why}; {free}",
        )


class ShortFile(OSError):
    """A file holds fewer bytes than were written to it (truncated by someone else)."""


def whole_pages(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def aligned_view(buf: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The page-aligned ``nbytes`` of ``buf`` (a 1-D uint8 CPU tensor at least a page longer)."""
    skip = -buf.data_ptr() % PAGE_BYTES
    if skip + nbytes > buf.numel():
        raise ValueError(f"a buffer of {buf.numel()} bytes cannot hold {nbytes} aligned bytes")
    return buf[skip : skip + nbytes]


def memory_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable buffer, without a copy.

    The caller keeps ``t`` alive for as long as the view is used.
    """
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class OsFiles:
    """The real thing: ``os`` calls, ``O_DIRECT`` where the file system allows it."""

    def direct_ok(self, directory: str) -> bool:
        """Whether files in ``directory`` can be written and read with ``O_DIRECT``."""
        path = os.path.join(directory, f".fxckpt-direct-{os.getpid()}-{secrets.token_hex(4)}")
        area = mmap.mmap(-1, PAGE_BYTES)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o600)
        except OSError as err:
            if err.errno == errno.EINVAL:
                return False
            raise
        try:
            os.pwrite(fd, area, 0)
            return True
        except OSError as err:
            if err.errno == errno.EINVAL:
                return False
            raise
        finally:
            os.close(fd)
            _remove(path)
            area.close()

    def write(self, path: str, data: memoryview, direct: bool) -> None:
        """Create ``path`` and write ``data`` (page-aligned, whole pages when ``direct``).

        On any failure the partial file is removed and the ``OSError`` raised (``ENOSPC``:
        the disk is full).
        """
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (_O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o600)
        try:
            _all(os.pwrite, fd, data)
            if not direct:  # the written pages stay cached otherwise: host memory
                os.fsync(fd)
                _drop_cache(fd)
        except BaseException:
            os.close(fd)
            _remove(path)
            raise
        os.close(fd)

    def read(self, path: str, into: memoryview, direct: bool) -> None:
        """Fill ``into`` from the start of ``path``; :class:`ShortFile` if it holds less."""
        fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))
        try:
            size = os.fstat(fd).st_size
            if size < len(into):
                raise ShortFile(errno.EIO, f"holds {size} bytes, {len(into)} were written", path)
            if _all(os.preadv, fd, into) < len(into):
                raise ShortFile(errno.EIO, f"ended before {len(into)} bytes", path)
            if not direct:
                _drop_cache(fd)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        _remove(path)


def _all(call: Any, fd: int, data: memoryview) -> int:
    """Move all of ``data`` with ``os.pwrite`` / ``os.preadv``; returns the bytes moved."""
    done = 0
    while done < len(data):
        chunk = data[done : done + _MAX_IO]
        n = call(fd, chunk, done) if call is os.pwrite else call(fd, [chunk], done)
        if n == 0:
            break
        done += n
    return done


def _drop_cache(fd: int) -> None:
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_O_DIRECT = getattr(os, "O_DIRECT", 0)

FILES: Any = OsFiles()

_rates: dict[str, tuple[float, float]] = {}
_rates_lock = threading.Lock()


def measure_bandwidth(directory: str, *, scratch: str | None = None, direct: bool | None = None
                      ) -> tuple[float, float]:
    """``(write, read)`` bytes per millisecond of files in ``directory``, measured once.

    Writes and reads back ``PROBE_BYTES`` the way the disk tier does (``O_DIRECT`` where
    allowed; buffered I/O is synced and its cache dropped, so the figure is the device's and
    not the page cache's). The probe file lives in ``scratch`` (default ``directory``).
    Cached per directory for the process: the disk tier's prefetch lead comes from it.
    """
    key = os.path.realpath(directory)
    with _rates_lock:
        if key in _rates:
            return _rates[key]
    if direct is None:
        direct = bool(_O_DIRECT) and FILES.direct_ok(scratch or directory)
    path = os.path.join(scratch or directory, f".fxckpt-probe-{os.getpid()}-{secrets.token_hex(4)}")
    area = mmap.mmap(-1, PROBE_BYTES)
    failed: tuple[int | None, str] | None = None
    try:
        data = memoryview(area)
        start = time.perf_counter()
        FILES.write(path, data, direct)
        wrote = time.perf_counter() - start
        start = time.perf_counter()
        FILES.read(path, data, direct)
        read = time.perf_counter() - start
    except OSError as err:
        # Only the figures leave this block: the error's traceback holds views of ``area``
        # (a chunk being written), and closing it while they live raises BufferError instead.
        failed = (err.errno, err.strerror or str(err))
    finally:
        FILES.remove(path)
        data.release()
    area.close()
    if failed is not None:
        raise DiskProbeError(directory, scratch or directory, *failed)
    rates = (PROBE_BYTES / max(wrote * 1e3, 1e-6), PROBE_BYTES / max(read * 1e3, 1e-6))
    with _rates_lock:
        _rates[key] = rates
    return rates
