"""Real gRPC servers on loopback: bad input is rejected with INVALID_ARGUMENT and changes nothing;
the oracle holds back a plan until the write-backs it depends on are durable."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from bagpipe.codec import WireBatch, decode_batch, encode_batch
from bagpipe.core.data import SyntheticConfig, SyntheticSource, build_batch, scaled_table_rows, table_offsets
from bagpipe.core.plans import MAX_TRAINERS, trainer_users
from bagpipe.core.shard_map import ShardMap
from bagpipe.data_processor.config import DataProcessorConfig, SourceConfig
from bagpipe.data_processor.server import create_server as create_data_processor
from bagpipe.embedding_server.server import create_server as create_embedding_server
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.errors import InvalidArgument
from bagpipe.oracle_cacher.config import OracleConfig
from bagpipe.oracle_cacher.server import Oracle, _Received
from bagpipe.oracle_cacher.server import create_server as create_oracle
from bagpipe.v1 import data_processor_pb2, data_processor_pb2_grpc
from bagpipe.v1 import embedding_server_pb2 as epb
from bagpipe.v1 import embedding_server_pb2_grpc as epb_grpc
from bagpipe.v1 import oracle_cacher_pb2 as opb
from bagpipe.v1 import oracle_cacher_pb2_grpc as opb_grpc
from bagpipe.wire import from_tensor, to_tensor


async def _embedding_server_rejects_bad_requests() -> None:
    offsets = table_offsets([50, 30])
    store = ShardStore(ShardMap.create(80, 1, num_buckets=8), 0, offsets, dim=4, state_width=4, seed=1)
    server, port, _, _ = await create_embedding_server(store)
    try:
        before = store.weights.copy()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = epb_grpc.EmbeddingServerStub(ch)
            keys = np.array([3, 60], dtype=np.int64)
            good_rows = np.full((2, 4), 0.5, dtype=np.float32)
            bad = {
                "keys: dtype must be int64, got int32": epb.WriteBackRequest(
                    shard_map_version=1,
                    keys=to_tensor(keys.astype(np.int32)),
                    rows=to_tensor(good_rows),
                    state=to_tensor(good_rows),
                ),
                "rows: shape must be [2, 4], got [2, 3]": epb.WriteBackRequest(
                    shard_map_version=1,
                    keys=to_tensor(keys),
                    rows=to_tensor(good_rows[:, :3]),
                    state=to_tensor(good_rows),
                ),
                "keys: key 80 out of range [0, 80)": epb.WriteBackRequest(
                    shard_map_version=1,
                    keys=to_tensor(np.array([3, 80])),
                    rows=to_tensor(good_rows),
                    state=to_tensor(good_rows),
                ),
            }
            for message, request in bad.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.WriteBack(request, timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details() == message
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(
                    epb.LookupRequest(shard_map_version=1, keys=to_tensor(np.array([-1]))), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(epb.LookupRequest(shard_map_version=2, keys=to_tensor(keys)), timeout=5)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert np.array_equal(store.weights, before), "a rejected request changed rows"
            await stub.WriteBack(
                epb.WriteBackRequest(
                    shard_map_version=1,
                    keys=to_tensor(keys),
                    rows=to_tensor(good_rows),
                    state=to_tensor(good_rows),
                ),
                timeout=5,
            )
            reply = await stub.Lookup(epb.LookupRequest(shard_map_version=1, keys=to_tensor(keys)), timeout=5)
            packed = from_tensor(reply.packed, "packed", np.float32)  # each row followed by its state
            assert np.array_equal(packed, np.hstack([good_rows, good_rows])) and not reply.HasField("rows")
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await server.stop(None)


def test_embedding_server_rejects_bad_requests_and_changes_nothing() -> None:
    asyncio.run(_embedding_server_rejects_bad_requests())


async def _malformed_tsv(tmp_path: Path) -> None:
    path = tmp_path / "day_0.tsv"
    good = "\t".join(["1"] + ["5"] * 13 + ["a1"] * 26)
    bad = "\t".join(["0"] + ["5"] * 13 + ["a1", "b2", "zz"] + ["a1"] * 23)
    path.write_text("\n".join([good, good, bad, good]) + "\n")
    cfg = DataProcessorConfig(SourceConfig(f"criteo:{path}", tuple([100] * 26)), 2, 0)
    server, port, _, _ = await create_data_processor(cfg)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = data_processor_pb2_grpc.DataProcessorStub(ch)
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for part in stub.StreamBatches(
                    data_processor_pb2.StreamBatchesRequest(start=0, stride=1), timeout=10
                ):
                    got.append(part.batch.number)
            assert got in ([], [0])  # batch 0 may go out before the processor reads past it
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"{path}:3: field C3: 'zz' is not hexadecimal" in err.value.details()
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await server.stop(None)


def test_malformed_tsv_line_fails_with_file_line_and_field(tmp_path: Path) -> None:
    asyncio.run(_malformed_tsv(tmp_path))


async def _processor_trainer_masks() -> None:
    rows = tuple(scaled_table_rows(0.0005))
    cfg = DataProcessorConfig(SourceConfig("synthetic", rows), 12, 0)
    server, port, _, _ = await create_data_processor(cfg)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = data_processor_pb2_grpc.DataProcessorStub(ch)
            request = data_processor_pb2.StreamBatchesRequest(start=0, stride=1, end=2, trainers=3)
            parts = [p async for p in stub.StreamBatches(request, timeout=10)]
            assert [p.WhichOneof("part") for p in parts] == ["batch", "batch"]
            for batch in (p.batch for p in parts):
                keys = from_tensor(batch.keys, "keys", np.int64, ndim=1)
                inverse = from_tensor(batch.inverse, "inverse", np.int32, ndim=2)
                # (one byte a key for 3 trainers: the masks cross in the planner's width)
                users = from_tensor(batch.users, "users", np.uint8, shape=(keys.size, 1)).reshape(-1)
                assert np.array_equal(users, trainer_users(inverse, keys.size, 3))
            plain = [
                p.batch
                async for p in stub.StreamBatches(
                    data_processor_pb2.StreamBatchesRequest(start=0, stride=1, end=1)
                )
            ]
            assert not plain[0].HasField("users")
            # in slices: each batch's keys and masks, then its samples, one part per trainer in rank order
            request = data_processor_pb2.StreamBatchesRequest(start=0, stride=1, end=2, trainers=3, slices=3)
            parts = [p async for p in stub.StreamBatches(request, timeout=10)]
            assert [p.WhichOneof("part") for p in parts] == ["batch", "samples", "samples", "samples"] * 2
            for head, *samples in (parts[:4], parts[4:]):
                assert not head.batch.HasField("inverse") and head.batch.HasField("users")
                assert [(s.samples.batch, s.samples.rank) for s in samples] == [
                    (head.batch.number, r) for r in range(3)
                ]
                inverse = np.concatenate(
                    [from_tensor(s.samples.inverse, "inverse", np.int32, ndim=2) for s in samples]
                )
                keys = from_tensor(head.batch.keys, "keys", np.int64, ndim=1)
                users = from_tensor(head.batch.users, "users", np.uint8, shape=(keys.size, 1)).reshape(-1)
                assert inverse.shape == (12, len(rows)) and np.array_equal(
                    users, trainer_users(inverse, keys.size, 3)
                )
            for field, value, why in (
                ("trainers", 5, "trainers: batch size 12 does not split over 5 trainers"),
                (
                    "trainers",
                    MAX_TRAINERS + 1,
                    f"trainers: must be in [0, {MAX_TRAINERS}], got {MAX_TRAINERS + 1}",
                ),
                ("slices", 5, "slices: batch size 12 does not split into 5 slices"),
                ("slices", -1, f"slices: must be in [0, {MAX_TRAINERS}], got -1"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    bad = data_processor_pb2.StreamBatchesRequest(start=0, stride=1, end=1, **{field: value})
                    _ = [b async for b in stub.StreamBatches(bad, timeout=10)]
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details() == why
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await server.stop(None)


def test_data_processor_works_out_which_trainers_use_each_key() -> None:
    asyncio.run(_processor_trainer_masks())


def test_oracle_rejects_trainer_masks_that_name_no_trainer_or_an_unknown_one() -> None:
    rows = tuple(scaled_table_rows(0.0005))
    oracle = Oracle(OracleConfig(rows, 16, 2, 2, 1, 6))
    arrays = build_batch(
        0, SyntheticSource(SyntheticConfig(table_rows=rows)).batch(0, 16), table_offsets(rows)
    )
    good = trainer_users(arrays.inverse, arrays.keys.size, 2)

    def decode(users: np.ndarray):
        head = data_processor_pb2.BatchPart.FromString(encode_batch(arrays, False, users)[0])
        return decode_batch(
            head.batch,
            num_keys=oracle.num_keys,
            batch_size=16,
            num_tables=len(rows),
            trainers=2,
        )

    for bad in (np.where(np.arange(good.size) == 0, 0, good), np.where(np.arange(good.size) == 0, 4, good)):
        with pytest.raises(InvalidArgument, match=r"batch 0: users: masks outside \[1, 3\] for 2 trainers"):
            decode(bad)
    assert np.array_equal(oracle._users(decode(good)), good) and oracle._users(decode(good)).dtype == np.uint8


async def _oracle_gates_plans() -> None:
    rows = tuple(scaled_table_rows(0.0005))
    offsets = table_offsets(rows)
    lookahead = 2
    oracle = Oracle(OracleConfig(rows, 16, 1, lookahead, 1, 6))
    source = SyntheticSource(SyntheticConfig(table_rows=rows))
    for b in range(6):
        arrays = build_batch(b, source.batch(b, 16), offsets)
        users = trainer_users(arrays.inverse, arrays.keys.size, 1)
        batch = WireBatch(b, arrays.keys, last=b == 5, users=users)
        samples = encode_batch(arrays, b == 5, users, slices=1)[1:]
        oracle.received[b] = _Received(batch, oracle._users(batch), samples)
    oracle.readers_done = 1
    planner = asyncio.create_task(oracle.run_planner())
    server, port, _, _ = await create_oracle(oracle)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = opb_grpc.OracleCacherStub(ch)
            stream = stub.StreamPlans(opb.StreamPlansRequest(rank=0, start=0), timeout=30)
            it = stream.__aiter__()
            prefetched: dict[int, np.ndarray] = {}  # each plan's fetched keys, as the trainers are told

            async def fetches() -> list[opb.Fetches]:  # (an embedding server's stream, read all along)
                return [m async for m in stub.StreamFetches(opb.StreamFetchesRequest(start=0), timeout=30)]

            fetching = asyncio.create_task(fetches())

            async def next_plan() -> opb.Plan:  # each batch's rows, its samples, then its plan
                rows, samples, plan = await it.__anext__(), await it.__anext__(), await it.__anext__()
                kinds = (rows.WhichOneof("part"), samples.WhichOneof("part"), plan.WhichOneof("part"))
                assert kinds == ("rows", "samples", "plan")
                assert rows.rows.batch == samples.samples.batch == plan.plan.batch
                prefetched[plan.plan.batch] = from_tensor(rows.rows.prefetch_keys, "keys", np.int64)
                return plan.plan

            assert [(await next_plan()).batch for _ in range(2)] == [0, 1]
            async with oracle.cond:
                await oracle.cond.wait_for(lambda: 2 in oracle.planned)
                # batch 2 refetches keys batch 0 evicted (tiny tables), so it depends on batch 0's write-backs
                assert oracle.planned[2].depends_on == 0
                assert not oracle._dispatchable(2), "plan 2 must wait for the write-backs of batch 0"
            await stub.ReportProgress(opb.ProgressReport(rank=0, trained=0, written_back=0), timeout=5)
            assert (await next_plan()).batch == 2
            rest = []
            for b in range(1, 4):  # (a trainer reports only batches it was sent)
                await stub.ReportProgress(opb.ProgressReport(rank=0, trained=b, written_back=b), timeout=5)
                rest.append(await next_plan())
            assert [p.batch for p in rest] == [3, 4, 5] and rest[-1].last
            # the fetch stream told every batch's fetched keys, in order, and the progress as it moved
            told = await fetching
            batches = [m.batch for m in told if m.batch >= 0]
            assert batches == sorted(set(batches)) and batches[-1] == 5 and told[-1].last
            assert len(batches) >= 3 and batches[0] <= 1, batches
            for m in told:
                if m.batch >= 0:
                    assert np.array_equal(from_tensor(m.keys, "keys", np.int64), prefetched[m.batch]), m.batch
            progress = [m.trained for m in told]
            assert progress == sorted(progress) and progress[0] == -1
            # progress on a batch never sent, or going back, is refused
            for trained, field in ((6, "sent plans up to 5"), (2, "progress only moves on")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ReportProgress(
                        opb.ProgressReport(rank=0, trained=trained, written_back=trained), timeout=5
                    )
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
            # a rank belongs to the process that first called for it
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ReportProgress(
                    opb.ProgressReport(rank=0, trained=5, written_back=5),
                    timeout=5,
                    metadata=[("bagpipe-trainer", "x")],
                )
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.StreamPlans(
                    opb.StreamPlansRequest(rank=0, start=0), metadata=[("bagpipe-trainer", "x")]
                ):
                    pass
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ReportProgress(opb.ProgressReport(rank=3), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await planner
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await server.stop(None)


def test_oracle_releases_a_plan_only_after_writebacks_of_batch_x_minus_l() -> None:
    asyncio.run(_oracle_gates_plans())


@contextlib.contextmanager
def _served(stores: list[ShardStore]) -> Iterator[dict[int, str]]:
    """Real embedding servers for ``stores`` on an event loop of their own thread; yields their addresses
    by shard, and stops them after."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = [asyncio.run_coroutine_threadsafe(create_embedding_server(st), loop).result() for st in stores]
    try:
        yield {s: f"127.0.0.1:{servers[s][1]}" for s in range(len(stores))}
    finally:
        for server, *_ in servers:
            asyncio.run_coroutine_threadsafe(server.stop(None), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_lookups_leave_out_initial_rows_only_for_a_client_that_computes_them_alike() -> None:
    """Two real servers; clients that compute initial rows (the servers' fingerprint), that compute them
    otherwise (another seed), and that do not: every lookup answers the same rows and state, before and
    after write-backs, and only the first client is spared the rows still initial, and told that the
    servers are untouched (until the first write-back)."""
    from bagpipe.core.embedding_init import InitialRows
    from bagpipe.embedding_server.client import EmbeddingClient

    offsets = table_offsets([300, 40, 7])
    dim, width, seed = 5, 5, 11
    sm = ShardMap.create(int(offsets[-1]), 2, num_buckets=8)
    stores = [ShardStore(sm, s, offsets, dim=dim, state_width=width, seed=seed) for s in range(2)]
    with _served(stores) as addresses:
        plain = EmbeddingClient(sm, addresses, dim, width)
        alike = EmbeddingClient(sm, addresses, dim, width, initial=InitialRows(offsets, dim, seed))
        other = EmbeddingClient(sm, addresses, dim, width, initial=InitialRows(offsets, dim, seed + 1))
        try:
            rng = np.random.default_rng(0)
            keys = rng.permutation(int(offsets[-1]))[:200].astype(np.int64)
            want = plain.lookup(keys)
            assert (want[1] == 0).all()  # (initial state)
            # untouched: only a client that computes initial rows as the servers do may take their word for it
            assert alike.untouched() and not other.untouched() and not plain.untouched()
            computed = alike.initial_of(keys)
            assert all(np.array_equal(w, g) for w, g in zip(want, computed, strict=True))
            for client in (alike, other):
                got = client.lookup(keys)
                assert all(np.array_equal(w, g) for w, g in zip(want, got, strict=True))
            assert alike.initial_rows == keys.size and other.initial_rows == 0
            assert alike.bytes_received < plain.bytes_received / 4  # (positions: 8 bytes a row, not 40)

            written = keys[::3]
            rows = rng.standard_normal((written.size, dim)).astype(np.float32)
            alike.write_back(written[:1], rows[:1], np.abs(rows[:1]) + 1)  # one row, on one of the servers
            assert not alike.untouched()
            alike.write_back(written, rows, np.abs(rows) + 1)
            want = plain.lookup(keys)
            assert np.array_equal(want[0][::3], rows) and np.array_equal(want[1][::3], np.abs(rows) + 1)
            before = alike.initial_rows
            got = alike.lookup(keys)
            assert all(np.array_equal(w, g) for w, g in zip(want, got, strict=True))
            assert alike.initial_rows - before == keys.size - written.size
            # the prefetch's form: each position answered exactly once, by a reply or as an initial row
            seen = np.zeros(keys.size, dtype=int)
            for positions, part_rows, part_state in alike.lookup_parts(keys):
                seen[positions] += 1
                assert np.array_equal(part_rows, want[0][positions])
                assert np.array_equal(part_state, want[1][positions])
            assert (seen == 1).all()
        finally:
            for client in (plain, alike, other):
                client.close()


def test_lookups_in_flight_from_one_thread_answer_as_lookup_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """``lookup_async`` on two real servers: four lookups in flight from one thread, each shard's keys in
    several calls (``MAX_ROWS_PER_RPC`` lowered to 16), from a client whose shard map is one version behind
    the servers': every first call is refused for its version and sent again under the map the resolver
    gives. Each answers the rows and state ``lookup`` does, in its keys' order, and answers it again
    unchanged when asked twice."""
    from bagpipe.embedding_server import client as client_module
    from bagpipe.embedding_server.client import EmbeddingClient

    offsets = table_offsets([300, 40, 7])
    dim, width = 3, 3
    older = ShardMap.create(int(offsets[-1]), 2, num_buckets=8)
    newer = ShardMap(2, older.num_keys, 2, older.bucket_to_shard.copy())
    stores = [ShardStore(newer, s, offsets, dim=dim, state_width=width, seed=5) for s in range(2)]
    with _served(stores) as addresses:
        current = EmbeddingClient(newer, addresses, dim, width)
        behind = EmbeddingClient(older, addresses, dim, width, resolver=lambda: (newer, addresses))
        try:
            rng = np.random.default_rng(3)
            written = rng.permutation(int(offsets[-1]))[:120].astype(np.int64)
            rows = rng.standard_normal((written.size, dim)).astype(np.float32)
            current.write_back(written, rows, np.abs(rows) + 1)
            monkeypatch.setattr(client_module, "MAX_ROWS_PER_RPC", 16)
            key_sets = [
                rng.permutation(int(offsets[-1]))[:size].astype(np.int64) for size in (200, 7, 347, 90)
            ]
            pending = [behind.lookup_async(keys) for keys in key_sets]
            assert behind.shard_map.version == 1  # (nothing answered yet: sent under the old map)
            for keys, lookup in zip(key_sets[::-1], pending[::-1], strict=True):
                got = lookup.result()
                want = current.lookup(keys)
                assert all(np.array_equal(w, g) for w, g in zip(want, got, strict=True))
                again = lookup.result()
                assert all(a is g for a, g in zip(again, got, strict=True))
            assert behind.refusals > 0 and behind.shard_map.version == 2
            answered = current.lookup(written)
            assert np.array_equal(answered[0], rows) and np.array_equal(answered[1], np.abs(rows) + 1)
        finally:
            for client in (current, behind):
                client.close()
