"""Re-sharding in one process: the next shard map moves as few buckets as possible, and a store's migration
carries every row, its optimizer state and its checkpoint flag to the new owner exactly once."""

from __future__ import annotations

import numpy as np
import pytest
from bagpipe.core.data import table_offsets
from bagpipe.core.embedding_init import init_rows
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.errors import InvalidArgument


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ([0, 1], [0, 1, 2]),
        ([0, 1, 2], [0, 1]),
        ([0, 1, 2], [0]),
        ([0], [0, 1, 2, 3]),
        ([0, 1, 2, 3], [0, 2]),
        ([0, 1], [0, 1]),
    ],
)
def test_rebalance_moves_only_what_it_must_and_evens_out(before: list[int], after: list[int]) -> None:
    sm = ShardMap.create(10_000, 1, num_buckets=1000).rebalance(before)
    new = sm.rebalance(after)
    assert new.version == sm.version + 1 and new.owners == after
    counts = np.bincount(new.bucket_to_shard, minlength=max(after) + 1)[after]
    assert counts.max() - counts.min() <= 1
    moved = int((sm.bucket_to_shard != new.bucket_to_shard).sum())
    # the fewest possible: what the removed shards held, plus what the kept ones hold above their new share
    held = np.bincount(sm.bucket_to_shard, minlength=max(before + after) + 1)
    quota = {s: int(c) for s, c in zip(after, counts, strict=True)}
    least = sum(int(held[s]) for s in before if s not in after) + sum(
        max(0, int(held[s]) - quota[s]) for s in after
    )
    assert moved == least
    assert sum(b.size for _, _, b in sm.moves(new)) == moved
    for src, dst, buckets in sm.moves(new):
        assert (sm.bucket_to_shard[buckets] == src).all() and (new.bucket_to_shard[buckets] == dst).all()


def test_rebalance_needs_a_shard() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        ShardMap.create(100, 2).rebalance([])


def _stores(sm: ShardMap, offsets: np.ndarray, shards: list[int]) -> dict[int, ShardStore]:
    return {s: ShardStore(sm, s, offsets, dim=3, state_width=3, seed=1) for s in shards}


def _migrate(stores: dict[int, ShardStore], new: ShardMap, between=None) -> None:
    """The servers' steps, in the order the coordinator drives them, with ``between(stores)`` (writes) after
    the bulk copy and before the switch."""
    parts = {s: st.begin_migration(new) for s, st in stores.items()}
    for s, m in parts.items():
        m.copy_staying(m.staying)
        for dst, rows in m.leaving.items():
            parts[dst].receive(s, *stores[s].read_rows(rows), None)
    if between is not None:
        between(stores)
    last = {s: m.seal() for s, m in parts.items()}
    for s, out in last.items():
        for dst, (keys, rows, state, changed) in out.items():
            parts[dst].receive(s, keys, rows, state, changed)
    for st in stores.values():
        st.finish_migration()


def test_a_migration_carries_every_row_state_and_checkpoint_flag_once() -> None:
    offsets = table_offsets([50, 70, 30])
    total = int(offsets[-1])
    sm = ShardMap.create(total, 2, num_buckets=16)
    stores = _stores(sm, offsets, [0, 1, 2])  # shard 2 joins empty
    rng = np.random.default_rng(0)
    keys = np.arange(total, dtype=np.int64)
    want_rows = np.concatenate(
        [stores[int(sm.shard_of(keys[i : i + 1])[0])].lookup(keys[i : i + 1])[0] for i in range(total)]
    )
    want_state = np.zeros((total, 3), dtype=np.float32)

    def write(stores: dict[int, ShardStore], some: np.ndarray) -> None:
        for s, part in enumerate(stores[0].shard_map.split(some)):
            if part.size:
                rows, state = (
                    rng.standard_normal((part.size, 3)).astype(np.float32),
                    rng.random((part.size, 3)).astype(np.float32),
                )
                stores[s].write(some[part], rows, state)
                want_rows[some[part]], want_state[some[part]] = rows, state

    assert all(st.untouched() for st in stores.values())
    before = rng.choice(total, 40, replace=False).astype(np.int64)
    write(stores, before)  # changed since the last checkpoint: the flags must follow the rows
    during = rng.choice(total, 40, replace=False).astype(np.int64)  # written after the copy: sent again
    new = sm.rebalance([0, 1, 2])
    _migrate(stores, new, lambda st: write(st, during))
    assert all(st.shard_map.version == 2 for st in stores.values())
    got_rows, got_state, changed = np.zeros_like(want_rows), np.zeros_like(want_state), []
    for s, part in enumerate(new.split(keys)):
        got_rows[part], got_state[part] = stores[s].lookup(keys[part])
        changed.append(stores[s].take_changes()[0])
    np.testing.assert_array_equal(got_rows, want_rows)
    np.testing.assert_array_equal(got_state, want_state)
    assert np.array_equal(np.sort(np.concatenate(changed)), np.union1d(before, during))
    # rows a lookup leaves out as initial are initial; those that stayed put and were never written keep
    # the flag (the ones that moved lose it: a flag may err only towards sending a row)
    initial = np.concatenate(
        [keys[part][stores[s].gather_changed(keys[part])[0]] for s, part in enumerate(new.split(keys))]
    )
    assert np.array_equal(got_rows[initial], init_rows(initial, offsets, 3, 1))
    assert not got_state[initial].any()
    stayed = keys[sm.shard_of(keys) == new.shard_of(keys)]
    assert np.array_equal(np.sort(initial), np.setdiff1d(stayed, np.union1d(before, during)))
    assert sum(st.rows_held for st in stores.values()) == total
    # a full snapshot after the switch takes keys only (no local row past its bucket's last key)
    for st in stores.values():
        taken = st.take_all()[0]
        assert taken.size and (taken >= 0).all() and (taken < total).all()
    assert not stores[2].untouched(), "rows received by re-sharding count as stored into"
    with pytest.raises(InvalidArgument, match="belongs to shard"):  # moved keys are no longer served here
        moved = keys[(sm.shard_of(keys) == 0) & (new.shard_of(keys) == 2)]
        stores[0].lookup(moved[:1])


def test_a_shard_is_not_untouched_while_it_migrates() -> None:
    """A trainer computes the rows it uses first only if every shard says it is untouched: a shard in the
    middle of a migration cannot say so; an aborted one stored nothing."""
    offsets = table_offsets([50, 70, 30])
    sm = ShardMap.create(int(offsets[-1]), 2, num_buckets=16)
    stores = _stores(sm, offsets, [0, 1, 2])
    for st in stores.values():
        st.begin_migration(sm.rebalance([0, 1, 2]))
    assert not any(st.untouched() for st in stores.values())
    for st in stores.values():
        st.abort_migration()
    assert all(st.untouched() for st in stores.values())


def test_a_bad_message_changes_nothing() -> None:
    offsets = table_offsets([40, 40])
    sm = ShardMap.create(80, 1, num_buckets=8)
    stores = _stores(sm, offsets, [0, 1])
    new = sm.rebalance([0, 1])
    m1 = stores[1].begin_migration(new)
    incoming = np.flatnonzero(new.shard_of(np.arange(80)) == 1).astype(np.int64)
    ok = np.zeros((incoming.size, 3), dtype=np.float32)
    with pytest.raises(InvalidArgument, match="from_shard"):
        m1.receive(1, incoming, ok, ok, None)
    with pytest.raises(InvalidArgument, match="rows"):
        m1.receive(0, incoming, np.full_like(ok, np.nan), ok, None)
    with pytest.raises(InvalidArgument, match="is not on shard 1"):
        staying = np.flatnonzero(new.shard_of(np.arange(80)) == 0).astype(np.int64)
        m1.receive(0, staying[:2], ok[:2], ok[:2], None)
    assert not m1.weights.any() and m1.finals == set()
