"""The key -> oracle shard map: a batch's keys in shard order, and back."""

from __future__ import annotations

import numpy as np
import pytest
from bagpipe.core.oracle_shards import KeyShards, shard_capacity
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


@pytest.mark.parametrize("shards", [2, 3, 5])
def test_a_shards_plan_in_the_trainers_terms(shards: int) -> None:
    """``for_trainers`` (one compiled pass) gives every key and slot the trainers receive of a shard's plan
    as ``global_keys`` and ``global_slots`` do, and leaves the batch's keys and the hand-overs' keys, which
    no trainer receives, as they were."""
    rng = np.random.default_rng(shards)
    key_shards = KeyShards(9000, shards)
    for shard in range(shards):
        planner = LookaheadPlanner(key_shards.rows(shard), 2, trainers=3)
        plans = []
        for b in range(6):
            keys = key_shards.split(np.unique(rng.integers(0, 9000, size=300)))
            local = keys.local[keys.part(shard)]
            local.flags.writeable = False
            users = rng.integers(1, 8, size=local.size).astype(np.uint8)
            if not planner.wants_more():
                plans.append(planner.pop())
            assert planner.push(b, local, last=b == 5, users=users)
        while planner.can_pop():
            plans.append(planner.pop())
        assert sum(p.prefetch_keys.size for p in plans) and sum(p.evict_keys.size for p in plans)
        for plan in plans:
            h = plan.handovers
            want_keys = [
                key_shards.global_keys(shard, a.copy()) for a in (plan.prefetch_keys, plan.evict_keys)
            ]
            want_slots = [key_shards.global_slots(shard, a.copy()) for a in (plan.slots, h.slots)]
            sent, handed = plan.keys.copy(), h.keys.copy()
            got = key_shards.for_trainers(plan, shard)
            assert np.array_equal(got.keys, sent) and np.array_equal(plan.keys, sent), (
                "the batch's keys as sent"
            )
            assert np.array_equal(got.handovers.keys, handed)
            for want, have in zip(want_keys, (got.prefetch_keys, got.evict_keys), strict=True):
                assert have.dtype == np.int64 and np.array_equal(have, want)
            for want, have in zip(want_slots, (got.slots, got.handovers.slots), strict=True):
                assert have.dtype == np.int32 and np.array_equal(have, want)
            assert got.slot_high_water == plan.slot_high_water * shards
