"""K oracle shards through the wire: the data processor's part of each batch for each shard, each shard's
planner and plan in the trainers' terms, and every trainer's merge of the K parts, against one oracle."""

from __future__ import annotations

import dataclasses
from typing import Any

import bagpipe.codec as codec
import numpy as np
import pytest
from bagpipe.codec import decode_batch, decode_plans, encode_batch, encode_plans, plan_part
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


def same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal field by field (arrays: values and dtypes)."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, tuple | list):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def decoded_both_ways(
    parts: list[tuple[bytes, bytes]], samples: Any, rank: int, trainers: int
) -> TrainerBatch:
    """``decode_plans`` of serialised (plan, rows) ``PlanPart`` pairs as a trainer reads them (the rows'
    bytes, ``plan_part``), checked against the same parts parsed as messages: the same batch, or the same
    error."""
    plans = [plan_part(plan, "plan")[1] for plan, _ in parts]
    views = [plan_part(rows, "rows") for _, rows in parts]
    assert all(kind == "rows" and isinstance(view, memoryview) for kind, view in views)
    messages = [opb.PlanPart.FromString(rows).rows for _, rows in parts]
    fast = codec._rows_from_bytes([view for _, view in views], plans[0].batch, trainers)
    results = []
    for rows in ([view for _, view in views], messages):
        try:
            results.append(
                decode_plans(
                    list(zip(plans, rows, strict=True)), samples, len(TABLE_ROWS), 13, rank, trainers
                )
            )
        except InvalidArgument as e:
            results.append(e)
    if isinstance(results[1], InvalidArgument):
        assert isinstance(results[0], InvalidArgument) and str(results[0]) == str(results[1])
        raise results[0]
    assert fast is not None, "parts as encode_plans writes them are read from their bytes"
    same(results[0], results[1])
    return results[0]


def _serialised(plan: opb.Plan, rows: opb.PlanRows) -> tuple[bytes, bytes]:
    return opb.PlanPart(plan=plan).SerializeToString(), opb.PlanPart(rows=rows).SerializeToString()


def run(oracles: int) -> tuple[list[list[TrainerBatch]], list[dict[int, int]]]:
    """Every trainer's decoded batches, planned by ``oracles`` shards (1: the one oracle, unsplit), and the
    trainers' slot of each key of each batch (each read from the rows' bytes and from messages)."""
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
            parts = [(planned[s][b][1][rank], planned[s][b][0]) for s in range(oracles)]
            samples = opb.PlanPart.FromString(carrier[rank]).samples
            out[rank].append(decoded_both_ways(parts, samples, rank, TRAINERS))
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
    decoded_both_ways([_serialised(plan0, rows0), _serialised(plan1, rows1)], sample, 0, TRAINERS)
    plan1.last = True
    with pytest.raises(InvalidArgument, match="plan 0: oracle shard 1: last"):
        decoded_both_ways([_serialised(plan0, rows0), _serialised(plan1, rows1)], sample, 0, TRAINERS)
    plan1.last, rows1.batch = False, 1
    with pytest.raises(InvalidArgument, match="oracle shard 1: rows"):
        decoded_both_ways([_serialised(plan0, rows0), _serialised(plan1, rows1)], sample, 0, TRAINERS)
    # one part missing: the samples index rows that are not there
    with pytest.raises(InvalidArgument, match="inverse"):
        decoded_both_ways([_serialised(plan0, rows0)], sample, 0, TRAINERS)
    rows1.batch = 0
    decoded_both_ways([_serialised(plan0, rows0), _serialised(plan1, rows1)], sample, 0, TRAINERS)
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
            decoded_both_ways(
                [_serialised(plan0, rows0), _serialised(broken_plan, broken_rows)], sample, 0, TRAINERS
            )
        assert why in str(e.value), (field, str(e.value))


def _shard_rows(trainers: int, oracles: int, users: bool) -> list[list[bytes]]:
    """Each batch's serialised ``PlanPart`` rows from each of ``oracles`` shards, for ``trainers`` trainers
    (two random samples a trainer, of two keys each in 400), with the rows' masks when ``users``."""
    rng = np.random.default_rng(trainers + oracles)
    shards = KeyShards(400, oracles)
    planners = [
        LookaheadPlanner(shards.rows(s), 3, trainers=trainers, shard=(shards, s)) for s in range(oracles)
    ]
    out: list[list[bytes]] = []
    for b in range(10):
        keys, inverse = np.unique(rng.integers(0, 400, size=(2 * trainers, 2)), return_inverse=True)
        masks = trainer_users(inverse.reshape(-1, 2).astype(np.int32), keys.size, trainers)
        split = shards.split(keys)
        for s, planner in enumerate(planners):
            index = split.part(s)
            planner.push(b, split.local[index], last=b == 9, users=masks[index])
        while all(p.can_pop() for p in planners):
            plans = [p.pop() for p in planners]
            size = 2 * trainers
            out.append([encode_plans(plan, [], size, None, trainers, users=users).rows for plan in plans])
    return out


@pytest.mark.parametrize(("trainers", "oracles"), [(8, 1), (8, 3), (70, 2), (130, 3)])
@pytest.mark.parametrize("users", [False, True])
def test_rows_read_from_their_bytes_are_the_rows_read_as_messages(
    trainers: int, oracles: int, users: bool
) -> None:
    """A trainer reads the K parts' rows from their bytes, in two compiled passes: the same rows as read
    from the parsed messages, with masks of one word and wide ones (``users``: the replicated cache's)."""
    for parts in _shard_rows(trainers, oracles, users):
        views = [plan_part(p, "rows")[1] for p in parts]
        messages = [opb.PlanPart.FromString(p).rows for p in parts]
        batch = messages[0].batch
        got = codec._rows_from_bytes(views, batch, trainers)
        assert got is not None
        same(got, codec._read_rows(messages, batch, trainers, ["rows"] * oracles))
        assert (got[0].users is not None) == users


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def test_rows_laid_out_otherwise_are_read_as_protobuf_reads_them() -> None:
    """What ``encode_plans`` does not write but protobuf reads is read as protobuf reads it: a field this
    version does not know (the parts are then read as messages), and a dimension written as a field of its
    own rather than packed (read from the bytes)."""
    parts = _shard_rows(8, 2, False)[4]
    views = [plan_part(p, "rows")[1] for p in parts]
    messages = [opb.PlanPart.FromString(p).rows for p in parts]
    batch = messages[0].batch
    want = codec._read_rows(messages, batch, 8, ["rows"] * 2)
    assert messages[1].slots.shape[0] > 0
    unknown = bytes(views[1]) + bytes([0xB2, 0x01, 0x00])  # (field 22, empty: a later version's)
    assert codec._rows_from_bytes([views[0], unknown], batch, 8) is None
    same(codec._read_rows([messages[0], opb.PlanRows.FromString(unknown)], batch, 8, ["rows"] * 2), want)
    rest = opb.PlanRows()
    rest.CopyFrom(messages[1])
    rest.ClearField("slots")
    slots = messages[1].slots
    tensor = b"\x08" + _varint(slots.dtype) + b"\x10" + _varint(slots.shape[0])
    tensor += b"\x1a" + _varint(len(slots.data)) + slots.data
    unpacked = b"\x0a" + _varint(len(tensor)) + tensor + rest.SerializeToString()
    assert opb.PlanRows.FromString(unpacked) == messages[1]
    got = codec._rows_from_bytes([views[0], unpacked], batch, 8)
    assert got is not None
    same(got, want)


def test_a_length_that_would_wrap_around_is_refused_as_protobuf_reads_it() -> None:
    """Dimensions whose products with the item sizes wrap around 64 bits to the data's sizes (the
    evictions' three fields with 2^62 + n rows in their n rows' bytes: 4n, 8n, 4n) are not read from the
    bytes, whose indices they would run past: the message reader refuses them by their sizes."""
    parts = _shard_rows(8, 2, False)[4]
    rows = opb.PlanPart.FromString(parts[1]).rows
    count = len(rows.evict.data) // 4
    assert count
    for name in ("evict", "evict_keys", "evict_writer"):
        getattr(rows, name).shape[0] = 2**62 + count
    views = [plan_part(parts[0], "rows")[1], rows.SerializeToString()]
    assert codec._rows_from_bytes(views, rows.batch, 8) is None
    with pytest.raises(InvalidArgument, match="rows: evict"):
        codec._read_rows([opb.PlanRows.FromString(bytes(v)) for v in views], rows.batch, 8, ["rows"] * 2)
