"""Client side of the embedding servers: routes keys to shards and calls them in parallel."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import numpy as np

from bagpipe import serving
from bagpipe.core.shard_map import ShardMap
from bagpipe.v1 import embedding_server_pb2 as pb
from bagpipe.v1 import embedding_server_pb2_grpc as pb_grpc
from bagpipe.wire import from_tensor, to_tensor

logger = logging.getLogger(__name__)

MAX_ROWS_PER_RPC = 1 << 18
_RETRIES = 5
T = TypeVar("T")


def call_with_retry(fn: Callable[[], T], what: str) -> T:
    """Retries only UNAVAILABLE (server restarting), with backoff; every call has a deadline."""
    for attempt in range(_RETRIES):
        try:
            return fn()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == _RETRIES - 1:
                raise
            logger.warning("%s: unavailable, retrying (%d/%d)", what, attempt + 1, _RETRIES)
            time.sleep(0.1 * 2**attempt)
    raise AssertionError("unreachable")


class EmbeddingClient:
    """Batched lookup and write-back across all shards of ``shard_map``."""

    def __init__(self, shard_map: ShardMap, addresses: dict[int, str], dim: int, state_width: int) -> None:
        missing = set(range(shard_map.num_shards)) - set(addresses)
        if missing:
            raise ValueError(f"addresses: no address for shards {sorted(missing)}")
        self.shard_map = shard_map
        self.dim = dim
        self.state_width = state_width
        self._channels = [serving.channel(addresses[s]) for s in range(shard_map.num_shards)]
        self._stubs = [pb_grpc.EmbeddingServerStub(c) for c in self._channels]
        self._pool = ThreadPoolExecutor(max_workers=max(1, shard_map.num_shards), thread_name_prefix="emb-rpc")
        self.bytes_sent = 0
        self.bytes_received = 0

    def _lookup_shard(self, shard: int, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = np.empty((keys.size, self.dim), dtype=np.float32)
        state = np.empty((keys.size, self.state_width), dtype=np.float32)
        for start in range(0, keys.size, MAX_ROWS_PER_RPC):
            part = keys[start : start + MAX_ROWS_PER_RPC]
            request = pb.LookupRequest(shard_map_version=self.shard_map.version, keys=to_tensor(part))
            reply = call_with_retry(
                lambda r=request: self._stubs[shard].Lookup(r, timeout=serving.RPC_TIMEOUT_S), f"lookup shard {shard}"
            )
            rows[start : start + part.size] = from_tensor(reply.rows, "rows", np.float32, shape=(part.size, self.dim))
            state[start : start + part.size] = from_tensor(
                reply.state, "state", np.float32, shape=(part.size, self.state_width)
            )
            self.bytes_sent += request.ByteSize()
            self.bytes_received += reply.ByteSize()
        return rows, state

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows and optimizer state of ``keys`` (any order, distinct), as float32 arrays."""
        rows = np.empty((keys.size, self.dim), dtype=np.float32)
        state = np.empty((keys.size, self.state_width), dtype=np.float32)
        parts = [p for p in self.shard_map.split(keys) if p.size]
        shards = self.shard_map.shard_of(keys[[int(p[0]) for p in parts]]) if parts else []
        futures = [self._pool.submit(self._lookup_shard, int(s), keys[p]) for s, p in zip(shards, parts, strict=True)]
        for p, f in zip(parts, futures, strict=True):
            rows[p], state[p] = f.result()
        return rows, state

    def _write_shard(self, shard: int, keys: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        for start in range(0, keys.size, MAX_ROWS_PER_RPC):
            sl = slice(start, start + MAX_ROWS_PER_RPC)
            request = pb.WriteBackRequest(
                shard_map_version=self.shard_map.version,
                keys=to_tensor(keys[sl]),
                rows=to_tensor(rows[sl]),
                state=to_tensor(state[sl]),
            )
            call_with_retry(
                lambda r=request: self._stubs[shard].WriteBack(r, timeout=serving.RPC_TIMEOUT_S),
                f"write-back shard {shard}",
            )
            self.bytes_sent += request.ByteSize()

    def write_back(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """Stores rows and state; returns once every shard has acknowledged (durable in memory)."""
        parts = [p for p in self.shard_map.split(keys) if p.size]
        shards = self.shard_map.shard_of(keys[[int(p[0]) for p in parts]]) if parts else []
        futures = [
            self._pool.submit(self._write_shard, int(s), keys[p], rows[p], state[p])
            for s, p in zip(shards, parts, strict=True)
        ]
        for f in futures:
            f.result()

    def snapshot(self, directory: str, next_batch: int) -> list[tuple[str, int, int]]:
        """Has every shard write its changed rows into the checkpoint ``next_batch`` of ``directory``, in
        parallel; returns (file, rows, bytes) per shard."""

        def one(shard: int) -> tuple[str, int, int]:
            request = pb.SnapshotRequest(
                shard_map_version=self.shard_map.version, directory=directory, next_batch=next_batch
            )
            reply = call_with_retry(
                lambda: self._stubs[shard].Snapshot(request, timeout=serving.RPC_TIMEOUT_S), f"snapshot shard {shard}"
            )
            return reply.file, reply.rows, reply.bytes

        return list(self._pool.map(one, range(self.shard_map.num_shards)))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for c in self._channels:
            c.close()
