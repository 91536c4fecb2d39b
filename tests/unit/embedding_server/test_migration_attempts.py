"""Migrations reject the past: every migration message names its attempt, and two real servers refuse any
message of an attempt other than the one they prepared (a stale Receive changes no row), a stale Abort
leaves the attempt under way alone, and the coordinator draws a new attempt for every try."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from bagpipe.core.data import table_offsets
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server import resharder as resharder_module
from bagpipe.embedding_server.resharder import Resharder
from bagpipe.embedding_server.server import EmbeddingServicer, create_server
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.errors import FailedPrecondition
from bagpipe.health_service import MAX_WATCHERS
from bagpipe.v1 import embedding_server_pb2 as pb
from bagpipe.v1 import embedding_server_pb2_grpc as pb_grpc
from bagpipe.wire import to_tensor
from grpc_health.v1 import health_pb2, health_pb2_grpc

DIM = STATE = 2
OLD, NEW = 0x0AB0_0000_0000_0001, 0x0CD0_0000_0000_0002  # the aborted attempt, and its retry


def _maps() -> tuple[ShardMap, ShardMap, np.ndarray]:
    offsets = table_offsets([300, 100])
    current = ShardMap.create(int(offsets[-1]), num_shards=1, num_buckets=8)
    return current, current.rebalance([0, 1]), offsets


@dataclass
class Pair:
    """Shard 0, which holds every row, and shard 1, which joins: version 2 moves half the buckets to it."""

    current: ShardMap
    new: ShardMap
    stores: dict[int, ShardStore]
    servicers: dict[int, EmbeddingServicer]
    stubs: dict[int, pb_grpc.EmbeddingServerStub]
    addresses: dict[int, str]

    def prepare(self, attempt: int) -> pb.PrepareMigrationRequest:
        return pb.PrepareMigrationRequest(
            shard_map=self.new.to_json(),
            current_shard_map=self.current.to_json(),
            addresses=self.addresses,
            attempt=attempt,
        )

    async def each(self, call: Callable[[pb_grpc.EmbeddingServerStub], Any]) -> list[Any]:
        return list(await asyncio.gather(*(call(stub) for stub in self.stubs.values())))

    def moving_keys(self) -> np.ndarray:
        keys = np.arange(self.current.num_keys, dtype=np.int64)
        return keys[self.new.shard_of(keys) == 1]


@asynccontextmanager
async def _pair(before_start: Callable[[dict[int, EmbeddingServicer]], None] = dict) -> AsyncIterator[Pair]:
    """The two servers on port 0; ``before_start`` may replace the servicers' handlers first."""
    current, new, offsets = _maps()
    stores = {s: ShardStore(current, s, offsets, dim=DIM, state_width=STATE, seed=3) for s in (0, 1)}
    keys = np.arange(current.num_keys, dtype=np.int64)
    rows = (keys[:, None] + np.arange(DIM) / 10).astype(np.float32)  # every row its own values
    stores[0].write(keys, rows, np.abs(rows))
    servicers = {s: EmbeddingServicer(st) for s, st in stores.items()}
    before_start(servicers)
    servers, addresses = [], {}
    for s, servicer in servicers.items():
        server, port, _, _ = await create_server(stores[s], servicer=servicer)
        servers.append(server)
        addresses[s] = f"127.0.0.1:{port}"
    channels = {s: grpc.aio.insecure_channel(a) for s, a in addresses.items()}
    stubs = {s: pb_grpc.EmbeddingServerStub(ch) for s, ch in channels.items()}
    try:
        yield Pair(current, new, stores, servicers, stubs, addresses)
    finally:
        for ch in channels.values():
            await ch.close()
        for server in servers:
            await server.stop(None)


async def _refused(call: Any, *words: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    for w in words:
        assert w in (e.value.details() or ""), e.value.details()
    return e.value.details() or ""


async def _migrates_exactly(pair: Pair, attempt: int) -> None:
    """Transfer and Seal of ``attempt`` on both; then shard 1 serves the moved rows as shard 0 held them."""
    moving = pair.moving_keys()
    expected = pair.stores[0].lookup(moving)
    version = pair.new.version
    await pair.each(lambda s: s.Transfer(pb.TransferRequest(shard_map_version=version, attempt=attempt)))
    await pair.each(lambda s: s.Seal(pb.SealRequest(shard_map_version=version, attempt=attempt)))
    for st in pair.stores.values():
        assert st.migration is None and st.shard_map.version == version
    rows, state = pair.servicers[1].store.lookup(moving)
    assert np.array_equal(rows, expected[0]) and np.array_equal(state, expected[1])


def test_a_stale_receive_replayed_after_abort_and_a_new_prepare_is_refused_and_changes_no_row() -> None:
    async def scenario() -> None:
        async with _pair() as pair:
            version = pair.new.version
            await pair.each(lambda s: s.PrepareMigration(pair.prepare(OLD)))
            moving = pair.moving_keys()
            junk = np.full((moving.size, DIM), 99.0, np.float32)
            # a chunk of the first attempt, still in flight, and the first attempt's last message
            chunk = pb.ReceiveRequest(
                shard_map_version=version,
                attempt=OLD,
                from_shard=0,
                keys=to_tensor(moving),
                rows=to_tensor(junk),
                state=to_tensor(junk),
            )
            last = pb.ReceiveRequest()
            last.CopyFrom(chunk)
            last.last = True
            last.changed_keys.CopyFrom(to_tensor(moving))
            abort = pb.AbortMigrationRequest(shard_map_version=version, attempt=OLD)
            await pair.each(lambda s: s.AbortMigration(abort))
            # aborted and nothing prepared: refused too
            await _refused(pair.stubs[1].Receive(chunk), f"{OLD:x}", f"version {version}")
            await pair.each(lambda s: s.PrepareMigration(pair.prepare(NEW)))

            m = pair.stores[1].migration
            assert m is not None and m.attempt == NEW
            before = (m.weights.copy(), m.state.copy(), m.changed.copy(), set(m.finals))
            for stale in (chunk, last):
                said = await _refused(
                    pair.stubs[1].Receive(stale), f"{OLD:x}", f"{NEW:x}", f"version {version}"
                )
                assert said.startswith("attempt:")
            assert pair.stores[1].migration is m
            assert np.array_equal(m.weights, before[0]) and np.array_equal(m.state, before[1])
            assert np.array_equal(m.changed, before[2]) and m.finals == before[3]

            await _migrates_exactly(pair, NEW)
            assert not (pair.stores[1].lookup(moving)[0] == 99.0).any()

    asyncio.run(scenario())


def test_stale_transfer_seal_and_abort_are_refused_and_the_current_attempt_goes_on() -> None:
    async def scenario() -> None:
        async with _pair() as pair:
            version = pair.new.version
            await pair.each(lambda s: s.PrepareMigration(pair.prepare(OLD)))
            await pair.each(
                lambda s: s.AbortMigration(pb.AbortMigrationRequest(shard_map_version=version, attempt=OLD))
            )
            await pair.each(lambda s: s.PrepareMigration(pair.prepare(NEW)))
            current = {s: st.migration for s, st in pair.stores.items()}
            words = (f"{OLD:x}", f"{NEW:x}", f"version {version}")
            for stub in pair.stubs.values():
                await _refused(
                    stub.Transfer(pb.TransferRequest(shard_map_version=version, attempt=OLD)), *words
                )
                await _refused(stub.Seal(pb.SealRequest(shard_map_version=version, attempt=OLD)), *words)
                abort = pb.AbortMigrationRequest(shard_map_version=version, attempt=OLD)
                await _refused(stub.AbortMigration(abort), *words, "goes on")
                # a Prepare of an attempt seen before is from the past too: it aborts nothing either
                await _refused(stub.PrepareMigration(pair.prepare(OLD)), f"{OLD:x}", "before")
            for s, st in pair.stores.items():
                m = st.migration
                assert m is current[s] and m is not None and m.attempt == NEW and not m.sealed
                assert not m.dirty.any() and not m.weights.any()  # (no stale Transfer copied a row)
            # the version is still checked as well
            await _refused(
                pair.stubs[0].Seal(pb.SealRequest(shard_map_version=version + 1, attempt=NEW)),
                f"version {version + 1}",
            )
            await _migrates_exactly(pair, NEW)

    asyncio.run(scenario())


def test_prepare_needs_an_attempt_id() -> None:
    async def scenario() -> None:
        async with _pair() as pair:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pair.stubs[0].PrepareMigration(pair.prepare(0))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (e.value.details() or "").startswith("attempt:")
            assert pair.stores[0].migration is None

    asyncio.run(scenario())


class _Registry:
    """What the coordinator asks of Redis, in memory."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.shard_map: ShardMap | None = None

    def try_lock(self, name: str, owner: str, ttl: float) -> bool:
        return True

    def unlock(self, name: str, owner: str) -> None:
        pass

    def replace_shard_map(self, shard_map: ShardMap) -> None:
        self.shard_map = shard_map

    def add_reshard(self, record: dict[str, Any]) -> None:
        self.records.append(record)


def test_the_coordinator_retries_a_failed_migration_under_a_new_attempt(monkeypatch: Any) -> None:
    drawn: list[int] = []
    draw = resharder_module.new_attempt
    monkeypatch.setattr(resharder_module, "new_attempt", lambda: drawn.append(draw()) or drawn[-1])
    failures = [FailedPrecondition("injected: shard 1 fails its first Transfer")]

    def flaky(servicers: dict[int, EmbeddingServicer]) -> None:
        transfer = servicers[1].Transfer

        async def once(request: pb.TransferRequest, context: Any) -> pb.TransferResponse:
            if failures:
                raise failures.pop()
            return await transfer(request, context)

        monkeypatch.setattr(servicers[1], "Transfer", once)

    async def scenario() -> None:
        async with _pair(flaky) as pair:
            registry = _Registry()
            coordinator = Resharder(registry)  # type: ignore[arg-type]
            expected = pair.stores[0].lookup(pair.moving_keys())
            with pytest.raises(grpc.aio.AioRpcError):
                await coordinator.migrate(pair.current, pair.new, pair.addresses)
            assert all(st.migration is None for st in pair.stores.values())  # aborted everywhere
            record = await coordinator.migrate(pair.current, pair.new, pair.addresses)
            assert record["state"] == "done" and registry.shard_map == pair.new
            assert len(drawn) == 2 and drawn[0] != drawn[1] and 0 not in drawn
            assert all(s._attempts == set(drawn) for s in pair.servicers.values())
            rows, state = pair.servicers[1].store.lookup(pair.moving_keys())
            assert np.array_equal(rows, expected[0]) and np.array_equal(state, expected[1])

    asyncio.run(scenario())


def test_a_migration_completes_with_every_health_watch_a_server_takes_open() -> None:
    """Health is answered on the event loop: watchers hold none of the threads a migration's steps use."""

    async def scenario() -> None:
        async with _pair() as pair:
            channels = [grpc.aio.insecure_channel(a) for a in pair.addresses.values()]
            watches = [
                health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
                for ch in channels
                for _ in range(MAX_WATCHERS)
            ]
            for watch in watches:
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            await pair.each(lambda s: s.PrepareMigration(pair.prepare(NEW), timeout=30))
            await asyncio.wait_for(_migrates_exactly(pair, NEW), 60)
            assert not any(w.done() for w in watches)
            for ch in channels:
                await ch.close()

    asyncio.run(scenario())


def test_a_prepare_arriving_after_its_own_abort_is_refused() -> None:
    """An aborted try is over for good: its Prepare, overtaken by its Abort, prepares nothing."""

    async def scenario() -> None:
        async with _pair() as pair:
            version = pair.new.version
            abort = pb.AbortMigrationRequest(shard_map_version=version, attempt=OLD)
            await pair.each(lambda s: s.AbortMigration(abort))
            for stub in pair.stubs.values():
                await _refused(stub.PrepareMigration(pair.prepare(OLD)), f"{OLD:x}", "aborted")
            assert all(st.migration is None for st in pair.stores.values())
            await pair.each(lambda s: s.PrepareMigration(pair.prepare(NEW), timeout=30))
            await _migrates_exactly(pair, NEW)

    asyncio.run(scenario())
