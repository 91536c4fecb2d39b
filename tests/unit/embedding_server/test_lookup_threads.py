"""Lookups copied into the reply and write-backs stored off the event loop (``--lookup-threads``): the
same replies and rows as on the loop, a lookup sees each write-back whole or not at all, write-backs
apply one at a time in the order they came, a stream of lookups cannot hold a write-back off, and a
refused write-back changes nothing. A copy or a write is held half done (``wire.Gather.into`` or
``ShardStore.write`` paused) to make the interleaving certain rather than likely."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from typing import Any

import numpy as np
import pytest
from bagpipe import wire
from bagpipe.core import snapshots
from bagpipe.core.data import table_offsets
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server import config as server_config
from bagpipe.embedding_server.server import EmbeddingServicer
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.errors import InvalidArgument
from bagpipe.v1 import embedding_server_pb2 as pb
from bagpipe.wire import from_tensor, to_tensor

DIM = STATE = 4


def _store() -> ShardStore:
    offsets = table_offsets([400, 100])
    shard_map = ShardMap.create(int(offsets[-1]), num_shards=1, num_buckets=8)
    return ShardStore(shard_map, 0, offsets, dim=DIM, state_width=STATE, seed=0)


def _lookup(keys: np.ndarray) -> pb.LookupRequest:
    return pb.LookupRequest(shard_map_version=1, keys=to_tensor(keys))


def _write(keys: np.ndarray, value: float) -> pb.WriteBackRequest:
    rows = np.full((keys.size, DIM), value, dtype=np.float32)
    state = np.full((keys.size, STATE), value, dtype=np.float32)
    return pb.WriteBackRequest(
        shard_map_version=1, keys=to_tensor(keys), rows=to_tensor(rows), state=to_tensor(state)
    )


def _rows(reply: bytes, n: int) -> np.ndarray:
    packed = pb.LookupResponse.FromString(reply).packed
    return from_tensor(packed, "packed", np.float32, shape=(n, DIM + STATE))


def test_a_reply_copied_off_the_loop_is_the_reply_built_on_it() -> None:
    keys = np.random.default_rng(0).permutation(500)[:300].astype(np.int64)

    async def both() -> tuple[bytes, bytes]:
        store = _store()
        store.write(keys[:50], np.ones((50, DIM), np.float32), np.ones((50, STATE), np.float32))
        on_loop = await EmbeddingServicer(store).Lookup(_lookup(keys), None)  # type: ignore[arg-type]
        off_loop = await EmbeddingServicer(store, lookup_threads=2).Lookup(_lookup(keys), None)  # type: ignore[arg-type]
        return on_loop, off_loop

    on_loop, off_loop = asyncio.run(both())
    assert on_loop == off_loop
    assert (_rows(on_loop, keys.size)[:50] == 1).all()
    with pytest.raises(ValueError, match="lookup_threads"):
        EmbeddingServicer(_store(), lookup_threads=-1)


def test_a_write_back_waits_for_the_copies_in_flight_and_holds_new_ones_off(monkeypatch: Any) -> None:
    half, go = threading.Event(), threading.Event()
    copy = wire.Gather.into

    def paused(self: wire.Gather, out: np.ndarray) -> None:
        rows = out.view(self.table.dtype).reshape(self.shape)
        h = self.index.size // 2
        rows[:h] = self.table[self.index[:h]]
        half.set()
        assert go.wait(30), "the test never let the copy finish"
        rows[h:] = self.table[self.index[h:]]

    keys = np.arange(500, dtype=np.int64)
    store = _store()
    before = store.gather(keys)

    async def scenario() -> tuple[bytes, bytes]:
        servicer = EmbeddingServicer(store, lookup_threads=2)
        monkeypatch.setattr(wire.Gather, "into", paused)
        first = asyncio.create_task(servicer.Lookup(_lookup(keys), None))  # type: ignore[arg-type]
        assert await asyncio.to_thread(half.wait, 30)  # (its copy is half done, on a lookup thread)
        write = asyncio.create_task(servicer.WriteBack(_write(keys, 7.0), None))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert not write.done() and (store.gather(keys[:1]) != 7).all()  # waits for the copy
        later = asyncio.create_task(servicer.Lookup(_lookup(keys), None))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert servicer._gate.in_flight == 1  # the later lookup starts no copy while the write waits
        monkeypatch.setattr(wire.Gather, "into", copy)
        go.set()
        reply = await first
        await write
        return reply, await later

    first, later = asyncio.run(scenario())
    assert np.array_equal(_rows(first, keys.size), before)  # all from before the write-back
    assert (_rows(later, keys.size) == 7).all()  # all from after it


def test_a_cancelled_lookup_holds_write_backs_off_until_its_copy_ends(monkeypatch: Any) -> None:
    """A call cancelled (its client gone) while its rows are copied: the thread still reads them, so a
    write-back still waits for it."""
    half, go = threading.Event(), threading.Event()
    copy = wire.Gather.into

    def paused(self: wire.Gather, out: np.ndarray) -> None:
        half.set()
        assert go.wait(30), "the test never let the copy finish"
        copy(self, out)

    keys = np.arange(500, dtype=np.int64)
    store = _store()

    async def scenario() -> None:
        servicer = EmbeddingServicer(store, lookup_threads=1)
        monkeypatch.setattr(wire.Gather, "into", paused)
        lookup = asyncio.create_task(servicer.Lookup(_lookup(keys), None))  # type: ignore[arg-type]
        assert await asyncio.to_thread(half.wait, 30)
        lookup.cancel()
        write = asyncio.create_task(servicer.WriteBack(_write(keys, 7.0), None))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert not lookup.done() and not write.done() and servicer._gate.in_flight == 1
        go.set()
        await write
        with pytest.raises(asyncio.CancelledError):
            await lookup
        assert servicer._gate.in_flight == 0

    asyncio.run(scenario())
    assert (store.gather(keys) == 7).all()


def test_write_backs_off_the_loop_store_what_the_loop_stores_and_refuse_the_same() -> None:
    keys = np.random.default_rng(1).permutation(500)[:200].astype(np.int64)

    async def both() -> tuple[ShardStore, ShardStore]:
        on, off = _store(), _store()
        for store, threads in ((on, 0), (off, 2)):
            servicer = EmbeddingServicer(store, lookup_threads=threads)
            await servicer.WriteBack(_write(keys, 3.0), None)  # type: ignore[arg-type]
            bad = _write(keys[:10], 5.0)
            bad.rows.CopyFrom(to_tensor(np.full((10, DIM), np.nan, dtype=np.float32)))
            with pytest.raises(InvalidArgument, match="rows"):  # (raised on the thread, reported here)
                await servicer.WriteBack(bad, None)  # type: ignore[arg-type]
        return on, off

    on, off = asyncio.run(both())
    everything = np.arange(500, dtype=np.int64)
    assert np.array_equal(on.gather(everything), off.gather(everything))
    assert (off.gather(keys) == 3).all()  # the refused one changed nothing
    assert np.array_equal(on.take_changes()[0], off.take_changes()[0])


def test_a_write_back_off_the_loop_runs_alone(monkeypatch: Any) -> None:
    """While a write-back's rows are stored on a thread (held half stored here), a lookup, a snapshot
    and a second write-back wait. The snapshot and the second write-back then run in the order they
    came, and the lookup after both (it waits while any handler that changes rows does)."""
    half, go = threading.Event(), threading.Event()
    keys = np.arange(500, dtype=np.int64)
    store = _store()
    write = store.write

    def paused(k: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        h = k.size // 2
        write(k[:h], rows[:h], state[:h])
        half.set()
        assert go.wait(30), "the test never let the write finish"
        write(k[h:], rows[h:], state[h:])

    async def scenario(directory: str) -> tuple[bytes, Any]:
        servicer = EmbeddingServicer(store, lookup_threads=2)
        monkeypatch.setattr(store, "write", paused)
        first = asyncio.create_task(servicer.WriteBack(_write(keys, 7.0), None))  # type: ignore[arg-type]
        assert await asyncio.to_thread(half.wait, 30)  # (half its rows stored, on a thread)
        lookup = asyncio.create_task(servicer.Lookup(_lookup(keys), None))  # type: ignore[arg-type]
        snapshot = asyncio.create_task(
            servicer.Snapshot(
                pb.SnapshotRequest(shard_map_version=1, directory=directory, next_batch=1), None
            )  # type: ignore[arg-type]
        )
        monkeypatch.setattr(store, "write", write)
        second = asyncio.create_task(servicer.WriteBack(_write(keys[:100], 9.0), None))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert not (lookup.done() or snapshot.done() or second.done())
        assert servicer._gate.in_flight == 0 and servicer._gate.changers == 3
        go.set()
        await first
        reply = await lookup
        taken = await snapshot
        await second
        return reply, taken

    with tempfile.TemporaryDirectory() as directory:
        reply, taken = asyncio.run(scenario(directory))
        with np.load(snapshots.path_of(directory, 1) / taken.file) as saved:
            snapshot_keys, snapshot_rows = saved["keys"], saved["rows"]
    rows = _rows(reply, keys.size)  # both write-backs whole: the waiting ones go before new copies
    assert (rows[:100] == 9).all() and (rows[100:] == 7).all()
    # the snapshot took every row of the first write-back, and ran before the second
    assert np.array_equal(np.sort(snapshot_keys), keys) and (snapshot_rows == 7).all()
    assert (store.gather(keys[:100]) == 9).all() and (store.gather(keys[100:]) == 7).all()


def test_a_cancelled_write_back_holds_the_others_off_until_its_rows_are_stored(monkeypatch: Any) -> None:
    half, go = threading.Event(), threading.Event()
    keys = np.arange(500, dtype=np.int64)
    store = _store()
    write = store.write

    def paused(k: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        half.set()
        assert go.wait(30), "the test never let the write finish"
        write(k, rows, state)

    async def scenario() -> bytes:
        servicer = EmbeddingServicer(store, lookup_threads=2)  # (a free thread: the lookup waits on the gate)
        monkeypatch.setattr(store, "write", paused)
        first = asyncio.create_task(servicer.WriteBack(_write(keys, 7.0), None))  # type: ignore[arg-type]
        assert await asyncio.to_thread(half.wait, 30)
        first.cancel()
        lookup = asyncio.create_task(servicer.Lookup(_lookup(keys), None))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert not first.done() and not lookup.done()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        reply = await lookup
        assert servicer._gate.changers == 0 and servicer._gate.in_flight == 0
        return reply

    assert (_rows(asyncio.run(scenario()), keys.size) == 7).all()


@pytest.mark.parametrize("threads", [0, 2])
def test_a_snapshot_cancelled_while_it_writes_keeps_its_rows_for_the_next(
    monkeypatch: Any, threads: int
) -> None:
    """The rows a snapshot took are marked changed again when its file is not written: the call failed
    or was cancelled (its client gone), so the next snapshot must hold them."""
    started, go = threading.Event(), threading.Event()
    keys = np.arange(0, 500, 5, dtype=np.int64)
    store = _store()
    write_rows = snapshots.write_rows

    def slow(*args: Any, **kwargs: Any) -> tuple[str, int]:
        started.set()
        assert go.wait(30), "the test never let the write finish"
        return write_rows(*args, **kwargs)

    async def scenario(directory: str) -> None:
        servicer = EmbeddingServicer(store, lookup_threads=threads)
        await servicer.WriteBack(_write(keys, 4.0), None)  # type: ignore[arg-type]
        monkeypatch.setattr(snapshots, "write_rows", slow)
        request = pb.SnapshotRequest(shard_map_version=1, directory=directory, next_batch=1)
        call = asyncio.create_task(servicer.Snapshot(request, None))  # type: ignore[arg-type]
        assert await asyncio.to_thread(started.wait, 30)
        call.cancel()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.05)  # (the shielded restore runs to its end)
        assert servicer._gate.changers == 0

    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(scenario(directory))
    assert np.array_equal(np.sort(store.take_changes()[0]), keys)


def test_the_flag_round_trips_and_refuses_a_negative_count() -> None:
    base = ["--shard", "0", "--embedding-dim", "4", "--table-rows", ",".join(["10"] * 26)]
    cfg = server_config.parse([*base, "--lookup-threads", "3"])
    assert cfg.lookup_threads == 3 and server_config.parse(server_config.argv(cfg)) == cfg
    assert server_config.parse(base).lookup_threads == 0
    with pytest.raises(SystemExit):
        server_config.parse([*base, "--lookup-threads", "-1"])
