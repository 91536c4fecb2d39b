"""The re-sharding coordinator: runs in embedding server 0 and keeps the shard map on the members.

The target set of servers is membership in Redis: every registered embedding server not marked leaving
(``Registry.set_leaving``; the drain step of a server going away). When it differs from the shards that
hold buckets, and every holder is registered, the coordinator computes the next version
(``ShardMap.rebalance``: only the buckets of added or removed servers move) and migrates to it while
training goes on:

1. ``PrepareMigration`` on every holder, old and new: each builds its arrays for the new version beside
   the serving ones and starts marking the rows written from then on.
2. ``Transfer`` on every holder: the rows that stay are copied locally, the leaving ones are sent to
   their new owners, in chunks (throttled by ``--migration-rows-per-second``).
3. Under the re-sharding lock in Redis (a checkpoint holds it while the servers write their snapshots,
   so a checkpoint never straddles a switch): the new map goes into Redis, and ``Seal`` on every
   holder switches it. A sealed server refuses the old version, sends the rows written since their copy
   as its last message to each new owner, and serves the new version once all its senders' last rows
   are in. Clients refused for their version re-read the map and retry.

Every try draws a new attempt id (``new_attempt``), which every message of it carries (Prepare,
Transfer, Seal, Abort, and the servers' Receives): a server refuses the messages of any attempt but the
one it prepared, so nothing of an aborted try, still in flight, lands in the next try at the same version.

A failure before step 3 aborts the migration (nothing changed; it is tried again later). A failure
during step 3 leaves the servers between versions: the coordinator records it and stops its server,
which starts again; the controller (``bagpipe.controller``) rolls the job back to its last checkpoint
(checkpoints do not depend on the number of servers), each server rebuilding its shard under the map in
force, and the coordinator tries again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from bagpipe import serving
from bagpipe.control.locks import RESHARD_LOCK
from bagpipe.control.registry import Registry
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server import metrics
from bagpipe.v1 import embedding_server_pb2 as pb
from bagpipe.v1 import embedding_server_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

POLL_S = 0.5
LOCK_TTL_S = 120.0


def new_attempt() -> int:
    """A migration attempt id: random 64 bits, never 0, so that no two tries (of one coordinator or of
    one started again) are taken for each other."""
    return secrets.randbits(64) or 1


class ReshardFailed(RuntimeError):
    """The servers were left between two versions: the job must roll back to its last checkpoint."""


def target_shards(shard_map: ShardMap, members: dict[int, str], leaving: set[int]) -> list[int] | None:
    """The shards that should hold buckets, or None while a holder is not registered (starting, or
    failed: recovery's business, not re-sharding's)."""
    if any(s not in members for s in shard_map.owners):
        return None
    target = sorted(s for s in members if s not in leaving)
    return target or None


class Resharder:
    """Watches membership and migrates to the next shard-map version when it changes."""

    def __init__(self, registry: Registry, rows_per_second: float = 0.0, poll: float = POLL_S) -> None:
        self.registry = registry
        self.rows_per_second = rows_per_second
        self.poll = poll
        self._owner = f"reshard-{uuid.uuid4().hex[:8]}"

    async def run(self, stop: asyncio.Event, on_fatal: Callable[[BaseException], Awaitable[None]]) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.poll)
                return
            except TimeoutError:
                pass
            try:
                await self.step()
            except ReshardFailed as e:
                logger.error("re-sharding failed between versions: %s", e)
                await on_fatal(e)
                return
            except Exception as e:
                lost = serving.redis_lost(e)
                if lost is not None:  # (the supervisor deals with Redis; one line, not a traceback a second)
                    logger.warning("re-sharding paused: %s", lost)
                else:
                    logger.exception("re-sharding attempt failed; nothing changed, trying again")

    async def step(self) -> dict[str, Any] | None:
        """One look at membership; migrates if the servers changed. Returns the record of a migration."""
        current, members = await asyncio.to_thread(self.registry.embedding_servers)
        if current is None:
            return None
        leaving = await asyncio.to_thread(self.registry.leaving)
        target = target_shards(current, members, leaving)
        if target is None:
            return None
        new = current.rebalance(target)
        if np.array_equal(new.bucket_to_shard, current.bucket_to_shard):
            return None
        return await self.migrate(current, new, members)

    async def migrate(self, current: ShardMap, new: ShardMap, members: dict[int, str]) -> dict[str, Any]:
        moves = current.moves(new)
        attempt = new_attempt()
        holders = sorted(set(current.owners) | set(new.owners))
        record: dict[str, Any] = {
            "from_version": current.version,
            "to_version": new.version,
            "from_shards": current.owners,
            "to_shards": new.owners,
            "buckets_moved": int(sum(b.size for _, _, b in moves)),
            "started_at": time.time(),
        }
        logger.info(
            "re-sharding %s -> %s: version %d (attempt %x), %d buckets move",
            current.owners,
            new.owners,
            new.version,
            attempt,
            record["buckets_moved"],
        )
        channels = {s: serving.aio_channel(members[s]) for s in holders}
        stubs = {s: pb_grpc.EmbeddingServerStub(ch) for s, ch in channels.items()}
        timeout = serving.RPC_TIMEOUT_S
        try:
            t0 = time.perf_counter()
            try:
                prepare = pb.PrepareMigrationRequest(
                    shard_map=new.to_json(),
                    current_shard_map=current.to_json(),
                    addresses={s: members[s] for s in new.owners},
                    rows_per_second=self.rows_per_second,
                    attempt=attempt,
                )
                prepared = await asyncio.gather(
                    *(stubs[s].PrepareMigration(prepare, timeout=timeout) for s in holders)
                )
                record["rows_moved"] = int(sum(p.leaving_rows for p in prepared))
                t1 = time.perf_counter()
                request = pb.TransferRequest(shard_map_version=new.version, attempt=attempt)
                # long: the bulk copy is throttled; each chunk has its own deadline inside
                sent = await asyncio.gather(*(stubs[s].Transfer(request, timeout=None) for s in holders))
                record["bytes_moved"] = int(sum(t.bytes_sent for t in sent))
                t2 = time.perf_counter()
            except BaseException:
                abort = pb.AbortMigrationRequest(shard_map_version=new.version, attempt=attempt)
                await asyncio.gather(
                    *(stubs[s].AbortMigration(abort, timeout=10) for s in holders), return_exceptions=True
                )
                raise
            while not await asyncio.to_thread(self.registry.try_lock, RESHARD_LOCK, self._owner, LOCK_TTL_S):
                await asyncio.sleep(0.01)  # a checkpoint is being written
            t3 = time.perf_counter()
            try:
                await asyncio.to_thread(self.registry.replace_shard_map, new)
                seal = pb.SealRequest(shard_map_version=new.version, attempt=attempt)
                sealed = await asyncio.gather(*(stubs[s].Seal(seal, timeout=timeout) for s in holders))
            except BaseException as e:
                record.update(state="failed", error=str(e), finished_at=time.time())
                await asyncio.to_thread(self.registry.add_reshard, record)
                raise ReshardFailed(f"version {new.version}: {e}") from e
            finally:
                await asyncio.to_thread(self.registry.unlock, RESHARD_LOCK, self._owner)
            t4 = time.perf_counter()
        finally:
            await asyncio.gather(*(ch.close() for ch in channels.values()))
        record.update(
            state="done",
            finished_at=time.time(),
            rows_resent=int(sum(s.rows_resent for s in sealed)),
            bytes_moved=record["bytes_moved"] + int(sum(s.bytes_resent for s in sealed)),
            seconds=t4 - t0,
            prepare_seconds=t1 - t0,
            copy_seconds=t2 - t1,
            lock_wait_seconds=t3 - t2,
            switch_seconds=t4 - t3,
        )
        for phase, seconds in (
            ("prepare", t1 - t0),
            ("copy", t2 - t1),
            ("lock_wait", t3 - t2),
            ("switch", t4 - t3),
        ):
            metrics.RESHARD_SECONDS.labels(phase).observe(seconds)
        metrics.RESHARDS.inc()
        metrics.BUCKETS_MOVED.inc(record["buckets_moved"])
        await asyncio.to_thread(self.registry.add_reshard, record)
        logger.info(
            "re-sharded to version %d: %d rows (%d bytes) in %.2f s, switch %.1f ms",
            new.version,
            record["rows_moved"],
            record["bytes_moved"],
            record["seconds"],
            1000 * record["switch_seconds"],
        )
        return record


def drain(registry: Registry, shard: int, timeout: float = 600.0, poll: float = 0.2) -> dict[str, Any] | None:
    """Marks ``shard`` leaving and waits until the servers serve a shard map without it (the coordinator
    moves its buckets away); returns the record of that migration (None if it held nothing). The drain
    step of a server that goes away: ``bagpipe scale`` and the chart's preStop hook call it."""
    registry.set_leaving(shard)
    deadline = time.monotonic() + timeout
    while True:
        leaving = registry.leaving()
        if not any(s not in leaving for s in registry.members("embedding_server") if int(s) != shard):
            # no server would be left to take the rows (the last one, or the whole tier going away)
            logger.warning("shard %d: no other embedding server stays, nothing to move its rows to", shard)
            return None
        shard_map = registry.shard_map()
        if shard_map is None or shard not in shard_map.owners:
            done = [
                r
                for r in registry.reshards()
                if shard_map is not None and r["to_version"] == shard_map.version
            ]
            if shard_map is None or shard_map.version == 1 or (done and done[-1]["state"] == "done"):
                return done[-1] if done else None
            if done and done[-1]["state"] == "failed":
                raise ReshardFailed(f"draining shard {shard}: {done[-1].get('error')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"shard {shard} still holds buckets after {timeout:g} s of draining")
        time.sleep(poll)
