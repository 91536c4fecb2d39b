"""One embedding-server shard: the rows of its buckets of every table, with optimizer state.

Storage is two dense float32 arrays, ``[local_rows, dim]`` and ``[local_rows, state_width]``; a
key's local row is arithmetic on the shard map, so the only per-row cost is the row itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from bagpipe.core.embedding_init import init_rows
from bagpipe.core.shard_map import ShardMap
from bagpipe.errors import InvalidArgument

logger = logging.getLogger(__name__)

_INIT_CHUNK = 1 << 18


class ShardStore:
    """Rows and optimizer state of shard ``shard`` of ``shard_map``."""

    def __init__(
        self,
        shard_map: ShardMap,
        shard: int,
        offsets: np.ndarray,
        dim: int,
        state_width: int,
        seed: int,
    ) -> None:
        if not 0 <= shard < shard_map.num_shards:
            raise ValueError(f"shard: must be in [0, {shard_map.num_shards}), got {shard}")
        if int(offsets[-1]) != shard_map.num_keys:
            raise ValueError(f"table rows total {int(offsets[-1])} but the shard map has {shard_map.num_keys} keys")
        self.shard_map = shard_map
        self.shard = shard
        self.offsets = offsets
        self.dim = dim
        self.state_width = state_width
        self._position, local_rows = shard_map.local_layout(shard)
        self.weights = np.zeros((local_rows, dim), dtype=np.float32)
        self.state = np.zeros((local_rows, state_width), dtype=np.float32)
        local_keys = shard_map.local_keys(shard)
        for start in range(0, local_rows, _INIT_CHUNK):
            keys = local_keys[start : start + _INIT_CHUNK]
            valid = keys >= 0
            self.weights[start : start + keys.size][valid] = init_rows(keys[valid], offsets, dim, seed)
        self.rows_held = int((local_keys >= 0).sum())
        self._local_keys = local_keys
        self._changed = np.zeros(local_rows, dtype=bool)  # written since the last snapshot

    def load_checkpoint(self, embeddings: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor] | None) -> None:
        """Replaces this shard's rows (and state, if given) with those of an interchange checkpoint."""
        local_keys = self.shard_map.local_keys(self.shard)
        for t in range(self.offsets.size - 1):
            table = embeddings.get(str(t))
            rows = int(self.offsets[t + 1] - self.offsets[t])
            if table is None or tuple(table.shape) != (rows, self.dim):
                got = None if table is None else tuple(table.shape)
                raise ValueError(f"embeddings/{t}: expected shape ({rows}, {self.dim}), got {got}")
            mine = np.flatnonzero((local_keys >= self.offsets[t]) & (local_keys < self.offsets[t + 1]))
            index = torch.from_numpy(local_keys[mine] - self.offsets[t])
            self.weights[mine] = table.index_select(0, index).numpy()
            if self.state_width and state is not None and str(t) in state:
                self.state[mine] = state[str(t)]["sum"].index_select(0, index).numpy()

    def local_index(self, keys: np.ndarray, field: str = "keys") -> np.ndarray:
        """Local rows of ``keys``; InvalidArgument if any key is out of range or not on this shard."""
        if keys.size:
            low, high = int(keys.min()), int(keys.max())
            if low < 0 or high >= self.shard_map.num_keys:
                bad = low if low < 0 else high
                raise InvalidArgument(field, f"key {bad} out of range [0, {self.shard_map.num_keys})")
        position = self._position[keys % self.shard_map.num_buckets]
        foreign = np.flatnonzero(position < 0)
        if foreign.size:
            key = int(keys[foreign[0]])
            raise InvalidArgument(
                field, f"key {key} belongs to shard {int(self.shard_map.shard_of(keys[foreign[:1]])[0])}, not {self.shard}"
            )
        return position * self.shard_map.rows_per_bucket + keys // self.shard_map.num_buckets

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        index = self.local_index(keys)
        return self.weights[index], self.state[index]

    def write(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """Validates everything first, then stores: a bad request changes nothing."""
        index = self.local_index(keys)
        if np.unique(index).size != index.size:
            raise InvalidArgument("keys", "duplicate keys in one write-back")
        if not np.isfinite(rows).all():
            raise InvalidArgument("rows", "non-finite values")
        if not np.isfinite(state).all():
            raise InvalidArgument("state", "non-finite values")
        self.weights[index] = rows
        if self.state_width:
            self.state[index] = state
        self._changed[index] = True

    def take_changes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global keys, rows and state of the rows written since the last call (copies), and forgets them:
        the next snapshot holds only what changes after this one."""
        index = np.flatnonzero(self._changed)
        self._changed[index] = False
        return self._local_keys[index], self.weights[index], self.state[index]

    def keep_changes(self, keys: np.ndarray) -> None:
        """Marks ``keys`` changed again (a snapshot of them could not be written)."""
        self._changed[self.local_index(keys)] = True

    def restore(self, deltas: Iterable[tuple[int, np.ndarray, np.ndarray, np.ndarray]]) -> int:
        """Applies checkpoint row files in order (``snapshots.row_deltas``), keeping the keys of this shard;
        returns the rows restored. The state they produce is the snapshot baseline (nothing is changed)."""
        restored = 0
        for _, keys, rows, state in deltas:
            if rows.shape[1:] != (self.dim,) or state.shape[1:] != (self.state_width,):
                raise ValueError(
                    f"checkpoint rows of width {rows.shape[1:]} and state {state.shape[1:]} do not fit this server "
                    f"(dim {self.dim}, state width {self.state_width}): other --embedding-dim or --optimizer?"
                )
            if keys.size and (keys.min() < 0 or keys.max() >= self.shard_map.num_keys):
                raise ValueError(f"checkpoint keys outside [0, {self.shard_map.num_keys}): other --table-rows?")
            mine = np.flatnonzero(self._position[keys % self.shard_map.num_buckets] >= 0)
            index = self.local_index(keys[mine])
            self.weights[index] = rows[mine]
            self.state[index] = state[mine]
            restored += mine.size
        return restored
