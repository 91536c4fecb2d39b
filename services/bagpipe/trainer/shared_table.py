"""The embedding tables in shared memory on the trainers' host: the benchmark's *ideal* system.

``bagpipe run --system ideal`` replaces the embedding servers, for the trainers, by one table in
``/dev/shm`` that every trainer maps: a prefetch is a memory copy and so is a write-back, both on the
background threads as usual. Plans, caches, synchronisation and the oracle's ordering are untouched,
so the result is still exact; what is gone is every network transfer of embeddings (paper §5.1's
ideal, where all embeddings already live with the trainers). Rank 0 fills the table from the
embedding servers before training, and the final checkpoint is read from it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np

from bagpipe.core.row_store import RowStore


class SharedTable:
    """Rows and optimizer state of every key, memory-mapped from ``prefix``-rows/-state files."""

    def __init__(self, prefix: str, num_keys: int, dim: int, state_width: int, create: bool) -> None:
        self.paths = (Path(f"{prefix}-rows"), Path(f"{prefix}-state"))
        mode: Literal["w+", "r+"] = "w+" if create else "r+"
        self.rows = np.memmap(str(self.paths[0]), dtype=np.float32, mode=mode, shape=(num_keys, dim))
        self.state = np.memmap(
            str(self.paths[1]), dtype=np.float32, mode=mode, shape=(num_keys, max(state_width, 1))
        )
        self.state_width = state_width
        self.bytes_sent = 0
        self.bytes_received = 0
        self.initial_rows = 0
        self.refusals = 0  # (one table: nothing is ever routed again)
        self.shard_map_version = 0

    def fill_from(self, store: RowStore, chunk: int = 1 << 18) -> None:
        """Copies every row (and its state) from ``store`` (the embedding servers)."""
        for start in range(0, self.rows.shape[0], chunk):
            keys = np.arange(start, min(start + chunk, self.rows.shape[0]), dtype=np.int64)
            rows, state = store.lookup(keys)
            self.rows[keys] = rows
            if self.state_width:
                self.state[keys] = state
        self.rows.flush()
        self.state.flush()

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = self.rows[keys]
        state = self.state[keys] if self.state_width else np.zeros((keys.size, 0), dtype=np.float32)
        return np.asarray(rows), np.asarray(state)

    def lookup_parts(self, keys: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return [(np.arange(keys.size), *self.lookup(keys))]

    def write_back(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        self.rows[keys] = rows
        if self.state_width:
            self.state[keys] = state

    def close(self) -> None:
        pass

    def unlink(self) -> None:
        for p in self.paths:
            if os.path.exists(p):
                os.unlink(p)
