"""bagpipe.codec: every wire message survives encode -> bytes -> decode unchanged, and a bad one is
refused with the batch and field named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from bagpipe.codec import (
    _check_samples_read,
    _samples_fit,
    check_samples,
    decode_batch,
    decode_plan,
    encode_batch,
    encode_plans,
    trainer_bitmaps,
)
from bagpipe.core.data import SyntheticConfig, SyntheticSource, table_offsets
from bagpipe.core.plans import for_trainer, has_trainer, mask_dtype, mask_words, trainer_users
from bagpipe.data_processor.batches import numbered_batches
from bagpipe.errors import InvalidArgument
from bagpipe.oracle_cacher.lookahead import LookaheadPlanner
from bagpipe.v1 import data_processor_pb2 as dpb
from bagpipe.v1 import oracle_cacher_pb2 as opb
from bagpipe.wire import encode_message, to_tensor

TABLE_ROWS = (40, 7, 300, 5, 90, 3)
BATCH = 24
TRAINERS = 3


def _batches(count: int):
    source = SyntheticSource(SyntheticConfig(table_rows=TABLE_ROWS, seed=3))
    return list(numbered_batches(source, TABLE_ROWS, BATCH, 0, 1, count))


def _wire(message):
    """Through bytes, as gRPC sends it."""
    return type(message).FromString(message.SerializeToString())


def _batch(arrays, last, users=None, slices=0) -> tuple[dpb.Batch, list[bytes]]:
    """The Batch message of ``encode_batch``'s first part, and the serialised parts after it."""
    parts = encode_batch(arrays, last, users, slices)
    head = dpb.BatchPart.FromString(parts[0])
    assert head.WhichOneof("part") == "batch" and head.SerializeToString() == parts[0]
    return head.batch, parts[1:]


def _decode(message: dpb.Batch, trainers: int = TRAINERS, slices: int = 0):
    num_keys = int(table_offsets(TABLE_ROWS)[-1])
    return decode_batch(
        _wire(message),
        num_keys=num_keys,
        batch_size=BATCH,
        num_tables=len(TABLE_ROWS),
        trainers=trainers,
        slices=slices,
    )


def _same(a, b) -> None:
    """Dataclasses of arrays (nested) and scalars are equal field by field, dtype included."""
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x):
            _same(x, y)
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def test_batch_round_trip_with_and_without_trainer_masks() -> None:
    for arrays, last in _batches(3):
        users = trainer_users(arrays.inverse, arrays.keys.size, TRAINERS)
        message, rest = _batch(arrays, last, users)
        got = _decode(message)
        assert not rest and got.arrays is not None
        _same(got.arrays, arrays)
        assert got.last == last and got.number == arrays.number and np.array_equal(got.keys, arrays.keys)
        # (the masks cross in the planner's width: one byte a key for 3 trainers)
        assert message.users.shape == [arrays.keys.size, 1] and len(message.users.data) == arrays.keys.size
        assert got.users is not None and got.users.dtype == mask_dtype(TRAINERS)
        assert np.array_equal(got.users, users)
        plain = _decode(_batch(arrays, last)[0])
        assert plain.users is None and plain.arrays is not None
        _same(plain.arrays, arrays)
    assert [last for _, last in _batches(3)] == [False, False, True]


def test_a_batch_in_slices_is_its_keys_then_every_trainers_samples_as_a_plan_part() -> None:
    arrays, last = _batches(2)[1]
    users = trainer_users(arrays.inverse, arrays.keys.size, TRAINERS)
    message, samples = _batch(arrays, last, users, slices=TRAINERS)
    got = _decode(message, slices=TRAINERS)
    assert got.arrays is None and got.number == 1 and got.last == last
    assert np.array_equal(got.keys, arrays.keys) and np.array_equal(got.users, users)
    assert len(samples) == TRAINERS
    per = BATCH // TRAINERS
    for rank, data in enumerate(samples):
        assert check_samples(data, 1, rank, per) is data  # forwarded as it came
        part = dpb.BatchPart.FromString(data)
        # the same bytes are the trainer's PlanPart: the oracle forwards them without a copy
        assert opb.PlanPart.FromString(data).SerializeToString() == data == part.SerializeToString()
        sent = opb.PlanPart.FromString(data).samples
        assert (sent.batch, sent.rank) == (1, rank)
        for name, full in (("dense", arrays.dense), ("labels", arrays.labels), ("inverse", arrays.inverse)):
            tensor = getattr(sent, name)
            want = full[rank * per : (rank + 1) * per]
            assert list(tensor.shape) == list(want.shape) and tensor.data == want.tobytes(), name
    with pytest.raises(
        InvalidArgument,
        match=r"batch 1: samples: are batch 1's for trainer 1, expected batch 1's for trainer 0",
    ):
        check_samples(samples[1], 1, 0, per)
    with pytest.raises(
        InvalidArgument,
        match=r"batch 2: samples: are batch 1's for trainer 0, expected batch 2's for trainer 0",
    ):
        check_samples(samples[0], 2, 0, per)
    with pytest.raises(
        InvalidArgument, match=r"batch 1: samples: expected trainer 0's samples, got another part"
    ):
        check_samples(encode_batch(arrays, last)[0], 1, 0, per)
    with pytest.raises(
        InvalidArgument, match=r"batch 1: samples: expected trainer 0's samples, got an empty part"
    ):
        check_samples(b"", 1, 0, per)
    # a processor with another batch size is refused by the oracle, before the batch is planned
    with pytest.raises(
        InvalidArgument, match=rf"batch 1: samples: labels: shape must be \[{per + 1}\], got \[{per}\]"
    ):
        check_samples(samples[0], 1, 0, per + 1)
    with pytest.raises(ValueError, match="batch 1: 24 samples do not split into 5"):
        encode_batch(arrays, last, None, 5)
    whole, _ = _batch(arrays, last, users)
    with pytest.raises(InvalidArgument, match=r"batch 1: dense: the samples were asked for in 3 slices"):
        _decode(whole, slices=TRAINERS)


def _read_in_python(data: bytes, batch: int, rank: int, size: int) -> bool:
    try:
        _check_samples_read(data, batch, rank, size)
    except InvalidArgument:
        return False
    return True


def test_the_compiled_samples_check_accepts_exactly_what_the_python_reader_accepts() -> None:
    """``check_samples`` answers from a compiled pass where it can (``_samples_fit``): it must accept
    only parts the field-by-field Python reader accepts, and accept the parts data processors and
    protobuf write, so that only a bad part pays for the Python reader, which says what is wrong."""
    arrays, last = _batches(2)[1]
    users = trainer_users(arrays.inverse, arrays.keys.size, TRAINERS)
    _, samples = _batch(arrays, last, users, slices=TRAINERS)
    per = BATCH // TRAINERS
    labels = arrays.labels[:per]
    written = [
        *samples,  # as encode_batch writes them, and as protobuf does, with fields in other orders,
        dpb.BatchPart(samples=dpb.BatchPart.FromString(samples[0]).samples).SerializeToString(),
    ]
    reordered = dpb.Samples(batch=1, rank=0, labels=to_tensor(labels))
    written.append(b"\x1a" + bytes([len(reordered.SerializeToString())]) + reordered.SerializeToString())
    for rank, data in enumerate(samples):
        assert _samples_fit(np.frombuffer(data, dtype=np.uint8), 1, rank, per)
    for data in written[TRAINERS:]:
        assert _samples_fit(np.frombuffer(data, dtype=np.uint8), 1, 0, per)
    rng = np.random.default_rng(5)
    tried = accepted = 0
    for data in written:
        for rank, batch, size in ((0, 1, per), (1, 1, per), (0, 2, per), (0, 1, per + 1), (0, 1, 0)):
            cases = [data, data[:-1], data + b"\x00", b"", data[: len(data) // 2]]
            for _ in range(60):  # bytes flipped at random, then bytes of the head (tags, sizes, scalars)
                mutated = bytearray(data)
                where = rng.integers(0, len(data) if rng.random() < 0.5 else min(len(data), 24))
                mutated[where] = rng.integers(0, 256)
                cases.append(bytes(mutated))
            for case in cases:
                fast = bool(_samples_fit(np.frombuffer(case, dtype=np.uint8), batch, rank, size))
                assert fast == _read_in_python(case, batch, rank, size), (case[:32], batch, rank, size)
                tried += 1
                accepted += fast
    assert accepted > 50 and tried > 1000
    # a length of 2^63 or more is past the end, not a step back (that looped, or landed on a field that
    # ended the message where the Python reader refuses it)
    inner = dpb.Samples(batch=1, rank=0, labels=to_tensor(labels)).SerializeToString()
    for tail in (b"\x3a" + _varint(2**64 - 11), b"\x48\x8a\x01\x0a" + _varint(2**64 - 13)):
        case = b"\x1a" + _varint(len(inner + tail)) + inner + tail
        assert not _samples_fit(np.frombuffer(case, dtype=np.uint8), 1, 0, per)
        assert not _read_in_python(case, 1, 0, per)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


def test_batch_masks_of_64_trainers_keep_the_top_bit() -> None:
    arrays, _ = _batches(1)[0]
    users = np.full(arrays.keys.size, np.uint64(1) << np.uint64(63), dtype=np.uint64)
    got = _decode(_batch(arrays, False, users)[0], trainers=64)
    assert got.users is not None and np.array_equal(got.users, users)


@pytest.mark.parametrize(
    ("corrupt", "field"),
    [
        (lambda m: m.labels.CopyFrom(to_tensor(np.zeros(BATCH - 1, np.float32))), "batch 0: labels"),
        (lambda m: m.dense.CopyFrom(to_tensor(np.zeros((BATCH, 2), np.int64))), "batch 0: dense"),
        (lambda m: m.keys.CopyFrom(to_tensor(np.array([5, 3, 9], np.int64))), "batch 0: keys"),
        (lambda m: m.keys.CopyFrom(to_tensor(np.array([0, 1], np.int64))), "batch 0: inverse"),
        (lambda m: m.keys.CopyFrom(to_tensor(np.zeros((2, 2), np.int64))), "batch 0: keys"),
        (lambda m: m.inverse.CopyFrom(to_tensor(np.zeros((BATCH, 2), np.int32))), "batch 0: inverse"),
        (lambda m: m.users.CopyFrom(to_tensor(np.zeros(1, np.int64))), "batch 0: users"),
    ],
)
def test_bad_batches_name_the_field(corrupt, field) -> None:
    arrays, last = _batches(1)[0]
    message, _ = _batch(arrays, last)
    corrupt(message)
    with pytest.raises(InvalidArgument) as err:
        _decode(message)
    assert str(err.value).startswith(field), str(err.value)


def test_bad_keys_and_masks_are_refused() -> None:
    arrays, last = _batches(1)[0]
    num_keys = int(table_offsets(TABLE_ROWS)[-1])
    repeated = arrays.keys.copy()
    repeated[-2] = repeated[-3]  # (one key twice, in order, near the end)
    cases = [
        ("keys outside", np.concatenate([arrays.keys[:-1], [num_keys]])),
        ("sorted and unique", arrays.keys[::-1].copy()),
        ("sorted and unique", repeated),
    ]
    for reason, keys in cases:
        message, _ = _batch(arrays, last)
        message.keys.CopyFrom(to_tensor(keys))
        with pytest.raises(InvalidArgument, match=reason):
            _decode(message)
    users = trainer_users(arrays.inverse, arrays.keys.size, TRAINERS)
    users[0] = 1 << TRAINERS  # a trainer that does not exist
    with pytest.raises(InvalidArgument, match=r"batch 0: users: masks outside \[1, 7\] for 3 trainers"):
        _decode(_batch(arrays, last, users)[0])


def _plans(checkpoint_after: int | None = None):
    """(batch arrays, global plan, its rows message, per-trainer plan and samples messages, checkpoint
    rows) of a few planned batches."""
    num_keys = int(table_offsets(TABLE_ROWS)[-1])
    planner = LookaheadPlanner(num_keys, 3, trainers=TRAINERS)
    batches = _batches(6)
    out = []

    def pop() -> None:
        plan = planner.pop()
        arrays, last = batches[plan.batch]
        cached = planner.cached() if plan.batch == checkpoint_after else None
        samples = encode_batch(arrays, last, None, TRAINERS)[1:]
        encoded = encode_plans(plan, samples, BATCH, cached)
        assert encoded.samples == samples  # forwarded as they are
        # the hand-written bytes are protobuf's own encoding of the same messages
        parts = [opb.PlanPart.FromString(data) for data in [encoded.rows, *encoded.plans, *samples]]
        assert [p.SerializeToString() for p in parts] == [encoded.rows, *encoded.plans, *samples]
        assert parts[0].WhichOneof("part") == "rows" and parts[0].rows.batch == plan.batch
        assert all(p.WhichOneof("part") == "plan" for p in parts[1 : 1 + TRAINERS])
        assert all(p.WhichOneof("part") == "samples" for p in parts[1 + TRAINERS :])
        plans = [p.plan for p in parts[1 : 1 + TRAINERS]]
        out.append((arrays, plan, parts[0].rows, plans, [p.samples for p in parts[1 + TRAINERS :]], cached))

    for arrays, last in batches:
        while not planner.wants_more():
            pop()
        users = trainer_users(arrays.inverse, arrays.keys.size, TRAINERS)
        assert planner.push(arrays.number, arrays.keys, last=last, users=users)
    planner.finish()
    while planner.can_pop():
        pop()
    return out


def test_plan_round_trip_is_each_trainers_share() -> None:
    planned = _plans(checkpoint_after=2)
    assert len(planned) == 6
    for arrays, plan, rows, messages, samples, cached in planned:
        assert len(messages) == TRAINERS
        per = BATCH // TRAINERS
        for rank, message in enumerate(messages):
            got = decode_plan(
                _wire(message),
                _wire(samples[rank]),
                _wire(rows),
                len(TABLE_ROWS),
                arrays.dense.shape[1],
                rank,
                TRAINERS,
            )
            _same(got.share, for_trainer(plan, arrays.inverse, rank, TRAINERS))
            assert np.array_equal(got.dense, arrays.dense[rank * per : (rank + 1) * per])
            assert np.array_equal(got.labels, arrays.labels[rank * per : (rank + 1) * per])
            assert (got.batch, got.last, got.global_batch_size) == (plan.batch, plan.last, BATCH)
            assert (got.lookahead, got.occupancy, got.unique_rows) == (
                plan.window,
                plan.occupancy,
                plan.unique,
            )
            assert got.slot_high_water == plan.slot_high_water
            assert got.checkpoint == (cached is not None)
            if cached is not None:
                keys, slots, writer = cached
                assert np.array_equal(got.checkpoint_keys, keys[writer == rank])
                assert np.array_equal(got.checkpoint_slots, slots[writer == rank])
    # the checkpoint's rows are split between the trainers, each written exactly once
    _, _, rows, messages, samples, (keys, _, _) = planned[2]
    written = np.concatenate(
        [
            decode_plan(m, samples[r], rows, len(TABLE_ROWS), 13, r, TRAINERS).checkpoint_keys
            for r, m in enumerate(messages)
        ]
    )
    assert np.array_equal(np.sort(written), np.sort(keys))


def test_a_plan_with_another_batchs_rows_is_refused() -> None:
    planned = _plans()
    (_, _, _, messages, samples, _), (_, _, rows, _, later, _) = planned[0], planned[1]
    with pytest.raises(InvalidArgument, match=r"plan 0: rows: are batch 1's"):
        decode_plan(messages[0], samples[0], rows, len(TABLE_ROWS), 13, 0, TRAINERS)
    _, _, rows, _, _, _ = planned[0]
    with pytest.raises(
        InvalidArgument, match=r"batch 0: samples: are batch 1's for trainer 0, expected batch 0's"
    ):
        decode_plan(messages[0], later[0], rows, len(TABLE_ROWS), 13, 0, TRAINERS)
    with pytest.raises(
        InvalidArgument,
        match=r"batch 0: samples: are batch 0's for trainer 1, expected batch 0's for trainer 0",
    ):
        decode_plan(messages[0], samples[1], rows, len(TABLE_ROWS), 13, 0, TRAINERS)


def test_masks_of_up_to_256_trainers_cross_the_wire() -> None:
    inverse = np.arange(256 * 2, dtype=np.int32).reshape(256, 2) % 40
    arrays = _batches(1)[0][0]
    arrays = dataclasses.replace(
        arrays,
        dense=np.zeros((256, arrays.dense.shape[1]), np.float32),
        labels=np.zeros(256, np.float32),
        keys=np.arange(40, dtype=np.int64),
        inverse=inverse,
    )
    for trainers in (8, 16, 64, 128, 256):  # one-, two- and eight-byte masks; wide ones of 2 and 4 words
        users = trainer_users(inverse, 40, trainers)
        # the batch's masks too: sent by the data processor, read by the oracle
        batch, _ = _batch(arrays, True, users, trainers)
        got_batch = decode_batch(
            _wire(batch), num_keys=40, batch_size=256, num_tables=2, trainers=trainers, slices=trainers
        )
        assert got_batch.users is not None and np.array_equal(got_batch.users, users)
        planner = LookaheadPlanner(40, 2, trainers=trainers)
        planner.push(0, arrays.keys, last=True, users=users)
        plan = planner.pop()
        encoded = encode_plans(plan, encode_batch(arrays, True, None, trainers)[1:], 256)
        rows = opb.PlanPart.FromString(encoded.rows).rows
        for rank, data in enumerate(encoded.plans):
            message = opb.PlanPart.FromString(data).plan
            samples = opb.PlanPart.FromString(encoded.samples[rank]).samples
            got = decode_plan(message, samples, rows, 2, arrays.dense.shape[1], rank, trainers)
            _same(got.share, for_trainer(plan, inverse, rank, trainers))
            per = 256 // trainers
            mine = np.unique(inverse[rank * per : (rank + 1) * per])
            assert np.array_equal(got.share.slots, plan.slots[mine])


def test_bad_plans_name_the_batch_and_field() -> None:
    arrays, _, good_rows, messages, good_samples, _ = _plans()[1]
    dims = (len(TABLE_ROWS), arrays.dense.shape[1], 0, TRAINERS)
    decode_plan(messages[0], good_samples[0], good_rows, *dims)

    def corrupted(change):
        """(plan, samples, rows) after ``change`` edits copies of them (samples take the plan's place
        in ``change`` for the fields only they have: dense, labels, inverse)."""
        plan, samples, rows = opb.Plan(), dpb.Samples(), opb.PlanRows()
        plan.CopyFrom(messages[0])
        samples.CopyFrom(good_samples[0])
        rows.CopyFrom(good_rows)
        change(samples if change in sample_changes else plan, rows)
        return plan, samples, rows

    unique = decode_plan(messages[0], good_samples[0], good_rows, *dims).unique_rows
    high = messages[0].slot_high_water

    def handover(send_bytes: int):
        """One hand-over, which this trainer sends (its bitmap ``send_bytes`` long: one byte is right)."""

        def change(plan: opb.Plan, rows: opb.PlanRows) -> None:
            rows.handover_slots.CopyFrom(to_tensor(np.zeros(1, np.int32)))
            rows.handover_critical.CopyFrom(to_tensor(np.ones(1, bool)))
            plan.handover_send.CopyFrom(to_tensor(np.ones(send_bytes, np.uint8)))
            plan.handover_recv.CopyFrom(to_tensor(np.zeros(1, np.uint8)))

        return change

    def bad_inverse(m, _) -> None:
        m.inverse.CopyFrom(to_tensor(np.full((BATCH // TRAINERS, 6), unique, np.int32)))

    def bad_dense(m, _) -> None:
        m.dense.CopyFrom(to_tensor(np.zeros((BATCH // TRAINERS, 2), np.float32)))

    def few_labels(m, _) -> None:
        m.labels.CopyFrom(to_tensor(np.zeros(BATCH // TRAINERS - 1, np.float32)))

    sample_changes = (bad_inverse, bad_dense, few_labels)
    sent = decode_plan(*corrupted(handover(1)), *dims)  # a well-formed hand-over passes
    assert sent.share.critical.handover_send.tolist() == [0] and not sent.share.critical.handover_recv.size
    cases = [
        (bad_inverse, rf"batch 1: samples: inverse: index {unique} outside \[0, {unique}\)"),
        (bad_dense, r"batch 1: samples: dense: shape must be \[8, 13\], got \[8, 2\]"),
        (few_labels, r"batch 1: samples: labels: shape must be \[8\], got \[7\]"),
        (
            lambda m, _: setattr(m, "global_batch_size", 25),
            r"plan 1: global_batch_size: 25 does not split over 3 trainers",
        ),
        (
            lambda _, r: r.slots.CopyFrom(to_tensor(np.full(unique, high, np.int32))),
            rf"plan 1: rows: slots: index {high} outside \[0, {high}\)",
        ),
        (
            lambda _, r: r.users.CopyFrom(to_tensor(np.zeros((unique, 1), np.uint8))),
            r"plan 1: rows: users: masks outside \[1, 7\] for 3 trainers",
        ),
        (
            lambda _, r: r.users.CopyFrom(to_tensor(np.ones((unique, 2), np.uint8))),
            r"plan 1: rows: users: shape must be",
        ),
        (
            lambda _, r: r.users.CopyFrom(to_tensor(np.full((unique, 1), 2, np.uint8))),
            r"plan 1: rows: users: row \d+ is used by trainer 0's samples, but its mask leaves 0 out",
        ),
        (
            lambda _, r: r.sync.CopyFrom(to_tensor(np.full(unique, 3, np.uint8))),
            r"plan 1: rows: sync: values must be in \[0, 2\], got 3",
        ),
        (
            lambda _, r: r.prefetch.CopyFrom(to_tensor(np.array([-1], np.int32))),
            r"plan 1: rows: prefetch: index -1",
        ),
        (
            lambda _, r: r.prefetch_keys.CopyFrom(to_tensor(np.zeros(10**3, np.int64))),
            r"plan 1: rows: prefetch_keys: shape must be",
        ),
        (
            lambda _, r: r.evict_writer.CopyFrom(to_tensor(np.full(r.evict.shape[0], 3, np.int32))),
            r"plan 1: rows: evict_writer: index 3 outside \[0, 3\)",
        ),
        (handover(2), r"plan 1: handover_send: shape must be \[1\], got \[2\]"),
        (
            lambda m, _: m.prefetch_mine.CopyFrom(to_tensor(np.zeros(10**3, np.uint8))),
            r"plan 1: prefetch_mine: shape must be",
        ),
        (
            lambda _, r: r.handover_critical.CopyFrom(to_tensor(np.ones(7, bool))),
            r"plan 1: rows: handover_critical: shape must be",
        ),
        (
            lambda _, r: r.prefetch_first.CopyFrom(to_tensor(np.ones(10**3, bool))),
            r"plan 1: rows: prefetch_first: shape must be",
        ),
        (
            lambda _, r: setattr(r, "first_since", 2),
            r"plan 1: rows: first_since: must be in \[0, 1\], got 2",
        ),
    ]
    for change, message in cases:
        plan, samples, rows = corrupted(change)
        if "evict_writer" in message and not rows.evict.shape[0]:
            continue  # nothing evicted in this batch to corrupt
        with pytest.raises(InvalidArgument, match=message):
            decode_plan(plan, samples, rows, *dims)


def test_wide_masks_naming_no_trainer_or_one_beyond_are_refused() -> None:
    arrays, _ = _batches(1)[0]
    users = np.zeros((arrays.keys.size, 3), dtype=np.uint64)
    users[:, 0] = 1
    assert _decode(_batch(arrays, False, users)[0], trainers=130).users is not None
    beyond = users.copy()
    beyond[2, 2] = np.uint64(1) << np.uint64(2)  # trainer 130 of 0..129
    with pytest.raises(InvalidArgument, match=r"batch 0: users: mask 2 names no trainer, or one beyond"):
        _decode(_batch(arrays, False, beyond)[0], trainers=130)
    empty = users.copy()
    empty[1] = 0
    with pytest.raises(InvalidArgument, match=r"mask 1 names no trainer"):
        _decode(_batch(arrays, False, empty)[0], trainers=130)


def test_rows_sent_without_masks_give_every_trainer_the_same_share() -> None:
    """With LRPP the oracle sends the batch's rows without their masks: each trainer takes the rows its
    samples use, which is what the data processors' masks say, so every share is the same, and the rows'
    message is smaller by a mask a row."""
    for arrays, plan, rows, messages, samples, _ in _plans():
        bare = encode_plans(
            plan, [s.SerializeToString() for s in samples], BATCH, None, TRAINERS, users=False
        )
        bare_rows = opb.PlanPart.FromString(bare.rows).rows
        assert not bare_rows.HasField("users") and len(bare.rows) < rows.ByteSize() + 8
        for rank, message in enumerate(messages):
            dims = (len(TABLE_ROWS), arrays.dense.shape[1], rank, TRAINERS)
            with_masks = decode_plan(_wire(message), _wire(samples[rank]), _wire(rows), *dims)
            without = decode_plan(_wire(message), _wire(samples[rank]), _wire(bare_rows), *dims)
            _same(without.share, with_masks.share)


@pytest.mark.parametrize("trainers", [3, 8, 16, 64, 70, 256])
@pytest.mark.parametrize("count", [0, 1, 13, 1001])
def test_each_trainers_bitmap_is_its_bits_of_the_masks(trainers: int, count: int) -> None:
    """``trainer_bitmaps`` (8x8 bit blocks transposed) gives each trainer what packing its bits would."""
    rng = np.random.default_rng(trainers * 1000 + count)
    words = mask_words(trainers)
    if words:
        masks = rng.integers(0, 2**63, size=(count, words), dtype=np.uint64) << np.uint64(1)
        if trainers % 64:
            masks[:, -1] &= np.uint64((1 << (trainers % 64)) - 1)
    else:
        masks = rng.integers(0, 1 << trainers, size=count, dtype=np.uint64).astype(mask_dtype(trainers))
    got = trainer_bitmaps(masks, trainers)
    assert got.shape == (trainers, (count + 7) // 8)
    for t in range(trainers):
        assert np.array_equal(got[t], np.packbits(has_trainer(masks, t), bitorder="little")), t


@pytest.mark.parametrize("trainers", [1, 3, 8, 9, 70, 256])
def test_each_trainers_plan_is_protobufs_own_message_of_its_fields(trainers: int) -> None:
    """Each trainer's ``Plan`` bytes (written for all trainers in one compiled pass) are what protobuf
    writes for a ``Plan`` made field by field: the scalars, a negative and a long ``depends_on``, fields
    at 0 (left out), and the trainer's bits of the prefetches' and hand-overs' masks, none of them too."""
    rng = np.random.default_rng(trainers)
    words = mask_words(trainers)

    def masks(count: int) -> np.ndarray:
        if words:
            m = rng.integers(1, 2**63, size=(count, words), dtype=np.uint64)
            if trainers % 64:
                m[:, -1] &= np.uint64((1 << (trainers % 64)) - 1)
            return m
        return rng.integers(1, 1 << trainers, size=count, dtype=np.uint64).astype(mask_dtype(trainers))

    arrays, _ = _batches(1)[0]
    planner = LookaheadPlanner(int(table_offsets(TABLE_ROWS)[-1]), 1, trainers=trainers)
    planner.push(0, arrays.keys, last=True, users=masks(arrays.keys.size))
    plan = planner.pop()
    cases = [(-1, 0, 7, 0), (2**40 + 3, 129, 0, 300), (0, 1, 1001, 17)]  # depends_on, window, P, H
    for depends_on, window, prefetches, handovers in cases:
        h = plan.handovers
        cut = dataclasses.replace(
            h,
            keys=np.arange(handovers, dtype=np.int64),
            slots=np.arange(handovers, dtype=np.int32),
            source=masks(handovers),
            recipients=masks(handovers),
            critical=np.zeros(handovers, dtype=bool),
        )
        odd = dataclasses.replace(
            plan, depends_on=depends_on, window=window, prefetch_holders=masks(prefetches), handovers=cut
        )
        encoded = encode_plans(odd, [], 0 if window else BATCH, None, trainers, users=False)
        assert len(encoded.plans) == trainers
        for rank, got in enumerate(encoded.plans):
            bits = [
                np.packbits(has_trainer(m, rank), bitorder="little")
                for m in (odd.prefetch_holders, cut.source, cut.recipients)
            ]
            want = opb.Plan(
                batch=odd.batch,
                slot_high_water=odd.slot_high_water,
                global_batch_size=0 if window else BATCH,
                last=odd.last,
                lookahead=window,
                depends_on=depends_on,
                occupancy=odd.occupancy,
                prefetch_mine=to_tensor(bits[0]),
                handover_send=to_tensor(bits[1]),
                handover_recv=to_tensor(bits[2]),
            )
            assert got == opb.PlanPart(plan=want).SerializeToString(), (depends_on, rank)


def test_int64_masks_of_an_older_processor_are_not_taken_for_masks() -> None:
    """A processor from before the masks took field 8 sends them as int64 in field 7, which is reserved:
    the batch reads as one without masks (the oracle then says the processor sent none)."""
    arrays, last = _batches(1)[0]
    users = trainer_users(arrays.inverse, arrays.keys.size, TRAINERS).astype(np.int64)
    fields = [(1, arrays.number), (2, arrays.dense), (3, arrays.labels), (4, arrays.keys)]
    old = encode_message([(1, [*fields, (5, arrays.inverse), (6, last), (7, users)])])
    head = dpb.BatchPart.FromString(old)
    assert not head.batch.HasField("users")
    got = _decode(head.batch)
    assert got.users is None and np.array_equal(got.keys, arrays.keys)
