"""Where the trainers' rows live between their uses: the one interface the trainer reads and writes.

Two implementations: :class:`bagpipe.embedding_server.client.EmbeddingClient` (the sharded embedding
servers over gRPC) and :class:`bagpipe.trainer.shared_table.SharedTable` (one table in shared memory,
the benchmark's ideal system). The trainer's pipeline, checkpoints and evaluation use only this.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class RowStore(Protocol):
    """Rows ``[n, dim]`` and optimizer state ``[n, state_width]`` (float32) by global key."""

    bytes_sent: int  # payload bytes this process sent / received (0 for memory copies)
    bytes_received: int
    initial_rows: int  # rows lookups were answered as still initial and computed here (no bytes)
    refusals: int  # requests refused for their shard-map version, then routed again (0: one table)

    @property
    def shard_map_version(self) -> int:
        """The version of the shard map the store routes by (0: one table, never re-sharded)."""
        ...

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows and state of ``keys`` (int64, any order, no duplicates needed)."""
        ...

    def lookup_parts(self, keys: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The same rows in parts, as they arrived: (positions in ``keys``, rows, state) each; the arrays
        may be read-only views of a reply, valid for as long as the caller keeps them."""
        ...

    def write_back(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """Stores ``rows`` and ``state`` under ``keys`` (distinct); durable when it returns."""
        ...

    def close(self) -> None: ...
