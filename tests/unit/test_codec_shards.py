"""K oracle shards through the wire: the data processor's part of each batch for each shard, each shard's
planner and plan in the trainers' terms, and every trainer's merge of the K parts, against one oracle."""

from __future__ import annotations

import numpy as np
import pytest
from bagpipe.codec import decode_batch, decode_plans, encode_batch, encode_plans
from bagpipe.core.data import SyntheticConfig, SyntheticSource, table_offsets
from bagpipe.core.oracle_shards import KeyShards
from bagpipe.core.plans import TrainerBatch, trainer_users
from bagpipe.data_processor.batches import numbered_batches
from bagpipe.data_processor.server import oracle_part
from bagpipe.errors import InvalidArgument
from bagpipe.oracle_cacher.lookahead import LookaheadPlanner
from bagpipe.v1 import data_processor_pb2 as dpb
from bagpipe.v1 import oracle_cacher_pb2 as opb
from bagpipe.wire import from_tensor, to_tensor

TABLE_ROWS = (40, 7, 300, 5, 90, 3)
BATCH, TRAINERS, L, BATCHES = 24, 3, 4, 14
NUM_KEYS = int(table_offsets(TABLE_ROWS)[-1])


def _batches():
    source = SyntheticSource(SyntheticConfig(table_rows=TABLE_ROWS, seed=5))
    return list(numbered_batches(source, TABLE_ROWS, BATCH, 0, 1, BATCHES))


_DTYPES = {"prefetch_keys": "int64", "prefetch_first": "bool_"}


def _parts(data: list[bytes]) -> tuple[dpb.Batch, list[bytes]]:
    head = dpb.BatchPart.FromString(data[0])
    return head.batch, data[1:]


def run(oracles: int) -> tuple[list[list[TrainerBatch]], list[dict[int, int]]]:
    """Every trainer's decoded batches, planned by ``oracles`` shards (1: the one oracle, unsplit), and the
    trainers' slot of each key of each batch."""
    shards = KeyShards(NUM_KEYS, oracles) if oracles > 1 else None
    planners = [
        LookaheadPlanner(NUM_KEYS, L, trainers=TRAINERS)
        if shards is None
        else LookaheadPlanner(shards.rows(s), L, trainers=TRAINERS, shard=(shards, s))
        for s in range(oracles)
    ]
    # per shard: batch -> (rows part, plan parts per rank, samples per rank or None, global keys)
    planned: list[dict[int, tuple]] = [{} for _ in range(oracles)]
    batches = _batches()
    for arrays, last in batches:
        users = trainer_users(arrays.inverse, arrays.keys.size, TRAINERS)
        for s, planner in enumerate(planners):
            part, its_users, carries = (
                (arrays, users, True) if shards is None else oracle_part(arrays, users, shards, s)
            )
            batch, samples = _parts(encode_batch(part, last, its_users, TRAINERS, carries))
            assert len(samples) == (TRAINERS if carries else 0)
            wire = decode_batch(
                batch,
                num_keys=planner.num_keys,
                batch_size=BATCH,
                num_tables=len(TABLE_ROWS),
                trainers=TRAINERS,
                slices=TRAINERS,
            )
            assert planner.push(wire.number, wire.keys, last=wire.last, users=wire.users.astype(np.uint8))
            if last:
                planner.finish()
            while planner.can_pop():
                plan = planner.pop()  # (a shard's: in the trainers' terms)
                encoded = encode_plans(plan, [], BATCH, None, TRAINERS)
                # (the batch's keys, which no trainer receives, stay the shard's rows)
                keys = plan.keys if shards is None else shards.global_keys(s, plan.keys.copy())
                planned[s][plan.batch] = (encoded.rows, encoded.plans, keys, plan.slots)
            planned[s][-arrays.number - 1] = samples
    # (the samples of batch x wait under -x-1 until its plan is made)
    out: list[list[TrainerBatch]] = [[] for _ in range(TRAINERS)]
    merged_keys = []
    for b in range(BATCHES):
        keys = np.concatenate([planned[s][b][2] for s in range(oracles)])
        slots = np.concatenate([planned[s][b][3] for s in range(oracles)])
        assert np.unique(slots).size == slots.size, "the shards' slots never meet"
        merged_keys.append(dict(zip(keys.tolist(), slots.tolist(), strict=True)))
        carrier = planned[b % oracles][-b - 1]
        for rank in range(TRAINERS):
            parts = [
                (
                    opb.PlanPart.FromString(planned[s][b][1][rank]).plan,
                    opb.PlanPart.FromString(planned[s][b][0]).rows,
                )
                for s in range(oracles)
            ]
            samples = opb.PlanPart.FromString(carrier[rank]).samples
            out[rank].append(decode_plans(parts, samples, len(TABLE_ROWS), 13, rank, TRAINERS))
    return out, merged_keys


@pytest.mark.parametrize("oracles", [2, 3])
def test_merged_shard_plans_make_every_trainer_do_what_one_oracle_plans(oracles: int) -> None:
    """Unbounded cache: a key's decisions are its own, so every trainer prefetches, updates alone and
    synchronises the same keys as under one oracle, the same keys are written back (by one of their holders,
    which the planner picks per batch to spread the work), and its samples read the same keys."""
    one, _ = run(1)
    many, merged_keys = run(oracles)
    batches = _batches()
    for b in range(BATCHES):
        written = [np.sort(np.concatenate([t[b].share.writeback_keys for t in run_])) for run_ in (one, many)]
        assert np.array_equal(*written)
    for rank in range(TRAINERS):
        for b, (a, m) in enumerate(zip(one[rank], many[rank], strict=True)):
            assert a.batch == m.batch == b
            assert np.array_equal(np.sort(a.share.prefetch_keys), np.sort(m.share.prefetch_keys))
            assert a.share.private_rows.size == m.share.private_rows.size
            assert a.share.critical.slots.size == m.share.critical.slots.size
            assert a.share.background.slots.size == m.share.background.slots.size
            assert a.unique_rows == m.unique_rows and a.last == m.last
            # the samples' rows, prefetches and write-backs, through the merged rows in shard order, are in
            # the slots the shards gave their keys
            slot_of = np.vectorize(merged_keys[b].__getitem__, otypes=[np.int64])
            arrays = batches[b][0]
            per = BATCH // TRAINERS
            keys = arrays.keys[arrays.inverse[rank * per : (rank + 1) * per]]
            assert np.array_equal(m.share.slots[m.share.inverse], slot_of(keys))
            for got_keys, got_slots in (
                (m.share.prefetch_keys, m.share.prefetch_slots),
                (m.share.writeback_keys, m.share.writeback_slots),
            ):
                assert got_keys.size == 0 or np.array_equal(got_slots, slot_of(got_keys))


def test_shard_parts_that_disagree_on_the_batch_are_refused() -> None:
    many, _ = run(2)
    assert many[0][0].batch == 0
    shards = KeyShards(NUM_KEYS, 2)
    planner = LookaheadPlanner(shards.rows(0), 1, trainers=TRAINERS)
    arrays, last = _batches()[0]
    users = trainer_users(arrays.inverse, arrays.keys.size, TRAINERS)
    encoded = []
    for s in range(2):
        part, its_users, _ = oracle_part(arrays, users, shards, s)
        planner = LookaheadPlanner(shards.rows(s), 1, trainers=TRAINERS, shard=(shards, s))
        planner.push(0, part.keys, last=False, users=its_users)
        encoded.append(encode_plans(planner.pop(), [], BATCH, None, TRAINERS))
    samples = encode_batch(oracle_part(arrays, users, shards, 0)[0], last, None, TRAINERS)[1]
    sample = opb.PlanPart.FromString(samples).samples
    plan0 = opb.PlanPart.FromString(encoded[0].plans[0]).plan
    rows0 = opb.PlanPart.FromString(encoded[0].rows).rows
    plan1 = opb.PlanPart.FromString(encoded[1].plans[0]).plan
    rows1 = opb.PlanPart.FromString(encoded[1].rows).rows
    decode_plans([(plan0, rows0), (plan1, rows1)], sample, len(TABLE_ROWS), 13, 0, TRAINERS)
    plan1.last = True
    with pytest.raises(InvalidArgument, match="plan 0: oracle shard 1: last"):
        decode_plans([(plan0, rows0), (plan1, rows1)], sample, len(TABLE_ROWS), 13, 0, TRAINERS)
    plan1.last, rows1.batch = False, 1
    with pytest.raises(InvalidArgument, match="oracle shard 1: rows"):
        decode_plans([(plan0, rows0), (plan1, rows1)], sample, len(TABLE_ROWS), 13, 0, TRAINERS)
    # one part missing: the samples index rows that are not there
    with pytest.raises(InvalidArgument, match="inverse"):
        decode_plans([(plan0, rows0)], sample, len(TABLE_ROWS), 13, 0, TRAINERS)
    rows1.batch = 0
    decode_plans([(plan0, rows0), (plan1, rows1)], sample, len(TABLE_ROWS), 13, 0, TRAINERS)
    # each part is read on its own terms: an index into the merged rows that is outside its own part's, a
    # field of the wrong length, a bitmap of the wrong length, a first batch after this one
    count1 = len(rows1.slots.data) // 4
    for change, field, why in (
        (
            ("rows", "prefetch", np.array([count1], np.int32)),
            "oracle shard 1: rows: prefetch",
            f"index {count1}",
        ),
        (("rows", "sync", np.zeros(count1 + 1, np.uint8)), "oracle shard 1: rows: sync", "shape must be"),
        (("plan", "prefetch_mine", np.zeros(1, np.uint8)), "oracle shard 1: prefetch_mine", "shape must be"),
        (("rows", "first_since", 1), "oracle shard 1: rows: first_since", "must be in [0, 0], got 1"),
    ):
        broken_plan, broken_rows = opb.Plan(), opb.PlanRows()
        broken_plan.CopyFrom(plan1)
        broken_rows.CopyFrom(rows1)
        where, name, value = change
        target = broken_rows if where == "rows" else broken_plan
        if isinstance(value, np.ndarray):
            if name == "prefetch":  # (with its per-prefetch fields cut to one, so only the index is wrong)
                for other in ("prefetch_keys", "prefetch_first"):
                    cut = from_tensor(getattr(broken_rows, other), other, getattr(np, _DTYPES[other]))[:1]
                    getattr(broken_rows, other).CopyFrom(to_tensor(cut))
                broken_plan.prefetch_mine.CopyFrom(to_tensor(np.zeros(1, np.uint8)))
            getattr(target, name).CopyFrom(to_tensor(value))
        else:
            broken_rows.first_since = value
        with pytest.raises(InvalidArgument, match=f"plan 0: {field}") as e:
            decode_plans(
                [(plan0, rows0), (broken_plan, broken_rows)], sample, len(TABLE_ROWS), 13, 0, TRAINERS
            )
        assert why in str(e.value), (field, str(e.value))
