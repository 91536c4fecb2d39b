"""An embedding server's rows within a memory budget: at most ``capacity`` rows (each with its optimizer
state) in memory, the others in a ``RowLog`` on disk, and those never written nowhere (they are computed from
their seed where they are needed, as without the tier).

What to keep and what to read ahead comes from the future, not the past. The oracle plans every batch L
batches ahead, so a server can know, for each of its rows, the next batch whose fetch needs it
(``Schedule``). The tier reads rows from disk before the fetch that needs them (``ahead``, then
``RowLog.read_where`` off the server's loop, then ``install``: a batch's rows at once, in offset order),
evicts the rows whose next use is furthest away (Belady's rule; rows with no use in sight first), and
writes to disk only the rows it evicts that changed since they were last there. A row that has to be read
while a fetch waits for it is counted (``TierStats.waited_rows``): with the schedule in time, none is.

Local rows are the shard's (``ShardStore``'s); the caller holds the server's gate, as for its table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bagpipe.embedding_server.row_log import RowLog

NEVER = np.iinfo(np.int32).max  # the next use of a row no planned batch fetches
# what to keep and when to read: the oracle's lookahead (Bagpipe's), and, for the benchmark only, the
# history-based eviction of multi-tier stores with reads on demand (lru), and next-batch prefetch with LRU
# eviction as SSD-backed TorchRec kernels do (next-batch)
POLICIES = ("lookahead", "lru", "next-batch")


class Schedule:
    """The next batch that fetches each of ``rows`` local rows, from the batches planned so far.

    Batches are added in order (``add``), and passed in order once their fetch is served (``passed``). Each
    batch keeps, for each of its rows, the next batch planned after it that fetches the row, filled in as
    later batches are added; passing the batch moves the rows' next use on to it."""

    def __init__(self, rows: int) -> None:
        self.next_use = np.full(rows, NEVER, dtype=np.int32)
        self._last = np.full(rows, -1, dtype=np.int32)  # the last planned batch that fetches the row
        self._last_at = np.zeros(rows, dtype=np.int32)  # the row's place in that batch's rows
        self._batches: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # batch -> (rows, next use of each)
        self.now = 0  # the first batch not passed
        self.horizon = -1  # the last batch planned

    def add(self, batch: int, rows: np.ndarray) -> None:
        """Batch ``batch`` (the one after the last added) fetches local ``rows`` (distinct)."""
        if batch <= self.horizon or batch < self.now:
            raise ValueError(f"batch {batch}: batches are planned in order (next {self.horizon + 1})")
        rows = np.asarray(rows, dtype=np.int64)
        last = self._last[rows]
        pending = last >= self.now  # (the row's next use is already a batch in sight: it stays)
        if pending.any():
            order = np.argsort(last[pending], kind="stable")
            by_batch = last[pending][order]
            places = self._last_at[rows[pending]][order]
            bounds = np.flatnonzero(np.diff(by_batch)) + 1
            for group in np.split(np.arange(by_batch.size), bounds):
                self._batches[int(by_batch[group[0]])][1][places[group]] = batch
        self.next_use[rows[~pending]] = batch
        self._last[rows] = batch
        self._last_at[rows] = np.arange(rows.size, dtype=np.int32)
        self._batches[batch] = (rows, np.full(rows.size, NEVER, dtype=np.int32))
        self.horizon = batch

    def rows_of(self, batch: int) -> np.ndarray:
        """The rows batch ``batch`` fetches (empty if it is not planned, or passed)."""
        planned = self._batches.get(batch)
        return planned[0] if planned is not None else np.zeros(0, dtype=np.int64)

    def passed(self, batch: int) -> None:
        """Batch ``batch``'s fetch was served: its rows' next use is the next planned batch that fetches
        them."""
        while self.now <= batch:
            planned = self._batches.pop(self.now, None)
            if planned is not None:
                rows, following = planned
                self.next_use[rows] = following
            self.now += 1

    def forget(self, rows: np.ndarray) -> None:
        """``rows`` left the shard: no plan counts on them here any more."""
        self.next_use[rows] = NEVER


@dataclass
class TierStats:
    """Rows moved between memory and disk since the tier began."""

    prefetched_rows: int = 0  # read from disk ahead of the fetch that needs them
    waited_rows: int = 0  # read from disk while a fetch waited
    evicted_rows: int = 0  # left memory
    written_rows: int = 0  # of those, written to disk (changed since they were last there)
    peeked_rows: int = 0  # read from disk without entering memory (snapshots, the undo log, re-sharding)
    wasted_rows: int = 0  # read ahead, then evicted before any request used them
    wait_seconds: float = 0.0  # spent by requests reading their rows from disk (the waited rows)


@dataclass(frozen=True)
class TierSpec:
    """``--row-memory`` and ``--row-disk``: a shard's rows and state in memory take at most ``memory_bytes``,
    the rest lies in files under ``directory``."""

    memory_bytes: int
    directory: Path
    policy: str = "lookahead"

    def capacity(self, width: int) -> int:
        """The rows of ``width`` float32 that the budget holds."""
        return self.memory_bytes // (4 * width)

    def tier(self, rows: int, width: int, name: str) -> RowTier:
        """A tier for ``rows`` rows, its files in ``directory/name``."""
        return RowTier(rows, width, self.capacity(width), self.directory / name, policy=self.policy)


class RowTier:
    """Local rows ``0 .. rows - 1`` of ``width`` float32 each (a row and its optimizer state), at most
    ``capacity`` of them in memory, the rest in a ``RowLog`` under ``directory``."""

    def __init__(
        self,
        rows: int,
        width: int,
        capacity: int,
        directory: Path,
        schedule: Schedule | None = None,
        policy: str = "lookahead",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1 row, got {capacity}")
        if policy not in POLICIES:
            raise ValueError(f"policy: one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.width = width
        self.capacity = capacity
        self.memory = np.zeros((capacity, width), dtype=np.float32)
        self.slot = np.full(rows, -1, dtype=np.int32)  # the memory slot of each row (-1: not in memory)
        self._row_in = np.full(capacity, -1, dtype=np.int64)  # the row in each slot (-1: free)
        self._dirty = np.zeros(capacity, dtype=bool)  # changed since last on disk
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int32)  # a stack of free slots
        self._free_count = capacity
        self._used_at = np.zeros(capacity, dtype=np.int64)  # each slot's last use (lru, next-batch)
        self._tick = 0
        self._unused = np.zeros(capacity, dtype=bool)  # read ahead and not yet asked for
        self.unused_rows = 0  # (their count)
        self.log = RowLog(directory, width, rows)
        self.schedule = schedule if schedule is not None else Schedule(rows)
        self.stats = TierStats()

    @property
    def read_ahead(self) -> int:
        """Batches planned beyond the one being fetched (the schedule's depth)."""
        return max(0, self.schedule.horizon - self.schedule.now + 1)

    @property
    def resident_rows(self) -> int:
        return self.capacity - self._free_count

    def stored(self, index: np.ndarray) -> np.ndarray:
        """Whether each row is held (in memory or on disk): a row never written is neither."""
        return (self.slot[index] >= 0) | self.log.on_disk(index)

    # ---- moving rows in
    def _take_slots(self, count: int, keep: np.ndarray) -> np.ndarray:
        """``count`` free slots, evicting rows (never those of ``keep``) to free them."""
        if count > self.capacity:
            raise MemoryError(
                f"{count} rows are needed in memory at once, more than the {self.capacity} the budget holds "
                "(--row-memory)"
            )
        if count > self._free_count:
            self._evict(count - self._free_count, keep)
        taken = self._free[self._free_count - count : self._free_count][::-1].copy()
        self._free_count -= count
        return taken

    def _give_back(self, slots: np.ndarray) -> None:
        """Free slots taken for rows that did not come (a read or write that failed)."""
        self._free[self._free_count : self._free_count + slots.size] = slots
        self._free_count += slots.size

    def _evict(self, count: int, keep: np.ndarray) -> None:
        """Frees at least ``count`` slots (an eighth of the budget more, so that evictions come in runs):
        the rows used furthest in the future leave, and those changed since last on disk are written."""
        kept = np.zeros(self.capacity, dtype=bool)
        slots = self.slot[keep]
        kept[slots[slots >= 0]] = True
        used = np.flatnonzero((self._row_in >= 0) & ~kept)
        want = min(used.size, count + self.capacity // 8)
        if want < count:
            raise MemoryError(
                f"{count} more rows are needed in memory, and only {used.size} can leave (--row-memory)"
            )
        if want < used.size:
            if self.policy == "lookahead":  # the furthest next use first
                order = -self.schedule.next_use[self._row_in[used]].astype(np.int64)
            else:  # the least recently used first
                order = self._used_at[used]
            used = used[np.argpartition(order, want - 1)[:want]]
        rows = self._row_in[used]
        dirty = self._dirty[used]
        if dirty.any():  # (first: a write that fails moves no row)
            # on disk in order of next use (then of row): the rows a batch fetches lie together, and a
            # read-ahead takes them in a few calls; lru and next-batch, which know no next use, in row order
            leaving = rows[dirty]
            due = self.schedule.next_use[leaving] if self.policy == "lookahead" else np.zeros_like(leaving)
            order = np.lexsort((leaving, due))
            self.log.write(leaving[order], self.memory[used[dirty][order]])
            self.stats.written_rows += int(dirty.sum())
            if self.log.wasteful():
                self.log.compact()
        wasted = int(self._unused[used].sum())
        self.stats.wasted_rows += wasted
        self.unused_rows -= wasted
        self._unused[used] = False
        self.slot[rows] = -1
        self._row_in[used] = -1
        self._dirty[used] = False
        self._free[self._free_count : self._free_count + used.size] = used
        self._free_count += used.size
        self.stats.evicted_rows += int(used.size)

    def _load(self, index: np.ndarray, keep: np.ndarray) -> None:
        """Reads rows ``index`` (on disk, not in memory) into memory while a request waits, evicting none of
        ``keep``."""
        slots = self._take_slots(index.size, keep)
        try:
            self.memory[slots] = self.log.read(index)
        except BaseException:
            self._give_back(slots)
            raise
        self.slot[index] = slots
        self._row_in[slots] = index
        self._used(slots, asked=True)
        self.stats.waited_rows += int(index.size)

    def ahead(self, index: np.ndarray) -> np.ndarray:
        """Those of ``index`` that a read-ahead must bring in: on disk, not in memory (unique)."""
        index = np.unique(np.asarray(index, dtype=np.int64))
        return index[(self.slot[index] < 0) & self.log.on_disk(index)]

    def install(self, index: np.ndarray, where: np.ndarray, values: np.ndarray) -> int:
        """Takes into memory the rows of a read-ahead (``RowLog.read_where``, run meanwhile without the
        caller's lock) that are still on disk where they were read and not in memory; returns how many."""
        fresh = (self.slot[index] < 0) & (self.log.location[index] == where)
        index, values = index[fresh], values[fresh]
        if self.policy == "lookahead":
            # Belady's rule for a read-ahead: a row comes in only in place of a row used later (or free
            # room), so rows read for a far batch never push out those of a nearer one
            due = self.schedule.next_use[index]
            order = np.argsort(due, kind="stable")
            index, values, due = index[order], values[order], due[order]
            count = self._fit(due)
        else:  # (the next batch's rows come in, in place of the least recently used)
            count = min(index.size, self.capacity // 2)
        index, values = index[:count], values[:count]
        if index.size == 0:
            return 0
        slots = self._take_slots(index.size, index)
        self.memory[slots] = values
        self.slot[index] = slots
        self._row_in[slots] = index
        self._used(slots, asked=False)
        self.stats.prefetched_rows += int(index.size)
        return int(index.size)

    def _fit(self, due: np.ndarray) -> int:
        """How many of the rows coming in with next uses ``due`` (ascending) may: each takes free room or
        the place of a row used after it (Belady's rule)."""
        if due.size <= self._free_count:  # (room for all: nothing to weigh)
            return int(due.size)
        fits = np.arange(1, due.size + 1) - self._free_count <= self._used_after(due)
        return int(np.argmin(fits)) if not fits.all() else int(due.size)

    def _used_after(self, due: np.ndarray) -> np.ndarray:
        """For each of ``due`` (next uses, ascending), how many rows in memory are next used after it: a
        count of the rows in memory by next use (batches in sight, and never), not a sort of them."""
        now, horizon = self.schedule.now, max(self.schedule.horizon, self.schedule.now)
        held = self.schedule.next_use[self._row_in[self._row_in >= 0]]
        # buckets: 0 .. span-1 for batches now .. horizon, span for every later use or none (NEVER)
        span = horizon - now + 1
        counts = np.bincount(np.clip(held.astype(np.int64) - now, 0, span), minlength=span + 1)
        after = counts[::-1].cumsum()[::-1]  # after[b]: rows used at bucket b or later
        bucket = np.clip(due.astype(np.int64) - now, 0, span)
        later = np.zeros(due.size, dtype=np.int64)
        inside = bucket < span  # (a row due in sight: those due in a later bucket; due never: none)
        later[inside] = after[bucket[inside] + 1]
        return later

    def _used(self, slots: np.ndarray, asked: bool) -> None:
        """``slots`` were used now (a request, ``asked``; or a read-ahead)."""
        self._tick += 1
        self._used_at[slots] = self._tick
        was = self._unused[slots]
        if was.any():  # (a request may ask for a row twice)
            self.unused_rows -= int(np.unique(slots[was]).size)
        if not asked:  # (a read-ahead's slots are distinct)
            self.unused_rows += int(slots.size)
        self._unused[slots] = not asked

    # ---- what the shard asks of it
    def read(self, index: np.ndarray) -> np.ndarray:
        """The rows ``index`` (each stored: see ``stored``), ``[n, width]``, a copy; rows not yet in memory
        are read first (a wait)."""
        index = np.asarray(index, dtype=np.int64)
        here = self.slot[index] >= 0
        missing = np.unique(index[~here])
        if missing.size and missing.size + np.unique(index[here]).size > self.capacity:
            self.stats.waited_rows += int(missing.size)  # (more than the budget holds: read, not kept)
            started = time.perf_counter()
            out = self._peek(index)
            self.stats.wait_seconds += time.perf_counter() - started
            return out
        if missing.size:
            started = time.perf_counter()
            self._load(missing, index)
            self.stats.wait_seconds += time.perf_counter() - started
        slots = self.slot[index]
        self._used(slots, asked=True)
        return self.memory[slots]

    def write(self, index: np.ndarray, values: np.ndarray) -> None:
        """Stores ``values`` as rows ``index`` (distinct); the disk copy of each, if any, is stale.

        With ``lookahead``, a row not in memory comes in only in place of a row used later (or free room),
        as a read-ahead's does: the others (rows no planned batch fetches first) go straight to disk,
        rather than pushing out rows read ahead for the coming batches."""
        index = np.asarray(index, dtype=np.int64)
        values = np.asarray(values, dtype=np.float32).reshape(index.size, self.width)
        missing = np.flatnonzero(self.slot[index] < 0)
        direct = missing[:0]
        if missing.size and self.policy == "lookahead":
            due = self.schedule.next_use[index[missing]]
            order = np.lexsort((index[missing], due))
            count = self._fit(due[order])
            direct = missing[order[count:]]  # (in order of next use, as an eviction writes)
            missing = np.sort(missing[order[:count]])
        # all or nothing (a disk that fails mid-way, a full one): room first, whose evictions write other
        # rows and may fail with none of these stored; then the rows that go to disk, whose failure gives
        # the room back; only then the rows in memory, which cannot fail
        taken = self._take_slots(missing.size, index) if missing.size else self._free[:0]
        if direct.size:
            try:
                self.log.write(index[direct], values[direct])
            except BaseException:
                self._give_back(taken)
                raise
            self.stats.written_rows += int(direct.size)
            self.stats.evicted_rows += int(direct.size)
            stay = np.ones(index.size, dtype=bool)
            stay[direct] = False
            index, values = index[stay], values[stay]
            missing = np.flatnonzero(self.slot[index] < 0)
        if missing.size:
            self.slot[index[missing]] = taken
            self._row_in[taken] = index[missing]
        slots = self.slot[index]
        self.memory[slots] = values
        self._dirty[slots] = True
        self._used(slots, asked=True)
        self.log.forget(index)

    def peek(self, index: np.ndarray) -> np.ndarray:
        """``read`` without moving any row in or out of memory (a snapshot's, an undo log's or a migration's
        read: no fetch waits for it, and it must not push out the rows the next batches need)."""
        index = np.asarray(index, dtype=np.int64)
        out = self._peek(index)
        self.stats.peeked_rows += int((self.slot[index] < 0).sum())
        return out

    def _peek(self, index: np.ndarray) -> np.ndarray:
        out = np.empty((index.size, self.width), dtype=np.float32)
        slots = self.slot[index]
        here = slots >= 0
        out[here] = self.memory[slots[here]]
        if not here.all():
            out[~here] = self.log.read(index[~here])
        return out

    def drop(self, index: np.ndarray) -> None:
        """Rows ``index`` are no longer held (they left the shard, or are initial again)."""
        index = np.unique(np.asarray(index, dtype=np.int64))
        slots = self.slot[index]
        slots = slots[slots >= 0]
        self._row_in[slots] = -1
        self._dirty[slots] = False
        self.unused_rows -= int(self._unused[slots].sum())
        self._unused[slots] = False
        self._free[self._free_count : self._free_count + slots.size] = slots
        self._free_count += slots.size
        self.slot[index] = -1
        self.log.forget(index)

    def close(self) -> None:
        self.log.close()
