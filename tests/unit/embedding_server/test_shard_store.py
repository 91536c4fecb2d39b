"""One shard's packed storage: rows and optimizer state in one array, keys recovered from positions."""

from __future__ import annotations

import numpy as np
import pytest
from bagpipe.core.data import table_offsets
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.errors import InvalidArgument


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
    from bagpipe.embedding_server.shard_store import check_values
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


def _assert_initial_flags_hold(store: ShardStore, offsets: np.ndarray, seed: int) -> np.ndarray:
    """Every row a lookup would leave out as initial holds its initial value and zero state; returns their
    keys, sorted."""
    from bagpipe.core.embedding_init import init_rows

    keys = store.keys_of(np.arange(store.table.shape[0]))
    keys = keys[keys >= 0]
    initial, packed = store.gather_changed(keys)
    left_out = keys[initial]
    rows, state = store.lookup(left_out)
    assert np.array_equal(rows, init_rows(left_out, offsets, store.dim, seed)) and not state.any()
    sent = np.delete(keys, initial)
    assert np.array_equal(packed, store.gather(sent))
    return np.sort(left_out)


def test_a_row_counts_as_initial_until_a_write_or_restore_stores_into_it() -> None:
    store = _store()
    offsets = store.offsets
    mine = np.flatnonzero(store.shard_map.shard_of(np.arange(store.shard_map.num_keys)) == 1)
    assert np.array_equal(_assert_initial_flags_hold(store, offsets, 0), mine)
    initial, packed = store.gather_changed(mine[[4, 1]])
    assert np.array_equal(initial, [0, 1]) and packed.shape == (0, 8)
    assert store.untouched()  # (lookups store nothing)
    refused = _store()  # a refused write-back leaves the shard untouched
    import pytest
    from bagpipe.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        refused.write(mine[[5, 6]], np.full((2, 4), np.nan, np.float32), np.ones((2, 4), np.float32))
    assert refused.untouched()
    refused.write(mine[[7]], np.ones((1, 4), np.float32), np.zeros((1, 4), np.float32))
    assert not refused.untouched()
    restored = _store()
    restored.restore([(1, mine[[3]], np.full((1, 4), 0.5, np.float32), np.zeros((1, 4), np.float32))])
    assert not restored.untouched()

    written = mine[[2, 9]]
    store.write(written, np.full((2, 4), 0.25, np.float32), np.ones((2, 4), np.float32))
    restored = mine[[3]]
    store.restore([(1, restored, np.full((1, 4), 0.5, np.float32), np.zeros((1, 4), np.float32))])
    store.write(mine[:0], np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32))
    left_out = _assert_initial_flags_hold(store, offsets, 0)
    assert np.array_equal(left_out, np.setdiff1d(mine, np.concatenate([written, restored])))
    # (a restored row equal to its initial value still counts as changed: the flag only ever errs that way)
    initial, packed = store.gather_changed(mine[[9, 0, 3]])
    assert np.array_equal(initial, [1]) and np.array_equal(packed, store.gather(mine[[9, 3]]))

    # a refused write-back stores nothing, and so clears no flag
    bad = np.full((2, 4), np.nan, np.float32)
    with pytest.raises(InvalidArgument):
        store.write(mine[[5, 6]], bad, np.ones((2, 4), np.float32))
    assert np.array_equal(_assert_initial_flags_hold(store, offsets, 0), left_out)


def test_the_compiled_key_mapping_matches_the_numpy_one_and_refuses_the_same_keys() -> None:
    """``local_index`` maps int64 keys in one compiled pass; any other key type, and every refusal, takes
    numpy's passes, which must agree with it."""
    store = _store()
    mine = np.flatnonzero(store.shard_map.shard_of(np.arange(store.shard_map.num_keys)) == 1)
    rng = np.random.default_rng(0)
    keys = rng.permutation(mine)
    assert np.array_equal(store.local_index(keys), store.local_index(keys.astype(np.int32)))
    assert np.array_equal(store.local_index(keys[::-2]), store.local_index(keys[::-2].astype(np.uint32)))
    read_only = np.frombuffer(keys.tobytes(), dtype=np.int64)  # (a request's keys)
    assert np.array_equal(store.local_index(read_only), store.local_index(keys))
    foreign = int(np.setdiff1d(np.arange(store.shard_map.num_keys), mine)[0])
    n = store.shard_map.num_keys
    for bad, message in ((foreign, "belongs to shard"), (n, f"key {n} out of range"), (-1, "key -1 out of")):
        for dtype in (np.int64, np.int32):
            with pytest.raises(InvalidArgument, match=message):
                store.local_index(np.array([*keys[:3], bad], dtype=dtype))
