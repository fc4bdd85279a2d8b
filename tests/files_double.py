"""A stand-in for ``fxckpt._files.FILES`` that does the real I/O and injects what disks do.

``full_after``: writes after that many succeed fail with ``ENOSPC`` (the disk is full) until
``full_after`` is set back to ``None``. ``write_delay_s`` / ``read_delay_s`` sleep before the
bytes move, so a buffer given back too early is overwritten before the write reads it.
``refuse_direct``: ``O_DIRECT`` writes fail with ``EINVAL``, as on a file system without it.
``hw``: a recording CUDA double; every file write (a host read of the buffer) and file read
(a host write into it) is checked against the copies in flight (``FakeCuda.host_access``).
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

from fxckpt import _files


class FilesDouble:
    def __init__(self) -> None:
        self.real = _files.OsFiles()
        self.full_after: int | None = None
        self.write_delay_s = 0.0
        self.read_delay_s = 0.0
        self.refuse_direct = False
        self.hw: Any = None
        self.writes: list[tuple[str, bool]] = []  # (path, direct)
        self.reads: list[str] = []
        self.failed_writes = 0
        self._lock = threading.Lock()

    def direct_ok(self, directory: str) -> bool:
        return not self.refuse_direct and self.real.direct_ok(directory)

    def write(self, path: str, data: memoryview, direct: bool) -> None:
        with self._lock:
            if self.full_after is not None and len(self.writes) >= self.full_after:
                self.failed_writes += 1
                raise OSError(errno.ENOSPC, "No space left on device", path)
            if direct and self.refuse_direct:
                raise OSError(errno.EINVAL, "Invalid argument", path)
        if self.write_delay_s:
            time.sleep(self.write_delay_s)
        if self.hw is not None:
            self.hw.host_access(_address(data), len(data), write=False, what="file write")
        self.real.write(path, data, direct)
        with self._lock:
            self.writes.append((path, direct))

    def read(self, path: str, into: memoryview, direct: bool) -> None:
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        if self.hw is not None:
            self.hw.host_access(_address(into), len(into), write=True, what="file read")
        self.real.read(path, into, direct)
        with self._lock:
            self.reads.append(path)

    def remove(self, path: str) -> None:
        self.real.remove(path)


def _address(view: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))
