"""core/plans: each trainer's share, cut from the plan's shared part, is what the logical plan says that
trainer does, row by row (a plain-Python reading of ``BatchPlan``'s fields, independent of ``share``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from bagpipe.core.plans import (
    BACKGROUND,
    CRITICAL,
    PRIVATE,
    BatchPlan,
    TrainerPlan,
    for_trainer,
    mask_dtype,
    mask_words,
    named,
    outside_trainers,
    share,
    shared_plan,
    trainer_users,
)
from bagpipe.oracle_cacher.lookahead import LookaheadPlanner


def _plans(trainers: int, seed: int) -> list[tuple[BatchPlan, np.ndarray]]:
    """(plan, the global batch's inverse) for a skewed stream, small enough to check row by row."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, 61) ** 1.2
    weights /= weights.sum()
    planner = LookaheadPlanner(60, 3, trainers=trainers)
    inverses, plans = {}, []
    for b in range(8):
        ids = rng.choice(60, size=(trainers * 4, 3), p=weights)
        keys, inverse = np.unique(ids, return_inverse=True)
        inverses[b] = inverse.reshape(ids.shape).astype(np.int32)
        if not planner.wants_more():
            plans.append(planner.pop())
        users = trainer_users(inverses[b], keys.size, trainers)
        assert planner.push(b, keys.astype(np.int64), last=b == 7, users=users)
    while planner.can_pop():
        plans.append(planner.pop())
    return [(plan, inverses[plan.batch]) for plan in plans]


def _has(mask, rank: int) -> bool:
    if np.ndim(mask):  # a wide mask: its words
        return bool(int(mask[rank // 64]) >> rank % 64 & 1)
    return bool(int(mask) >> rank & 1)


@pytest.mark.parametrize("trainers", [2, 3, 9, 70])
def test_each_share_is_the_plan_read_row_by_row(trainers: int) -> None:
    for plan, inverse in _plans(trainers, seed=trainers):
        per = inverse.shape[0] // trainers
        h = plan.handovers
        for rank in range(trainers):
            got = for_trainer(plan, inverse, rank, trainers)
            mine = [i for i in range(plan.unique) if _has(plan.users[i], rank)]
            assert got.slots.tolist() == [int(plan.slots[i]) for i in mine]
            assert [int(plan.slots[mine[j]]) for j in got.inverse.ravel()] == [
                int(plan.slots[i]) for i in inverse[rank * per : (rank + 1) * per].ravel()
            ]
            fetched = [int(i) for i in plan.prefetch if _has(plan.holders[i], rank)]
            assert got.prefetch_keys.tolist() == [int(plan.keys[i]) for i in fetched]
            assert got.prefetch_slots.tolist() == [int(plan.slots[i]) for i in fetched]
            assert got.private_rows.tolist() == [j for j, i in enumerate(mine) if not plan.sync[i]]
            for step, critical in ((got.critical, True), (got.background, False)):
                rows = [i for i in range(plan.unique) if plan.sync[i] and plan.critical[i] == critical]
                assert step.slots.tolist() == [int(plan.slots[i]) for i in rows]
                assert step.local.tolist() == [mine.index(i) if i in mine else -1 for i in rows]
                handed = [j for j in range(h.slots.size) if h.critical[j] == critical]
                assert step.handover_slots.tolist() == [int(h.slots[j]) for j in handed]
                sends = [n for n, j in enumerate(handed) if _has(h.source[j], rank)]
                receives = [n for n, j in enumerate(handed) if _has(h.recipients[j], rank)]
                assert (step.handover_send.tolist(), step.handover_recv.tolist()) == (sends, receives)
            written = [int(i) for e, i in enumerate(plan.evict) if plan.writer[e] == rank]
            assert got.writeback_keys.tolist() == [int(plan.keys[i]) for i in written]
            assert got.writeback_slots.tolist() == [int(plan.slots[i]) for i in written]


def test_shared_part_classes_every_row_once() -> None:
    for plan, _ in _plans(3, seed=1):
        sync = shared_plan(plan).sync
        assert sync.dtype == np.uint8 and sync.shape == (plan.unique,)
        assert np.array_equal(sync == PRIVATE, ~plan.sync)
        assert np.array_equal(sync == CRITICAL, plan.sync & plan.critical)
        assert np.array_equal(sync == BACKGROUND, plan.sync & ~plan.critical)


def _arrays(plan: TrainerPlan) -> dict[str, np.ndarray]:
    steps = {
        f"{name}.{field}": getattr(getattr(plan, name), field)
        for name in ("critical", "background")
        for field in ("slots", "local", "handover_slots", "handover_send", "handover_recv")
    }
    return {
        **{
            n: getattr(plan, n)
            for n in ("slots", "inverse", "prefetch_keys", "prefetch_slots", "private_rows")
        },
        **{n: getattr(plan, n) for n in ("writeback_keys", "writeback_slots", "prefetch_first")},
        **steps,
    }


@pytest.mark.parametrize("trainers", [3, 70])
def test_rows_from_the_samples_are_the_rows_the_masks_name(trainers: int) -> None:
    """With LRPP the masks are not sent: a trainer's rows are those its samples use, which is what the
    masks say, so its share is the same array for array, dtype for dtype."""
    for plan, inverse in _plans(trainers, seed=5):
        per = inverse.shape[0] // trainers
        for rank in range(trainers):
            mine = inverse[rank * per : (rank + 1) * per]
            by_masks = _arrays(share(shared_plan(plan), mine, rank))
            by_samples = _arrays(share(shared_plan(plan, users=False), mine.astype(np.int64), rank))
            for name, want in by_masks.items():
                got = by_samples[name]
                assert got.dtype == want.dtype and np.array_equal(got, want), name
            assert by_masks["slots"].dtype == np.int32 and by_masks["inverse"].shape == mine.shape


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_an_index_outside_the_rows_is_refused(bad: int) -> None:
    plan, inverse = _plans(2, seed=3)[0]
    mine = inverse[: inverse.shape[0] // 2].copy()
    mine[1, 2] = bad
    for users in (True, False):
        with pytest.raises(IndexError, match=f"inverse: index {bad} outside the batch's {plan.unique} rows"):
            share(shared_plan(plan, users=users), mine, 0)


@pytest.mark.parametrize("field", ["prefetch", "evict"])
@pytest.mark.parametrize("bad", [-1, 10**6])
def test_a_prefetch_or_eviction_outside_the_rows_is_refused(field: str, bad: int) -> None:
    """A row a trainer fetches or writes back is a position among the batch's rows: one outside them is
    refused, not read past the rows."""
    plan, inverse = next((p, i) for p, i in _plans(2, seed=3) if getattr(p, field).size)
    shared = shared_plan(plan)
    positions = getattr(shared, field).copy()
    positions[-1] = bad
    with pytest.raises(IndexError, match=f"{field}: an index outside the batch's {plan.unique} rows"):
        share(dataclasses.replace(shared, **{field: positions}), inverse[: inverse.shape[0] // 2], 0)


@pytest.mark.parametrize("trainers", [7, 64, 130, 256])
def test_masks_that_name_trainers_are_told_word_by_word(trainers: int) -> None:
    """``named`` and ``outside_trainers`` on one-word and wide masks, against a plain reading of the bits."""
    rng = np.random.default_rng(trainers)
    words = mask_words(trainers)
    count = 500
    bits = rng.random((count, trainers)) < rng.choice([0.0, 0.01, 0.5], size=(count, 1))
    if words:
        masks = np.zeros((count, words), dtype=np.uint64)
        for t in range(trainers):
            masks[:, t // 64] |= bits[:, t].astype(np.uint64) << np.uint64(t % 64)
        beyond = masks.copy()
        if trainers % 64:
            beyond[3, -1] |= np.uint64(1) << np.uint64(63)  # a trainer past the job's
    else:
        masks = (bits * (1 << np.arange(trainers))).sum(axis=1).astype(mask_dtype(trainers))
        beyond = masks.copy()
        beyond[3] |= mask_dtype(trainers).type(1 << 7)
    want = bits.any(axis=1)
    assert np.array_equal(named(masks), want)
    assert np.array_equal(outside_trainers(masks, trainers), ~want)
    if trainers % 64:
        assert outside_trainers(beyond, trainers)[3]
