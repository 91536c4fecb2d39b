"""The shard's undo log: a roll-back in place gives back a checkpoint's rows, state and initial flags bit for
bit, touches no row written before it, and refuses whatever the log cannot answer for."""

from __future__ import annotations

import numpy as np
import pytest
from bagpipe.core.data import table_offsets
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.errors import InvalidArgument

State = tuple[np.ndarray, np.ndarray, bool]


def _store() -> ShardStore:
    offsets = table_offsets([1000, 37, 5])
    shard_map = ShardMap.create(int(offsets[-1]), num_shards=3, num_buckets=12)
    return ShardStore(shard_map, 1, offsets, dim=4, state_width=4, seed=0)


def _mine(store: ShardStore) -> np.ndarray:
    keys = np.arange(store.shard_map.num_keys, dtype=np.int64)
    return keys[store.shard_map.shard_of(keys) == store.shard]


def _write(store: ShardStore, keys: np.ndarray, rng: np.random.Generator) -> None:
    rows = rng.standard_normal((keys.size, store.dim)).astype(np.float32)
    store.write(keys, rows, rng.random((keys.size, store.state_width)).astype(np.float32))


def _state(store: ShardStore) -> State:
    return store.table.copy(), store._initial.copy(), store.untouched()


def _assert_at(store: ShardStore, want: State) -> None:
    table, initial, untouched = want
    assert store.table.tobytes() == table.tobytes()  # (bit for bit: -0.0 and NaN payloads too)
    assert np.array_equal(store._initial, initial)
    assert store.untouched() == untouched


def _history(store: ShardStore, rng: np.random.Generator) -> tuple[dict[int, State], list[np.ndarray]]:
    """Checkpoints 0, 5 and 10 with writes between and after them, the later ones partly on rows written
    before: the states at each checkpoint, and the keys of each run of writes."""
    mine = _mine(store)
    store.track_undo(0)
    states = {0: _state(store)}
    a = rng.choice(mine, 30, replace=False)
    b = np.concatenate([a[:10], rng.choice(np.setdiff1d(mine, a), 20, replace=False)])
    c = np.concatenate(
        [a[10:15], b[20:25], rng.choice(np.setdiff1d(mine, np.union1d(a, b)), 10, replace=False)]
    )
    _write(store, a, rng)
    _write(store, a[:3], rng)  # (again in the same segment: the first value logged stays)
    store.undo_checkpoint(5)
    states[5] = _state(store)
    _write(store, b, rng)
    store.undo_checkpoint(10)
    states[10] = _state(store)
    _write(store, c, rng)
    return states, [a, b, c]


def test_undo_to_gives_back_each_checkpoint_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    store = _store()
    states, (a, b, c) = _history(store, rng)
    assert states[0][2] and not states[5][2]
    assert store.undo_rows == a.size + b.size + c.size
    assert store.undo_to(10) == c.size
    _assert_at(store, states[10])
    _write(store, rng.choice(_mine(store), 25, replace=False), rng)  # later writes, then further back
    store.undo_to(5)
    _assert_at(store, states[5])
    assert store.can_undo_to(0) and not store.can_undo_to(10)
    assert store.undo_to(0) == a.size
    _assert_at(store, states[0])
    assert store.undo_to(0) == 0  # (nothing written since)


def test_undo_straight_to_an_older_checkpoint() -> None:
    rng = np.random.default_rng(1)
    store = _store()
    states, (a, b, c) = _history(store, rng)
    assert store.undo_to(5) == np.union1d(b, c).size
    _assert_at(store, states[5])
    assert store.undo_rows == a.size  # (segment 0 stays: its rows' values at 0)
    _write(store, b, rng)
    store.undo_to(0)
    _assert_at(store, states[0])


def test_forget_undo_before_keeps_the_checkpoint_it_names() -> None:
    rng = np.random.default_rng(2)
    store = _store()
    states, (_, b, c) = _history(store, rng)
    store.forget_undo_before(10)
    assert store.can_undo_to(10) and not store.can_undo_to(5) and not store.can_undo_to(0)
    assert store.undo_rows == c.size
    with pytest.raises(ValueError, match="does not reach"):
        store.undo_to(5)
    store.undo_to(10)
    _assert_at(store, states[10])
    store.forget_undo_before(10)  # (again: the segment of 10 stays)
    assert store.can_undo_to(10)


def test_a_refused_write_leaves_the_roll_back_exact() -> None:
    rng = np.random.default_rng(3)
    store = _store()
    states, (a, _, _) = _history(store, rng)
    fresh = np.setdiff1d(_mine(store), store.keys_of(np.flatnonzero(~store._initial)))[:4]
    keys = np.concatenate([a[:3], fresh])
    rows = np.ones((keys.size, store.dim), dtype=np.float32)
    rows[-1, 2] = np.nan
    with pytest.raises(InvalidArgument, match="rows"):
        store.write(keys, rows, np.zeros_like(rows))
    with pytest.raises(InvalidArgument, match="duplicate"):
        twice = np.concatenate([fresh, fresh[:1]])
        store.write(twice, np.ones((twice.size, 4), np.float32), np.ones((twice.size, 4), np.float32))
    store.undo_to(10)
    _assert_at(store, states[10])
    store.undo_to(0)
    _assert_at(store, states[0])


def test_rows_not_written_since_the_checkpoint_are_left_alone() -> None:
    """A row written before checkpoint 10 and not after holds its value at 10: a roll-back to 10 does not
    store into it (poked here behind the store's back, the poke survives)."""
    rng = np.random.default_rng(4)
    store = _store()
    _, (a, b, c) = _history(store, rng)
    quiet = store.local_index(np.setdiff1d(np.union1d(a, b), c)[:5])
    store.table[quiet] = 7.0
    store.undo_to(10)
    assert (store.table[quiet] == 7.0).all()


def test_after_undo_only_later_writes_count_as_changed() -> None:
    rng = np.random.default_rng(5)
    store = _store()
    _history(store, rng)
    store.undo_to(10)
    assert not store._changed.any()
    e = rng.choice(_mine(store), 12, replace=False)
    _write(store, e, rng)
    assert np.array_equal(np.sort(store.take_changes()[0]), np.sort(e))


def test_a_retried_snapshot_moves_the_checkpoint_to_the_retry() -> None:
    """A snapshot for checkpoint 5 fails and is retried after more writes: checkpoint 5 holds the rows at the
    retry, and checkpoint 0 is still reachable through them."""
    rng = np.random.default_rng(6)
    store = _store()
    mine = _mine(store)
    store.track_undo(0)
    at0 = _state(store)
    _write(store, mine[:20], rng)
    store.undo_checkpoint(5)
    _write(store, mine[10:30], rng)
    store.undo_checkpoint(5)
    at5 = _state(store)
    _write(store, mine[25:40], rng)
    store.undo_to(5)
    _assert_at(store, at5)
    store.undo_to(0)
    _assert_at(store, at0)
    with pytest.raises(ValueError, match="after checkpoint"):
        store.undo_checkpoint(-1)


def test_undo_without_track_undo_is_refused_and_logs_nothing() -> None:
    rng = np.random.default_rng(7)
    store = _store()
    store.undo_checkpoint(5)
    _write(store, _mine(store)[:10], rng)
    assert store.undo_rows == 0 and not store.can_undo_to(0) and not store.can_undo_to(5)
    with pytest.raises(ValueError, match="does not reach"):
        store.undo_to(0)


def test_restore_and_loaded_checkpoints_invalidate_the_log() -> None:
    import torch

    rng = np.random.default_rng(8)
    store = _store()
    _history(store, rng)
    keys = _mine(store)[:3]
    store.restore([(0, keys, np.ones((3, 4), np.float32), np.ones((3, 4), np.float32))])
    assert store.undo_rows == 0 and not any(store.can_undo_to(b) for b in (0, 5, 10))

    _history(store, rng)  # (tracking again from here)
    sizes = np.diff(store.offsets)
    bad = {"embeddings": {str(t): torch.zeros(int(n) + (t == 2), 4) for t, n in enumerate(sizes)}}
    with pytest.raises(ValueError, match="embeddings/2"):  # refused before any row changed: the log stands
        store.load_checkpoint(bad, (), 4, False)
    assert store.can_undo_to(10)
    good = {"embeddings": {str(t): torch.zeros(int(n), 4) for t, n in enumerate(sizes)}}
    store.load_checkpoint(good, (), 4, False)
    assert not any(store.can_undo_to(b) for b in (0, 5, 10))
    with pytest.raises(ValueError, match="does not reach"):
        store.undo_to(10)


def _migrate(stores: dict[int, ShardStore], new: ShardMap) -> None:
    """The servers' steps of a migration, in the coordinator's order (as test_resharding)."""
    parts = {s: st.begin_migration(new) for s, st in stores.items()}
    for s, m in parts.items():
        m.copy_staying(m.staying)
        for dst, rows in m.leaving.items():
            parts[dst].receive(s, *stores[s].read_rows(rows), None)
    for s, m in parts.items():
        for dst, (keys, rows, state, changed) in m.seal().items():
            parts[dst].receive(s, keys, rows, state, changed)
    for st in stores.values():
        st.finish_migration()


def test_a_migration_that_replaces_the_arrays_invalidates_the_log() -> None:
    rng = np.random.default_rng(9)
    offsets = table_offsets([50, 70, 30])
    sm = ShardMap.create(int(offsets[-1]), 2, num_buckets=16)
    stores = {s: ShardStore(sm, s, offsets, dim=3, state_width=3, seed=1) for s in (0, 1, 2)}
    for st in stores.values():
        st.track_undo(0)
        mine = _mine(st)
        if mine.size:
            _write(st, mine[:5], rng)
        st.undo_checkpoint(5)
    _migrate(stores, sm.rebalance([0, 1, 2]))
    for st in stores.values():
        assert not st.can_undo_to(0) and not st.can_undo_to(5) and st.undo_rows == 0
        with pytest.raises(ValueError, match="does not reach"):
            st.undo_to(5)


def test_undo_is_refused_during_a_migration_and_an_aborted_one_keeps_the_log() -> None:
    rng = np.random.default_rng(10)
    offsets = table_offsets([50, 70, 30])
    sm = ShardMap.create(int(offsets[-1]), 2, num_buckets=16)
    store = ShardStore(sm, 0, offsets, dim=3, state_width=3, seed=1)
    store.track_undo(0)
    at0 = _state(store)
    _write(store, _mine(store)[:8], rng)
    store.begin_migration(sm.rebalance([0, 1, 2]))
    with pytest.raises(ValueError, match="migration"):
        store.undo_to(0)
    _write(store, _mine(store)[4:12], rng)  # (a write during the migration is logged too)
    store.abort_migration()
    assert store.undo_to(0) == 12
    _assert_at(store, at0)


def test_a_roll_back_to_the_checkpoint_a_shard_was_built_at_builds_nothing_until_a_row_changes() -> None:
    """A job started from ``--init-from`` without checkpoints has no undo log and rows that are not initial:
    its first generation's roll-back to batch 0 once rebuilt the whole shard (and the first stayed alive
    beside it, twice the table resident). A shard as built holds that checkpoint; once a row is stored,
    rolled back or migrated it does not, and a roll-back rebuilds."""
    import asyncio

    from bagpipe.embedding_server.server import EmbeddingServicer

    store = _store()
    keys = _mine(store)[:5]
    store.restore([(0, keys, np.ones((5, 4), np.float32), np.ones((5, 4), np.float32))])  # (--init-from)
    store.built_batch = 0  # (as build_store leaves it)
    servicer = EmbeddingServicer(store, 1)
    built: list[int] = []

    def rebuild(batch: int) -> ShardStore:
        built.append(batch)
        fresh = _store()
        fresh.built_batch = batch
        return fresh

    version = store.shard_map.version
    said = asyncio.run(servicer.roll_back(0, version, rebuild))
    assert built == [] and servicer.store is store and "as it was built" in said
    _write(store, keys[:2], np.random.default_rng(0))
    assert store.built_batch is None
    asyncio.run(servicer.roll_back(0, version, rebuild))
    assert built == [0] and servicer.store is not store

    for change in (
        lambda s: s.restore([(0, keys[:1], np.ones((1, 4), np.float32), np.ones((1, 4), np.float32))]),
        lambda s: s.begin_migration(s.shard_map.rebalance([0, 1, 2, 3]), 1),
    ):
        fresh = rebuild(0)
        change(fresh)
        assert fresh.built_batch is None
