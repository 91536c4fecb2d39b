"""The disk half of an embedding server's row tier: rows (each with its optimizer state) that the server
evicted from memory, in one file written as a log.

Reads go around the page cache (``O_DIRECT``), so what they cost is the disk's and the memory they take is
the server's own buffers; where the file system refuses ``O_DIRECT`` (tmpfs), the file is read and written
through the cache and each range is dropped from it after use (``posix_fadvise(DONTNEED)``).

Layout: the file is a sequence of segments (``segment_bytes``, 1 MiB by default) of 4 KiB pages, and a page
holds whole rows (a row wider than a page takes whole pages of its own). A row written goes to a new slot at
the log's head, never over its old one, so a write is one sequential run of whole pages and never reads a
page first; the old slot is dead. ``location[row]`` is the row's slot (-1: not on disk). Segments all of
whose slots are dead are used again; ``compact`` copies the live rows of the emptiest segments to the head
once dead slots outnumber live ones, so the file stays within about twice the rows it holds.

The file is the server's working space, not a checkpoint: a server started again begins with an empty one
(its rows come from the checkpoint chain), so nothing here is fsynced.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bagpipe.embedding_server import aio

PAGE = 4096
READERS = 16  # reads in flight at once for one large read
# pages read at most into one buffer before its rows are taken out (a large read's memory beyond the budget)
GROUP_PAGES = 1024
_pool: list[ThreadPoolExecutor] = []


def _readers() -> ThreadPoolExecutor:
    if not _pool:
        _pool.append(ThreadPoolExecutor(READERS, thread_name_prefix="row-reads"))
    return _pool[0]


def _aligned(size: int) -> mmap.mmap:
    """A zeroed buffer of ``size`` bytes (at least a page), starting on a page boundary as O_DIRECT needs."""
    return mmap.mmap(-1, max(PAGE, -(-size // PAGE) * PAGE))


@dataclass
class LogStats:
    """What the log did since it was opened: rows and bytes read and written, and the part of each done to
    compact it."""

    rows_read: int = 0
    rows_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    rows_compacted: int = 0
    read_calls: int = 0


class RowLog:
    """Rows ``0 .. num_rows - 1`` of ``row_floats`` float32 each, on disk under ``directory``."""

    def __init__(
        self,
        directory: Path,
        row_floats: int,
        num_rows: int,
        segment_bytes: int = 1 << 20,
        max_run_pages: int = 64,
        max_gap_pages: int = 3,
        native_aio: bool = True,
    ) -> None:
        if row_floats < 1 or num_rows < 0:
            raise ValueError(f"row_floats {row_floats}, num_rows {num_rows}: must be >= 1 and >= 0")
        if segment_bytes < PAGE or segment_bytes % PAGE:
            raise ValueError(f"segment_bytes: must be a positive multiple of {PAGE}, got {segment_bytes}")
        self.row_floats = row_floats
        self.row_bytes = 4 * row_floats
        if self.row_bytes <= PAGE:
            self.rows_per_page, self.pages_per_row = PAGE // self.row_bytes, 1
        else:
            self.rows_per_page, self.pages_per_row = 1, -(-self.row_bytes // PAGE)
        self.pages_per_segment = segment_bytes // PAGE
        if self.pages_per_segment < self.pages_per_row:
            raise ValueError(f"segment_bytes {segment_bytes}: smaller than one row ({self.row_bytes} bytes)")
        # slots per segment: a segment holds whole rows
        self.slots_per_segment = (self.pages_per_segment // self.pages_per_row) * self.rows_per_page
        self.max_run_pages = max(self.pages_per_row, max_run_pages)
        # pages not asked for that a read takes to join two that are (at most 4x the pages asked for)
        self.max_gap_pages = max_gap_pages
        self.location = np.full(num_rows, -1, dtype=np.int64)
        self._owner = np.empty(0, dtype=np.int64)  # the row in each slot of the file (-1: dead or unused)
        self._live = np.empty(0, dtype=np.int64)  # live slots per segment
        self._free: list[int] = []  # segments with no live slot, to be written again
        self._head: tuple[int, int] | None = None  # (segment, next slot in it) being filled
        self.stats = LogStats()
        self._lock = threading.Lock()
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"rows-{os.getpid()}-{id(self):x}.log"
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        try:
            self._fd = os.open(self.path, flags | getattr(os, "O_DIRECT", 0), 0o600)
            self.direct = hasattr(os, "O_DIRECT")
        except OSError as e:
            if e.errno != errno.EINVAL:  # (tmpfs: no O_DIRECT; any other error is the volume's)
                raise
            self._fd = os.open(self.path, flags, 0o600)
            self.direct = False
        # (reads many at a time where the kernel takes them so: O_DIRECT files only)
        self._aio = aio.Reader.open(self._fd) if self.direct and native_aio else None
        self._buffer: mmap.mmap | None = None  # (reads: at most GROUP_PAGES, or a run, of pages)

    # ---- where a slot is
    def _grid(self, buffer: mmap.mmap, pages: int) -> np.ndarray:
        """``buffer`` (``pages`` whole pages) as ``[units, rows_per_page, row_floats]`` float32, a view: unit
        ``u`` is page ``u`` (or the ``pages_per_row`` pages of one wide row)."""
        units = pages // self.pages_per_row
        unit_bytes = self.pages_per_row * PAGE
        floats = np.frombuffer(buffer, dtype=np.float32, count=units * unit_bytes // 4)
        return np.lib.stride_tricks.as_strided(
            floats,
            shape=(units, self.rows_per_page, self.row_floats),
            strides=(unit_bytes, self.row_bytes, 4),
            writeable=True,
        )

    def _offsets(self, slots: np.ndarray) -> np.ndarray:
        """The byte offset in the file of each slot."""
        segment, within = np.divmod(slots, self.slots_per_segment)
        page = segment * self.pages_per_segment + (within // self.rows_per_page) * self.pages_per_row
        return page * PAGE + (within % self.rows_per_page) * self.row_bytes

    @property
    def rows_on_disk(self) -> int:
        return int(self._live.sum())

    @property
    def file_bytes(self) -> int:
        return int(self._live.size) * self.pages_per_segment * PAGE

    def on_disk(self, rows: np.ndarray) -> np.ndarray:
        """Whether each of ``rows`` has a copy on disk."""
        return self.location[rows] >= 0

    # ---- writing
    def _allocate(self, count: int) -> np.ndarray:
        """``count`` new slots at the head, in order (new segments as needed); a write ends on a whole page,
        so the head moves to the next page after it."""
        slots = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            if self._head is None:
                if self._free:
                    segment = self._free.pop()
                else:
                    segment = self._live.size
                    self._live = np.append(self._live, 0)
                    self._owner = np.append(self._owner, np.full(self.slots_per_segment, -1, np.int64))
                self._head = (segment, 0)
            segment, at = self._head
            take = min(count - done, self.slots_per_segment - at)
            base = segment * self.slots_per_segment
            slots[done : done + take] = np.arange(base + at, base + at + take)
            done += take
            at += take
            at = -(-at // self.rows_per_page) * self.rows_per_page  # (the rest of the page stays unused)
            self._head = None if at >= self.slots_per_segment else (segment, at)
        return slots

    def _kill(self, rows: np.ndarray) -> None:
        """The slots of ``rows`` become dead."""
        old = self.location[rows]
        old = old[old >= 0]
        if old.size:
            self._owner[old] = -1
            np.subtract.at(self._live, old // self.slots_per_segment, 1)
            emptied = np.unique(old // self.slots_per_segment)
            head = self._head[0] if self._head is not None else -1
            self._free.extend(int(s) for s in emptied if self._live[s] == 0 and s != head)

    def write(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Writes ``values[i]`` (``row_floats`` float32) as row ``rows[i]``; rows must be distinct."""
        rows = np.asarray(rows, dtype=np.int64)
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(rows.size, self.row_floats)
        if rows.size == 0:
            return
        with self._lock:
            self._write(rows, values)

    def _write(self, rows: np.ndarray, values: np.ndarray) -> None:
        """All or nothing: the rows' old copies stay theirs (and unoverwritten) until every page is written;
        a write that fails part way leaves dead slots, no row changed."""
        slots = self._allocate(rows.size)
        offsets = self._offsets(slots)
        # runs of consecutive pages (slots are consecutive within a segment; a segment change breaks a run)
        pages = offsets // PAGE
        step = np.diff(pages)
        breaks = np.flatnonzero((step != 0) & (step != self.pages_per_row)) + 1
        for run in np.split(np.arange(rows.size), breaks):
            first = int(pages[run[0]]) * PAGE
            size = int(offsets[run[-1]]) + self.row_bytes - first
            buffer = _aligned(size)
            local = offsets[run] - first
            grid = self._grid(buffer, len(buffer) // PAGE)
            grid[local // (self.pages_per_row * PAGE), (local % PAGE) // self.row_bytes] = values[run]
            written = os.pwritev(self._fd, [buffer], first)
            if written != len(buffer):
                raise OSError(errno.EIO, f"short write: {written} of {len(buffer)} bytes", str(self.path))
            self._dropped(first, len(buffer))
            self.stats.bytes_written += len(buffer)
        np.add.at(self._live, slots // self.slots_per_segment, 1)  # (before the kill: a segment holding old
        self._owner[slots] = rows  # and new copies is not emptied)
        self._kill(rows)
        self.location[rows] = slots
        self.stats.rows_written += int(rows.size)

    def forget(self, rows: np.ndarray) -> None:
        """Drops the disk copy of ``rows`` (a row that left the shard, or whose value came from elsewhere)."""
        rows = np.asarray(rows, dtype=np.int64)
        with self._lock:
            self._kill(rows)
            self.location[rows] = -1

    # ---- reading
    def read(self, rows: np.ndarray) -> np.ndarray:
        """The values of ``rows`` (each must be on disk), ``[len(rows), row_floats]``: the pages they lie on,
        read in offset order, adjacent ones in one call."""
        rows = np.asarray(rows, dtype=np.int64)
        with self._lock:
            return self._read(rows)

    def read_where(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``read``, with where each row was read from (its slot): a reader without the caller's lock
        (a read-ahead) installs only the rows still there afterwards."""
        rows = np.asarray(rows, dtype=np.int64)
        with self._lock:  # (a row no longer on disk, rewritten meanwhile, is read as zeros from nowhere: -2)
            where = self.location[rows].copy()
            there = where >= 0
            values = np.zeros((rows.size, self.row_floats), dtype=np.float32)
            values[there] = self._read(rows[there])
            where[~there] = -2
            return values, where

    def _read(self, rows: np.ndarray) -> np.ndarray:
        out = np.empty((rows.size, self.row_floats), dtype=np.float32)
        if rows.size == 0:
            return out
        slots = self.location[rows]
        if (slots < 0).any():
            missing = rows[slots < 0]
            raise KeyError(f"rows not on disk: {missing[:8].tolist()}{' ...' if missing.size > 8 else ''}")
        offsets = self._offsets(slots)
        first_page = offsets // PAGE
        pages = np.unique((first_page[:, None] + np.arange(self.pages_per_row)).ravel())
        # spans: pages at most max_gap_pages apart are read in one call, the gap with them (a read's cost
        # here is the call, about the same from 4 to 64 KiB), each span at most max_run_pages long
        span = np.cumsum(np.r_[True, np.diff(pages) > self.max_gap_pages + 1]) - 1
        span_first = pages[np.r_[0, np.flatnonzero(np.diff(span)) + 1]]
        piece = (pages - span_first[span]) // self.max_run_pages
        first = np.r_[True, (np.diff(span) != 0) | (np.diff(piece) != 0)]
        lows = pages[first]
        highs = pages[np.r_[np.flatnonzero(first)[1:] - 1, pages.size - 1]] + 1
        # groups of spans of at most GROUP_PAGES pages, each read into one buffer and taken apart
        lengths = highs - lows
        group = np.cumsum(lengths) // max(GROUP_PAGES, self.max_run_pages)
        span_of_row = np.searchsorted(lows, first_page, side="right") - 1
        for g in np.unique(group).tolist():
            members = np.flatnonzero(group == g)
            starts = np.r_[0, np.cumsum(lengths[members])[:-1]]  # each span's first page in the buffer
            pages_read = int(lengths[members].sum())
            buffer = self._read_buffer(pages_read)
            self._read_spans(buffer, lows[members], lengths[members], starts)
            grid = self._grid(buffer, pages_read)
            mine = np.flatnonzero(group[span_of_row] == g)
            at = np.searchsorted(members, span_of_row[mine])
            unit = (starts[at] + first_page[mine] - lows[members][at]) // self.pages_per_row
            out[mine] = grid[unit, (offsets[mine] % PAGE) // self.row_bytes]
            self.stats.bytes_read += int(lengths[members].sum()) * PAGE
        self.stats.read_calls += int(lows.size)
        self.stats.rows_read += int(rows.size)
        return out

    def _read_buffer(self, pages: int) -> mmap.mmap:
        """The log's read buffer, at least ``pages`` long: one mapping kept from read to read (its pages stay
        resident; a new one per read faulted in, zero-filled, every page it took)."""
        if self._buffer is None or len(self._buffer) < pages * PAGE:
            self._buffer = _aligned(pages * PAGE)
        return self._buffer

    def _read_spans(
        self, buffer: mmap.mmap, lows: np.ndarray, lengths: np.ndarray, starts: np.ndarray
    ) -> None:
        """Reads span ``i`` (``lengths[i]`` pages from page ``lows[i]`` of the file) into ``buffer`` at page
        ``starts[i]``; several in flight at once when there are many."""
        if self._aio is not None:
            address = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
            self._aio.read(address, starts * PAGE, lows * PAGE, lengths * PAGE)
            return
        spans = list(zip(lows.tolist(), lengths.tolist(), starts.tolist(), strict=True))

        def read_some(some: list[tuple[int, int, int]]) -> None:
            for low, length, start in some:
                part = memoryview(buffer)[start * PAGE : (start + length) * PAGE]
                got = os.preadv(self._fd, [part], low * PAGE)
                if got != len(part):
                    raise OSError(errno.EIO, f"short read: {got} of {len(part)} bytes", str(self.path))
                self._dropped(low * PAGE, len(part))

        # several reads in flight (the GIL is released in each): a disk answers random reads at a queue
        # depth of one at a fraction of the rate it has with several
        if len(spans) >= 2 * READERS:
            list(_readers().map(read_some, [spans[i::READERS] for i in range(READERS)]))
        else:
            read_some(spans)

    def _dropped(self, offset: int, size: int) -> None:
        if not self.direct:  # (through the page cache: what was read or written leaves it)
            os.posix_fadvise(self._fd, offset, size, os.POSIX_FADV_DONTNEED)

    # ---- keeping the file small
    def wasteful(self, slack_segments: int = 4) -> bool:
        """Whether the file holds more than twice its live rows' slots (and a few segments): time to
        ``compact``."""
        live_segments = -(-self.rows_on_disk // self.slots_per_segment)
        return self._live.size - len(self._free) > 2 * live_segments + slack_segments

    def compact(self, max_dead_ratio: float = 1.0) -> int:
        """Copies the live rows of the emptiest segments to the head until dead slots are at most
        ``max_dead_ratio`` times the live ones (counting whole segments); returns the rows copied."""
        with self._lock:
            copied = 0
            while True:
                used = np.setdiff1d(np.arange(self._live.size), np.array(self._free, dtype=np.int64))
                head = self._head[0] if self._head is not None else -1
                used = used[used != head]
                live = int(self._live.sum())
                dead = used.size * self.slots_per_segment - int(self._live[used].sum())
                if used.size == 0 or dead <= max_dead_ratio * max(live, 1):
                    return copied
                victim = int(used[np.argmin(self._live[used])])
                base = victim * self.slots_per_segment
                rows = self._owner[base : base + self.slots_per_segment]
                rows = rows[rows >= 0]
                if rows.size:
                    values = self._read(rows)
                    self.stats.rows_read -= int(rows.size)  # (counted apart: not a read the tier asked for)
                    self._write(rows, values)
                    self.stats.rows_written -= int(rows.size)
                    self.stats.rows_compacted += int(rows.size)
                    copied += int(rows.size)
                elif victim not in self._free:
                    self._free.append(victim)

    def close(self) -> None:
        if self._aio is not None:
            self._aio.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
