"""(An embedding server with a row tier.) The oracle's fetch stream feeds the tier's schedule: each planned
batch's fetched keys of this shard as soon as the batch is planned (the tier then reads those rows from disk
ahead of the fetch, and evicts by next use), and the trainers' progress (the batches whose fetches are done).

The stream is opened again, where the schedule stands, whenever it ends: the oracle rewinds with each
generation, and a roll-back or a migration gives the shard a new schedule."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from bagpipe import allocator, serving
from bagpipe.control.registry import Registry
from bagpipe.embedding_server.row_tier import RowTier
from bagpipe.embedding_server.server import EmbeddingServicer
from bagpipe.v1 import oracle_cacher_pb2 as pb
from bagpipe.v1 import oracle_cacher_pb2_grpc as pb_grpc
from bagpipe.wire import from_tensor

logger = logging.getLogger(__name__)

RETRY_S = 0.5
TRIM_EVERY_S = 10.0
READ_CHUNK_ROWS = 4096  # rows a read-ahead takes in at once (the schedule is looked at again between)
# the rows read ahead and not yet fetched, at most, as a share of the budget: reading further ahead filled
# the budget with rows for distant batches, which the coming batches' write-backs then pushed out unused
# (over 800 iterations at a tenth of the shard, half of all rows read ahead were)
READ_AHEAD_SHARE = 0.25
AGAIN_BATCHES = 2  # the nearest batches read ahead already, looked at again each time a batch passes


async def follow_fetches(
    servicer: EmbeddingServicer, registry: Registry, stop: asyncio.Event, oracles: int = 1
) -> None:
    """Feeds the tier of ``servicer``'s shard from the fetch streams of the job's ``oracles`` oracle shards
    until ``stop``; meanwhile hands the heap's free pages back to
    the kernel every ``TRIM_EVERY_S``: the allocator keeps requests' freed buffers for reuse, and at 50 k rows
    a request (the medium profile) those held 800 MB beyond the budget."""
    trimming = asyncio.create_task(_trim_now_and_then(stop), name="trim")
    try:
        await _follow(servicer, registry, stop, oracles)
    finally:
        trimming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await trimming


async def _trim_now_and_then(stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), TRIM_EVERY_S)
        await asyncio.to_thread(allocator.release_free_memory)


async def _follow(servicer: EmbeddingServicer, registry: Registry, stop: asyncio.Event, oracles: int) -> None:
    while not stop.is_set():
        try:
            await _follow_once(servicer, registry, stop, oracles)
        except (grpc.RpcError, OSError, ValueError) as e:  # (the oracle rewinding, restarting, or gone)
            logger.debug("fetch stream: %s", e)
        except Exception as e:  # (Redis away: the next try may find it)
            logger.warning("fetch stream: %s", e)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RETRY_S)


async def _follow_once(
    servicer: EmbeddingServicer, registry: Registry, stop: asyncio.Event, oracles: int
) -> None:
    store = servicer.store
    tier = store.tier
    if tier is None or tier.policy == "lru":  # (lru reads on demand only: no plan is looked at)
        return
    schedule = tier.schedule
    members = await asyncio.to_thread(registry.members, "oracle_cacher")
    addresses = [members.get(str(shard)) for shard in range(oracles)]
    if None in addresses:
        return
    fetched = [-1]  # the last batch every trainer has fetched
    changed = asyncio.Event()
    # (the disk reads in a task of their own: the stream is read, and the schedule kept current, meanwhile)
    reader = asyncio.create_task(_read_ahead(servicer, tier, fetched, changed), name="read-ahead")
    try:
        async for message in fetch_stream(addresses, schedule.horizon + 1):  # type: ignore[arg-type]
            if stop.is_set() or servicer.store is not store or tier.schedule is not schedule:
                return  # (a roll-back or a migration: the new schedule starts its own stream)
            done = max(message.trained, message.fetched)
            if done >= 0:  # (the batches whose rows the trainers have)
                schedule.passed(done)
                fetched[0] = max(fetched[0], message.fetched)
            if (
                message.keys is not None
                and message.batch > schedule.horizon
                and message.batch >= schedule.now
            ):
                keys = message.keys  # (not yet fetched)
                schedule.add(message.batch, store.local_index(keys[store.holds(keys)]))
            changed.set()
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


@dataclass(frozen=True)
class Fetched:
    """A message of the oracle shards' fetch streams taken together: a batch's fetched keys of every shard
    (None: only progress), and the least progress any shard has told (-1: none yet)."""

    batch: int
    keys: np.ndarray | None
    last: bool
    trained: int
    fetched: int


async def fetch_stream(addresses: list[str], start: int) -> AsyncIterator[Fetched]:
    """The fetch streams (StreamFetches from ``start``) of the K oracle shards at ``addresses``, as one: a
    batch once every shard has sent its keys of it (concatenated), and with each message the progress as the
    least any shard has told. A batch that a shard passed over (its trainers have trained it) is dropped.
    Ends when every stream has ended."""
    shards = len(addresses)
    queue: asyncio.Queue[tuple[int, pb.Fetches | BaseException | None]] = asyncio.Queue()

    async def pump(shard: int, stream: Any) -> None:
        try:
            async for message in stream:
                await queue.put((shard, message))
            await queue.put((shard, None))
        except Exception as e:  # (handed to the reader, which raises it)
            await queue.put((shard, e))

    async with contextlib.AsyncExitStack() as stack:
        channels = [await stack.enter_async_context(serving.aio_channel(a)) for a in addresses]
        streams = [
            pb_grpc.OracleCacherStub(ch).StreamFetches(pb.StreamFetchesRequest(start=start))
            for ch in channels
        ]
        pumps = [
            asyncio.create_task(pump(i, stream), name=f"fetches-{i}") for i, stream in enumerate(streams)
        ]
        try:
            progress = [(-1, -1)] * shards  # (trained, fetched) each shard told last
            newest = [-1] * shards  # the last batch each shard sent
            parts: dict[int, list[np.ndarray | None]] = {}
            lasts: dict[int, bool] = {}
            ended = 0
            while ended < shards:
                shard, message = await queue.get()
                if message is None:
                    ended += 1
                    continue
                if isinstance(message, BaseException):
                    raise message
                progress[shard] = (message.trained, message.fetched)
                if message.batch >= 0:
                    newest[shard] = message.batch
                    keys = from_tensor(message.keys, "keys", np.int64, ndim=1)
                    parts.setdefault(message.batch, [None] * shards)[shard] = keys
                    lasts[message.batch] = lasts.get(message.batch, False) or message.last
                trained = min(p[0] for p in progress)
                fetched = min(p[1] for p in progress)
                sent = False
                for batch in sorted(parts):
                    got = parts[batch]
                    if all(k is not None for k in got):
                        del parts[batch]
                        merged = got[0] if shards == 1 else np.concatenate(got)  # type: ignore[arg-type]
                        yield Fetched(batch, merged, lasts.pop(batch), trained, fetched)
                        sent = True
                    elif any(k is None and newest[i] > batch for i, k in enumerate(got)):
                        del parts[batch]  # (a shard passed it over: trained already)
                        lasts.pop(batch, None)
                    else:
                        break
                if not sent:
                    yield Fetched(-1, None, False, trained, fetched)
        finally:
            for task in pumps:
                task.cancel()
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)


async def _read_ahead(
    servicer: EmbeddingServicer, tier: RowTier, fetched: list[int], changed: asyncio.Event
) -> None:
    """Each time the schedule moves: lookahead reads the planned batches ahead, nearest first, a chunk at a
    time, until a batch does not fit (the budget holds rows used sooner: it is tried again as batches
    pass); next-batch reads the one batch after the last fetched."""
    read = -1  # (next-batch: the last fetched batch whose next one was read)
    # (lookahead: the first batch not yet read ahead; the batches before it are looked at again only for
    # the next few, whose rows a write-back may have pushed out since)
    frontier, followed, looked_again = -1, None, -1
    while True:
        await changed.wait()
        changed.clear()
        schedule = tier.schedule
        if schedule is not followed:  # (a new plan: a roll-back)
            followed, frontier, looked_again = schedule, -1, -1
        if tier.policy == "next-batch":
            if fetched[0] > read:
                read = fetched[0]
                await servicer.read_ahead(schedule.rows_of(read + 1))
            continue
        # (the nearest ones again once a batch has passed: not at every message)
        again = range(
            schedule.now, min(schedule.now + AGAIN_BATCHES, frontier) if schedule.now > looked_again else 0
        )
        looked_again = schedule.now
        for batch in [*again, *range(max(schedule.now, frontier), schedule.horizon + 1)]:
            if tier.unused_rows >= tier.capacity * READ_AHEAD_SHARE:
                break  # (far enough ahead: rows read for later batches would be pushed out before use)
            missing = tier.ahead(schedule.rows_of(batch))
            for start in range(0, missing.size, READ_CHUNK_ROWS):
                part = missing[start : start + READ_CHUNK_ROWS]
                if await servicer.read_ahead(part) < part.size:
                    break
            else:
                frontier = max(frontier, batch + 1)
                continue
            break
