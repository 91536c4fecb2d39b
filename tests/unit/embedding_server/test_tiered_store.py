"""A shard with its rows within a memory budget (``--row-memory``) answers exactly as one with every row in
memory: the same random writes, refused writes, lookups, snapshots, undo to a checkpoint, restores and a
migration, applied to both, give the same rows, state and flags; and most rows are on disk meanwhile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bagpipe.core.data import table_offsets
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server.row_tier import TierSpec
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.errors import InvalidArgument

from tests.unit.embedding_server.test_resharding import _migrate

DIM, STATE = 4, 4
ROW_BYTES = 4 * (DIM + STATE)


def _pair(tmp_path: Path, sm: ShardMap, offsets: np.ndarray, shard: int, budget_rows: int):
    dense = ShardStore(sm, shard, offsets, DIM, STATE, seed=3)
    tier = TierSpec(budget_rows * ROW_BYTES, tmp_path / "rows")
    tiered = ShardStore(sm, shard, offsets, DIM, STATE, seed=3, tier=tier)
    return dense, tiered


def _all(store: ShardStore, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    initial, packed = store.gather_changed(keys)
    return initial, np.asarray(packed)


def _same(dense: ShardStore, tiered: ShardStore, keys: np.ndarray) -> None:
    for a, b in zip(_all(dense, keys), _all(tiered, keys), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(dense.rows(keys)), np.asarray(tiered.rows(keys)))


def _materialised(taken: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    keys, rows, state = taken
    return keys, np.asarray(rows[0 : keys.size]), np.asarray(state[0 : keys.size])


def test_a_tiered_shard_answers_as_one_in_memory_through_writes_snapshots_undo_and_restore(
    tmp_path: Path,
) -> None:
    offsets = table_offsets([300, 500, 200])
    sm = ShardMap.create(int(offsets[-1]), 2, num_buckets=32)
    dense, tiered = _pair(tmp_path, sm, offsets, 1, budget_rows=60)  # (a tenth of the shard's 500 rows)
    mine = sm.local_keys(1)
    mine = mine[mine >= 0]
    rng = np.random.default_rng(7)
    for store in (dense, tiered):
        store.track_undo(0)
    checkpoints = [0]
    deltas = []
    for step in range(1, 120):
        keys = rng.choice(mine, size=int(rng.integers(1, 40)), replace=False)
        rows = rng.standard_normal((keys.size, DIM)).astype(np.float32)
        state = rng.random((keys.size, STATE)).astype(np.float32)
        if step % 17 == 0:  # refused, by both, changing nothing
            rows[-1, 0] = np.nan
            for store in (dense, tiered):
                with pytest.raises(InvalidArgument, match=f"key {int(keys[-1])}"):
                    store.write(keys, rows, state)
        else:
            for store in (dense, tiered):
                store.write(keys, rows, state)
        _same(dense, tiered, rng.choice(mine, size=50, replace=False))
        if step % 10 == 0:  # a checkpoint: the changes, then a segment of the undo log
            taken = [store.take_changes() for store in (dense, tiered)]
            for a, b in zip(*taken, strict=True):
                np.testing.assert_array_equal(a, b)
            deltas.append((step, *taken[0]))
            for store in (dense, tiered):
                store.undo_checkpoint(step)
            checkpoints.append(step)
        if step % 45 == 0:  # a roll-back to an earlier checkpoint
            back = checkpoints[-2]
            # (counts may differ: without a tier a refused write logs its rows, unchanged, too)
            assert dense.undo_to(back) >= tiered.undo_to(back) > 0
            checkpoints = [c for c in checkpoints if c <= back]
            _same(dense, tiered, mine)
    assert tiered.tier is not None and tiered.tier.resident_rows <= 60
    assert tiered.tier.log.rows_on_disk > 60  # (most of what was written lies on disk)
    for a, b in zip(_materialised(dense.take_all()), _materialised(tiered.take_all()), strict=True):
        np.testing.assert_array_equal(a, b)
    for store in (dense, tiered):  # a restart: the rows from the checkpoint files
        store.restore(deltas)
    _same(dense, tiered, mine)
    tiered.close()
    assert not list((tmp_path / "rows").rglob("*.log"))


def test_a_migration_between_tiered_shards_carries_every_row(tmp_path: Path) -> None:
    offsets = table_offsets([50, 70, 30])
    total = int(offsets[-1])
    sm = ShardMap.create(total, 2, num_buckets=16)
    pairs = {s: _pair(tmp_path / str(s), sm, offsets, s, budget_rows=12) for s in (0, 1, 2)}
    rng = np.random.default_rng(1)
    keys = np.arange(total, dtype=np.int64)

    def write(stores: dict[int, ShardStore], some: np.ndarray, seed: int) -> None:
        values = np.random.default_rng(seed)
        for s, part in enumerate(stores[0].shard_map.split(some)):
            if part.size:
                rows = values.standard_normal((part.size, DIM)).astype(np.float32)
                state = values.random((part.size, STATE)).astype(np.float32)
                stores[s].write(some[part], rows, state)

    before = rng.choice(total, 60, replace=False).astype(np.int64)
    during = rng.choice(total, 40, replace=False).astype(np.int64)
    new = sm.rebalance([0, 1, 2])
    for side in (0, 1):
        stores = {s: p[side] for s, p in pairs.items()}
        write(stores, before, 10)
        _migrate(stores, new, lambda st: write(st, during, 11))
    for s, part in enumerate(new.split(keys)):
        dense, tiered = pairs[s]
        _same(dense, tiered, keys[part])
        for a, b in zip(dense.take_changes(), tiered.take_changes(), strict=True):
            np.testing.assert_array_equal(a, b)
        assert tiered.tier is not None and tiered.tier.resident_rows <= 12
    for s in (0, 1, 2):  # (the old layout's files went at the switch)
        assert len(list((tmp_path / str(s) / "rows").rglob("*.log"))) == 1


def test_a_checkpoint_loads_into_a_tiered_shard_a_part_at_a_time_as_into_one_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from bagpipe.embedding_server import shard_store

    monkeypatch.setattr(shard_store, "LOAD_CHUNK_ROWS", 7)  # (parts of 7 rows: many, of uneven ends)
    offsets = table_offsets([40, 90, 25])
    sm = ShardMap.create(int(offsets[-1]), 2)
    dense, tiered = _pair(tmp_path, sm, offsets, 1, budget_rows=10)
    gen = torch.Generator().manual_seed(5)
    sizes = np.diff(offsets)
    ckpt = {
        "embeddings": {str(t): torch.randn(int(n), DIM, generator=gen) for t, n in enumerate(sizes)},
        "optimizer": {
            "embeddings": {
                str(t): {"sum": torch.rand(int(n), STATE, generator=gen)} for t, n in enumerate(sizes)
            }
        },
    }
    for store in (dense, tiered):
        store.load_checkpoint(ckpt, ("sum",), DIM, False)
    keys = sm.local_keys(1)
    _same(dense, tiered, keys)
    assert tiered.tier is not None and tiered.tier.log.rows_on_disk > keys.size // 2
    tiered.close()
