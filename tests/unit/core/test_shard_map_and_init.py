"""Shard map placement and row initialisation that does not depend on the number of servers."""

from __future__ import annotations

import numpy as np
import pytest
from bagpipe.core.data import table_offsets
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.errors import InvalidArgument


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_every_key_has_exactly_one_local_row(shards: int) -> None:
    sm = ShardMap.create(num_keys=1000, num_shards=shards, num_buckets=64)
    seen = np.concatenate([k[k >= 0] for k in (sm.local_keys(s) for s in range(shards))])
    assert np.array_equal(np.sort(seen), np.arange(1000))
    parts = sm.split(np.arange(1000, dtype=np.int64))
    assert sum(p.size for p in parts) == 1000
    for s, p in enumerate(parts):
        assert (sm.shard_of(p.astype(np.int64)) == s).all()


@pytest.mark.parametrize("owners", [[0], [2], [0, 2], [0, 1, 2]])
def test_split_gives_each_shard_its_keys_positions_in_order(owners: list[int]) -> None:
    """One owning shard (a fresh one-server map, or what a scale-down leaves) takes a path without a
    sort; its answer is the sorting path's: every position, in order, and nothing for the others."""
    sm = ShardMap.create(num_keys=5000, num_shards=3, num_buckets=64).rebalance(owners)
    keys = np.random.default_rng(0).permutation(5000)[:700].astype(np.int64)
    parts = sm.split(keys)
    assert sm.sole_shard == (owners[0] if len(owners) == 1 else -1)
    assert len(parts) == sm.num_shards
    for s, p in enumerate(parts):
        assert np.array_equal(p, np.flatnonzero(sm.shard_of(keys) == s))


def test_shard_map_round_trips_through_json() -> None:
    sm = ShardMap.create(500, 3)
    back = ShardMap.from_json(sm.to_json())
    assert back.version == sm.version and np.array_equal(back.bucket_to_shard, sm.bucket_to_shard)


def test_initial_rows_do_not_depend_on_the_number_of_servers() -> None:
    offsets = table_offsets([7, 100, 33])
    total = int(offsets[-1])

    def all_rows(shards: int) -> np.ndarray:
        sm = ShardMap.create(total, shards, num_buckets=16)
        out = np.zeros((total, 4), dtype=np.float32)
        for s in range(shards):
            store = ShardStore(sm, s, offsets, dim=4, state_width=0, seed=3)
            keys = np.flatnonzero(sm.shard_of(np.arange(total)) == s).astype(np.int64)
            out[keys] = store.lookup(keys)[0]
        return out

    one, three = all_rows(1), all_rows(3)
    assert np.array_equal(one, three)
    assert np.abs(one[:7]).max() <= 1 / np.sqrt(7) and np.abs(one[7:107]).max() <= 1 / np.sqrt(100)
    assert np.unique(one).size > 0.9 * one.size


def test_bad_write_changes_nothing() -> None:
    offsets = table_offsets([10, 10])
    sm = ShardMap.create(20, 2, num_buckets=4)
    store = ShardStore(sm, 0, offsets, dim=2, state_width=2, seed=0)
    before = store.weights.copy()
    mine = np.flatnonzero(sm.shard_of(np.arange(20)) == 0).astype(np.int64)
    other = np.flatnonzero(sm.shard_of(np.arange(20)) == 1).astype(np.int64)
    rows = np.ones((2, 2), dtype=np.float32)
    with pytest.raises(InvalidArgument, match="belongs to shard 1"):
        store.write(np.array([mine[0], other[0]]), rows, rows)
    with pytest.raises(InvalidArgument, match="out of range"):
        store.write(np.array([mine[0], 20]), rows, rows)
    with pytest.raises(InvalidArgument, match="duplicate"):
        store.write(np.array([mine[0], mine[0]]), rows, rows)
    with pytest.raises(InvalidArgument, match=r"rows: key \d+: value nan"):
        store.write(mine[:2], np.array([[1, np.nan], [0, 0]], dtype=np.float32), rows)
    with pytest.raises(InvalidArgument, match=r"rows: key \d+: value 3e\+38 \(must be at most 1e\+06"):
        store.write(mine[:2], np.array([[1, 3e38], [0, 0]], dtype=np.float32), rows)
    with pytest.raises(InvalidArgument, match=r"state: key \d+: value -1 \(must be finite and >= 0"):
        store.write(mine[:2], rows, np.array([[1, -1], [0, 0]], dtype=np.float32))
    assert np.array_equal(store.weights, before)


@pytest.mark.parametrize("dim", [1, 4, 16, 65])
def test_the_compiled_initial_rows_are_the_numpy_definition_bit_for_bit(dim: int) -> None:
    from bagpipe.core.embedding_init import InitialRows, fingerprint, init_rows, init_rows_numpy

    offsets = table_offsets([1, 7, 100_000, 33])
    rng = np.random.default_rng(dim)
    keys = np.concatenate([np.arange(10), [int(offsets[-1]) - 1], rng.integers(0, int(offsets[-1]), 3000)])
    for seed in (0, 5, 2**62 + 3):
        got = init_rows(keys, offsets, dim, seed)
        assert got.tobytes() == init_rows_numpy(keys, offsets, dim, seed).tobytes()
        assert InitialRows(offsets, dim, seed).rows(keys).tobytes() == got.tobytes()
    assert init_rows(keys[:0], offsets, dim, 0).shape == (0, dim)
    # the fingerprint tells apart what the rows depend on
    prints = {
        fingerprint(offsets, dim, 0),
        fingerprint(offsets, dim, 1),
        fingerprint(offsets, dim + 1, 0),
        fingerprint(table_offsets([1, 8, 100_000, 32]), dim, 0),
    }
    assert len(prints) == 4 and all(0 < p < 2**63 for p in prints)
