"""``allocator.huge_page_zeros``: the embedding servers' tables."""

from __future__ import annotations

import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
from bagpipe import allocator


def _owner(array: np.ndarray) -> object:
    while isinstance(array.base, np.ndarray):
        array = array.base
    base = array.base
    return base.obj if isinstance(base, memoryview) else base


def _thp_eligible(array: np.ndarray) -> bool | None:
    """``THPeligible`` of the mapping that holds ``array`` (/proc/self/smaps), None where not reported."""
    start = array.ctypes.data
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= start < high
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


def test_huge_page_zeros_is_a_writable_zero_array_of_its_own():
    a = allocator.huge_page_zeros((3000, 256), np.float32)  # 3 MB
    assert a.shape == (3000, 256) and a.dtype == np.float32 and a.flags.writeable and a.flags.c_contiguous
    assert not a.any()
    a[17] = 1.5
    b = allocator.huge_page_zeros((3000, 256), np.float32)
    assert a[17].sum() == 1.5 * 256 and not b.any()  # (separate mappings)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert isinstance(_owner(a), mmap.mmap)


def test_huge_page_zeros_asks_for_huge_pages_where_the_kernel_offers_them():
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    a = allocator.huge_page_zeros((1 << 20, 4), np.float32)  # 16 MB
    eligible = _thp_eligible(a)
    if not hasattr(mmap, "MADV_HUGEPAGE") or not setting.exists() or "[never]" in setting.read_text():
        assert eligible in (None, False)
    elif eligible is not None:
        assert eligible, "the table's mapping is not eligible for transparent huge pages"


def test_small_arrays_are_plain_zeros():
    a = allocator.huge_page_zeros((10, 4), np.int64)
    assert a.dtype == np.int64 and not a.any() and not isinstance(_owner(a), mmap.mmap)


_FRAGMENTED_HEAP = """
import sys
from bagpipe import allocator

def anon_kib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:"))

allocator.keep_freed_buffers()
blocks, pins = [], []
for _ in range(300):  # 150 MiB of heap buffers, each followed by a small block that stays
    blocks.append(bytearray(b"\x01") * (512 << 10))  # (written: resident)
    pins.append(bytearray(b"\x01") * 4096)  # (past pymalloc's 512 bytes: from the same heap)
blocks.clear()  # (free, but held: the pins fragment the heap, so it cannot shrink from its top)
before = anon_kib()
released = allocator.release_free_memory()
print(before, anon_kib(), released)
"""


def test_release_free_memory_gives_back_the_free_pages_inside_a_fragmented_heap():
    """After a shard's build (transient buffers between long-lived objects), the free pages inside the heap
    go back to the kernel; the trim threshold alone would keep them all."""
    out = subprocess.run(
        [sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True, check=True
    ).stdout.split()
    before, after, released = int(out[0]), int(out[1]), out[2] == "True"
    assert released
    assert before - after > 100 << 10, f"resident anonymous memory {before} KiB -> {after} KiB"
