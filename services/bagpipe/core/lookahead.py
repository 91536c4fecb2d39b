"""The oracle's lookahead algorithm (paper Algorithm 1), vectorised.

Batches enter a window of ``L`` batches (the current one included, as in the paper's Figure 6). When
the oldest batch leaves the window it gets a plan:

* every key of the batch gets a time to live: the last batch *in the window* that uses it
  (Algorithm 1's ``LatestTracker``);
* keys that are not cached are prefetched and get a cache slot (``InCache``);
* keys whose time to live is the batch itself are evicted after it.

The guarantee that keeps training identical to synchronous training: a key evicted after batch ``e``
is not used by batches ``e+1 .. e+L-1`` (they were all in the window when ``e`` was planned), so a
prefetch for batch ``x`` only has to wait for the write-backs of evictions at batches ``<= x-L``.
The same bound makes slot reuse safe: a slot freed after ``e`` is handed out again only to a batch
``x >= e+L``, whose prefetch cannot start before the evicted row has been copied out and written back.

State is one int32 per key (latest use) and one int32 per key (slot, -1 when not cached), so each
batch costs a few gathers and scatters over its unique keys and no Python loop over ids.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["BatchPlan", "LookaheadPlanner", "SlotAllocator"]


@dataclass(frozen=True)
class BatchPlan:
    """What every trainer does for one global batch.

    ``prefetch`` and ``evict`` are indices into ``keys``; evicted keys are always keys of the batch
    itself, because only the batch that is a key's last use in the window can expire it.
    """

    batch: int
    keys: np.ndarray  # int64 [U], sorted unique global keys
    slots: np.ndarray  # int32 [U]
    ttl: np.ndarray  # int64 [U]
    prefetch: np.ndarray  # int32 [P]
    evict: np.ndarray  # int32 [E]
    slot_high_water: int
    occupancy: int
    last: bool


class SlotAllocator:
    """Cache slots as a free stack plus a quarantine of slots freed too recently to reuse.

    A slot released after batch ``e`` becomes free for batches ``>= e + delay``.
    """

    def __init__(self, delay: int) -> None:
        if delay < 1:
            raise ValueError(f"delay: must be >= 1, got {delay}")
        self._delay = delay
        self._free = np.empty(0, dtype=np.int32)
        self._quarantine: deque[tuple[int, np.ndarray]] = deque()
        self.high_water = 0

    def take(self, count: int, batch: int) -> np.ndarray:
        """Returns ``count`` slots usable by a prefetch for ``batch``."""
        while self._quarantine and self._quarantine[0][0] + self._delay <= batch:
            _, slots = self._quarantine.popleft()
            self._free = np.concatenate([self._free, slots])
        reused = min(count, self._free.size)
        taken = self._free[self._free.size - reused :]
        self._free = self._free[: self._free.size - reused]
        fresh = np.arange(self.high_water, self.high_water + count - reused, dtype=np.int32)
        self.high_water += count - reused
        return np.concatenate([taken, fresh]) if reused else fresh

    def release(self, slots: np.ndarray, batch: int) -> None:
        """Frees ``slots`` after ``batch``."""
        if slots.size:
            self._quarantine.append((batch, slots.astype(np.int32, copy=True)))

    @property
    def in_quarantine(self) -> int:
        return int(sum(s.size for _, s in self._quarantine))


class LookaheadPlanner:
    """Algorithm 1 over global keys ``0 .. num_keys-1``.

    ``push`` batches in order (lines 5-11); ``pop`` plans the oldest one (lines 12-25) once the window
    holds ``lookahead`` batches or the last batch has been pushed.
    """

    def __init__(self, num_keys: int, lookahead: int) -> None:
        if num_keys < 1:
            raise ValueError(f"num_keys: must be >= 1, got {num_keys}")
        if lookahead < 1:
            raise ValueError(f"lookahead: must be >= 1, got {lookahead}")
        self.num_keys = num_keys
        self.lookahead = lookahead
        self._latest = np.full(num_keys, -1, dtype=np.int32)  # LatestTracker
        self._slot = np.full(num_keys, -1, dtype=np.int32)  # InCache, with the key's slot
        self._window: deque[tuple[int, np.ndarray]] = deque()
        self._allocator = SlotAllocator(delay=lookahead)
        self._next_push: int | None = None
        self._ended = False
        self.occupancy = 0
        self.peak_occupancy = 0

    @property
    def next_push(self) -> int | None:
        """The batch number ``push`` expects next (None before the first push)."""
        return self._next_push

    @property
    def window_size(self) -> int:
        return len(self._window)

    @property
    def slot_high_water(self) -> int:
        return self._allocator.high_water

    def wants_more(self) -> bool:
        """True while the window is not full and the last batch has not been pushed."""
        return not self._ended and len(self._window) < self.lookahead

    def can_pop(self) -> bool:
        return bool(self._window) and (self._ended or len(self._window) >= self.lookahead)

    def push(self, batch: int, keys: np.ndarray, last: bool = False) -> None:
        """Adds the next batch (its sorted unique keys) to the window."""
        if self._ended:
            raise ValueError(f"batch {batch}: pushed after the last batch")
        if self._next_push is not None and batch != self._next_push:
            raise ValueError(f"batch {batch}: expected batch {self._next_push}")
        if not self.wants_more():
            raise ValueError(f"batch {batch}: the window already holds {self.lookahead} batches")
        if keys.dtype != np.int64 or keys.ndim != 1:
            raise ValueError(f"keys: expected a 1-D int64 array, got {keys.dtype} {keys.shape}")
        if keys.size and (keys[0] < 0 or keys[-1] >= self.num_keys):
            raise ValueError(f"keys: batch {batch} has keys outside [0, {self.num_keys})")
        self._latest[keys] = batch
        self._window.append((batch, keys))
        self._next_push = batch + 1
        self._ended = last

    def finish(self) -> None:
        """Marks the last pushed batch as the end of the data (when no batch carried ``last``)."""
        self._ended = True

    def pop(self) -> BatchPlan:
        """Plans the oldest batch of the window and removes it."""
        if not self.can_pop():
            raise RuntimeError("pop: the window is not full and the last batch has not been pushed")
        batch, keys = self._window.popleft()
        ttl = self._latest[keys].astype(np.int64)
        slots = self._slot[keys]
        prefetch = np.flatnonzero(slots < 0).astype(np.int32)
        if prefetch.size:
            new_slots = self._allocator.take(prefetch.size, batch)
            slots[prefetch] = new_slots
            self._slot[keys[prefetch]] = new_slots
        self.occupancy += prefetch.size
        self.peak_occupancy = max(self.peak_occupancy, self.occupancy)
        evict = np.flatnonzero(ttl == batch).astype(np.int32)
        if evict.size:
            gone = keys[evict]
            self._slot[gone] = -1
            self._latest[gone] = -1
            self._allocator.release(slots[evict], batch)
        self.occupancy -= evict.size
        return BatchPlan(
            batch=batch,
            keys=keys,
            slots=slots,
            ttl=ttl,
            prefetch=prefetch,
            evict=evict,
            slot_high_water=self._allocator.high_water,
            occupancy=self.occupancy + evict.size,
            last=self._ended and not self._window,
        )
