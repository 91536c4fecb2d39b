"""The key -> oracle shard map: a batch's keys in shard order, and back."""

from __future__ import annotations

import dataclasses

import numba
import numpy as np
import pytest
from bagpipe.core.oracle_shards import KeyShards, shard_capacity
from bagpipe.core.plans import mask_dtype, mask_words
from bagpipe.oracle_cacher.lookahead import LookaheadPlanner


@pytest.mark.parametrize(("num_keys", "shards"), [(5000, 2), (5000, 3), (700, 4), (3, 2)])
def test_a_batch_split_by_shard_is_put_back_by_the_inverse(num_keys: int, shards: int) -> None:
    rng = np.random.default_rng(shards)
    key_shards = KeyShards(num_keys, shards)
    samples = rng.integers(0, num_keys, size=(64, 3))
    keys, inverse = np.unique(samples, return_inverse=True)
    inverse = inverse.reshape(samples.shape).astype(np.int32)
    split = key_shards.split(keys)
    in_order = np.concatenate([keys[split.part(s)] for s in range(shards)])
    # the samples' keys are found through the new inverse in the parts concatenated in shard order
    assert np.array_equal(in_order[split.inverse(inverse)], samples)
    for s in range(shards):
        local = split.local[split.part(s)]
        assert (np.diff(local) > 0).all(), "a part's rows are sorted, unique"
        assert local.size == 0 or (local.min() >= 0 and local.max() < key_shards.rows(s))
        assert np.array_equal(key_shards.global_keys(s, local), keys[split.part(s)])
        assert (key_shards.map.shard_of(keys[split.part(s)]) == s).all()


def test_every_key_has_one_local_row_in_its_shard() -> None:
    key_shards = KeyShards(3000, 3)
    keys = np.arange(3000)
    split = key_shards.split(keys)
    assert sum(split.part(s).size for s in range(3)) == 3000
    for s in range(3):
        local = split.local[split.part(s)]
        assert np.unique(local).size == local.size


def test_the_capacity_is_split_into_equal_parts() -> None:
    assert [shard_capacity(10, 3, s) for s in range(3)] == [4, 3, 3]
    assert shard_capacity(None, 3, 1) is None
    with pytest.raises(ValueError, match="oracles"):
        KeyShards(10, 0)


def test_a_shard_owns_at_least_one_key_bucket() -> None:
    from bagpipe.oracle_cacher.config import OracleConfig

    job = {"table_rows": (5, 7), "batch_size": 8, "trainers": 2, "lookahead": 2, "data_processors": 1}
    OracleConfig(**job, iterations=4, oracles=12, shard=11)
    with pytest.raises(ValueError, match="oracles: at most 12, a key bucket a shard, got 13"):
        OracleConfig(**job, iterations=4, oracles=13)
    with pytest.raises(ValueError, match=r"shard: must be in \[0, 2\)"):
        OracleConfig(**job, iterations=4, oracles=2, shard=2)


@pytest.mark.parametrize(
    ("shards", "trainers", "threads", "keys", "size"),
    [
        (2, 3, 1, 3000, 400),  # K divides the buckets: key k is shard k % K's row k // K
        (3, 3, 1, 3000, 400),  # it does not: by the shard's buckets
        (5, 3, 1, 3000, 1000),
        (3, 70, 1, 3000, 400),  # wide masks (_pop_wide)
        (2, 130, 1, 60_000, 20_000),  # ... over several of its chunks (over _POP_CHUNK keys a shard)
        pytest.param(  # two threads (_pop_parts: each part's slots, then the lists moved up)
            *(2, 3, 2, 120_000, 50_000),
            marks=pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one core: no second thread"),
        ),
    ],
)
def test_a_shards_planner_writes_its_plans_in_the_trainers_terms(
    shards: int, trainers: int, threads: int, keys: int, size: int
) -> None:
    """A shard's planner (``shard=``) plans as a planner of its rows alone, and writes what the trainers
    receive in their terms: slots and hand-over slots as ``global_slots`` gives them, prefetched and evicted
    keys as ``global_keys``, the high-water mark K times; the batch's keys and the hand-overs' keys, which
    no trainer receives, and every other field as the plain planner's. Its cached rows too."""
    rng = np.random.default_rng(shards + trainers)
    key_shards = KeyShards(keys, shards)
    bits = mask_words(trainers)
    for shard in range(shards):
        rows = key_shards.rows(shard)
        plain = LookaheadPlanner(rows, 3, trainers=trainers, threads=threads)
        theirs = LookaheadPlanner(rows, 3, trainers=trainers, threads=threads, shard=(key_shards, shard))
        pairs = []
        for b in range(12):
            split = key_shards.split(np.unique(rng.integers(0, keys, size=size)))
            local = split.local[split.part(shard)]
            if bits:
                users = rng.integers(0, 1 << 62, size=(local.size, bits), dtype=np.uint64)
                users[:, 0] |= np.uint64(1)
                users[:, -1] &= np.uint64((1 << (trainers - 64 * (bits - 1))) - 1)
            else:
                users = rng.integers(1, 1 << trainers, size=local.size).astype(mask_dtype(trainers))
            if not plain.wants_more():
                pairs.append((plain.pop(), theirs.pop()))
                if len(pairs) == 3:  # (between batches: the rows cached after the third)
                    want_keys, want_slots, want_writer = plain.cached()
                    got_keys, got_slots, got_writer = theirs.cached()
                    assert want_keys.size, "rows are cached"
                    assert np.array_equal(got_keys, key_shards.global_keys(shard, want_keys))
                    assert np.array_equal(got_slots, key_shards.global_slots(shard, want_slots))
                    assert np.array_equal(got_writer, want_writer)
            assert plain.push(b, local, last=b == 11, users=users)
            assert theirs.push(b, local, last=b == 11, users=users)
        while plain.can_pop():
            pairs.append((plain.pop(), theirs.pop()))
        assert sum(p.prefetch_keys.size for p, _ in pairs) and sum(p.evict_keys.size for p, _ in pairs)
        assert sum(p.handovers.keys.size for p, _ in pairs), "hand-overs were planned"
        # (what the server's counters and log report, as its metric does: the plan's figure)
        high_water = theirs.trainer_slot_high_water
        assert high_water == plain.slot_high_water * shards == pairs[-1][1].slot_high_water
        converted = {"prefetch_keys", "evict_keys", "slots", "slot_high_water", "handovers"}
        for want, got in pairs:
            for f in dataclasses.fields(want):
                if f.name not in converted:
                    a, b = getattr(want, f.name), getattr(got, f.name)
                    assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, f.name
            for name in ("prefetch_keys", "evict_keys"):
                have = getattr(got, name)
                assert have.dtype == np.int64
                assert np.array_equal(have, key_shards.global_keys(shard, getattr(want, name))), name
            assert got.slots.dtype == np.int32
            assert np.array_equal(got.slots, key_shards.global_slots(shard, want.slots))
            assert got.slot_high_water == want.slot_high_water * shards
            h, g = want.handovers, got.handovers
            assert np.array_equal(g.slots, key_shards.global_slots(shard, h.slots))
            for name in ("keys", "source", "recipients", "critical"):
                assert np.array_equal(getattr(g, name), getattr(h, name)), name


def test_a_shards_planner_has_the_shards_rows() -> None:
    key_shards = KeyShards(9000, 3)
    with pytest.raises(ValueError, match="num_keys: oracle shard 1 has 3069 rows, got 9000"):
        LookaheadPlanner(9000, 2, trainers=3, shard=(key_shards, 1))
