"""glibc malloc settings for processes that allocate large transient buffers at a high rate.

Every request and reply on the training path allocates buffers of 0.1 to 10 MB: gathered rows, wire
messages, plan arrays. With glibc's defaults a buffer that size comes from a fresh ``mmap`` and goes
back to the kernel when freed, so the next one page-faults in and is zero-filled page by page. In an
embedding server's lookup (gather 16 k rows, build the reply) that was half of the time, most of it in
the kernel (bench/README.md, "Embedding server"). Raising the mmap threshold keeps such buffers in the
heap, and raising the trim threshold keeps the freed ones there for reuse. Blocks above the threshold
(an embedding table, the oracle's per-key state) are still mapped on their own, so the resident set
grows by at most about the trim threshold.

``huge_page_zeros`` is for the other kind: one large table read and written at random rows (an embedding
server's rows and state). Backed by 4 KiB pages, nearly every row of a lookup misses the TLB as well
as the cache; on 2 MiB pages (transparent huge pages, which hosts commonly enable only where a process
asks) a 16 k-row gather from a 4 GiB table took 0.62 ms instead of 1.05 ms here (bench/README.md).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap

import numpy as np

logger = logging.getLogger(__name__)

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps M_MMAP_THRESHOLD at HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
# below this a table gains nothing from huge pages (it would fill less than one)
HUGE_PAGE_BYTES = 2 << 20


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


def release_free_memory() -> bool:
    """Gives the kernel back the heap's free pages (``malloc_trim(0)``), wherever they lie in it: after a
    server has built its shard, the transient buffers of the build are free but, fragmented in the heap,
    still resident (about 90 MB of a tiered shard's 130 MB here). Returns whether any memory went back;
    False where the C library has no ``malloc_trim``."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def huge_page_zeros(shape: tuple[int, ...], dtype: np.dtype | type = np.float32) -> np.ndarray:
    """Zeros of ``shape`` in an anonymous mapping of their own that asks the kernel for transparent huge
    pages (``madvise(MADV_HUGEPAGE)``), like ``np.zeros`` in every other respect: the pages are zero and
    taken on first touch, and the mapping is unmapped when the array (its ``base``) is freed. Where the
    platform has no such advice, or the array is under one huge page, it is plain ``np.zeros``."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE_BYTES or advice is None:
        return np.zeros(shape, dtype=dt)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError as e:  # (a kernel built without transparent huge pages: ordinary pages, still zeros)
        logger.debug("madvise(MADV_HUGEPAGE) refused (%s): ordinary pages", e)
    return np.frombuffer(region, dtype=dt).reshape(shape)
