"""Which oracle shard plans each key, and how a batch's rows are split between the shards and put back.

With ``--oracles K`` the keys fall into K oracle shards by the embedding servers' bucket map over K shards
(``ShardMap.create(num_keys, K)``: key ``k`` in bucket ``k % B``, bucket ``b`` on shard ``b % K``), and each
shard plans its keys numbered densely, so that its planner's records cover its keys alone. The numbering
keeps the keys' order: shard ``I``'s key ``k`` is its row ``(k // B) * n + p``, where ``n`` is how many
buckets the shard owns and ``p`` the position of ``k``'s bucket among them (``k // K`` when K divides B).
A batch's hot keys (each table's first rows, under the usual skew) then lie together in a shard's
records as they do in one oracle's: numbered bucket by bucket, as a server numbers its rows, they were
spread over the whole table, and a shard's time a key was a fifth higher. The split is fixed for a job:
it does not follow the servers' re-sharding.

A batch's rows travel in *shard order*: its unique keys ordered by (shard, local row), so that shard ``I``'s
part is one contiguous run of them and the data processor's inverse index (into the rows in that order)
holds for the K plan parts concatenated in shard order, which is how a trainer merges them
(``codec.decode_plan``). Shard ``I``'s cache slot ``s`` is the trainers' slot ``s * K + I``, so the shards'
slots never meet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from bagpipe.core.shard_map import ShardMap

__all__ = ["KeyShards", "global_key", "global_slot", "one_shard_terms", "shard_capacity"]


def shard_capacity(capacity: int | None, oracles: int, shard: int) -> int | None:
    """Oracle shard ``shard``'s part of the cache's ``capacity`` rows: an equal part, the first
    ``capacity % oracles`` shards one row more (None: no bound)."""
    if capacity is None:
        return None
    return capacity // oracles + (1 if shard < capacity % oracles else 0)


@dataclass(frozen=True)
class Split:
    """A batch's sorted unique keys in shard order: ``order`` (positions into the keys) ranks them by
    (shard, local row), ``bounds[I]:bounds[I+1]`` of it are shard ``I``'s, and ``local`` is each key's
    local row (aligned with the keys, not with ``order``)."""

    order: np.ndarray
    bounds: np.ndarray
    local: np.ndarray

    def part(self, shard: int) -> np.ndarray:
        """Positions (into the keys) of shard ``shard``'s keys, by local row."""
        return self.order[self.bounds[shard] : self.bounds[shard + 1]]

    def inverse(self, inverse: np.ndarray) -> np.ndarray:
        """An index into the keys (``BatchArrays.inverse``) as an index into the keys in shard order."""
        rank = np.empty(self.order.size, dtype=np.int32)
        rank[self.order] = np.arange(self.order.size, dtype=np.int32)
        return rank[inverse]


class KeyShards:
    """The key -> oracle shard map of a job with ``shards`` oracle shards over ``num_keys`` keys."""

    def __init__(self, num_keys: int, shards: int) -> None:
        if shards < 1:
            raise ValueError(f"oracles: must be >= 1, got {shards}")
        self.shards = shards
        self.map = ShardMap.create(num_keys, shards)
        b2s = self.map.bucket_to_shard
        # each bucket's position among its shard's buckets (one array serves every shard), each shard's
        # buckets in that order, and how many it owns
        self.position = np.zeros(b2s.size, dtype=np.int64)
        self.owned = [self.map.buckets_of(s).astype(np.int64, copy=False) for s in range(shards)]
        for owned in self.owned:
            self.position[owned] = np.arange(owned.size)
        self.counts = np.array([owned.size for owned in self.owned], dtype=np.int64)
        self._shard_of = b2s.astype(np.int8 if shards <= np.iinfo(np.int8).max else np.int16)
        # K divides the buckets: shard k % K, local row k // K
        self._plain = self.map.num_buckets % shards == 0

    def rows(self, shard: int) -> int:
        """Shard ``shard``'s local rows are ``[0, rows)`` (its last round of buckets may pass the keys)."""
        return -(-self.map.num_keys // self.map.num_buckets) * int(self.counts[shard])

    def split(self, keys: np.ndarray) -> Split:
        """``keys`` (sorted unique global keys) in shard order: the numbering keeps the keys' order within a
        shard, so a stable sort by shard alone (a radix sort of small integers) is the order."""
        nb, k = self.map.num_buckets, self.shards
        if self._plain:
            shard = (keys % k).astype(self._shard_of.dtype)
            local = keys // k
        else:
            bucket = keys % nb
            shard = self._shard_of[bucket]
            local = (keys // nb) * self.counts[shard] + self.position[bucket]
        order = np.argsort(shard, kind="stable")
        bounds = np.searchsorted(shard[order], np.arange(k + 1))
        return Split(order, bounds, local)

    def global_keys(self, shard: int, local: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The global keys of shard ``shard``'s local rows ``local`` (into ``out``: may be ``local``), by
        ``global_key``."""
        rows = np.asarray(local, dtype=np.int64)
        out = np.empty_like(rows) if out is None else out
        terms, owned = self.terms(shard)
        _global_keys(rows, out, terms, owned)
        return out

    def global_slots(self, shard: int, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Shard ``shard``'s cache slots as the trainers' slots (into ``out``: may be ``slots``), by
        ``global_slot``."""
        slots = np.asarray(slots, dtype=np.int32)
        out = np.empty_like(slots) if out is None else out
        _global_slots(slots, out, self.shards, shard)
        return out

    def terms(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """What a planner of shard ``shard``'s local rows needs to write its plans in the trainers' terms
        (``LookaheadPlanner(..., shard=...)``): int64 ``[K, shard, plain, buckets it owns, buckets]`` and
        its buckets (``global_key``'s arguments)."""
        plain = 1 if self._plain else 0
        terms = [self.shards, shard, plain, self.counts[shard], self.map.num_buckets]
        return np.array(terms, dtype=np.int64), self.owned[shard]


def one_shard_terms() -> tuple[np.ndarray, np.ndarray]:
    """``KeyShards.terms`` of a job with one oracle: a key is its own row, a slot its own."""
    return np.array([1, 0, 1, 1, 1], dtype=np.int64), np.zeros(1, dtype=np.int64)


@njit(cache=True, nogil=True)
def global_key(row, shards, shard, plain, count, owned, buckets):  # type: ignore[no-untyped-def]
    """The global key of shard ``shard``'s local row ``row``: the one mapping, for compiled loops
    (``KeyShards.terms`` gives the arguments after ``row``, ``plain`` as 0 or 1)."""
    if plain:
        return row * shards + shard
    return (row // count) * buckets + owned[row % count]


@njit(cache=True, nogil=True)
def global_slot(slot, shards, shard):  # type: ignore[no-untyped-def]
    """Shard ``shard``'s cache slot ``slot`` as the trainers' slot: ``slot * K + shard``."""
    return slot * shards + shard


@njit(cache=True, nogil=True)
def _global_keys(rows, out, terms, owned):  # type: ignore[no-untyped-def]
    shards, shard, plain, count, buckets = terms[0], terms[1], terms[2] != 0, terms[3], terms[4]
    for i in range(rows.size):
        out[i] = global_key(rows[i], shards, shard, plain, count, owned, buckets)


@njit(cache=True, nogil=True)
def _global_slots(slots, out, shards, shard):  # type: ignore[no-untyped-def]
    for i in range(slots.size):
        out[i] = global_slot(slots[i], shards, shard)
