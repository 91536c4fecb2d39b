"""Algorithm 1: the paper's Figure 6, and the invariants that keep training exact."""

from __future__ import annotations

import numpy as np
import pytest
from bagpipe.core.plans import BatchPlan
from bagpipe.oracle_cacher.lookahead import CapacityError, LookaheadPlanner, SlotAllocator


def plan_all(batches: dict[int, list[int]], lookahead: int, num_keys: int = 16):
    planner = LookaheadPlanner(num_keys, lookahead)
    numbers = sorted(batches)
    pending = list(numbers)
    plans = []
    while len(plans) < len(numbers):
        while planner.wants_more() and pending:
            n = pending.pop(0)
            planner.push(n, np.array(sorted(set(batches[n])), dtype=np.int64), last=not pending)
        plans.append(planner.pop())
    return plans, planner


def test_figure_6_prefetches_ttls_and_evictions() -> None:
    # Figure 6: L = 2, batches 1..4 use {3, 9}, {3, 4}, {3, 6}, {6, 1}
    plans, _ = plan_all({1: [3, 9], 2: [3, 4], 3: [3, 6], 4: [6, 1]}, lookahead=2)
    got = [
        (
            p.batch,
            dict(zip(p.keys.tolist(), p.ttl.tolist(), strict=True)),
            sorted(p.keys[p.prefetch].tolist()),
            sorted(p.keys[p.evict].tolist()),
        )
        for p in plans
    ]
    assert got == [
        (1, {3: 2, 9: 1}, [3, 9], [9]),  # 3 reused in batch 2: cached with TTL 2
        (2, {3: 3, 4: 2}, [4], [4]),  # 3 is a hit; its TTL moves to 3
        (3, {3: 3, 6: 4}, [6], [3]),  # 6 cached until 4; 3 has no later use in the window
        (4, {1: 4, 6: 4}, [1], [1, 6]),
    ]
    assert plans[-1].last


def random_batches(n: int, keys: int, per_batch: int, seed: int) -> dict[int, list[int]]:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, keys + 1) ** 1.2
    return {b: rng.choice(keys, size=per_batch, p=weights / weights.sum()).tolist() for b in range(n)}


@pytest.mark.parametrize("lookahead", [1, 2, 5, 9])
def test_cached_rows_are_exactly_those_used_within_the_window(lookahead: int) -> None:
    batches = random_batches(60, 40, 12, seed=lookahead)
    plans, planner = plan_all(batches, lookahead, num_keys=40)
    used = {b: set(v) for b, v in batches.items()}
    cached: dict[int, int] = {}  # key -> slot
    slot_owner: dict[int, int] = {}
    slot_freed_at: dict[int, int] = {}
    for p in plans:
        x = p.batch
        keys = p.keys.tolist()
        prefetched = set(p.keys[p.prefetch].tolist())
        for k, slot in zip(keys, p.slots.tolist(), strict=True):
            if k in prefetched:
                assert k not in cached, f"batch {x}: {k} prefetched while cached"
                # no batch in [x-L+1, x-1] used it, so its newest value is on the servers
                assert not any(k in used.get(b, ()) for b in range(x - lookahead + 1, x))
                assert slot not in slot_owner, (
                    f"batch {x}: slot {slot} still holds key {slot_owner.get(slot)}"
                )
                if slot in slot_freed_at:
                    assert slot_freed_at[slot] <= x - lookahead, (
                        "slot reused before its write-back is waited for"
                    )
                cached[k] = slot
                slot_owner[slot] = k
            else:
                assert cached.get(k) == slot, f"batch {x}: {k} expected in the cache at slot {slot}"
        for k in p.keys[p.evict].tolist():
            assert not any(k in used.get(b, ()) for b in range(x + 1, x + lookahead)), (
                f"{k} evicted too early"
            )
            slot_freed_at[cached[k]] = x
            del slot_owner[cached.pop(k)]
        ttl = dict(zip(keys, p.ttl.tolist(), strict=True))
        for k in keys:
            window = [b for b in range(x, x + lookahead) if k in used.get(b, ())]
            assert ttl[k] == max(window)
    assert not cached, "every row is evicted (and so written back) by the last batch"
    assert planner.occupancy == 0
    assert planner.peak_occupancy <= planner.slot_high_water


@pytest.mark.parametrize(("lookahead", "start"), [(1, 0), (3, 0), (6, 40)])
def test_prefetches_marked_first_are_exactly_keys_no_earlier_batch_used(lookahead: int, start: int) -> None:
    """A trainer computes a row marked first instead of fetching it: the mark must hold only for a key
    that no batch since the planner's first one used (so none changed it), and for every such key."""
    batches = {start + b: v for b, v in random_batches(50, 40, 12, seed=7 + lookahead).items()}
    plans, _ = plan_all(batches, lookahead, num_keys=40)
    seen: set[int] = set()
    refetched = 0
    for p in plans:
        assert p.first_since == start
        assert p.prefetch_first.shape == p.prefetch_keys.shape and p.prefetch_first.dtype == bool
        for key, first in zip(p.prefetch_keys.tolist(), p.prefetch_first.tolist(), strict=True):
            assert first == (key not in seen), f"batch {p.batch}: key {key} marked first={first}"
            refetched += not first
        seen.update(batches[p.batch])
    assert refetched > 0, "some key must be evicted and fetched again (not first)"


def test_push_rejects_out_of_order_and_out_of_range_batches() -> None:
    planner = LookaheadPlanner(10, 3)
    planner.push(0, np.array([1, 2], dtype=np.int64))
    with pytest.raises(ValueError, match="expected batch 1"):
        planner.push(2, np.array([1], dtype=np.int64))
    with pytest.raises(ValueError, match="outside"):
        planner.push(1, np.array([3, 10], dtype=np.int64))
    with pytest.raises(RuntimeError):
        planner.pop()  # window not full, last batch not pushed
    with pytest.raises(ValueError, match="a key no trainer uses"):  # (it would have no writer)
        LookaheadPlanner(10, 3, trainers=2).push(
            0, np.array([1, 2], dtype=np.int64), users=np.array([1, 0], np.uint8)
        )


def test_read_only_keys_and_masks_plan_like_writable_ones() -> None:
    keys = np.array([1, 4, 7], dtype=np.int64)
    users = np.array([1, 3, 2], dtype=np.uint8)
    plans = []
    for writable in (True, False):
        k, u = keys.copy(), users.copy()
        k.flags.writeable = u.flags.writeable = writable  # (as decoded from a message: read-only views)
        planner = LookaheadPlanner(10, 2, trainers=2)
        planner.push(0, k, users=u)
        planner.push(1, k, last=True, users=u)
        plans.append([planner.pop(), planner.pop()])
    for a, b in zip(*plans, strict=True):
        assert np.array_equal(a.slots, b.slots) and np.array_equal(a.holders, b.holders)
        assert np.array_equal(a.evict, b.evict) and np.array_equal(a.writer, b.writer)


def test_slot_allocator_reuses_the_longest_free_slots_after_the_delay() -> None:
    a = SlotAllocator(delay=2)
    first, dep = a.take(5, batch=0)
    assert first.tolist() == [0, 1, 2, 3, 4] and dep == -1
    a.release(np.array([3, 1]), batch=0)
    a.release(np.array([4]), batch=1)
    a.release(np.array([0, 2]), batch=2)
    # at batch 1 nothing is out of quarantine (released after 0, reusable from 2): new slots
    slots, dep = a.take(1, batch=1)
    assert slots.tolist() == [5] and dep == -1 and a.high_water == 6
    assert a.in_quarantine == 5
    # at batch 3 the releases after 0 and 1 are free: oldest first, then new slots; it depends on batch 1
    slots, dep = a.take(4, batch=3)
    assert slots.tolist() == [3, 1, 4, 6] and dep == 1
    # a take that ends inside a run leaves the rest of it for the next one
    slots, dep = a.take(1, batch=4)
    assert slots.tolist() == [0] and dep == 2
    slots, dep = a.take(1, batch=5)
    assert slots.tolist() == [2] and dep == 2
    assert a.early_reuses == 0


def test_slot_allocator_reuses_early_only_when_the_capacity_forces_it() -> None:
    a = SlotAllocator(delay=10, capacity=3)
    a.take(3, batch=0)
    a.release(np.array([2, 0]), batch=0)
    slots, dep = a.take(2, batch=1)  # nothing free, no room: the quarantined slots, a dependency
    assert slots.tolist() == [2, 0] and dep == 0 and a.early_reuses == 1
    with pytest.raises(CapacityError, match="needs 1 new cache rows, only 0 are free"):
        a.take(1, batch=2)


def test_writer_is_the_key_modulo_holders_th_holder() -> None:
    # the evicted row's writer: the (key % holders)-th of its holders in trainer order, for any mask width
    from bagpipe.oracle_cacher.lookahead import _writer

    rng = np.random.default_rng(3)
    masks = [1, 2, 3, 0b1010_0110, 1 << 15, (1 << 16) - 1, 1 << 63, (1 << 64) - 1]
    masks += rng.integers(1, 1 << 63, size=50, dtype=np.int64).tolist()
    for mask in masks:
        holders = [t for t in range(64) if mask >> t & 1]
        for key in (0, 1, 5, 7, 1_000_003, 33_762_576):
            assert _writer(np.uint64(mask), key) == holders[key % len(holders)], (mask, key)


@pytest.mark.parametrize("capacity", [None, 40])
def test_a_reset_planner_plans_as_a_new_one(capacity: int | None) -> None:
    """The oracle's rewind reuses its planner (``reset``): planned again from a later batch, with users
    of several trainers, a capacity and hand-overs, it gives the plans a new planner gives, field by
    field, and holds no entry of its past."""
    rng = np.random.default_rng(3)
    batches = random_batches(60, 200, 24, seed=4)
    users = {b: rng.integers(1, 4, size=200) for b in batches}

    def run(planner: LookaheadPlanner, first: int) -> list:
        numbers = [b for b in sorted(batches) if b >= first]
        pending, plans = list(numbers), []
        while len(plans) < len(numbers):
            while planner.wants_more() and pending:
                n = pending.pop(0)
                keys = np.array(sorted(set(batches[n])), dtype=np.int64)
                planner.push(n, keys, last=not pending, users=users[n][keys].astype(np.uint8))
            plans.append(planner.pop())
        return plans

    used = LookaheadPlanner(200, 6, trainers=2, capacity=capacity)
    run(used, 0)
    used.reset()
    fresh = LookaheadPlanner(200, 6, trainers=2, capacity=capacity)
    assert np.array_equal(used._state, fresh._state) and np.array_equal(used._handover_at, fresh._handover_at)
    assert not used._slot_key.any()
    again, new = run(used, 25), run(fresh, 25)
    assert len(again) == len(new) == 35
    assert_same_plans(again, new)


def assert_same_plans(plans: list[BatchPlan], others: list[BatchPlan]) -> None:
    """The two lists' plans are equal field by field (arrays: values and dtype)."""
    assert len(plans) == len(others)
    for a, b in zip(plans, others, strict=True):
        for name in a.__dataclass_fields__:
            x, y = getattr(a, name), getattr(b, name)
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y), (a.batch, name)
            elif hasattr(x, "__dataclass_fields__"):
                for sub in x.__dataclass_fields__:
                    u, v = getattr(x, sub), getattr(y, sub)
                    assert u.dtype == v.dtype and np.array_equal(u, v), (a.batch, name, sub)
            else:
                assert x == y, (a.batch, name)
