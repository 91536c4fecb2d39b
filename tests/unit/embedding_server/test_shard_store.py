"""One shard's packed storage: rows and optimizer state in one array, keys recovered from positions."""

from __future__ import annotations

import numpy as np
from bagpipe.core.data import table_offsets
from bagpipe.core.shard_map import ShardMap
from bagpipe.core.shard_store import ShardStore


def _store(shard: int = 1) -> ShardStore:
    offsets = table_offsets([1000, 37, 5])
    shard_map = ShardMap.create(int(offsets[-1]), num_shards=3, num_buckets=12)
    return ShardStore(shard_map, shard, offsets, dim=4, state_width=4, seed=0)


def test_every_local_row_maps_back_to_its_key() -> None:
    store = _store()
    mine = np.flatnonzero(store.shard_map.shard_of(np.arange(store.shard_map.num_keys)) == 1)
    index = store.local_index(mine)
    assert np.array_equal(store.keys_of(index), mine)
    padding = np.setdiff1d(np.arange(store.table.shape[0]), index)
    assert (store.keys_of(padding) == -1).all()
    assert store.rows_held == mine.size


def test_rows_and_state_share_one_table_and_lookups_are_copies() -> None:
    store = _store()
    keys = np.flatnonzero(store.shard_map.shard_of(np.arange(store.shard_map.num_keys)) == 1)[[3, 0, 7]]
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    state = rows + 100
    store.write(keys, rows, state)
    got_rows, got_state = store.lookup(keys)
    assert np.array_equal(got_rows, rows) and np.array_equal(got_state, state)
    assert np.array_equal(store.table[store.local_index(keys)], np.hstack([rows, state]))
    got_rows[:] = -1  # a lookup's result is the caller's, not a view of the store
    assert np.array_equal(store.lookup(keys)[0], rows)


def test_snapshot_changes_name_the_written_keys_once() -> None:
    store = _store()
    store.take_changes()
    keys = np.flatnonzero(store.shard_map.shard_of(np.arange(store.shard_map.num_keys)) == 1)[[5, 2]]
    rows = np.ones((2, 4), dtype=np.float32)
    store.write(keys, rows, rows)
    changed, got_rows, _ = store.take_changes()
    assert np.array_equal(np.sort(changed), np.sort(keys)) and np.array_equal(got_rows, rows)
    assert store.take_changes()[0].size == 0
