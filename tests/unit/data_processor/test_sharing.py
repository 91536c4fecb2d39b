"""A data processor's K oracle-shard streams of one request share one build of each batch
(data_processor/sharing.py): each stream gets exactly the part it would get from a build of its own, the
batches are built once, a stream that falls behind is still served, a failed build fails every stream, and
the groups go with their streams."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from bagpipe.core.data import scaled_table_rows
from bagpipe.core.oracle_shards import KeyShards
from bagpipe.data_processor import server
from bagpipe.data_processor.config import DataProcessorConfig, SourceConfig
from bagpipe.data_processor.server import DataProcessorServicer, built_batches, oracle_part
from bagpipe.data_processor.sharing import KEEP, BuildRegistry
from bagpipe.v1 import data_processor_pb2 as pb

ROWS = tuple(scaled_table_rows(0.0005))
BATCH, TRAINERS, END, K = 24, 3, 9, 3


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The numbers of the batches built, as they are built."""
    built: list[int] = []
    real = server.built_batches

    def counting(*args: Any) -> Iterator[Any]:
        for item in real(*args):
            built.append(int(item[0].number))
            yield item

    monkeypatch.setattr(server, "built_batches", counting)
    return built


def _servicer(keep: int = KEEP, grace_s: float = 0.0) -> DataProcessorServicer:
    """A processor whose groups go with their last stream (``grace_s`` 0: they wait for no late shard)
    unless ``grace_s`` says otherwise."""
    servicer = DataProcessorServicer(DataProcessorConfig(SourceConfig("synthetic", ROWS), BATCH, 0))
    servicer.builds = BuildRegistry(keep, grace_s)
    return servicer


def _request(shard: int, start: int = 0) -> pb.StreamBatchesRequest:
    return pb.StreamBatchesRequest(
        start=start, stride=1, end=END, trainers=TRAINERS, slices=TRAINERS, oracles=K, shard=shard
    )


def _own(shard: int, start: int = 0) -> list[Any]:
    """Shard ``shard``'s parts from a build of its own."""
    source = SourceConfig("synthetic", ROWS)
    shards = KeyShards(int(np.sum(ROWS)), K)
    parts = []
    for arrays, last, users in built_batches(source, BATCH, start, 1, END, TRAINERS):
        part, its_users, carries = oracle_part(arrays, users, shards, shard)
        parts.append((part, last, its_users, carries))
    return parts


def _same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for (arrays, last, users, carries), (a, l2, u, c) in zip(got, want, strict=True):
        assert (arrays.number, last, carries) == (a.number, l2, c)
        for name in ("keys", "inverse", "dense", "labels"):
            assert np.array_equal(getattr(arrays, name), getattr(a, name)), name
        assert np.array_equal(users, u)


def test_the_shards_streams_take_one_build_of_each_batch(builds: list[int]) -> None:
    servicer = _servicer()
    shards = servicer.key_shards(K)
    streams = [servicer.shard_stream(_request(s), shards) for s in range(K)]
    got: list[list[Any]] = [[] for _ in range(K)]
    for _ in range(END):  # (in turns, as the shards read)
        for s, stream in enumerate(streams):
            got[s].append(next(stream))
    for stream in streams:
        assert next(stream, None) is None
    assert sorted(builds) == list(range(END)), "each batch built once for the three streams"
    assert servicer.builds.open_groups() == 0
    for s in range(K):
        _same(got[s], _own(s))


def test_streams_in_threads_of_their_own(builds: list[int]) -> None:
    servicer = _servicer()
    shards = servicer.key_shards(K)
    got: list[list[Any]] = [[] for _ in range(K)]

    joined = threading.Barrier(K)  # (the shards' streams are open together, as a job's are)

    def read(s: int) -> None:
        stream = servicer.shard_stream(_request(s), shards)
        got[s] = [next(stream)]
        joined.wait()
        got[s] += list(stream)

    threads = [threading.Thread(target=read, args=(s,)) for s in range(K)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(builds) == list(range(END))
    assert servicer.builds.open_groups() == 0
    for s in range(K):
        _same(got[s], _own(s))


def test_streams_behind_the_kept_builds_share_a_build_of_their_own(builds: list[int]) -> None:
    """Shards that ask again from the start (rewound) while a stream of the same request is ahead: the group
    ahead no longer keeps those batches, so they start a group of their own, and share it."""
    servicer = _servicer(keep=2)
    shards = servicer.key_shards(K)
    ahead = servicer.shard_stream(_request(0), shards)
    first = [next(ahead) for _ in range(6)]  # (batches 0-5 built; 4 and 5 kept)
    behind = [servicer.shard_stream(_request(s), shards) for s in (1, 2)]
    got: list[list[Any]] = [[], []]
    for _ in range(END):
        for i, stream in enumerate(behind):
            got[i].append(next(stream))
    assert servicer.builds.open_groups() == 2
    rest = list(ahead)  # (its own group builds on)
    for stream in behind:
        assert next(stream, None) is None
    assert sorted(builds) == sorted([*range(END), *range(END)])
    assert servicer.builds.open_groups() == 0
    _same(first + rest, _own(0))
    _same(got[0], _own(1))
    _same(got[1], _own(2))


def test_a_failed_build_fails_every_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    real = server.built_batches

    def failing(*args: Any) -> Iterator[Any]:
        for item in real(*args):
            if item[0].number == 2:
                raise OSError("disk gone at batch 2")
            yield item

    monkeypatch.setattr(server, "built_batches", failing)
    servicer = _servicer()
    shards = servicer.key_shards(K)
    streams = [servicer.shard_stream(_request(s), shards) for s in range(2)]
    for _ in range(2):
        for stream in streams:
            next(stream)
    for stream in streams:  # (the first builds and fails; the second fails with it, not silently ended)
        with pytest.raises(OSError, match="disk gone at batch 2"):
            next(stream)
    assert servicer.builds.open_groups() == 0


def test_a_shard_that_opens_its_stream_after_the_others_ended_takes_their_builds(builds: list[int]) -> None:
    """The shards' processes start at their own times: in a short job the first may read every batch before
    the last asks for one. The group keeps its builds for the shards that have not joined yet (for
    ``grace_s``), and goes once all K have."""
    servicer = _servicer(grace_s=60.0)
    shards = servicer.key_shards(K)
    got = []
    for s in range(K):  # (one after another: each reads to the end before the next opens its stream)
        got.append(list(servicer.shard_stream(_request(s), shards)))
        assert servicer.builds.open_groups() == (1 if s < K - 1 else 0)
    assert builds == list(range(END)), "each batch built once for the three streams"
    for s in range(K):
        _same(got[s], _own(s))


def test_a_group_waits_for_late_shards_only_a_while(builds: list[int]) -> None:
    servicer = _servicer(grace_s=0.05)
    shards = servicer.key_shards(K)
    list(servicer.shard_stream(_request(0), shards))
    assert servicer.builds.open_groups() == 1
    time.sleep(0.1)
    assert servicer.builds.open_groups() == 0, "no shard came for it in time"
    list(servicer.shard_stream(_request(1), shards))
    assert builds == [*range(END), *range(END)]


def test_a_stream_closed_early_leaves_its_group() -> None:
    servicer = _servicer()
    shards = servicer.key_shards(K)
    streams = [servicer.shard_stream(_request(s), shards) for s in range(2)]
    next(streams[0])
    next(streams[1])
    assert servicer.builds.open_groups() == 1
    streams[0].close()
    assert servicer.builds.open_groups() == 1
    streams[1].close()
    assert servicer.builds.open_groups() == 0


def test_a_stream_far_ahead_of_a_group_does_not_make_it_build_for_nobody(builds: list[int]) -> None:
    servicer = _servicer(keep=2)
    shards = servicer.key_shards(K)
    behind = servicer.shard_stream(_request(0), shards)
    next(behind)  # (its group will build batch 1 next)
    far = servicer.builds.join((0, 1, END, TRAINERS, K), 6, 1, lambda start: iter(()))
    assert servicer.builds.open_groups() == 2, "batch 6 is more than two builds past the group at batch 1"
    servicer.builds.leave((0, 1, END, TRAINERS, K), far)
    near = servicer.builds.join((0, 1, END, TRAINERS, K), 2, 1, lambda start: iter(()))
    assert servicer.builds.open_groups() == 1, "batch 2 is within the group's next two builds"
    servicer.builds.leave((0, 1, END, TRAINERS, K), near)
    behind.close()
    assert servicer.builds.open_groups() == 0 and builds == [0]


def test_a_stream_after_a_failed_build_starts_a_group_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    real = server.built_batches
    failures = [2]  # (the first build of batch 2 fails; built again, it does not)

    def failing_once(*args: Any) -> Iterator[Any]:
        for item in real(*args):
            if item[0].number in failures:
                failures.remove(item[0].number)
                raise OSError("disk gone at batch 2")
            yield item

    monkeypatch.setattr(server, "built_batches", failing_once)
    servicer = _servicer()
    shards = servicer.key_shards(K)
    first = servicer.shard_stream(_request(0), shards)
    for _ in range(2):
        next(first)
    with pytest.raises(OSError, match="disk gone at batch 2"):
        next(first)
    # a shard that asks again while the failed group is still held gets batches, not the old error
    again = servicer.shard_stream(_request(1), shards)
    _same(list(again), _own(1))
    first.close()
    assert servicer.builds.open_groups() == 0
