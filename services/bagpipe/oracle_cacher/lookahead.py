"""The oracle's lookahead algorithm (paper Algorithm 1) with an LRPP cache.

(Over 400 lines: one algorithm, whose compiled loops and planner share the record layout described
below.)

Batches enter a window of up to ``L`` batches (the current one included, as in the paper's Figure 6).
When the oldest batch leaves the window it gets a plan:

* every key of the batch gets a time to live: the last batch *in the window* that uses it
  (Algorithm 1's ``LatestTracker``);
* keys that are not cached are prefetched and get a cache slot (``InCache``); a prefetch is marked
  when it is the key's first use since the planner's first batch (``prefetch_first``: no batch since
  then changed its row, so a trainer that found the servers untouched computes it instead);
* keys whose time to live is the batch itself are evicted after it.

**Exactness.** A key evicted after batch ``e`` is not used by the batches that were in the window
with ``e``, so it is prefetched again only by a later batch ``x``. Every plan carries ``depends_on``:
the newest batch whose write-backs must be durable before the plan's prefetches may start: the last
eviction of every key it prefetches, and the release of every slot it reuses. The oracle dispatches a
plan only then, so a prefetch always reads the newest value and never overwrites a row that is still
being written back. With a full window of ``L`` and the default reuse delay this is at most ``x-L``
for keys (DESIGN.md rule 1).

**LRPP (logically replicated, physically partitioned).** Slots are global: a cached key has the same
slot on every trainer, so the oracle reasons about one logical cache. Physically, only the key's
*holders* (the trainers whose samples use it during its stay, as far as the window shows) fetch and keep
it. Each batch's update of a key is all-reduced only when it has more than one holder; a key with one
holder is updated there alone (its gradient is already the global one, since nobody else has a
contribution) and written back by it. When a batch entering the window uses a cached key from a trainer
that does not hold it (the key's use *spreads*), the key is handed over: after the holders' last update
before that batch, one holder sends the row and its optimizer state to the new holders (an all-reduce in
which only the sender contributes), so the newcomer trains on the newest value.

**Delayed synchronisation.** An all-reduce (or hand-over) is *critical* when the next batch reads the
row; the others may run in the background, overlapped with the next batch's compute, as long as they
end before the next critical synchronisation. Rows the next batch reads are exactly those in its keys.

**Capacity.** The planner keeps, for every batch in the window, how many rows will be live (cached) while
it runs: a key's stay runs from its first use to its last use in the window. A batch enters the window
only if, with it, every batch's live rows fit ``capacity``;
otherwise the window shrinks (the effective L drops) until they do, and grows back when the data allows.
Slots of evicted rows wait ``reuse_delay`` batches before reuse (so prefetches run ahead of
write-backs) unless the capacity is needed, in which case they are reused at once and ``depends_on``
reflects it.

**Layout.** The oracle's cost is memory latency: tens of thousands of random accesses per batch into
per-key state for tens of millions of keys. So a key's state is one 16-byte record (``_state``): its
latest use (int32; after eviction, the eviction batch), its slot (int32), its position in the keys of
its latest batch (int32), its holders and its pending hand-over recipients (16-bit trainer masks;
wider records above 16 trainers). ``push`` and ``pop`` each visit the batch's records once (with a
capacity, push reads their latest uses once more first), in loops over its keys compiled with numba
(``_push_records``, ``_pop_records``: the lines of Algorithm 1 per key, which also build the plan's
lists: evictions and their writers, hand-overs, prefetched keys; compiled, or loaded from numba's
cache, when the first planner for a mask width is made); slot allocation works on whole arrays. Pop
runs in phases, each a loop that does one thing, and push reads each chunk's latest uses ahead, so
that the random loads overlap rather than wait behind mispredicted branches. Compiled loops, not numpy
passes: a vectorised pass gathers the records,
then makes a dozen passes over the copies, then scatters them back, and at 63 k keys per batch those
passes cost more than the gathers (4.1 ms per batch against 3.3 ms, bench/README.md). Only keys with a
pending hand-over touch a second array (the batch after which it is due). Whether the next batch reads
a key (critical synchronisation) is recorded while the next batch is pushed, through the stored
positions, so no search is needed. Keys no batch before them in the window uses when they are pushed
are exactly the batch's prefetches (a key used earlier in the window is cached by the time its batch
is planned, and nothing in between evicts it), so ``pop`` takes them from the push.

**Threads.** A batch's keys are distinct and each record is touched only for its own key, so the
compiled loops can plan disjoint runs of a batch's positions at once (``threads``, numba's ``prange``
over OpenMP threads, which wait actively a short while before they sleep): each run lists its
evictions and hand-overs from its first position on, and a short pass moves them together. The plans
are the same; at the paper's point two threads plan a batch in about 0.6 of one's time.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba import njit, prange

from bagpipe.allocator import huge_page_zeros
from bagpipe.core.intrinsics import load_early
from bagpipe.core.oracle_shards import KeyShards, global_key, global_slot, one_shard_terms
from bagpipe.core.plans import (
    BatchPlan,
    Handovers,
    every_trainer,
    lowest_trainer,
    mask_dtype,
    mask_words,
    masks_shape,
    named,
)

logger = logging.getLogger(__name__)

__all__ = ["CapacityError", "LookaheadPlanner", "SlotAllocator"]


class CapacityError(ValueError):
    """A single batch needs more cache rows than the capacity allows."""


class SlotAllocator:
    """Cache slots as a free list plus a quarantine of slots freed too recently to reuse.

    A slot released after batch ``e`` is reused for batches ``>= e + delay``, or earlier when the
    capacity leaves no other choice; ``take`` then reports ``e`` as a dependency. Both lists hold runs
    (the batch after which they were released, the slots), oldest first; a take slices the runs it
    uses rather than copying what stays free.
    """

    def __init__(self, delay: int, capacity: int | None = None) -> None:
        if delay < 1:
            raise ValueError(f"delay: must be >= 1, got {delay}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.delay = delay
        self.capacity = capacity
        self._free: deque[tuple[int, np.ndarray]] = deque()
        self._free_count = 0
        self._quarantine: deque[tuple[int, np.ndarray]] = deque()
        self.high_water = 0
        self.early_reuses = 0

    def take(self, count: int, batch: int) -> tuple[np.ndarray, int]:
        """Returns ``count`` slots for a prefetch for ``batch`` and the newest batch whose write-backs
        must be durable before they are overwritten (-1: none)."""
        while self._quarantine and self._quarantine[0][0] + self.delay <= batch:
            self._unquarantine()
        room = self.capacity - self.high_water if self.capacity is not None else count
        while self._free_count + room < count and self._quarantine:
            self._unquarantine()
            self.early_reuses += 1
        if self._free_count + room < count:
            raise CapacityError(
                f"batch {batch}: needs {count} new cache rows, only {self._free_count + room} are free"
            )
        reused = min(count, self._free_count)  # the longest-free slots first: the oldest dependency
        pieces, depends_on, left = [], -1, reused
        while left:  # (the newest release among the taken slots is the last run taken from)
            released, slots = self._free[0]
            depends_on = released
            if slots.size > left:
                pieces.append(slots[:left])
                self._free[0] = (released, slots[left:])
                break
            pieces.append(slots)
            left -= slots.size
            self._free.popleft()
        self._free_count -= reused
        if reused == count and len(pieces) == 1:
            return pieces[0], depends_on  # (one run's slots: a view, the rest of the run stays free)
        fresh = np.arange(self.high_water, self.high_water + count - reused, dtype=np.int32)
        self.high_water += count - reused
        return np.concatenate([*pieces, fresh]), depends_on

    def _unquarantine(self) -> None:
        run = self._quarantine.popleft()
        self._free.append(run)
        self._free_count += run[1].size

    def release(self, slots: np.ndarray, batch: int) -> None:
        """Frees ``slots`` after ``batch``."""
        if slots.size:
            self._quarantine.append((batch, slots.astype(np.int32, copy=True)))

    @property
    def in_quarantine(self) -> int:
        return int(sum(s.size for _, s in self._quarantine))


@dataclass
class _Entry:
    batch: int
    keys: np.ndarray
    users: np.ndarray
    depends_on: int  # last eviction of keys first seen with this batch
    next_used: np.ndarray  # bool [U]: the next batch uses the key (filled when the next batch is pushed)
    next_pos: np.ndarray  # int32 [U]: ... at this position of its keys
    fresh: np.ndarray  # int32: positions of keys no batch before it in the window uses: its prefetches
    first: np.ndarray  # bool, aligned with fresh: no batch the planner was given before it uses the key


def _state_dtype(mask: np.dtype) -> np.dtype:
    """A key's record: 16 bytes (one gather's fast path) up to 16 trainers, wider above."""
    flags = np.dtype(np.uint16) if mask.itemsize <= 2 else mask
    fields = [
        ("latest", np.int32),
        ("slot", np.int32),
        ("pos", np.int32),
        ("holders", flags),
        ("handover_to", flags),
    ]
    size = 12 + 2 * flags.itemsize
    return np.dtype(
        {
            "names": [f for f, _ in fields],
            "formats": [t for _, t in fields],
            "offsets": [0, 4, 8, 12, 12 + flags.itemsize],
            "itemsize": size + (-size % 8 if size > 16 else 0),
        }
    )


_CHUNK = 256  # keys per chunk of _push_records
_POP_CHUNK = 4096  # ... and of _pop_records (10% less time a pop than 256 at the paper's point)
# the fewest keys a thread takes of a batch (``LookaheadPlanner.threads``): below that, handing a part to
# another thread costs more than it saves
_MIN_PART = 8192
# how many keys ahead the loops that read records at random start loading the record they will read
# (intrinsics.load_early). At the paper's point (62.9 k keys a batch in 33.8 M records) 32 and 64 first
# planned about 11% faster than none, 16 about 5%; on this machine's present host a batch's push and pop
# took 0.99 ms at 128 against 1.25 ms at 32 and 1.06 ms at 64 (256: as 128), one planner a process
_AHEAD = 128
# The compiled loops index with unsigned values (``np.uint64(key)``, ``np.uint32(position)``): numba
# wraps a signed index around when it is negative, which costs a few instructions per access and
# registers that the loops' other values need; every index here is already in range. Plans are the
# same, and push and pop took 9% less (3.47-4.38 against 3.84-4.83 ms a batch, three runs of two planners
# in one process fed the same batches, alternating; bench/README.md, "Oracle").


@njit(cache=True, nogil=True)
def _push_records(  # type: ignore[no-untyped-def]
    state, handover_at, keys, users, batch, oldest, linked, before_used, before_pos, fresh, first, lo, hi
):
    """Lines 5-11 of Algorithm 1 for one batch, one pass over its keys' records (see ``push``). Returns
    the newest eviction among its fresh keys (-1: none) and how many of ``fresh`` it filled; ``first``
    says of each whether it is the key's first use since the planner began (no latest use at all). Only
    the keys at positions ``lo .. hi-1`` (a part, see ``LookaheadPlanner.threads``): ``fresh`` and
    ``first`` are filled from ``lo`` on.

    In chunks of ``_CHUNK`` keys: a loop that only reads the chunk's latest uses (so that their loads are
    in flight at once, and the records are in cache for what follows), then the loop that works on them
    (its branches would otherwise hold the loads back); 8% faster than one loop at the paper's point."""
    depends_on = -1
    fresh_count = lo
    latest = np.empty(_CHUNK, dtype=np.int32)
    for start in range(lo, hi, _CHUNK):
        end = min(hi, start + _CHUNK)
        for i in range(start, end):
            if i + _AHEAD < hi:
                load_early(state, np.uint64(keys[i + _AHEAD]))
            latest[i - start] = state[np.uint64(keys[i])].latest
        for i in range(start, end):
            k = np.uint64(keys[i])
            rec = state[k]
            prev = latest[i - start]
            mine = np.uint64(users[i])
            if prev < oldest:  # not used by any batch in the window: not cached either; prefetched at pop
                depends_on = max(depends_on, prev)
                fresh[fresh_count] = i
                first[fresh_count] = prev < 0
                fresh_count += 1
                rec.holders = mine
            else:
                if linked and prev == batch - 1:  # the previous batch learns that this one reads the key
                    at = np.uint32(rec.pos)
                    before_used[at] = True
                    before_pos[at] = i
                old = np.uint64(rec.holders)
                joiners = mine & ~old
                if joiners != 0 and rec.slot >= 0:  # cached, used by someone new: a hand-over after ``prev``
                    pending = np.uint64(rec.handover_to)
                    # rides along with a pending one (holds early: costs synchronisation, not exactness)
                    if pending != 0:
                        rec.handover_to = pending | joiners
                    else:
                        rec.handover_to = joiners
                        handover_at[k] = prev
                rec.holders = old | mine
            rec.latest = batch
            rec.pos = i
    return depends_on, fresh_count - lo


@njit(cache=True)
def _popcount(v: np.uint64) -> np.uint64:
    """Set bits of ``v``, without a data-dependent branch (SWAR)."""
    v = v - ((v >> np.uint64(1)) & np.uint64(0x5555555555555555))
    v = (v & np.uint64(0x3333333333333333)) + ((v >> np.uint64(2)) & np.uint64(0x3333333333333333))
    v = (v + (v >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (v * np.uint64(0x0101010101010101)) >> np.uint64(56)


@njit(cache=True)
def _writer(owners: np.uint64, key: int) -> int:
    """The trainer that writes an evicted key back: the ``key % holders``-th of its holders (so that
    write-backs spread over the trainers)."""
    one = np.uint64(1)
    for _ in range(key % int(_popcount(owners))):  # drop the lowest set bits, then take the lowest one left
        owners &= owners - one
    return int(_popcount((owners & (~owners + one)) - one))  # (its trailing zeros)


@njit(cache=True, nogil=True)
def _pop_records(  # type: ignore[no-untyped-def]
    state,
    handover_at,
    slot_key,
    keys,
    next_used,
    next_pos,
    prefetch,
    new_slots,
    x,
    delayed,
    following_users,
    ttl,
    slots,
    holders,
    pending,
    sync_class,
    prefetch_keys,
    prefetch_holders,
    evict,
    evict_keys,
    evict_slots,
    writer,
    due,
    handed_keys,
    handed_slots,
    handed_source,
    handed_to,
    handed_critical,
    due_at,
    terms,
    owned,
    lo,
    hi,
):
    """Lines 12-25 of Algorithm 1 for batch ``x`` (see ``pop``): the keys at ``prefetch`` get
    ``new_slots``; ``following_users`` are the users of batch ``x+1``'s keys (empty when it is not in the
    window; then ``next_used`` is all False). Returns how many of ``evict``, ``evict_keys``,
    ``evict_slots`` and ``writer`` and of the ``handed_*`` arrays it filled. Only the keys at positions
    ``lo .. hi-1`` and the prefetches among them (a part, see ``LookaheadPlanner.threads``): the lists
    are filled from ``lo`` on. The slots, hand-over slots and prefetched and evicted keys are written in
    the trainers' terms (``terms``, ``owned``: ``KeyShards.terms``); ``evict_slots`` stay the planner's.

    In chunks of ``_POP_CHUNK`` keys, and in phases, each a loop that does one thing: gather the chunk's
    records (nothing else in the loop, so that many loads are in flight at once), work out every key's
    plan without a data-dependent branch (the evictions and pending hand-overs are listed as it goes),
    then settle the few keys with a pending hand-over, a new slot or an eviction, each in a loop of its
    own, while the chunk's records are still in cache. One loop with a branch per case ran a fifth
    slower: a mispredicted branch drops the loads in flight with it. (A key's own steps keep their order,
    and keys do not share records, so the plan is the one whole-batch phases give.)"""
    one, ahead, lo_u, hi_u = np.uint64(1), np.uint64(_AHEAD), np.uint64(lo), np.uint64(hi)
    shards, shard, plain, count, buckets = terms[0], terms[1], terms[2] != 0, terms[3], terms[4]
    urgent = not delayed
    evicted = lo_u
    waiting = lo_u
    handed = lo_u
    fetched, fetches = np.uint64(np.searchsorted(prefetch, lo)), np.uint64(prefetch.size)
    for start in range(lo_u, hi_u, np.uint64(_POP_CHUNK)):
        end = min(hi_u, start + np.uint64(_POP_CHUNK))
        for i in range(start, end):
            if i + ahead < hi_u:
                load_early(state, np.uint64(keys[i + ahead]))
            rec = state[np.uint64(keys[i])]
            ttl[i] = rec.latest
            slots[i] = rec.slot
            holders[i] = rec.holders
            pending[i] = rec.handover_to
        evicting = evicted
        waited = waiting
        for i in range(start, end):
            to = np.uint64(pending[i])
            owners = np.uint64(holders[i]) & ~to  # those still waiting for a hand-over lack the newest value
            holders[i] = owners
            shared = owners & (owners - one) != 0  # more than one holder
            background = shared & (not (next_used[i] | urgent))  # the next batch does not read it
            sync_class[i] = np.uint8(shared) + np.uint8(background)  # PRIVATE, CRITICAL or BACKGROUND
            evict[evicted] = i  # its last use in the window: evicted, written back by one of its holders
            evicted += np.uint64(ttl[i] == x)
            due[waiting] = i
            waiting += np.uint64(to != 0)
        for j in range(waited, waiting):  # (gathered first, in a loop without a branch, so the loads overlap)
            due_at[j] = handover_at[np.uint64(keys[np.uint32(due[j])])]
        for j in range(waited, waiting):  # the hand-overs due after this batch
            i = np.uint32(due[j])
            k = keys[i]
            if due_at[j] == x:
                state[np.uint64(k)].handover_to = 0
                owners = np.uint64(holders[i])
                to = np.uint64(pending[i])
                handed_keys[handed] = k
                handed_slots[handed] = global_slot(slots[i], shards, shard)
                handed_source[handed] = owners & (~owners + one)  # the lowest holder sends
                handed_to[handed] = to
                if urgent:
                    handed_critical[handed] = True
                else:  # critical when a new holder reads the key in the next batch
                    readers = np.uint64(0)
                    if next_used[i]:  # (next_pos is set only then)
                        readers = np.uint64(following_users[np.uint32(next_pos[i])])
                    handed_critical[handed] = (readers & to) != 0
                handed += one
        while fetched < fetches and np.uint64(prefetch[fetched]) < end:
            j = fetched
            i = np.uint32(prefetch[j])
            k = keys[i]
            slot = new_slots[j]
            slots[i] = slot
            state[np.uint64(k)].slot = slot
            slot_key[np.uint32(slot)] = k + 1
            prefetch_keys[j] = global_key(k, shards, shard, plain, count, owned, buckets)
            prefetch_holders[j] = holders[i]
            fetched += one
        for j in range(evicting, evicted):
            i = np.uint32(evict[j])
            k = keys[i]
            slot_key[np.uint32(slots[i])] = 0
            evict_keys[j] = global_key(k, shards, shard, plain, count, owned, buckets)
            evict_slots[j] = slots[i]
            writer[j] = _writer(np.uint64(holders[i]), k)
            rec = state[np.uint64(k)]
            rec.slot = -1
            rec.holders = 0
        if shards != 1:  # (the chunk's slots, used above as the planner's, in the trainers' terms)
            for i in range(start, end):
                slots[i] = global_slot(slots[i], shards, shard)
    return int(evicted - lo_u), int(handed - lo_u)


@njit(cache=True, nogil=True)
def _word_count(row):  # type: ignore[no-untyped-def]
    """Set bits of a wide mask's row."""
    total = np.uint64(0)
    for w in range(row.size):
        total += _popcount(np.uint64(row[w]))
    return total


@njit(cache=True, nogil=True)
def _load_wide_early(state, held, keys, i, hi):  # type: ignore[no-untyped-def]
    """Starts loading the record and the holders' row of the key ``_AHEAD`` positions after ``i`` (below
    ``hi``), so that the wide loops' random loads overlap as the one-word loops' do."""
    if i + _AHEAD < hi:
        ahead = np.uint64(keys[i + _AHEAD])
        load_early(state, ahead)
        load_early(held[ahead], 0)


@njit(cache=True, nogil=True)
def _push_wide(  # type: ignore[no-untyped-def]
    state, held, pending_to, handover_at, keys, users, batch, oldest, linked, before_used, before_pos, fresh,
    first, lo, hi,
):  # fmt: skip
    """``_push_records`` for wide masks (``mask_words``): a key's holders and pending hand-over recipients
    are rows of ``held`` and ``pending_to`` (uint64 ``[num_keys, words]``), and ``users`` is ``[U, words]``;
    the record's ``handover_to`` is 1 while a hand-over is pending. The same steps, word by word."""
    words = held.shape[1]
    depends_on = -1
    fresh_count = lo
    joiners = np.empty(words, dtype=np.uint64)
    for i in range(lo, hi):
        _load_wide_early(state, held, keys, i, hi)
        k = np.uint64(keys[i])
        rec = state[k]
        prev = rec.latest
        if prev < oldest:
            depends_on = max(depends_on, prev)
            fresh[fresh_count] = i
            first[fresh_count] = prev < 0
            fresh_count += 1
            for w in range(words):
                held[k, w] = users[i, w]
        else:
            if linked and prev == batch - 1:
                at = np.uint32(rec.pos)
                before_used[at] = True
                before_pos[at] = i
            new = False
            for w in range(words):
                joiners[w] = users[i, w] & ~held[k, w]
                new |= joiners[w] != 0
            if new and rec.slot >= 0:
                if rec.handover_to != 0:
                    for w in range(words):
                        pending_to[k, w] |= joiners[w]
                else:
                    for w in range(words):
                        pending_to[k, w] = joiners[w]
                    rec.handover_to = 1
                    handover_at[k] = prev
            for w in range(words):
                held[k, w] |= users[i, w]
        rec.latest = batch
        rec.pos = i
    return depends_on, fresh_count - lo


@njit(cache=True, nogil=True)
def _writer_wide(owners, key):  # type: ignore[no-untyped-def]
    """``_writer`` of a wide mask's row: the ``key % holders``-th of its holders."""
    n = np.uint64(key) % _word_count(owners)
    one = np.uint64(1)
    for w in range(owners.size):
        v = np.uint64(owners[w])
        c = _popcount(v)
        if n < c:
            for _ in range(int(n)):
                v &= v - one
            return w * 64 + int(_popcount((v & (~v + one)) - one))
        n -= c
    return -1


@njit(cache=True, nogil=True)
def _lowest_wide(row, out):  # type: ignore[no-untyped-def]
    """The lowest trainer of a wide mask's ``row``, as a mask into ``out``."""
    found = False
    for w in range(row.size):
        v = np.uint64(row[w])
        if not found and v != 0:
            out[w] = v & (~v + np.uint64(1))
            found = True
        else:
            out[w] = 0


@njit(cache=True, nogil=True)
def _pop_wide(  # type: ignore[no-untyped-def]
    state, held, pending_to, handover_at, slot_key, keys, next_used, next_pos, prefetch, new_slots, x,
    delayed, following_users, ttl, slots, holders, pending, sync_class, prefetch_keys, prefetch_holders,
    evict, evict_keys, evict_slots, writer, handed_keys, handed_slots, handed_source, handed_to,
    handed_critical, terms, owned, lo, hi,
):  # fmt: skip
    """``_pop_records`` for wide masks (see ``_push_wide``): ``holders``, ``pending``, ``prefetch_holders``,
    ``handed_source``, ``handed_to`` and ``following_users`` are ``[N, words]``. The same steps per key, in
    the same phases a chunk: gather the records and holders' rows, then the few keys with a pending
    hand-over read their recipients, then every key's sync class and eviction without a data-dependent
    branch, then the hand-overs due, the prefetches and the evictions, each in a loop of its own. One loop
    with a branch per case took longer a batch: 4.2 ms against 3.2 at 128 trainers, 5.6 against 5.3 at
    256 (the paper's batch, two planners in one process fed the same batches in turns)."""
    words = held.shape[1]
    shards, shard, plain, count_, buckets = terms[0], terms[1], terms[2] != 0, terms[3], terms[4]
    urgent = not delayed
    evicted = lo
    handed = lo
    fetched = np.searchsorted(prefetch, lo)
    due = np.empty(min(hi - lo, _POP_CHUNK), dtype=np.int64)  # a chunk's keys with a pending hand-over
    for start in range(lo, hi, _POP_CHUNK):
        end = min(hi, start + _POP_CHUNK)
        waiting = 0
        for i in range(start, end):
            _load_wide_early(state, held, keys, i, hi)
            k = np.uint64(keys[i])
            rec = state[k]
            ttl[i] = rec.latest
            slots[i] = rec.slot
            for w in range(words):
                holders[i, w] = held[k, w]
                pending[i, w] = 0
            due[waiting] = i
            waiting += rec.handover_to != 0
        for j in range(waiting):  # those still waiting for a hand-over lack the newest value
            i = due[j]
            k = np.uint64(keys[i])
            for w in range(words):
                to = pending_to[k, w]
                pending[i, w] = to
                holders[i, w] &= ~to
        evicting = evicted
        for i in range(start, end):
            count = np.uint64(0)
            for w in range(words):
                count += _popcount(holders[i, w])
            shared = count > 1
            background = shared & (not (next_used[i] | urgent))
            sync_class[i] = np.uint8(shared) + np.uint8(background)
            evict[evicted] = i  # its last use in the window: evicted, written back by one of its holders
            evicted += ttl[i] == x
        for j in range(waiting):  # the hand-overs due after this batch
            i = due[j]
            k = np.uint64(keys[i])
            if handover_at[k] != x:
                continue
            state[k].handover_to = 0
            handed_keys[handed] = keys[i]
            handed_slots[handed] = global_slot(slots[i], shards, shard)
            _lowest_wide(holders[i], handed_source[handed])
            critical = urgent
            for w in range(words):
                handed_to[handed, w] = pending[i, w]
                pending_to[k, w] = 0
                if not urgent and next_used[i]:
                    critical |= (following_users[np.uint32(next_pos[i]), w] & pending[i, w]) != 0
            handed_critical[handed] = critical
            handed += 1
        while fetched < prefetch.size and prefetch[fetched] < end:
            i = prefetch[fetched]
            slot = new_slots[fetched]
            slots[i] = slot
            state[np.uint64(keys[i])].slot = slot
            slot_key[np.uint32(slot)] = keys[i] + 1
            prefetch_keys[fetched] = global_key(keys[i], shards, shard, plain, count_, owned, buckets)
            for w in range(words):
                prefetch_holders[fetched, w] = holders[i, w]
            fetched += 1
        for j in range(evicting, evicted):
            i = evict[j]
            k = np.uint64(keys[i])
            slot_key[np.uint32(slots[i])] = 0
            evict_keys[j] = global_key(keys[i], shards, shard, plain, count_, owned, buckets)
            evict_slots[j] = slots[i]
            writer[j] = _writer_wide(holders[i], keys[i])
            state[k].slot = -1
            for w in range(words):
                held[k, w] = 0
        if shards != 1:  # (the chunk's slots, used above as the planner's, in the trainers' terms)
            for i in range(start, end):
                slots[i] = global_slot(slots[i], shards, shard)
    return evicted - lo, handed - lo


@njit(cache=True, nogil=True, parallel=True)
def _push_parts(  # type: ignore[no-untyped-def]
    state, handover_at, keys, users, batch, oldest, linked, before_used, before_pos, fresh, first, cuts, done
):
    """``_push_records`` for the parts ``cuts[p] .. cuts[p+1]-1``, one a thread (``done[p]``: the part's
    results), then each part's fresh keys moved up behind the part's before it: ``_push_records``'s
    results for the whole batch."""
    for p in prange(cuts.size - 1):
        depends_on, count = _push_records(
            state, handover_at, keys, users, batch, oldest, linked, before_used, before_pos, fresh, first,
            cuts[p], cuts[p + 1],
        )  # fmt: skip
        done[p, 0] = depends_on
        done[p, 1] = count
    filled = done[0, 1]
    for p in range(1, cuts.size - 1):
        _move(fresh, cuts[p], filled, done[p, 1])
        _move(first, cuts[p], filled, done[p, 1])
        filled += done[p, 1]
    return done[:, 0].max(), filled


@njit(cache=True, nogil=True, parallel=True)
def _pop_parts(  # type: ignore[no-untyped-def]
    state, handover_at, slot_key, keys, next_used, next_pos, prefetch, new_slots, x, delayed,
    following_users, ttl, slots, holders, pending, sync_class, prefetch_keys, prefetch_holders, evict,
    evict_keys, evict_slots, writer, due, handed_keys, handed_slots, handed_source, handed_to,
    handed_critical, due_at, terms, owned, cuts, done,
):  # fmt: skip
    """``_pop_records`` for the parts ``cuts[p] .. cuts[p+1]-1``, one a thread (``done[p]``: the part's
    results), then each part's lists moved up behind the part's before it: ``_pop_records``'s results
    for the whole batch."""
    for p in prange(cuts.size - 1):
        evicted, handed = _pop_records(
            state, handover_at, slot_key, keys, next_used, next_pos, prefetch, new_slots, x, delayed,
            following_users, ttl, slots, holders, pending, sync_class, prefetch_keys, prefetch_holders,
            evict, evict_keys, evict_slots, writer, due, handed_keys, handed_slots, handed_source,
            handed_to, handed_critical, due_at, terms, owned, cuts[p], cuts[p + 1],
        )  # fmt: skip
        done[p, 0] = evicted
        done[p, 1] = handed
    evicted, handed = done[0, 0], done[0, 1]
    for p in range(1, cuts.size - 1):
        at, count = cuts[p], done[p, 0]
        _move(evict, at, evicted, count)
        _move(evict_keys, at, evicted, count)
        _move(evict_slots, at, evicted, count)
        _move(writer, at, evicted, count)
        evicted += count
        count = done[p, 1]
        _move(handed_keys, at, handed, count)
        _move(handed_slots, at, handed, count)
        _move(handed_source, at, handed, count)
        _move(handed_to, at, handed, count)
        _move(handed_critical, at, handed, count)
        handed += count
    return evicted, handed


@njit(cache=True, nogil=True)
def _move(array, start, to, count):  # type: ignore[no-untyped-def]
    """``array[start : start+count]`` to ``array[to : to+count]`` (``to <= start``)."""
    for t in range(count):
        array[to + t] = array[start + t]


def _read_only(array: np.ndarray) -> np.ndarray:
    if not array.flags.writeable:  # (as decode_batch gives them: views of the received bytes)
        return array
    view = array.view()
    view.flags.writeable = False
    return view


_COMPILED: set[tuple[int, int, bool]] = set()


def _compile(trainers: int, threads: int) -> None:
    """Compiles (or loads from numba's cache) the loops for ``trainers``' mask width (and, with
    ``threads`` above 1, the loops that split them over threads), on a two-key plan, so that a service
    does it while it starts rather than on its first batch."""
    kind = (mask_dtype(trainers).itemsize, mask_words(trainers), threads > 1)
    if kind in _COMPILED:
        return
    _COMPILED.add(kind)
    planner = LookaheadPlanner(2, 1, trainers, threads=threads)
    planner.push(0, np.arange(2, dtype=np.int64), last=True)
    planner.pop()


class LookaheadPlanner:
    """Algorithm 1 with LRPP over keys ``0 .. num_keys-1`` (global keys, or an oracle shard's rows: ``shard``)
    for ``trainers`` trainers.

    ``push`` batches in order (lines 5-11) with the mask of trainers using each key (``users``;
    all trainers for a replicated cache); ``pop`` plans the oldest one (lines 12-25) once the window
    holds ``lookahead`` batches, the next batch does not fit the capacity, or the last batch has been
    pushed. ``delayed_sync`` off makes every synchronisation critical.

    ``threads`` above 1 splits each batch's keys into that many runs of positions (at least
    ``_MIN_PART`` keys each), each planned by a thread of numba's pool (``prange``). A key's record is
    only ever touched for that key, and a batch's keys are distinct, so the parts share no record,
    position or slot, and each part lists its evictions and hand-overs from its first position on: the
    plan is the same whatever the number of threads. (At most numba's thread count, the machine's cores
    unless ``NUMBA_NUM_THREADS`` says otherwise.)

    ``shard`` (``(KeyShards, I)``): the planner of oracle shard ``I``, whose keys are the shard's local rows
    (``num_keys`` is ``KeyShards.rows(I)``). Its plans are in the trainers' terms, written so by the
    compiled pop as it goes: slots (the plan's and its hand-overs') are ``s * K + I``, the prefetched and
    evicted keys are global, and the slot high-water mark is K times the shard's (every slot of the shard
    lies below it); the batch's keys and the hand-overs' keys, which no trainer receives (a trainer reads
    its rows by slot), stay the shard's rows. ``cached`` gives global keys and slots too.
    """

    def __init__(
        self,
        num_keys: int,
        lookahead: int,
        trainers: int = 1,
        capacity: int | None = None,
        reuse_delay: int | None = None,
        delayed_sync: bool = True,
        threads: int = 1,
        shard: tuple[KeyShards, int] | None = None,
    ) -> None:
        if num_keys < 1:
            raise ValueError(f"num_keys: must be >= 1, got {num_keys}")
        if lookahead < 1:
            raise ValueError(f"lookahead: must be >= 1, got {lookahead}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity: must be >= 1 rows, got {capacity}")
        most = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
        if not 1 <= threads <= most:
            raise ValueError(f"threads: must be in [1, {most}] (numba's threads), got {threads}")
        if shard is not None and num_keys != shard[0].rows(shard[1]):
            rows = shard[0].rows(shard[1])
            raise ValueError(f"num_keys: oracle shard {shard[1]} has {rows} rows, got {num_keys}")
        self.num_keys = num_keys
        self.shard = shard
        # what the compiled pop needs to write its plans in the trainers' terms (KeyShards.terms)
        self._terms, self._owned = one_shard_terms() if shard is None else shard[0].terms(shard[1])
        self.lookahead = lookahead
        self.trainers = trainers
        self.capacity = capacity
        self.delayed_sync = delayed_sync
        self.threads = threads
        self.mask = mask_dtype(trainers)
        # wide masks (above 64 trainers): a key's holders and pending recipients in arrays of their own,
        # planned by the loops for them (_push_wide, _pop_wide) on one thread
        self.words = mask_words(trainers)
        # per key: latest (LatestTracker; the eviction batch once evicted), slot (InCache), pos (in the latest
        # batch's keys), holders, handover_to (pending hand-over recipients; the batch after which it is due
        # is in _handover_at, valid while handover_to is not 0)
        self._dtype = _state_dtype(np.dtype(np.uint8) if self.words else self.mask)
        self._state = np.zeros(num_keys, dtype=self._dtype)
        self._state["latest"] = -1
        self._state["slot"] = -1
        self._handover_at = np.full(num_keys, -1, dtype=np.int32)
        # (every key of every batch reads and writes its holders' row, at random over a gigabyte at 256
        # trainers: on huge pages a pop took 15% less, a push 9%; the pending rows are rarely touched)
        self._held = huge_page_zeros((num_keys, self.words), np.uint64) if self.words else None
        self._pending_to = np.zeros((num_keys, self.words), dtype=np.uint64) if self.words else None
        # key + 1 in each cache slot (0: empty); zeroed pages are mapped lazily, so the slots never used
        # cost no memory, and the array rarely has to grow
        self._slot_key = np.zeros(num_keys, dtype=np.int64)
        self._reuse_delay = reuse_delay
        self._start()
        _compile(trainers, threads)

    def _start(self) -> None:
        """Everything but the per-key arrays, as a new planner has it."""
        lookahead, capacity = self.lookahead, self.capacity
        self._window: deque[_Entry] = deque()
        self._allocator = SlotAllocator(
            delay=min(lookahead, self._reuse_delay or lookahead), capacity=capacity
        )
        self._next_push: int | None = None
        self._first_batch = -1  # the first batch pushed (set by the first push, before any pop)
        self._ended = False
        self._blocked = False
        self._live = np.zeros(
            0, dtype=np.int64
        )  # with a capacity, per batch in the window: rows cached while it runs
        self.occupancy = 0
        self.peak_occupancy = 0
        self.min_window = lookahead

    def reset(self) -> None:
        """This planner as new (the same keys, trainers and limits), for the oracle's rewind to a checkpoint:
        only the per-key entries it wrote are put back. A new planner's arrays cost a page fault per page
        of ``num_keys`` entries (1.7 s at 33.8 M keys, on the path of every recovery); one scan and the
        keys it touched cost a tenth of that."""
        initial = np.zeros(1, dtype=self._dtype)
        initial["latest"] = -1
        initial["slot"] = -1
        touched = np.flatnonzero((self._state != initial[0]) | (self._handover_at != -1))
        self._state[touched] = initial[0]
        self._handover_at[touched] = -1
        if self._held is not None and self._pending_to is not None:  # (a key pushed has a latest use)
            self._held[touched] = 0
            self._pending_to[touched] = 0
        self._slot_key[np.flatnonzero(self._slot_key)] = 0
        self._start()

    def _parts(self, size: int) -> np.ndarray:
        """Where the runs of positions a batch of ``size`` keys is planned in start, one run per thread
        (at least ``_MIN_PART`` keys each), then ``size``."""
        count = max(1, min(self.threads, size // _MIN_PART))
        return np.arange(count + 1, dtype=np.int64) * size // count

    def _split(self, serial: Any, parallel: Any, args: tuple[Any, ...], size: int) -> tuple[int, int]:
        """``serial(*args, 0, size)``'s results: one call with one thread, else ``parallel``'s, which
        plans the batch's ``size`` positions in parts (``_parts``), a thread each."""
        if self.threads == 1 or self.words:  # (wide masks: one thread)
            first, second = serial(*args, 0, size)
        else:
            cuts = self._parts(size)
            if numba.get_num_threads() != self.threads:  # (each thread's own setting)
                numba.set_num_threads(self.threads)
            first, second = parallel(*args, cuts, np.empty((cuts.size - 1, 2), dtype=np.int64))
        return int(first), int(second)

    @property
    def next_push(self) -> int | None:
        """The batch number ``push`` expects next (None before the first push)."""
        return self._next_push

    @property
    def window_size(self) -> int:
        return len(self._window)

    @property
    def slot_high_water(self) -> int:
        """The planner's own slots in use at most (a shard's: its plans' ``slot_high_water`` is K times)."""
        return self._allocator.high_water

    @property
    def trainer_slot_high_water(self) -> int:
        """The slots a trainer's cache needs for this planner's rows: its plans' ``slot_high_water`` (a
        shard's slot ``s`` is the trainers' ``s·K + I``, so K times its own)."""
        return self._allocator.high_water * int(self._terms[0])

    @property
    def early_reuses(self) -> int:
        return self._allocator.early_reuses

    def wants_more(self) -> bool:
        """True while the window has room and the last batch has not been pushed."""
        return not self._ended and not self._blocked and len(self._window) < self.lookahead

    def can_pop(self) -> bool:
        return bool(self._window) and (self._ended or self._blocked or len(self._window) >= self.lookahead)

    def push(self, batch: int, keys: np.ndarray, last: bool = False, users: np.ndarray | None = None) -> bool:
        """Adds the next batch (its sorted unique keys) to the window.

        Returns False, changing nothing, when the batch does not fit the capacity next to the window:
        pop, then push it again. Raises ``CapacityError`` when it does not fit even alone.
        """
        if self._ended:
            raise ValueError(f"batch {batch}: pushed after the last batch")
        if self._next_push is not None and batch != self._next_push:
            raise ValueError(f"batch {batch}: expected batch {self._next_push}")
        if not self.wants_more():
            raise ValueError(f"batch {batch}: the window is full ({len(self._window)} batches)")
        if keys.dtype != np.int64 or keys.ndim != 1:
            raise ValueError(f"keys: expected a 1-D int64 array, got {keys.dtype} {keys.shape}")
        if keys.size and (keys[0] < 0 or keys[-1] >= self.num_keys):
            raise ValueError(f"keys: batch {batch} has keys outside [0, {self.num_keys})")
        shape = masks_shape(keys.size, self.trainers)
        if users is None:
            users = every_trainer(keys.size, self.trainers)
        elif users.dtype != self.mask or users.shape != shape:
            raise ValueError(f"users: expected {self.mask} {shape}, got {users.dtype} {users.shape}")
        elif users.size and (users.min() == 0 if users.ndim == 1 else not named(users).all()):
            # (one-word masks: their least is 0 where one names no trainer; a reduction, no temporary)
            unused = int(keys[~named(users)][0])
            raise ValueError(f"users: batch {batch} has a key no trainer uses (key {unused})")
        keys, users = _read_only(keys), _read_only(users)  # (one compiled variant, whatever the caller has)
        oldest = self._window[0].batch if self._window else batch
        if self.capacity is not None:  # a read-only pass first: the batch may not fit
            prev = self._state["latest"][keys]
            here = len(self._window)
            # a fresh key is live at this batch only; another one from the batch after its last use on
            starts = np.where(prev < oldest, here, prev - oldest + 1)
            live = np.append(self._live, 0) + np.cumsum(np.bincount(starts, minlength=here + 1))
            if not self._window and keys.size > self.capacity:
                raise CapacityError(
                    f"cache capacity of {self.capacity} rows is smaller than batch {batch}, which uses "
                    f"{keys.size} rows"
                )
            if int(live.max()) > self.capacity:
                self._blocked = True
                return False
            self._live = live
        before = self._window[-1] if self._window else None
        next_used = np.zeros(keys.size, dtype=bool)
        next_pos = np.empty(keys.size, dtype=np.int32)  # (read only where next_used is set)
        fresh = np.empty(keys.size, dtype=np.int32)
        first = np.empty(keys.size, dtype=bool)
        wide = (self._held, self._pending_to) if self.words else ()
        depends_on, fresh_count = self._split(
            _push_wide if self.words else _push_records,
            _push_parts,
            (
                self._state,
                *wide,
                self._handover_at,
                keys,
                users,
                batch,
                oldest,
                before is not None,
                before.next_used if before is not None else next_used,  # (not written when not linked)
                before.next_pos if before is not None else next_pos,
                fresh,
                first,
            ),
            keys.size,
        )
        if self._next_push is None:
            self._first_batch = batch
        self._window.append(
            _Entry(
                batch,
                keys,
                users,
                int(depends_on),
                next_used,
                next_pos,
                fresh[:fresh_count].copy(),
                first[:fresh_count].copy(),
            )
        )
        self._next_push = batch + 1
        self._ended = last
        return True

    def finish(self) -> None:
        """Marks the last pushed batch as the end of the data (when no batch carried ``last``)."""
        self._ended = True

    def pop(self) -> BatchPlan:
        """Plans the oldest batch of the window and removes it."""
        if not self.can_pop():
            raise RuntimeError("pop: the window is not full and the last batch has not been pushed")
        window = len(self._window)
        if not self._ended:
            self.min_window = min(self.min_window, window)
        entry = self._window.popleft()
        x, keys = entry.batch, entry.keys
        prefetch = entry.fresh  # not cached when pushed, and no batch before it in the window used them
        depends_on = entry.depends_on
        new_slots = np.zeros(0, dtype=np.int32)
        if prefetch.size:
            new_slots, reused_after = self._allocator.take(prefetch.size, x)
            depends_on = max(depends_on, reused_after)
            if self._allocator.high_water > self._slot_key.size:
                grown = np.zeros(max(self._allocator.high_water, 2 * self._slot_key.size), dtype=np.int64)
                grown[: self._slot_key.size] = self._slot_key
                self._slot_key = grown
        self.occupancy += prefetch.size
        self.peak_occupancy = max(self.peak_occupancy, self.occupancy)
        size = keys.size
        ttl, slots = np.empty(size, dtype=np.int32), np.empty(size, dtype=np.int32)
        shape = masks_shape(size, self.trainers)
        holders, to = np.empty(shape, dtype=self.mask), np.empty(shape, dtype=self.mask)
        sync_class = np.empty(size, dtype=np.uint8)
        prefetch_keys = np.empty(prefetch.size, dtype=np.int64)
        prefetch_holders = np.empty(masks_shape(prefetch.size, self.trainers), dtype=self.mask)
        evict, writer, due = np.empty((3, size), dtype=np.int32)
        evict_keys = np.empty(size, dtype=np.int64)
        evict_slots = np.empty(size, dtype=np.int32)  # (gathered where the slots are in cache)
        following = self._window[0] if self._window else None  # batch x+1: push is in order
        h = Handovers(
            np.empty(size, np.int64),
            np.empty(size, np.int32),
            np.empty(shape, self.mask),
            np.empty(shape, self.mask),
            np.empty(size, bool),
        )
        if self.words:
            evicted, handed = _pop_wide(
                self._state, self._held, self._pending_to, self._handover_at, self._slot_key, keys,
                entry.next_used, entry.next_pos, prefetch, new_slots, x, self.delayed_sync,
                following.users if following is not None else entry.users[:0], ttl, slots, holders, to,
                sync_class, prefetch_keys, prefetch_holders, evict, evict_keys, evict_slots, writer, h.keys,
                h.slots, h.source, h.recipients, h.critical, self._terms, self._owned, 0, size,
            )  # fmt: skip
        else:
            evicted, handed = self._split(
                _pop_records,
                _pop_parts,
                (
                    self._state,
                    self._handover_at,
                    self._slot_key,
                    keys,
                    entry.next_used,
                    entry.next_pos,
                    prefetch,
                    new_slots,
                    x,
                    self.delayed_sync,
                    following.users if following is not None else entry.users[:0],
                    ttl,
                    slots,
                    holders,
                    to,
                    sync_class,
                    prefetch_keys,
                    prefetch_holders,
                    evict,
                    evict_keys,
                    evict_slots,
                    writer,
                    due,
                    h.keys,
                    h.slots,
                    h.source,
                    h.recipients,
                    h.critical,
                    np.empty(size, np.int32),
                    self._terms,
                    self._owned,
                ),
                size,
            )
        # (views of the filled prefixes: a plan lives until it is serialised)
        evict, writer, evict_keys = evict[:evicted], writer[:evicted], evict_keys[:evicted]
        handovers = Handovers(
            h.keys[:handed], h.slots[:handed], h.source[:handed], h.recipients[:handed], h.critical[:handed]
        )
        if evict.size:
            self._allocator.release(evict_slots[:evicted], x)
        self.occupancy -= evict.size
        if self.capacity is not None:
            assert self.occupancy + evict.size == self._live[0], "live-row accounting is off"
            self._live = self._live[1:]
        self._blocked = False
        return BatchPlan(
            batch=x,
            keys=keys,
            slots=slots,
            ttl=ttl,
            users=entry.users,
            holders=holders,
            sync_class=sync_class,
            prefetch=prefetch,
            prefetch_keys=prefetch_keys,
            prefetch_holders=prefetch_holders,
            prefetch_first=entry.first,
            first_since=self._first_batch,
            evict=evict,
            evict_keys=evict_keys,
            writer=writer,
            handovers=handovers,
            depends_on=depends_on,
            window=window,
            slot_high_water=self.trainer_slot_high_water,
            occupancy=self.occupancy + evict.size,
            last=self._ended and not self._window,
        )

    def cached(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every row in the cache after the last popped batch (its evictions and hand-overs done): keys,
        slots, and the trainer with the newest value that writes it out for a checkpoint (the lowest of
        its current holders; those still waiting for a hand-over do not count)."""
        slots = np.flatnonzero(self._slot_key[: self._allocator.high_water]).astype(np.int32)
        keys = self._slot_key[slots] - 1
        rec = self._state[keys]
        if self._held is not None and self._pending_to is not None:
            waiting = (rec["handover_to"] != 0)[:, None]
            holders = self._held[keys] & ~np.where(waiting, self._pending_to[keys], np.uint64(0))
        else:
            holders = (rec["holders"] & ~rec["handover_to"]).astype(self.mask)
        if holders.size and not named(holders).all():
            raise AssertionError("a cached row has no holder with its newest value")
        if self.shard is not None:
            shards, shard = self.shard
            keys = shards.global_keys(shard, keys, out=keys)
            slots = shards.global_slots(shard, slots, out=slots)
        return keys, slots, lowest_trainer(holders)
