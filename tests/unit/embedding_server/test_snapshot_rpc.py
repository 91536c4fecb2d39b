"""The embedding server's Snapshot handler: idempotent (a retry after a lost or late reply gets the first
call's answer and never writes an empty file over the rows), full snapshots of every row not initial,
and a failed write that keeps the changes for the next one."""

from __future__ import annotations

import asyncio
import errno
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bagpipe.core import snapshots
from bagpipe.core.data import table_offsets
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server.server import EmbeddingServicer
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.errors import FailedPrecondition, Unavailable
from bagpipe.v1 import embedding_server_pb2 as pb

DIM = STATE = 2


def _store() -> ShardStore:
    offsets = table_offsets([300, 100])
    shard_map = ShardMap.create(int(offsets[-1]), num_shards=1, num_buckets=8)
    store = ShardStore(shard_map, 0, offsets, dim=DIM, state_width=STATE, seed=0)
    return store


def _write(store: ShardStore, keys: np.ndarray, value: float) -> None:
    store.write(
        keys, np.full((keys.size, DIM), value, np.float32), np.full((keys.size, STATE), value, np.float32)
    )


def _request(directory: Path, n: int, full: bool = False) -> pb.SnapshotRequest:
    return pb.SnapshotRequest(shard_map_version=1, directory=str(directory), next_batch=n, full=full)


def _saved(directory: Path, n: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    with np.load(snapshots.path_of(directory, n) / name) as data:
        return data["keys"], data["rows"]


def test_a_retried_snapshot_gets_the_first_answer_and_keeps_the_rows(tmp_path: Path) -> None:
    store = _store()
    keys = np.arange(0, 100, 2, dtype=np.int64)
    _write(store, keys, 5.0)

    async def twice() -> tuple[Any, Any]:
        servicer = EmbeddingServicer(store)
        first = await servicer.Snapshot(_request(tmp_path, 5), None)  # type: ignore[arg-type]
        again = await servicer.Snapshot(_request(tmp_path, 5), None)  # type: ignore[arg-type]
        return first, again

    first, again = asyncio.run(twice())
    assert first == again and first.rows == 50
    saved_keys, saved_rows = _saved(tmp_path, 5, first.file)
    assert np.array_equal(np.sort(saved_keys), keys) and (saved_rows == 5).all()


def test_a_retry_while_the_first_call_still_writes_waits_for_its_answer(
    tmp_path: Path, monkeypatch: Any
) -> None:
    store = _store()
    keys = np.arange(40, dtype=np.int64)
    _write(store, keys, 2.0)
    writing, go = threading.Event(), threading.Event()
    write_rows = snapshots.write_rows
    calls = []

    def slow(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])
        writing.set()
        assert go.wait(30)
        return write_rows(*args, **kwargs)

    monkeypatch.setattr(snapshots, "write_rows", slow)

    async def scenario() -> tuple[Any, Any]:
        servicer = EmbeddingServicer(store)
        first = asyncio.create_task(servicer.Snapshot(_request(tmp_path, 5), None))  # type: ignore[arg-type]
        assert await asyncio.to_thread(writing.wait, 30)
        retry = asyncio.create_task(servicer.Snapshot(_request(tmp_path, 5), None))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert not retry.done()
        go.set()
        return await first, await retry

    first, retry = asyncio.run(scenario())
    assert first == retry and first.rows == 40 and calls == [5]
    assert np.array_equal(np.sort(_saved(tmp_path, 5, first.file)[0]), keys)


@pytest.mark.parametrize(
    ("error", "refusal", "prefix"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), FailedPrecondition, "directory"),
        (OSError(errno.EROFS, "Read-only file system"), FailedPrecondition, "directory"),
        (OSError(errno.EIO, "Input/output error"), Unavailable, "snapshot"),
        (OSError(errno.ESTALE, "Stale file handle"), Unavailable, "snapshot"),
    ],
)
def test_a_snapshot_that_could_not_be_written_is_written_whole_by_the_retry(
    tmp_path: Path, monkeypatch: Any, error: OSError, refusal: type, prefix: str
) -> None:
    """A full or read-only volume is refused as the directory's fault (the trainer fails the job: a replay
    would meet it again); any other error of the volume as one that may pass (retried, recovered from)."""
    store = _store()
    keys = np.arange(30, dtype=np.int64)
    _write(store, keys, 4.0)
    write_rows = snapshots.write_rows
    failures = [OSError(error.errno, error.strerror, str(tmp_path))]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return write_rows(*args, **kwargs)

    monkeypatch.setattr(snapshots, "write_rows", flaky)

    async def scenario() -> Any:
        servicer = EmbeddingServicer(store)
        with pytest.raises(refusal, match=f"{prefix}: cannot write the snapshot.*: .*{tmp_path}"):
            await servicer.Snapshot(_request(tmp_path, 5), None)  # type: ignore[arg-type]
        return await servicer.Snapshot(_request(tmp_path, 5), None)  # type: ignore[arg-type]

    reply = asyncio.run(scenario())
    assert reply.rows == 30 and np.array_equal(np.sort(_saved(tmp_path, 5, reply.file)[0]), keys)


def test_a_full_snapshot_holds_every_row_not_initial_and_restarts_the_changes(tmp_path: Path) -> None:
    store = _store()
    _write(store, np.arange(0, 60, dtype=np.int64), 1.0)

    async def scenario() -> tuple[Any, Any, Any]:
        servicer = EmbeddingServicer(store)
        delta = await servicer.Snapshot(_request(tmp_path, 5), None)  # type: ignore[arg-type]
        _write(store, np.arange(50, 70, dtype=np.int64), 3.0)
        full = await servicer.Snapshot(_request(tmp_path, 10, full=True), None)  # type: ignore[arg-type]
        _write(store, np.arange(0, 5, dtype=np.int64), 7.0)
        after = await servicer.Snapshot(_request(tmp_path, 15), None)  # type: ignore[arg-type]
        return delta, full, after

    delta, full, after = asyncio.run(scenario())
    assert (delta.file, delta.rows) == ("rows-0.npz", 60)
    assert (full.file, full.rows) == ("base-0.npz", 70)
    keys, rows = _saved(tmp_path, 10, "base-0.npz")
    order = np.argsort(keys)
    assert np.array_equal(keys[order], np.arange(70))
    assert (rows[order][:50] == 1).all() and (rows[order][50:] == 3).all()
    assert after.rows == 5  # (only what changed after the full one)
