"""The disk half of the row tier: rows written, rewritten, forgotten and read back bit for bit, whole-page
I/O around the page cache, and a file kept within about twice the rows it holds."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from bagpipe.embedding_server import aio, row_log
from bagpipe.embedding_server.row_log import PAGE, RowLog


def _values(rng: np.random.Generator, n: int, floats: int) -> np.ndarray:
    return rng.standard_normal((n, floats)).astype(np.float32)


@pytest.mark.parametrize("floats", [32, 3, 1500])  # 128 B (32 a page), 12 B (a page's tail unused), 6000 B
def test_rows_read_back_what_was_last_written(tmp_path: Path, floats: int) -> None:
    rng = np.random.default_rng(floats)
    log = RowLog(tmp_path, floats, 5000, segment_bytes=64 * PAGE)
    truth: dict[int, np.ndarray] = {}
    try:
        for _ in range(30):
            rows = rng.choice(5000, size=int(rng.integers(1, 400)), replace=False)
            values = _values(rng, rows.size, floats)
            log.write(rows, values)
            truth.update(zip(rows.tolist(), values, strict=True))
            gone = rng.choice(list(truth), size=min(10, len(truth)), replace=False)
            log.forget(gone)
            for r in gone.tolist():
                del truth[r]
            asked = rng.permutation(np.array(list(truth), dtype=np.int64))[:300]
            np.testing.assert_array_equal(log.read(asked), np.stack([truth[r] for r in asked.tolist()]))
        assert log.rows_on_disk == len(truth)
        assert log.on_disk(np.array(list(truth))).all()
    finally:
        log.close()
    assert not log.path.exists()


def test_a_row_not_on_disk_is_refused_naming_it(tmp_path: Path) -> None:
    log = RowLog(tmp_path, 4, 100)
    log.write(np.array([1, 2]), np.ones((2, 4), np.float32))
    log.forget(np.array([2]))
    with pytest.raises(KeyError, match=r"rows not on disk: \[2, 7\]"):
        log.read(np.array([1, 2, 7]))
    log.close()


def test_reads_take_whole_pages_in_offset_order_adjacent_ones_in_one_call(tmp_path: Path) -> None:
    log = RowLog(tmp_path, 32, 10_000, max_run_pages=64)  # 32 rows a page
    rows = np.arange(1024)
    log.write(rows, np.zeros((1024, 32), np.float32))  # 32 pages, one run
    assert log.stats.bytes_written == 32 * PAGE
    log.read(rows[::-1].copy())  # (asked in any order)
    assert (log.stats.read_calls, log.stats.bytes_read, log.stats.rows_read) == (1, 32 * PAGE, 1024)
    log.read(np.array([0, 64, 65, 1023]))  # pages 0, 2 and 31: 0 to 2 in one call (the gap with it), 31
    assert log.stats.read_calls == 3 and log.stats.bytes_read == 36 * PAGE
    log.close()


def test_pages_further_apart_than_the_gap_are_read_apart_and_big_reads_come_in_bounded_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(row_log, "GROUP_PAGES", 4)  # (a buffer of 4 pages at most)
    log = RowLog(tmp_path, 1024, 400, max_run_pages=4, max_gap_pages=1)  # a row a page
    values = np.random.default_rng(0).standard_normal((400, 1024)).astype(np.float32)
    log.write(np.arange(400), values)
    log.read(np.array([10, 12, 20]))  # pages 10-12 (gap 1), 20 (gap 7): two calls
    assert (log.stats.read_calls, log.stats.bytes_read) == (2, 4 * PAGE)
    wanted = np.random.default_rng(1).permutation(400)[:150]  # spans cut at 4 pages, groups of 4 pages
    np.testing.assert_array_equal(log.read(wanted), values[wanted])
    log.close()


def test_the_page_cache_is_bypassed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = RowLog(tmp_path, 8, 10)
    assert log.direct and fcntl.fcntl(log._fd, fcntl.F_GETFL) & os.O_DIRECT
    log.close()
    opened = os.open

    def no_direct(path, flags, mode=0o777):  # (a file system that refuses O_DIRECT, as older tmpfs does)
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return opened(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct)
    cached = RowLog(tmp_path / "cached", 8, 10)
    monkeypatch.undo()
    try:  # (through the cache, each range dropped from it after use)
        assert not cached.direct
        cached.write(np.array([3]), np.full((1, 8), 2.5, np.float32))
        np.testing.assert_array_equal(cached.read(np.array([3])), np.full((1, 8), 2.5, np.float32))
    finally:
        cached.close()


def test_compaction_keeps_the_file_within_twice_the_live_rows(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    log = RowLog(tmp_path, 32, 4096, segment_bytes=16 * PAGE)  # 512 rows a segment
    truth = _values(rng, 4096, 32)
    log.write(np.arange(4096), truth)
    for _ in range(20):  # rewrites scattered over every segment: each keeps some live rows
        rows = rng.choice(4096, size=1500, replace=False)
        truth[rows] = _values(rng, rows.size, 32)
        log.write(rows, truth[rows])
    written = log.stats.rows_written
    grown = log.file_bytes
    copied = log.compact()
    live_bytes = 4096 * 32 * 4
    assert copied > 0 and log.stats.rows_compacted == copied and log.stats.rows_written == written
    in_use = log.file_bytes - len(log._free) * 16 * PAGE
    assert log.file_bytes <= grown and in_use <= 2 * live_bytes + 16 * PAGE
    np.testing.assert_array_equal(log.read(np.arange(4096)), truth)
    log.close()


@pytest.mark.parametrize("native_aio", [True, False])
def test_many_reads_at_once_natively_or_on_threads_give_the_rows_bit_for_bit(
    tmp_path: Path, native_aio: bool
) -> None:
    log = RowLog(tmp_path, 256, 5000, native_aio=native_aio)  # 4 rows a page
    if native_aio and log._aio is None:
        pytest.skip("no native asynchronous I/O here")
    values = np.random.default_rng(2).standard_normal((5000, 256)).astype(np.float32)
    log.write(np.arange(5000), values)
    wanted = np.random.default_rng(3).permutation(5000)[:900]  # (hundreds of spans: more than one submit)
    np.testing.assert_array_equal(log.read(wanted), values[wanted])
    log.close()


def test_a_native_read_past_the_end_of_the_file_is_an_error_naming_where(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\0" * PAGE)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    reader = aio.Reader.open(fd)
    if reader is None:
        pytest.skip("no native asynchronous I/O here")
    aligned = mmap.mmap(-1, 2 * PAGE)
    address = np.frombuffer(aligned, dtype=np.uint8).ctypes.data
    offsets = np.array([0, PAGE], dtype=np.int64)
    with pytest.raises(OSError, match=f"read of {PAGE} bytes at {PAGE}: got 0"):
        reader.read(address, offsets, offsets, np.array([PAGE, PAGE], dtype=np.int64))
    reader.close()
    os.close(fd)
