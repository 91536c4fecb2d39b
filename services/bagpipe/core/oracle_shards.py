"""Which oracle shard plans each key, and how a batch's rows are split between the shards and put back.

With ``--oracles K`` the keys fall into K oracle shards by the embedding servers' bucket map over K shards
(``ShardMap.create(num_keys, K)``: bucket ``b`` on shard ``b % K``), and each shard plans its keys
numbered as a server numbers its rows (``ShardMap.local_rows``: its buckets' rows in turn), so that its
planner's records cover its keys alone. The split is fixed for a job: it does not follow the servers'
re-sharding.

A batch's rows travel in *shard order*: its unique keys ordered by (shard, local row), so that shard ``I``'s
part is one contiguous run of them and the data processor's inverse index (into the rows in that order)
holds for the K plan parts concatenated in shard order, which is how a trainer merges them
(``codec.decode_plan``). Shard ``I``'s cache slot ``s`` is the trainers' slot ``s * K + I``, so the shards'
slots never meet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from bagpipe.core.plans import BatchPlan
from bagpipe.core.shard_map import ShardMap

__all__ = ["KeyShards", "shard_capacity"]


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
        # each bucket's position among its shard's buckets (one array serves every shard), and each shard's
        # buckets in that order
        self.position = np.zeros(b2s.size, dtype=np.int64)
        self.owned = [self.map.buckets_of(s) for s in range(shards)]
        for owned in self.owned:
            self.position[owned] = np.arange(owned.size)

    def rows(self, shard: int) -> int:
        """Shard ``shard``'s local rows are ``[0, rows)`` (the last bucket's may run past the keys)."""
        return int(self.owned[shard].size) * self.map.rows_per_bucket

    def split(self, keys: np.ndarray) -> Split:
        """``keys`` (sorted unique global keys) in shard order."""
        m = self.map
        local = self.position[keys % m.num_buckets] * m.rows_per_bucket + keys // m.num_buckets
        shard = m.shard_of(keys).astype(np.int64)
        order = np.argsort(shard * (int(local.max(initial=0)) + 1) + local, kind="stable")
        bounds = np.searchsorted(shard[order], np.arange(self.shards + 1))
        return Split(order, bounds, local)

    def global_keys(self, shard: int, local: np.ndarray) -> np.ndarray:
        """The global keys of shard ``shard``'s local rows ``local``."""
        m = self.map
        rows = np.asarray(local, dtype=np.int64)
        return self.owned[shard][rows // m.rows_per_bucket] + m.num_buckets * (rows % m.rows_per_bucket)

    def global_slots(self, shard: int, slots: np.ndarray) -> np.ndarray:
        """Shard ``shard``'s cache slots as the trainers' slots: ``s * K + shard``."""
        return slots * np.int32(self.shards) + np.int32(shard)

    def for_trainers(self, plan: BatchPlan, shard: int) -> BatchPlan:
        """Shard ``shard``'s plan of its local rows in the trainers' terms: global keys and slots, and a slot
        high-water mark K times the shard's (every slot of the shard lies below it)."""

        def keys(local: np.ndarray) -> np.ndarray:
            return self.global_keys(shard, local)

        def slots(local: np.ndarray) -> np.ndarray:
            return self.global_slots(shard, local)

        h = plan.handovers
        return dataclasses.replace(
            plan,
            keys=keys(plan.keys),
            slots=slots(plan.slots),
            prefetch_keys=keys(plan.prefetch_keys),
            evict_keys=keys(plan.evict_keys),
            handovers=dataclasses.replace(h, keys=keys(h.keys), slots=slots(h.slots)),
            slot_high_water=plan.slot_high_water * self.shards,
        )
