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


def test_the_compiled_write_refuses_exactly_what_the_numpy_checks_refuse() -> None:
    """Write-backs with one bad value here and there (NaN, inf, beyond --max-abs-value, a negative sum of
    squares, a repeated key), against ``check_values`` and a duplicate test on the same request: the store
    takes a request whole exactly when they pass it, and otherwise changes nothing."""
    import pytest
    from bagpipe.core.shard_store import check_values
    from bagpipe.errors import InvalidArgument

    store = _store()
    store.max_abs = 2.5
    store.non_negative = slice(2, 4)  # Adam-like: the first two state columns may be negative
    mine = np.flatnonzero(store.shard_map.shard_of(np.arange(store.shard_map.num_keys)) == 1)
    rng = np.random.default_rng(7)
    poison = [np.nan, np.inf, -np.inf, 2.5000002, -3.0, -1e-30, 2.5, -2.5, -0.0, 1e-45]
    taken = 0
    for trial in range(300):
        keys = rng.choice(mine, size=int(rng.integers(1, 40)), replace=False)
        if trial % 5 == 0:
            keys[-1] = keys[0]
        rows = rng.uniform(-2, 2, (keys.size, 4)).astype(np.float32)
        state = rng.uniform(0, 2, (keys.size, 4)).astype(np.float32)
        for _ in range(int(rng.integers(0, 3))):
            target = rows if rng.random() < 0.5 else state
            target[rng.integers(keys.size), rng.integers(4)] = poison[rng.integers(len(poison))]
        before = store.table.copy()
        try:
            if np.unique(keys).size != keys.size:
                raise InvalidArgument("keys", "duplicate")
            check_values(keys, rows, state, store.max_abs, store.non_negative)
            expected = None
        except InvalidArgument as e:
            expected = e.field
        if expected is None:
            store.write(keys, rows, state)
            taken += 1
            got_rows, got_state = store.lookup(keys)
            assert np.array_equal(got_rows, rows) and np.array_equal(got_state, state)
        else:
            with pytest.raises(InvalidArgument) as refused:
                store.write(keys, rows, state)
            assert refused.value.field == expected
            assert np.array_equal(store.table, before, equal_nan=True)
    assert 50 < taken < 250  # both outcomes were drawn


def test_an_embedding_server_does_not_load_torch() -> None:
    """torch is 185 MB of a server's resident memory and a server computes nothing with it: only reading an
    ``--init-from`` checkpoint loads it (the memory target is 1.1x the rows and state)."""
    import subprocess
    import sys

    code = "import sys, bagpipe.embedding_server.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"
