"""(An embedding server with a row tier.) The oracle's fetch stream feeds the tier's schedule: each planned
batch's fetched keys of this shard as soon as the batch is planned (the tier then reads those rows from disk
ahead of the fetch, and evicts by next use), and the trainers' progress (the batches whose fetches are done).

The stream is opened again, where the schedule stands, whenever it ends: the oracle rewinds with each
generation, and a roll-back or a migration gives the shard a new schedule."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import numpy as np

from bagpipe import serving
from bagpipe.control.registry import Registry
from bagpipe.embedding_server.server import EmbeddingServicer
from bagpipe.v1 import oracle_cacher_pb2 as pb
from bagpipe.v1 import oracle_cacher_pb2_grpc as pb_grpc
from bagpipe.wire import from_tensor

logger = logging.getLogger(__name__)

RETRY_S = 0.5


async def follow_fetches(servicer: EmbeddingServicer, registry: Registry, stop: asyncio.Event) -> None:
    """Feeds the tier of ``servicer``'s shard until ``stop``."""
    while not stop.is_set():
        try:
            await _follow_once(servicer, registry, stop)
        except (grpc.RpcError, OSError, ValueError) as e:  # (the oracle rewinding, restarting, or gone)
            logger.debug("fetch stream: %s", e)
        except Exception as e:  # (Redis away: the next try may find it)
            logger.warning("fetch stream: %s", e)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RETRY_S)


async def _follow_once(servicer: EmbeddingServicer, registry: Registry, stop: asyncio.Event) -> None:
    store = servicer.store
    tier = store.tier
    if tier is None:
        return
    if tier.policy == "lru":  # (reads on demand only: no plan is looked at)
        return
    schedule = tier.schedule
    read = -1  # (next-batch: the last dispatched batch whose next one was read ahead)
    address = (await asyncio.to_thread(registry.members, "oracle_cacher")).get("0")
    if address is None:
        return
    async with serving.aio_channel(address) as channel:
        stream = pb_grpc.OracleCacherStub(channel).StreamFetches(
            pb.StreamFetchesRequest(start=schedule.horizon + 1)
        )
        async for message in stream:
            if stop.is_set() or servicer.store is not store or tier.schedule is not schedule:
                stream.cancel()  # (a roll-back or a migration: the new schedule starts its own stream)
                return
            if message.trained >= 0:
                schedule.passed(message.trained)
            if message.batch >= 0 and message.batch > schedule.horizon:
                keys = from_tensor(message.keys, "keys", np.int64, ndim=1)
                local = store.local_index(keys[store.holds(keys)])
                schedule.add(message.batch, local)
                if tier.policy == "lookahead":  # (as soon as it is planned)
                    await servicer.read_ahead(local)
            if tier.policy == "next-batch" and message.dispatched > read:
                read = message.dispatched  # (the rows of the one batch the trainers fetch next)
                await servicer.read_ahead(schedule.rows_of(read + 1))
