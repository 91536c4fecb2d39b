"""Deterministic, versioned placement of embedding rows on embedding-server shards.

Keys fall into ``num_buckets`` buckets by ``key % num_buckets`` (interleaved, so the few rows of a
small, hot table spread over all shards); a bucket -> shard table assigns buckets to shards. Changing
the number of servers only rewrites that table and bumps the version, so rows move a bucket at a time.
Inside a shard, a key's row index is pure arithmetic (no per-row index structure):
``bucket_position * rows_per_bucket + key // num_buckets``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = 1024


@dataclass(frozen=True)
class ShardMap:
    """Which shard owns every key. ``bucket_to_shard[b]`` is the shard of bucket ``b``."""

    version: int
    num_keys: int
    num_shards: int
    bucket_to_shard: np.ndarray = field(repr=False)
    # the shard that holds every bucket (-1: several hold some), so that ``split`` need not sort
    sole_shard: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.version < 1:
            raise ValueError(f"version: must be >= 1, got {self.version}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards: must be >= 1, got {self.num_shards}")
        if self.num_keys < 1:
            raise ValueError(f"num_keys: must be >= 1, got {self.num_keys}")
        b2s = self.bucket_to_shard
        if b2s.ndim != 1 or b2s.size < 1:
            raise ValueError("bucket_to_shard: must be a non-empty 1-D array")
        if b2s.min() < 0 or b2s.max() >= self.num_shards:
            raise ValueError(f"bucket_to_shard: values must lie in [0, {self.num_shards})")
        object.__setattr__(self, "sole_shard", int(b2s[0]) if (b2s == b2s[0]).all() else -1)

    @classmethod
    def create(cls, num_keys: int, num_shards: int, num_buckets: int = DEFAULT_BUCKETS) -> ShardMap:
        """Version 1: bucket ``b`` on shard ``b % num_shards``."""
        buckets = max(1, min(num_buckets, num_keys))
        return cls(1, num_keys, num_shards, (np.arange(buckets) % num_shards).astype(np.int32))

    @property
    def num_buckets(self) -> int:
        return int(self.bucket_to_shard.size)

    @property
    def rows_per_bucket(self) -> int:
        return -(-self.num_keys // self.num_buckets)

    def shard_of(self, keys: np.ndarray) -> np.ndarray:
        return self.bucket_to_shard[keys % self.num_buckets]

    def split(self, keys: np.ndarray) -> list[np.ndarray]:
        """Positions in ``keys`` of the keys of each shard (vectorised, stable)."""
        if self.sole_shard >= 0:  # (one server, as before a scale-up: 0.17 ms for 16 k keys saved)
            empty = np.zeros(0, dtype=np.int64)
            return [np.arange(keys.size) if s == self.sole_shard else empty for s in range(self.num_shards)]
        shards = self.shard_of(keys)
        if self.num_shards <= np.iinfo(np.int16).max:  # (numpy's stable sort of 16-bit values is a radix
            shards = shards.astype(np.int16)  # sort: 0.08 ms for 16 k keys, against 0.2-0.4 ms for int32)
        order = np.argsort(shards, kind="stable")
        bounds = np.searchsorted(shards[order], np.arange(self.num_shards + 1))
        return [order[bounds[s] : bounds[s + 1]] for s in range(self.num_shards)]

    def buckets_of(self, shard: int) -> np.ndarray:
        return np.flatnonzero(self.bucket_to_shard == shard)

    @property
    def owners(self) -> list[int]:
        """The shards that hold at least one bucket."""
        return [int(s) for s in np.unique(self.bucket_to_shard)]

    def rebalance(self, shards: Iterable[int]) -> ShardMap:
        """The next version, spread evenly over ``shards``, moving as few buckets as possible.

        Every shard gets ``B // n`` or one more bucket (the shards that hold most keep the extra ones);
        a shard keeps its buckets up to that quota, and only the rest move: every bucket of a shard not in
        ``shards``, and the surplus of the others, to the shards below their quota (lowest first). So
        adding a server moves only the buckets it receives, and removing one only the buckets it had.
        """
        target = sorted({int(s) for s in shards})
        if not target or target[0] < 0:
            raise ValueError(f"shards: need at least one shard index >= 0, got {target}")
        b2s = self.bucket_to_shard
        held = {s: np.flatnonzero(b2s == s) for s in target}
        base, extra = divmod(self.num_buckets, len(target))
        by_size = sorted(target, key=lambda s: (-held[s].size, s))
        quota = {s: base + (1 if i < extra else 0) for i, s in enumerate(by_size)}
        keep = np.zeros(self.num_buckets, dtype=bool)
        for s in target:
            keep[held[s][: quota[s]]] = True
        new = np.where(keep, b2s, -1).astype(np.int32)
        # the rest go, lowest bucket first, to the shards below their quota, lowest shard first
        short = [quota[s] - min(quota[s], held[s].size) for s in target]
        new[~keep] = np.repeat(np.asarray(target, dtype=np.int32), short)
        return ShardMap(self.version + 1, self.num_keys, target[-1] + 1, new)

    def moves(self, new: ShardMap) -> list[tuple[int, int, np.ndarray]]:
        """(from shard, to shard, buckets) of every bucket that ``new`` places elsewhere."""
        if new.num_buckets != self.num_buckets or new.num_keys != self.num_keys:
            raise ValueError("shard maps of different key spaces or bucket counts")
        moved = np.flatnonzero(self.bucket_to_shard != new.bucket_to_shard)
        pairs = np.stack([self.bucket_to_shard[moved], new.bucket_to_shard[moved]], axis=1)
        kinds, which = np.unique(pairs, axis=0, return_inverse=True)
        return [(int(a), int(b), moved[which.reshape(-1) == k]) for k, (a, b) in enumerate(kinds)]

    def local_layout(self, shard: int) -> tuple[np.ndarray, int]:
        """(bucket -> position among the shard's buckets, or -1; number of row slots on the shard)."""
        owned = self.buckets_of(shard)
        position = np.full(self.num_buckets, -1, dtype=np.int64)
        position[owned] = np.arange(owned.size)
        return position, int(owned.size) * self.rows_per_bucket

    def local_rows(self, keys: np.ndarray, position: np.ndarray) -> np.ndarray:
        """The local row of each of ``keys`` on the shard whose ``local_layout`` gives ``position`` (keys
        of that shard only: unchecked)."""
        return position[keys % self.num_buckets] * self.rows_per_bucket + keys // self.num_buckets

    def local_keys(self, shard: int) -> np.ndarray:
        """Global key of every local row slot of ``shard`` (-1 for padding past the last key)."""
        owned = self.buckets_of(shard)
        keys = owned[:, None] + self.num_buckets * np.arange(self.rows_per_bucket)[None, :]
        keys = keys.reshape(-1).astype(np.int64)
        keys[keys >= self.num_keys] = -1
        return keys

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "num_keys": self.num_keys,
                "num_shards": self.num_shards,
                "bucket_to_shard": self.bucket_to_shard.tolist(),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ShardMap:
        d = json.loads(text)
        return cls(
            int(d["version"]),
            int(d["num_keys"]),
            int(d["num_shards"]),
            np.asarray(d["bucket_to_shard"], dtype=np.int32),
        )
