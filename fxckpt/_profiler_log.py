"""Keep the profiler's own start/stop lines off stderr while the CPU meter starts and stops it.

The CPU meter (:mod:`fxckpt.meter`) reads allocator events from torch's profiler, and the
profiler's C++ library (kineto) logs each trace's start and stop to file descriptor 2:

    USDT:2026-12-01 13:48:48 6230:6230 SyncActivityProfilerHandler.cpp:52] profiler_start

torch lowers kineto's log level to ERROR, but kineto ranks these ``USDT`` lines above ERROR,
so no level hides them without hiding errors too, and no Python API sets the level. A CUDA
build of torch on a machine without a GPU also logs, once, that it could not count GPUs
(``gpuGetDeviceCount failed with code 35``), which torch already knows.

:func:`quiet_trace_lines` sends fd 2 to a temporary file for the length of the block (the
profiler's start, or its stop and the reading of its events: never the measured call), then
writes back every line except those. Anything else the process wrote meanwhile, from any
thread, comes out unchanged and in order, a moment later.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

# kineto's Logger writes "<LEVEL>:<date> <time> <pid>:<tid> <file>:<line>] <message>".
_TRACE_LINE = re.compile(
    rb"USDT:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ SyncActivityProfilerHandler\.cpp:\d+\] "
    rb"profiler_(?:start|stop)"
)
# torch's CPU allocator warns, once a process, where a block older than the events is freed
# while they are recorded (the meter leaves such frees out): the meter lets it happen while
# the profiler starts, here.
_OLDER_BLOCK_LINE = re.compile(
    rb"\[W\d+ [\d:.]+ CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before "
    rb"the profiling started, profiler results will not include the deallocation event"
)
_NO_GPU_LINE = re.compile(
    rb"ERROR:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ DeviceProperties\.cpp:\d+\] "
    rb"gpuGetDeviceCount failed with code \d+"
)

# fd 2 is the process's: one block at a time redirects it.
_lock = threading.Lock()


def without_trace_lines(data: bytes) -> bytes:
    """``data`` less kineto's trace start/stop lines (and its failure to count GPUs where torch
    sees none)."""
    out = []
    no_gpu: bool | None = None
    for line in data.splitlines(keepends=True):
        body = line.rstrip(b"\r\n")
        if _TRACE_LINE.fullmatch(body) or _OLDER_BLOCK_LINE.fullmatch(body):
            continue
        if _NO_GPU_LINE.fullmatch(body):
            if no_gpu is None:
                import torch

                no_gpu = not torch.cuda.is_available()
            if no_gpu:
                continue
        out.append(line)
    return b"".join(out)


@contextlib.contextmanager
def quiet_trace_lines() -> Iterator[None]:
    """Within the block, fd 2 is a temporary file; at its end (exception or not) fd 2 is
    restored and what was written to it, less :func:`without_trace_lines`' lines, is written
    there."""
    with _lock:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):
            # No fd 2 to redirect (closed, or stderr replaced by an object without one).
            yield
            return
        try:
            with tempfile.TemporaryFile() as held:
                os.dup2(held.fileno(), 2)
                try:
                    yield
                finally:
                    with contextlib.suppress(OSError, ValueError, AttributeError):
                        sys.stderr.flush()
                    os.dup2(saved, 2)
                    held.seek(0)
                    _write_all(2, without_trace_lines(held.read()))
        finally:
            os.close(saved)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
