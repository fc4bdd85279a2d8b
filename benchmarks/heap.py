"""Keep the CPU allocator's freed blocks in the process, as a GPU's caching allocator does.

On the CPU a tensor of more than glibc's mmap threshold (128 KiB, rising with use to at most
32 MiB) gets pages of its own from the kernel and gives them back when freed: every step then
pays page faults on first touch and an ``munmap`` (and its TLB shootdown, with the copy
threads running) for each large tensor it allocates. A GPU pays none of that: torch's CUDA
caching allocator keeps freed blocks for the next step. A row that allocates more large
tensors per step (a weight's device copy per use, a restored activation) would pay the CPU's
cost and not a GPU's. :func:`keep_freed_blocks` asks glibc to serve blocks up to 32 MiB from
the heap and to keep the heap's top: the same for every row of a benchmark, set before any of
them runs. The meter is unaffected: it reads torch's allocator events, not the process's pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)


def keep_freed_blocks() -> bool:
    """Blocks up to 32 MiB from the heap, and the heap kept; ``False`` where the C library is
    not glibc (nothing changes there)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
