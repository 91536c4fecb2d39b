"""The disk half of the row tier: rows written, rewritten, forgotten and read back bit for bit, whole-page
I/O around the page cache, and a file kept within about twice the rows it holds."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import numpy as np
import pytest
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
    log.read(np.array([0, 64, 65, 1023]))  # pages 0, 2 and 31: three runs
    assert log.stats.read_calls == 4 and log.stats.bytes_read == 35 * PAGE
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
