"""LRPP and delayed synchronisation, checked by replaying plans against a model of every trainer's cache.

The replay keeps, per trainer, what each slot holds (key and version: the batch of the key's last
update) and, per key, the newest version and the version on the embedding servers. It fails when a
trainer reads a row that is not the newest value, when an update reaches only some holders, when a
background synchronisation or hand-over is read by the next batch, when a prefetch can run before the
write-back it needs, or when the cache holds more rows than allowed.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from bagpipe.core.plans import for_trainer, mask_dtype, mask_words, traffic, trainer_users
from bagpipe.oracle_cacher import lookahead
from bagpipe.oracle_cacher.lookahead import _POP_CHUNK, CapacityError, LookaheadPlanner

from tests.unit.oracle_cacher.test_lookahead import assert_same_plans


def as_int(mask) -> int:
    """A mask (an integer, or a wide mask's row of uint64 words) as a Python integer."""
    if isinstance(mask, np.ndarray):
        return sum(int(word) << (64 * j) for j, word in enumerate(mask.tolist()))
    return int(mask)


def masks_of(values: list[int], trainers: int) -> np.ndarray:
    """Python-integer masks as the planner takes them (wide above 64 trainers: ``[N, words]``)."""
    words = mask_words(trainers)
    if not words:
        return np.array(values, dtype=mask_dtype(trainers))
    return np.array([[(v >> (64 * j)) & (2**64 - 1) for j in range(words)] for v in values], dtype=np.uint64)


def bits(mask, trainers: int) -> list[int]:
    value = as_int(mask)
    return [t for t in range(trainers) if value >> t & 1]


def make_stream(n: int, trainers: int, keys: int, per: int, seed: int) -> list[list[set[int]]]:
    """batches[b][t]: the keys trainer t's samples use in batch b (skewed, so rows change hands)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, keys + 1) ** 1.1
    weights /= weights.sum()
    return [[set(rng.choice(keys, size=per, p=weights).tolist()) for _ in range(trainers)] for _ in range(n)]


def plan_stream(
    stream,
    trainers,
    window,
    num_keys,
    capacity=None,
    delayed=True,
    reuse_delay=None,
    replicated=False,
    threads=1,
):
    planner = LookaheadPlanner(
        num_keys,
        window,
        trainers,
        capacity=capacity,
        reuse_delay=reuse_delay,
        delayed_sync=delayed,
        threads=threads,
    )
    plans, nxt = [], 0
    while len(plans) < len(stream):
        while planner.wants_more() and nxt < len(stream):
            used = stream[nxt]
            keys = np.array(sorted(set().union(*used)), dtype=np.int64)
            values = [sum(1 << t for t in range(trainers) if k in used[t]) for k in keys.tolist()]
            if replicated:
                values = [(1 << trainers) - 1] * len(values)
            users = masks_of(values, trainers)
            if not planner.push(nxt, keys, last=nxt == len(stream) - 1, users=users):
                break
            nxt += 1
        plans.append(planner.pop())
    return plans, planner


def replay(stream, plans, trainers, capacity=None, delayed=True) -> dict[str, int]:
    newest: dict[int, int] = {}  # key -> version (batch of its last update; -1: initial)
    server: dict[int, int] = {}
    caches: list[dict[int, tuple[int, int]]] = [{} for _ in range(trainers)]
    owner: dict[int, int] = {}  # slot -> key, in the logical cache
    evicted_at: dict[int, int] = {}
    released_at: dict[int, int] = {}
    seen = {"handovers": 0, "background": 0, "private": 0}
    for p in plans:
        x = p.batch
        keys = p.keys.tolist()
        slot_of = dict(zip(keys, p.slots.tolist(), strict=True))
        nxt = set().union(*stream[x + 1]) if x + 1 < len(stream) else set()
        for i in p.prefetch.tolist():
            k, s = keys[i], slot_of[keys[i]]
            assert evicted_at.get(k, -1) <= p.depends_on, f"batch {x}: prefetch of {k} before its write-back"
            assert released_at.get(s, -1) <= p.depends_on, f"batch {x}: slot {s} reused before its write-back"
            assert s not in owner, f"batch {x}: slot {s} still holds {owner.get(s)}"
            assert server.get(k, -1) == newest.get(k, -1), f"batch {x}: server copy of {k} is stale"
            owner[s] = k
            for t in bits(p.holders[i], trainers):
                caches[t][s] = (k, server.get(k, -1))
        if capacity is not None:
            assert p.slot_high_water <= capacity and len(owner) <= capacity
        for t in range(trainers):  # every read is the newest value
            for k in stream[x][t]:
                assert caches[t].get(slot_of[k]) == (k, newest.get(k, -1)), (
                    f"batch {x}: trainer {t} reads stale {k}"
                )
        for i, k in enumerate(keys):
            holders = bits(p.holders[i], trainers)
            users = [t for t in range(trainers) if k in stream[x][t]]
            assert bits(p.users[i], trainers) == users or as_int(p.users[i]) == (1 << trainers) - 1
            assert set(users) <= set(holders), f"batch {x}: {k} used by {users}, held by {holders}"
            for t in holders:
                assert caches[t].get(slot_of[k]) == (k, newest.get(k, -1)), (
                    f"batch {x}: holder {t} of {k} is stale"
                )
            assert p.sync[i] == (len(holders) > 1)
            if (
                p.sync[i] and k in nxt and p.ttl[i] > x
            ):  # (an evicted row is fetched again after its write-back)
                assert p.critical[i], (
                    f"batch {x}: {k} is read by batch {x + 1} but synchronised in the background"
                )
            if not delayed:
                assert p.critical[i] == p.sync[i]
            seen["background"] += int(p.sync[i] and not p.critical[i])
            seen["private"] += int(not p.sync[i])
            newest[k] = x
            for t in holders:  # the update reaches every holder (all-reduce) or the only one
                caches[t][slot_of[k]] = (k, x)
        h = p.handovers
        for k, s, src, dst, crit in zip(
            h.keys.tolist(), h.slots.tolist(), h.source, h.recipients, h.critical, strict=True
        ):
            (sender,) = bits(src, trainers)
            assert caches[sender].get(s) == (k, newest[k]), f"batch {x}: hand-over of {k} from a stale copy"
            assert crit or k not in nxt, (
                f"batch {x}: hand-over of {k} in the background but batch {x + 1} reads it"
            )
            for t in bits(dst, trainers):
                caches[t][s] = (k, newest[k])
            seen["handovers"] += 1
        for i, w in zip(p.evict.tolist(), p.writer.tolist(), strict=True):
            k, s = keys[i], slot_of[keys[i]]
            assert w in bits(p.holders[i], trainers)
            assert caches[w][s] == (k, newest[k])
            server[k] = newest[k]
            evicted_at[k] = x
            released_at[s] = x
            del owner[s]
    assert not owner, "every row is written back by the end"
    assert server == newest
    return seen


# 20, 64: wider per-key records and masks; 70, 200: wide masks (rows of words, their own loops)
@pytest.mark.parametrize("trainers", [2, 3, 5, 20, 64, 70, 200])
@pytest.mark.parametrize("lookahead", [1, 2, 4, 9])
@pytest.mark.parametrize("delayed", [True, False])
def test_every_read_is_the_newest_value(trainers: int, lookahead: int, delayed: bool) -> None:
    keys = 60 if trainers < 64 else 400  # (with 64 trainers on 60 keys, no row would be private)
    stream = make_stream(80, trainers, keys=keys, per=5, seed=trainers * 100 + lookahead)
    plans, planner = plan_stream(stream, trainers, lookahead, keys, delayed=delayed)
    seen = replay(stream, plans, trainers, delayed=delayed)
    assert seen["private"] > 0
    if lookahead >= 4:
        assert seen["handovers"] > 0, "with a long window, rows must change hands"
        assert seen["background"] > 0 or not delayed
    assert planner.occupancy == 0


def test_replicated_cache_holds_everything_everywhere() -> None:
    stream = make_stream(40, 3, keys=40, per=4, seed=7)
    plans, _ = plan_stream(stream, 3, 4, 40, replicated=True)
    seen = replay(stream, plans, 3)
    assert seen["handovers"] == 0 and seen["private"] == 0
    assert all((p.holders == 7).all() for p in plans)


def test_use_spreading_to_a_second_trainer_hands_the_row_over() -> None:
    # key 5: trainer 0 in batches 0-4, trainer 1 from batch 5 (read right after batch 4: critical);
    # key 7: trainer 0 in batches 0-2, trainer 1 in batch 4 (batch 3 does not read it: background)
    stream = [[{5, 7}, {1}] for _ in range(3)] + [[{5}, {2}], [{5}, {7}]] + [[{5}, {5}] for _ in range(3)]
    plans, _ = plan_stream(stream, 2, 4, 10)
    replay(stream, plans, 2)
    by_batch = {p.batch: p for p in plans}
    h2, h4 = by_batch[2].handovers, by_batch[4].handovers
    assert h2.keys.tolist() == [7] and h2.recipients.tolist() == [2] and not h2.critical[0]
    assert h4.keys.tolist() == [5] and h4.recipients.tolist() == [2] and h4.critical[0]
    # before the hand-over key 5 is private to trainer 0; afterwards its updates are all-reduced
    assert not by_batch[4].sync[by_batch[4].keys.tolist().index(5)]
    assert by_batch[5].sync[by_batch[5].keys.tolist().index(5)]


@pytest.mark.parametrize("capacity", [14, 20, 30])
def test_a_small_cache_shrinks_the_window_and_stays_exact(capacity: int) -> None:
    stream = make_stream(80, 3, keys=60, per=4, seed=capacity)
    plans, planner = plan_stream(stream, 3, 16, 60, capacity=capacity)
    replay(stream, plans, 3, capacity=capacity)
    windows = [p.window for p in plans]
    assert min(windows[:-16]) < 16, "the window must have shrunk"
    assert planner.slot_high_water <= capacity
    unbounded, _ = plan_stream(stream, 3, 16, 60)
    assert max(p.slot_high_water for p in unbounded) > capacity, "the capacity must actually bind"


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one core: no second thread to plan with")
@pytest.mark.parametrize(
    ("trainers", "capacity", "delayed"), [(3, None, True), (5, 30, True), (20, None, False), (64, None, True)]
)
def test_planning_split_between_threads_gives_the_same_plans(
    monkeypatch: pytest.MonkeyPatch, trainers: int, capacity: int | None, delayed: bool
) -> None:
    """With two threads each batch's keys are planned in two parts (here of 4 keys or more), a thread
    each: every plan is the one a single thread makes, field by field, and replays exactly."""
    monkeypatch.setattr(lookahead, "_MIN_PART", 4)
    stream = make_stream(60, trainers, keys=120, per=6, seed=trainers)
    one, _ = plan_stream(stream, trainers, 6, 120, capacity=capacity, delayed=delayed)
    two, planner = plan_stream(stream, trainers, 6, 120, capacity=capacity, delayed=delayed, threads=2)
    assert min(p.unique for p in two) >= 2 * lookahead._MIN_PART, "every batch must be split"
    assert_same_plans(one, two)
    seen = replay(stream, two, trainers, capacity=capacity, delayed=delayed)
    assert seen["handovers"] > 0 and sum(p.evict.size for p in two) > 0
    assert planner.occupancy == 0


def test_more_threads_than_numba_has_is_a_clear_error() -> None:
    most = numba.config.NUMBA_NUM_THREADS
    expected = rf"threads: must be in \[1, {most}\] \(numba's threads\), got {most + 1}"
    with pytest.raises(ValueError, match=expected):
        LookaheadPlanner(10, 2, threads=most + 1)


def test_a_batch_larger_than_the_cache_is_a_clear_error() -> None:
    planner = LookaheadPlanner(100, 4, capacity=3)
    with pytest.raises(CapacityError, match="capacity of 3 rows is smaller than batch 0, which uses 4 rows"):
        planner.push(0, np.arange(4, dtype=np.int64))


def test_single_key_batches_keep_their_plans_when_the_key_is_evicted() -> None:
    # a plan's per-key arrays are its own: evicting a batch's only key must not rewrite its slot
    stream = [[{5}, {5}] for _ in range(6)]
    plans, _ = plan_stream(stream, 2, 3, 10)
    replay(stream, plans, 2)
    assert [p.slots.tolist() for p in plans] == [[0]] * 6
    assert [p.evict.tolist() for p in plans] == [[], [], [], [], [], [0]]


def test_trainer_users_for_up_to_64_trainers() -> None:
    rng = np.random.default_rng(1)
    for trainers in (1, 7, 8, 9, 16, 33, 64):
        inverse = rng.integers(0, 50, size=(trainers * 3, 4)).astype(np.int32)
        users = trainer_users(inverse, 50, trainers)
        assert users.dtype == mask_dtype(trainers)
        expected = [
            sum(1 << t for t in range(trainers) if (inverse[3 * t : 3 * t + 3] == k).any()) for k in range(50)
        ]
        assert [int(u) for u in users] == expected


def test_trainer_users_and_shares_follow_the_sample_slices() -> None:
    # 4 samples, 2 tables, 2 trainers: samples 0-1 go to trainer 0, 2-3 to trainer 1
    inverse = np.array([[0, 3], [1, 3], [1, 4], [2, 4]], dtype=np.int32)
    users = trainer_users(inverse, 5, 2)
    assert users.tolist() == [1, 3, 2, 1, 2]
    stream = [[{0, 1, 3}, {1, 2, 4}]]
    plans, _ = plan_stream(stream, 2, 1, 5)
    share = for_trainer(plans[0], inverse, 1, 2)
    assert share.slots.tolist() == plans[0].slots[[1, 2, 4]].tolist()
    assert share.inverse.tolist() == [[0, 2], [1, 2]]
    assert sorted(share.prefetch_keys.tolist()) == [1, 2, 4]
    assert share.private_rows.tolist() == [1, 2]  # keys 2 and 4; key 1 is shared
    t = traffic(plans[0], dim=4, state_width=0)
    assert (t.unique, t.prefetched, t.critical_rows, t.background_rows) == (5, 6, 0, 1)


@pytest.mark.parametrize(
    ("capacity", "delayed", "batches", "keys", "per"),
    [
        (None, True, 60, 200, 6),
        (90, True, 60, 200, 6),
        (None, False, 60, 200, 6),
        (None, True, 10, 200_000, 500),  # batches of over _POP_CHUNK keys: several chunks a pop
    ],
)
def test_wide_masks_plan_what_one_word_plans(
    capacity: int | None, delayed: bool, batches: int, keys: int, per: int
) -> None:
    """Above 64 trainers masks are rows of words, planned by loops of their own (``_push_wide``,
    ``_pop_wide``). A stream whose samples come from 40 of 130 trainers is planned exactly as one word plans
    it for 40 trainers: every field of every plan, masks read as integers, and the cached rows' writers."""
    stream = make_stream(batches, 40, keys=keys, per=per, seed=11)
    narrow, one = plan_stream(stream, 40, 6, keys, capacity=capacity, delayed=delayed)
    padded = [[*used, *([set()] * 90)] for used in stream]  # (trainers 40..129 use nothing)
    wide, many = plan_stream(padded, 130, 6, keys, capacity=capacity, delayed=delayed)
    assert many.words == 3 and one.words == 0
    for a, b in zip(narrow, wide, strict=True):
        for name in ("keys", "slots", "ttl", "sync_class", "prefetch", "prefetch_keys", "evict", "writer"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), (a.batch, name)
        for name in ("users", "holders", "prefetch_holders"):
            assert [as_int(m) for m in getattr(a, name)] == [as_int(m) for m in getattr(b, name)], name
        ha, hb = a.handovers, b.handovers
        for name in ("keys", "slots", "critical"):
            assert np.array_equal(getattr(ha, name), getattr(hb, name)), (a.batch, name)
        for name in ("source", "recipients"):
            assert [as_int(m) for m in getattr(ha, name)] == [as_int(m) for m in getattr(hb, name)], name
        assert (a.depends_on, a.window, a.occupancy) == (b.depends_on, b.window, b.occupancy)
    assert sum(p.handovers.keys.size for p in wide) > 0 and sum(p.evict.size for p in wide) > 0
    assert max(p.keys.size for p in wide) > _POP_CHUNK or keys < _POP_CHUNK
    replay(padded, wide, 130, capacity=capacity, delayed=delayed)


def test_wide_cached_rows_name_their_writer() -> None:
    """Mid-stream (rows cached, some hand-overs pending), the rows a checkpoint writes out and who writes
    each are those of one word; reset leaves no wide mask behind."""
    stream = make_stream(30, 40, keys=200, per=6, seed=5)
    planners = [LookaheadPlanner(200, 6, 40), LookaheadPlanner(200, 6, 200)]
    for b in range(14):
        values = [
            sum(1 << t for t in range(40) if k in stream[b][t]) for k in sorted(set().union(*stream[b]))
        ]
        keys = np.array(sorted(set().union(*stream[b])), dtype=np.int64)
        for planner in planners:
            if not planner.wants_more():
                planner.pop()
            assert planner.push(b, keys, users=masks_of(values, planner.trainers))
    one, many = (planner.cached() for planner in planners)
    assert one[0].size > 0
    for a, b in zip(one, many, strict=True):
        assert np.array_equal(a, b)
    planners[1].reset()
    assert not planners[1]._held.any() and not planners[1]._pending_to.any()  # noqa: SLF001
