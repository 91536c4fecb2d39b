"""glibc malloc settings for processes that allocate large transient buffers at a high rate.

Every request and reply on the training path allocates buffers of 0.1 to 10 MB: gathered rows, wire
messages, plan arrays. With glibc's defaults a buffer that size comes from a fresh ``mmap`` and goes
back to the kernel when freed, so the next one page-faults in and is zero-filled page by page. In an
embedding server's lookup (gather 16 k rows, build the reply) that was half of the time, most of it in
the kernel (bench/README.md, "Embedding server"). Raising the mmap threshold keeps such buffers in the
heap, and raising the trim threshold keeps the freed ones there for reuse. Blocks above the threshold
(an embedding table, the oracle's per-key state) are still mapped on their own, so the resident set
grows by at most about the trim threshold.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps M_MMAP_THRESHOLD at HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20


def keep_freed_buffers(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Serves allocations below ``mmap_threshold`` from the heap and keeps up to ``trim_threshold`` bytes
    of freed heap for reuse. Returns False, changing nothing, where the C library has no ``mallopt``
    (musl, macOS) or refuses the values."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        logger.debug("no mallopt in this C library: allocator settings unchanged")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not mallopt(_M_MMAP_THRESHOLD, mmap_threshold):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
