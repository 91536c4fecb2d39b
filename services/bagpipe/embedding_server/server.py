"""The EmbeddingServer servicer and ``create_server``.

Handlers run on the asyncio loop and do not await between validating a request and applying it,
so each lookup or write-back is atomic with respect to the others and a rejected one changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import numpy as np

from bagpipe import serving
from bagpipe.core import snapshots
from bagpipe.core.shard_store import ShardStore
from bagpipe.embedding_server import metrics
from bagpipe.errors import FailedPrecondition, InvalidArgument, grpc_errors
from bagpipe.v1 import embedding_server_pb2 as pb
from bagpipe.v1 import embedding_server_pb2_grpc as pb_grpc
from bagpipe.wire import from_tensor, to_tensor

logger = logging.getLogger(__name__)


class EmbeddingServicer(pb_grpc.EmbeddingServerServicer):
    def __init__(self, store: ShardStore) -> None:
        self.store = store

    def _check_version(self, version: int) -> None:
        if version != self.store.shard_map.version:
            raise FailedPrecondition(
                f"shard_map_version: request has {version}, this server has {self.store.shard_map.version}"
            )

    @grpc_errors
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:  # noqa: N802
        with metrics.LATENCY.labels("lookup").time():
            self._check_version(request.shard_map_version)
            keys = from_tensor(request.keys, "keys", np.int64, ndim=1)
            rows, state = self.store.lookup(keys)
            metrics.ROWS.labels("lookup").inc(keys.size)
            metrics.REQUESTS.labels("lookup").inc()
            metrics.BYTES.labels("lookup").inc(rows.nbytes + state.nbytes)
            return pb.LookupResponse(rows=to_tensor(rows), state=to_tensor(state))

    @grpc_errors
    async def WriteBack(self, request: pb.WriteBackRequest, context: grpc.aio.ServicerContext) -> pb.WriteBackResponse:  # noqa: N802
        with metrics.LATENCY.labels("write_back").time():
            self._check_version(request.shard_map_version)
            keys = from_tensor(request.keys, "keys", np.int64, ndim=1)
            n = keys.size
            rows = from_tensor(request.rows, "rows", np.float32, shape=(n, self.store.dim))
            state = from_tensor(request.state, "state", np.float32, shape=(n, self.store.state_width))
            self.store.write(keys, rows, state)
            metrics.ROWS.labels("write_back").inc(n)
            metrics.REQUESTS.labels("write_back").inc()
            metrics.BYTES.labels("write_back").inc(rows.nbytes + state.nbytes)
            return pb.WriteBackResponse(rows=n)


    @grpc_errors
    async def Snapshot(self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext) -> pb.SnapshotResponse:  # noqa: N802
        self._check_version(request.shard_map_version)
        if not request.directory:
            raise InvalidArgument("directory", "empty")
        if request.next_batch < 1:
            raise InvalidArgument("next_batch", f"must be >= 1, got {request.next_batch}")
        t0 = time.perf_counter()
        # taken on the loop (atomic with respect to write-backs), written off it
        keys, rows, state = self.store.take_changes()
        try:
            name, size = await asyncio.to_thread(
                snapshots.write_rows, request.directory, request.next_batch, self.store.shard, keys, rows, state
            )
        except OSError as e:
            self.store.keep_changes(keys)  # the next snapshot must still hold them
            raise FailedPrecondition(f"directory: cannot write the snapshot: {e}") from e
        metrics.SNAPSHOT_SECONDS.observe(time.perf_counter() - t0)
        metrics.SNAPSHOT_ROWS.inc(keys.size)
        logger.info("snapshot for batch %d: %d changed rows, %d bytes", request.next_batch, keys.size, size)
        return pb.SnapshotResponse(file=name, rows=keys.size, bytes=size)


async def create_server(store: ShardStore, address: str = "127.0.0.1:0") -> tuple[grpc.aio.Server, int, serving.ControlServicer, object]:
    """Starts a server for ``store`` on ``address``; returns (server, port, control, health)."""
    servicer = EmbeddingServicer(store)

    def counters() -> dict[str, float]:
        return {"rows_held": float(store.rows_held), "shard": float(store.shard)}

    server, port, control, health = await serving.create_server(
        address, "EmbeddingServer", lambda s: pb_grpc.add_EmbeddingServerServicer_to_server(servicer, s), counters
    )
    metrics.ROWS_HELD.set(store.rows_held)
    return server, port, control, health
