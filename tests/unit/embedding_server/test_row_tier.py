"""The row tier: the next use of every row from the planned batches, rows kept exactly through evictions to
disk and reads back, and a schedule in time leaving no fetch waiting for the disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bagpipe.embedding_server.row_tier import NEVER, RowTier, Schedule


def test_the_next_use_of_every_row_follows_the_planned_batches() -> None:
    rng = np.random.default_rng(1)
    rows, lookahead, batches = 60, 5, 80
    plans = [rng.choice(rows, size=int(rng.integers(0, 20)), replace=False) for _ in range(batches)]
    schedule = Schedule(rows)
    for b in range(lookahead):
        schedule.add(b, plans[b])
    for now in range(batches):
        expected = np.full(rows, NEVER)
        for b in range(min(batches, now + lookahead) - 1, now - 1, -1):  # (the nearest planned use wins)
            expected[plans[b]] = b
        np.testing.assert_array_equal(schedule.next_use, expected, err_msg=f"at batch {now}")
        np.testing.assert_array_equal(schedule.rows_of(now), plans[now])
        schedule.passed(now)
        if now + lookahead < batches:
            schedule.add(now + lookahead, plans[now + lookahead])
    with pytest.raises(ValueError, match="in order"):
        schedule.add(batches - 3, np.array([1]))


def test_rows_come_back_exactly_through_evictions_and_reads(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    tier = RowTier(500, 6, capacity=40, directory=tmp_path)
    truth: dict[int, np.ndarray] = {}
    for _ in range(200):
        index = rng.choice(500, size=int(rng.integers(1, 30)), replace=False)
        values = rng.standard_normal((index.size, 6)).astype(np.float32)
        tier.write(index, values)
        truth.update(zip(index.tolist(), values, strict=True))
        asked = rng.choice(np.array(list(truth)), size=min(25, len(truth)), replace=False)
        np.testing.assert_array_equal(tier.read(asked), np.stack([truth[r] for r in asked.tolist()]))
        if rng.random() < 0.1:
            gone = asked[:3]
            tier.drop(gone)
            for r in gone.tolist():
                del truth[r]
            assert not tier.stored(gone).any()
        assert tier.resident_rows <= 40
    assert tier.stored(np.array(list(truth))).all()
    assert tier.stats.written_rows <= tier.stats.evicted_rows and tier.log.stats.rows_written > 0
    # (more rows than the budget holds: those it cannot keep go straight to disk)
    more = rng.standard_normal((41, 6)).astype(np.float32)
    tier.write(np.arange(41), more)
    assert tier.resident_rows <= 40
    np.testing.assert_array_equal(tier.peek(np.arange(41)), more)
    tier.close()
    lru = RowTier(500, 6, capacity=40, directory=tmp_path / "lru", policy="lru")
    with pytest.raises(MemoryError, match="--row-memory"):
        lru.write(np.arange(41), np.zeros((41, 6), np.float32))
    lru.close()


def test_with_the_batches_planned_ahead_no_fetch_waits_and_only_changed_rows_are_written(
    tmp_path: Path,
) -> None:
    """A training-like run: each batch fetches its rows (prefetched as soon as it is planned, L ahead) and
    writes them back changed; the budget is a tenth of the rows."""
    rng = np.random.default_rng(3)
    rows, lookahead, batches, width = 2000, 4, 120, 4
    popularity = 1.0 / np.arange(1, rows + 1) ** 1.1  # (a few hot rows, a long tail)
    plans = [np.unique(rng.choice(rows, size=40, p=popularity / popularity.sum())) for _ in range(batches)]
    schedule = Schedule(rows)
    tier = RowTier(rows, width, capacity=rows // 10, directory=tmp_path, schedule=schedule)
    truth = np.zeros((rows, width), np.float32)
    written = np.zeros(rows, dtype=bool)
    for b in range(lookahead):
        schedule.add(b, plans[b])
    for b in range(batches):
        stored = plans[b][written[plans[b]]]
        np.testing.assert_array_equal(tier.read(stored), truth[stored])
        truth[plans[b]] += 1.0
        tier.write(plans[b], truth[plans[b]])
        written[plans[b]] = True
        schedule.passed(b)
        if b + lookahead < batches:
            schedule.add(b + lookahead, plans[b + lookahead])
            ahead = tier.ahead(plans[b + lookahead])  # (the server's read-ahead: read, then taken in)
            tier.install(ahead, *tier.log.read_where(ahead)[::-1])
    assert tier.stats.waited_rows == 0
    assert tier.stats.prefetched_rows > 0  # (the budget did bind)
    assert tier.stats.written_rows <= tier.stats.evicted_rows
    tier.close()


def test_the_rows_used_after_each_read_ahead_row_are_counted_as_a_sort_would(tmp_path: Path) -> None:
    """Belady's guard for a read-ahead counts, for each row coming in, the rows in memory used later; it
    counts them by next use instead of sorting them: the same answer, batches in sight or none."""
    rng = np.random.default_rng(4)
    tier = RowTier(400, 2, 120, tmp_path)
    tier.write(np.arange(120), np.zeros((120, 2), np.float32))  # (120 rows in memory)
    for batch in range(30):
        tier.schedule.add(batch, rng.choice(400, 40, replace=False))
    tier.schedule.passed(9)
    held = np.sort(tier.schedule.next_use[tier._row_in[tier._row_in >= 0]])
    due = np.sort(np.r_[tier.schedule.next_use[rng.choice(400, 60)], NEVER, 10, 29])
    expected = held.size - np.searchsorted(held, due, side="right")
    np.testing.assert_array_equal(tier._used_after(due), expected)
    tier.close()


def test_rows_written_back_that_no_planned_batch_fetches_do_not_push_out_rows_read_ahead(
    tmp_path: Path,
) -> None:
    tier = RowTier(100, 2, capacity=10, directory=tmp_path)
    tier.write(np.arange(10), np.ones((10, 2), np.float32))
    tier.write(np.arange(20, 30), np.full((10, 2), 2, np.float32))  # (memory full, no use in sight: disk)
    assert (tier.slot[20:30] < 0).all() and tier.log.on_disk(np.arange(20, 30)).all()
    tier.schedule.add(0, np.arange(20, 30))
    wanted = tier.ahead(tier.schedule.rows_of(0))
    values, where = tier.log.read_where(wanted)
    assert tier.install(wanted, where, values) == 10  # (in place of rows no batch fetches)
    tier.write(np.arange(5), np.full((5, 2), 3, np.float32))  # a write-back of rows with no use in sight
    assert (tier.slot[20:30] >= 0).all() and tier.stats.wasted_rows == 0
    np.testing.assert_array_equal(tier.peek(np.arange(5)), np.full((5, 2), 3, np.float32))
    np.testing.assert_array_equal(tier.read(np.arange(20, 30)), np.full((10, 2), 2, np.float32))
    tier.close()


def test_the_rows_read_ahead_and_not_yet_asked_for_are_counted(tmp_path: Path) -> None:
    tier = RowTier(100, 2, capacity=20, directory=tmp_path)
    tier.write(np.arange(40), np.ones((40, 2), np.float32))  # (20 in memory, 20 on disk)
    on_disk = np.flatnonzero(tier.slot[:40] < 0)
    tier.schedule.add(0, on_disk[:6])
    values, where = tier.log.read_where(on_disk[:6])
    assert tier.install(on_disk[:6], where, values) == 6 and tier.unused_rows == 6
    tier.read(np.r_[on_disk[:2], on_disk[:2]])  # (asked for twice in one request)
    assert tier.unused_rows == 4
    tier.drop(on_disk[2:3])
    assert tier.unused_rows == 3 == int(tier._unused.sum())
    tier.close()


@pytest.mark.parametrize("policy", ["lookahead", "lru"])
def test_a_disk_that_fails_mid_write_changes_no_row_and_loses_none(
    policy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full or failing disk (ENOSPC, EIO) part way through a write: the write raises, every row of it
    keeps its old value (none half-applied, in memory or on disk), no other row is lost or overwritten,
    the budget is kept, and the tier goes on once the disk works again."""
    import errno

    from bagpipe.embedding_server import row_log

    rng = np.random.default_rng(9)
    rows, width = 400, 5
    schedule = Schedule(rows)
    tier = RowTier(rows, width, capacity=30, directory=tmp_path, schedule=schedule, policy=policy)
    real = row_log.os.pwritev
    budget = [10**9]  # page writes that succeed before the disk fails

    def pwritev(fd: int, buffers: list, offset: int) -> int:
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        budget[0] -= 1
        return real(fd, buffers, offset)

    monkeypatch.setattr(row_log.os, "pwritev", pwritev)
    truth: dict[int, np.ndarray] = {}
    failed = 0
    for batch in range(300):
        schedule.add(batch + 3, rng.choice(rows, size=12, replace=False))  # (next uses, 3 batches ahead)
        index = rng.choice(rows, size=int(rng.integers(1, 25)), replace=False)
        values = rng.standard_normal((index.size, width)).astype(np.float32)
        budget[0] = int(rng.integers(0, 3)) if rng.random() < 0.3 else 10**9
        try:
            tier.write(index, values)
        except OSError:
            failed += 1
        else:
            truth.update(zip(index.tolist(), values, strict=True))
        budget[0] = 10**9
        held = np.array(sorted(truth))
        np.testing.assert_array_equal(tier.peek(held), np.stack([truth[r] for r in held.tolist()]))
        assert not tier.stored(np.setdiff1d(np.arange(rows), held)).any()
        in_memory = np.flatnonzero(tier.slot >= 0)
        assert in_memory.size == tier.resident_rows <= 30
        np.testing.assert_array_equal(tier._row_in[tier.slot[in_memory]], in_memory)
        schedule.passed(batch)
    assert failed > 20 and tier.log.stats.rows_written > 0
    asked = np.array(sorted(truth))[:25]
    np.testing.assert_array_equal(tier.read(asked), np.stack([truth[r] for r in asked.tolist()]))
    tier.close()
