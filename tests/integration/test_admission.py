"""Strangers cannot exhaust a service: a call without the job's secret is refused before its body is read,
each method refuses a request over its cap before decoding it, open health streams stall nothing and are
bounded, and so are connections, idle ones closed.

Real gRPC servers on loopback. The memory test runs its server in a process of its own, so that the
resident memory it reads is the server's alone.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import numpy as np
import pytest
from bagpipe import security, serving
from bagpipe.core.data import table_offsets
from bagpipe.core.shard_map import ShardMap
from bagpipe.core.snapshots import path_of
from bagpipe.data_processor.config import DataProcessorConfig, SourceConfig
from bagpipe.data_processor.server import create_server as create_data_processor
from bagpipe.embedding_server.caps import request_caps
from bagpipe.embedding_server.client import MAX_ROWS_PER_RPC
from bagpipe.embedding_server.server import create_server as create_embedding_server
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.health_service import MAX_WATCHERS, HealthService
from bagpipe.v1 import data_processor_pb2, data_processor_pb2_grpc
from bagpipe.v1 import embedding_server_pb2 as epb
from bagpipe.v1 import embedding_server_pb2_grpc as epb_grpc
from bagpipe.wire import to_tensor
from grpc_health.v1 import health_pb2, health_pb2_grpc

SECRET = "admission-secret-0123456789"
DIM = 4
MB = 1 << 20

SERVER = textwrap.dedent(
    """
    import asyncio, sys
    from bagpipe.core.data import table_offsets
    from bagpipe.core.shard_map import ShardMap
    from bagpipe.embedding_server.shard_store import ShardStore
    from bagpipe.embedding_server.server import create_server

    async def main():
        store = ShardStore(ShardMap.create(80, 1, num_buckets=8), 0, table_offsets([50, 30]), 4, 4, seed=1)
        server, port, _, _ = await create_server(store)
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())
    """
)


def _store() -> ShardStore:
    return ShardStore(ShardMap.create(80, 1, num_buckets=8), 0, table_offsets([50, 30]), DIM, DIM, seed=1)


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


async def _oversize_strangers(
    address: str, calls: int, size: int, method: str = "/bagpipe.v1.EmbeddingServer/WriteBack"
) -> list[grpc.StatusCode]:
    payload = bytes(size)  # (never parsed: the server must not read it)
    options = [("grpc.max_send_message_length", size + MB)]
    async with grpc.aio.insecure_channel(address, options=options) as ch:
        write_back = ch.unary_unary(method)

        async def one() -> grpc.StatusCode:
            try:
                await write_back(payload, timeout=60)
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        return await asyncio.gather(*(one() for _ in range(calls)))


def test_unauthenticated_oversize_calls_are_refused_unread(tmp_path: Path) -> None:
    """16 concurrent 256 MB calls without the secret raise the server's peak memory by under 64 MB."""
    env = {**os.environ, security.JOB_SECRET_ENV: SECRET}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], env=env, stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        asyncio.run(_oversize_strangers(f"127.0.0.1:{port}", 1, 1024))  # (the server's first call: warm)
        before = _peak_rss(proc.pid)
        codes = asyncio.run(_oversize_strangers(f"127.0.0.1:{port}", 16, 256 * MB))
        grown = _peak_rss(proc.pid) - before
        # the health service is open (kubelet probes send no metadata): a stranger's check is answered the
        # server's status, its request unread too
        health = asyncio.run(
            _oversize_strangers(f"127.0.0.1:{port}", 16, 256 * MB, "/grpc.health.v1.Health/Check")
        )
        grown_by_health = _peak_rss(proc.pid) - before - grown
        assert proc.poll() is None, "the server died"
    finally:
        proc.kill()
        proc.wait()
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    assert grown < 64 * MB, f"the server's peak resident memory grew by {grown / MB:.0f} MB"
    assert set(health) == {grpc.StatusCode.OK}, health
    assert grown_by_health < 64 * MB, f"health checks grew it by {grown_by_health / MB:.0f} MB"


async def _caps() -> None:
    store = _store()
    before = store.weights.copy()
    server, port, _, _ = await create_embedding_server(store)
    try:
        caps = request_caps(store)
        async with serving.aio_channel(f"127.0.0.1:{port}") as ch:
            stub = epb_grpc.EmbeddingServerStub(ch)
            # a lookup of as many keys as a client sends in one request is answered; one more is refused
            keys = np.arange(MAX_ROWS_PER_RPC + 1024, dtype=np.int64) % 80
            most = epb.LookupRequest(shard_map_version=1, keys=to_tensor(keys[:MAX_ROWS_PER_RPC]))
            assert (await stub.Lookup(most, timeout=30)).packed.shape[0] == MAX_ROWS_PER_RPC
            over = epb.LookupRequest(shard_map_version=1, keys=to_tensor(keys[: MAX_ROWS_PER_RPC + 1]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(over, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"a client sends at most {MAX_ROWS_PER_RPC}" in (err.value.details() or "")
            # a lookup of more keys than a request may carry, by more than its cap's envelope, is refused from
            # its size, undecoded
            big = epb.LookupRequest(shard_map_version=1, keys=to_tensor(keys))
            assert big.ByteSize() > caps["Lookup"]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(big, timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"Lookup: a request of {big.ByteSize()} bytes" in err.value.details()
            assert f"at most {caps['Lookup']}" in err.value.details()
            # a control message carries a path, not megabytes
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Snapshot(epb.SnapshotRequest(directory="d" * (100 << 10), next_batch=1), timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            largest = max(security.SMALL_REQUEST_BYTES, *caps.values())
            # over the largest cap, gRPC itself refuses the message from its length prefix
            huge = epb.WriteBackRequest(
                shard_map_version=1, keys=to_tensor(np.zeros(largest // 8 + 1, dtype=np.int64))
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.WriteBack(huge, timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # within its cap, a write-back lands
            small = epb.WriteBackRequest(
                shard_map_version=1,
                keys=to_tensor(keys[:16]),
                rows=to_tensor(np.full((16, DIM), 0.5, dtype=np.float32)),
                state=to_tensor(np.zeros((16, DIM), dtype=np.float32)),
            )
            assert (await stub.WriteBack(small, timeout=5)).rows == 16
        assert not np.array_equal(store.weights, before)
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await server.stop(None)


def test_each_method_refuses_a_request_over_its_cap_before_decoding(monkeypatch) -> None:
    monkeypatch.setenv(security.JOB_SECRET_ENV, SECRET)
    asyncio.run(_caps())


async def _watch(address: str, streams: int) -> tuple[list[grpc.aio.Call], grpc.aio.Channel]:
    """``streams`` open Health.Watch streams (no secret), each past its first answer."""
    ch = grpc.aio.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(ch)
    calls = [stub.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(streams)]
    for call in calls:
        assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
    return calls, ch


async def _health_streams_stall_nothing(tmp_path: Path) -> None:
    rows = tuple([20] * 26)
    dp, dp_port, _, _ = await create_data_processor(
        DataProcessorConfig(SourceConfig("synthetic", rows), 12, 0)
    )
    store = _store()
    es, es_port, _, _ = await create_embedding_server(store)
    try:
        watchers = [await _watch(f"127.0.0.1:{p}", MAX_WATCHERS) for p in (dp_port, es_port)]
        async with serving.aio_channel(f"127.0.0.1:{dp_port}") as ch:
            stub = data_processor_pb2_grpc.DataProcessorStub(ch)
            request = data_processor_pb2.StreamBatchesRequest(start=0, stride=1, end=8)
            # every batch is generated off the event loop: with the health streams on its threads, none was
            parts = [p async for p in stub.StreamBatches(request, timeout=30)]
            assert [p.batch.number for p in parts] == list(range(8))
        async with serving.aio_channel(f"127.0.0.1:{es_port}") as ch:
            stub = epb_grpc.EmbeddingServerStub(ch)
            keys = to_tensor(np.arange(8, dtype=np.int64))
            rows = to_tensor(np.full((8, DIM), 0.25, dtype=np.float32))
            await stub.WriteBack(epb.WriteBackRequest(shard_map_version=1, keys=keys, rows=rows, state=rows))
            # a snapshot's file is written off the event loop too
            reply = await stub.Snapshot(
                epb.SnapshotRequest(shard_map_version=1, directory=str(tmp_path), next_batch=1, full=True),
                timeout=30,
            )
            assert reply.rows >= 8 and (path_of(tmp_path, 1) / reply.file).exists()
        for calls, ch in watchers:
            assert all(not c.done() for c in calls)  # the streams were open all along
            await ch.close()
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await dp.stop(None)
        await es.stop(None)


def test_open_health_streams_do_not_stall_batches_or_snapshots(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(security.JOB_SECRET_ENV, SECRET)
    asyncio.run(_health_streams_stall_nothing(tmp_path))


async def _health_answers() -> None:
    health = HealthService(max_watchers=2)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        health.set("", health_pb2.HealthCheckResponse.SERVING)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            serving_now = await stub.Check(health_pb2.HealthCheckRequest())
            assert serving_now.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            first = stub.Watch(health_pb2.HealthCheckRequest())
            unknown = stub.Watch(health_pb2.HealthCheckRequest(service="later"))
            assert (await first.read()).status == health_pb2.HealthCheckResponse.SERVING
            assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            third = stub.Watch(health_pb2.HealthCheckRequest())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await third.read()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            health.set("later", health_pb2.HealthCheckResponse.SERVING)
            assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVING
            listed = await stub.List(health_pb2.HealthListRequest())
            assert {k: v.status for k, v in listed.statuses.items()} == {"": 1, "later": 1}
            health.enter_graceful_shutdown()
            assert (await first.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await unknown.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await first.read() == grpc.aio.EOF  # (stopping: the watches end, the stop waits for none)
            health.set("", health_pb2.HealthCheckResponse.SERVING)  # (stopping: for good)
            assert (await stub.Check(health_pb2.HealthCheckRequest())).status == (
                health_pb2.HealthCheckResponse.NOT_SERVING
            )
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await server.stop(None)


def test_health_checks_and_watches_follow_the_status() -> None:
    asyncio.run(_health_answers())


async def _watches_over_the_cap() -> None:
    store = _store()
    server, port, _, _ = await create_embedding_server(store)
    try:
        address = f"127.0.0.1:{port}"
        # the strangers' watches come on two connections of their own, each request of nearly the stream's
        # window, which the server holds unread while the watch is open
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 2 * MB)]
        strangers = [grpc.aio.insecure_channel(address, options=options) for _ in range(2)]
        watch = [ch.unary_stream("/grpc.health.v1.Health/Watch") for ch in strangers]
        calls = [watch[i % 2](bytes(serving.STREAM_WINDOW_BYTES - 1024)) for i in range(MAX_WATCHERS + 8)]
        outcomes = []
        for call in calls:
            try:
                reply = health_pb2.HealthCheckResponse.FromString(await call.read())
                outcomes.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            except grpc.aio.AioRpcError as e:
                outcomes.append(e.code().name)
                assert f"this server takes at most {MAX_WATCHERS}" in (e.details() or "")
        assert outcomes.count("SERVING") == MAX_WATCHERS
        assert outcomes.count("RESOURCE_EXHAUSTED") == 8
        # a probe's check (no secret) and the job's own calls are answered meanwhile
        async with grpc.aio.insecure_channel(address) as ch:
            probe = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert probe.status == health_pb2.HealthCheckResponse.SERVING
        async with serving.aio_channel(address) as ch:
            check = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="bagpipe.v1.EmbeddingServer"), timeout=10
            )
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            keys = to_tensor(np.arange(8, dtype=np.int64))
            rows = to_tensor(np.full((8, DIM), 0.25, dtype=np.float32))
            written = await epb_grpc.EmbeddingServerStub(ch).WriteBack(
                epb.WriteBackRequest(shard_map_version=1, keys=keys, rows=rows, state=rows), timeout=10
            )
            assert written.rows == 8
        # a watch that ends gives its place back
        calls[0].cancel()
        again = watch[0](b"")
        assert health_pb2.HealthCheckResponse.FromString(await again.read()).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
        assert sum(not c.done() for c in calls) == MAX_WATCHERS - 1
        for ch in strangers:
            await ch.close()
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await server.stop(None)


def test_health_watches_past_the_cap_are_refused_while_checks_and_calls_answer(monkeypatch) -> None:
    monkeypatch.setenv(security.JOB_SECRET_ENV, SECRET)
    asyncio.run(_watches_over_the_cap())


async def _check(address: str, wait_for_ready: bool = False) -> str:
    """A health check on a connection of its own: SERVING, or the code it failed with. ``wait_for_ready``:
    the check waits, connecting again and again, until the server admits the connection."""
    ch = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=wait_for_ready
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.aio.AioRpcError as e:
        return e.code().name
    finally:
        await ch.close()


async def _connections_bounded() -> None:
    server, port, _, _ = await create_embedding_server(_store())
    try:
        address = f"127.0.0.1:{port}"
        held = [
            grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(3)
        ]
        for ch in held:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        # the server's three places are taken: a fourth connection is closed as it comes
        assert await _check(address) == "UNAVAILABLE"
        # those who hold a place are still answered
        reply = await health_pb2_grpc.HealthStub(held[0]).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for ch in held:
            await ch.close()
        assert await _check(address, wait_for_ready=True) == "SERVING"
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await server.stop(None)


def test_connections_past_the_servers_bound_are_refused(monkeypatch) -> None:
    monkeypatch.setattr(serving, "MAX_CONNECTIONS", 3)
    asyncio.run(_connections_bounded())


async def _idle_closed() -> None:
    server, port, _, _ = await create_embedding_server(_store())
    try:
        address = f"127.0.0.1:{port}"
        ch = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert ch.get_state() == grpc.ChannelConnectivity.READY
        # no call for the idle time: the server closes the connection, and its one place is free again (once
        # the server has torn the connection down: a client connecting sooner is refused, and tries again)
        await asyncio.wait_for(ch.wait_for_state_change(grpc.ChannelConnectivity.READY), 30)
        assert await _check(address, wait_for_ready=True) == "SERVING"
        # the client that went idle reconnects at its next call
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await ch.close()
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await server.stop(None)


def test_idle_connections_are_closed_and_give_their_place_back(monkeypatch) -> None:
    monkeypatch.setattr(serving, "MAX_CONNECTIONS", 1)
    monkeypatch.setattr(serving, "MAX_CONNECTION_IDLE_MS", 300)
    asyncio.run(_idle_closed())


async def _held_watches(address: str, watches: int) -> list[str]:
    """``watches`` strangers' watches, opened one after another on 8 connections, each request of nearly
    a stream's window (unread, so held by the server while the watch is open); the outcome of each."""
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 2 * MB)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(8)]
    outcomes = []
    for i in range(watches):
        call = channels[i % 8].unary_stream("/grpc.health.v1.Health/Watch")(
            bytes(serving.STREAM_WINDOW_BYTES - 1024)
        )
        try:
            await call.read()
            outcomes.append("open")
        except grpc.aio.AioRpcError as e:
            outcomes.append(e.code().name)
    for ch in channels:
        await ch.close()
    return outcomes


def test_strangers_open_health_watches_hold_at_most_the_cap_of_windows(tmp_path: Path) -> None:
    """256 strangers' watches with 1 MB requests raise the server's peak memory by under 64 MB (33 MB
    measured; 262 MB when a server took 256 watchers): it holds the windows of at most MAX_WATCHERS of
    them (16 MiB), and refuses the rest."""
    env = {**os.environ, security.JOB_SECRET_ENV: SECRET}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], env=env, stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert proc.stdout is not None
        address = f"127.0.0.1:{int(proc.stdout.readline())}"
        asyncio.run(_held_watches(address, 1))  # (the server's first watch: warm)
        before = _peak_rss(proc.pid)
        outcomes = asyncio.run(_held_watches(address, 256))
        grown = _peak_rss(proc.pid) - before
        assert proc.poll() is None, "the server died"
    finally:
        proc.kill()
        proc.wait()
    assert grown < 64 * MB, f"the server's peak resident memory grew by {grown / MB:.0f} MB"
    assert outcomes.count("open") == MAX_WATCHERS
    assert set(outcomes[MAX_WATCHERS:]) == {"RESOURCE_EXHAUSTED"}
