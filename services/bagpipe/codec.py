"""The wire messages of the training path, built and read in one place.

(Over 400 lines: the three messages of the training path are written and read here together, so that
every check on the way in sits beside the encoding it checks.)

* ``BatchPart`` (data processor -> oracle): :func:`encode_batch` writes a batch, whole or (with
  ``slices``) as its keys and masks followed by every trainer's ``Samples``; :func:`decode_batch` reads
  the batch and :func:`check_samples` a trainer's samples, which the oracle forwards as they came.
* ``PlanPart`` (oracle -> one trainer): :func:`encode_plans` writes the batch's rows once for every
  trainer, and each trainer's ``Plan``; the trainer's ``Samples`` go between them. :func:`decode_plan`
  reads a plan with its rows and samples and cuts the trainer's share out of the rows, into
  :class:`TrainerBatch`.

Decoding validates everything the receiver indexes with (dtypes, shapes, index ranges, trainer masks)
and raises :class:`~bagpipe.errors.InvalidArgument` naming the batch and the field, so a bad message is
refused before it changes any state. Decoded arrays are read-only views of the message bytes (no copy),
but for the K parts of a plan's rows, each field of which is copied once into one block.
Tensors themselves are raw little-endian bytes (``bagpipe.wire``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from bagpipe.core.data import BatchArrays, table_offsets
from bagpipe.core.plans import (
    BACKGROUND,
    BatchPlan,
    SharedPlan,
    TrainerBatch,
    TrainerBits,
    mask_dtype,
    mask_words,
    masks_shape,
    outside_trainers,
    share,
    shared_plan,
)
from bagpipe.errors import InvalidArgument
from bagpipe.v1 import data_processor_pb2 as dpb
from bagpipe.v1 import oracle_cacher_pb2 as opb
from bagpipe.v1 import tensor_pb2
from bagpipe.wire import (
    DTYPE_CODES,
    encode_message,
    from_tensor,
    read_shallow,
    read_tensor,
    unwrap,
)


def _tensor(msg: Any, name: str, dtype: Any, where: str, **kw: Any) -> np.ndarray:
    return from_tensor(getattr(msg, name), (where, name), dtype, **kw)


def _check_index(values: np.ndarray, bound: int, field: str) -> None:
    if values.size and (values.min() < 0 or values.max() >= bound):
        bad = values[(values < 0) | (values >= bound)][0]
        raise InvalidArgument(field, f"index {int(bad)} outside [0, {bound})")


@njit(cache=True, nogil=True)
def _values_fine(dense, labels):  # type: ignore[no-untyped-def]
    """Whether every dense feature is finite and every label 0 or 1: one pass over each, no temporary."""
    wrong = 0
    for i in range(dense.size):
        wrong += not np.isfinite(dense[i])
    for i in range(labels.size):
        wrong += labels[i] != 0 and labels[i] != 1
    return wrong == 0


def _check_values(dense: np.ndarray, labels: np.ndarray, where: str) -> None:
    """Dense features finite and labels 0 or 1 (one compiled pass); the error names the first bad
    sample."""
    if _values_fine(dense.reshape(-1), labels.reshape(-1)):
        return
    finite = np.isfinite(dense)
    if not finite.all():
        i, j = (int(x) for x in np.unravel_index(int(np.argmin(finite)), finite.shape))
        value = float(dense[i, j])
        raise InvalidArgument(f"{where}: dense", f"sample {i}, feature {j}: value {value} is not finite")
    binary = (labels == 0) | (labels == 1)
    if not binary.all():
        i = int(np.argmin(binary))
        raise InvalidArgument(f"{where}: labels", f"sample {i}: label {float(labels[i])} is not 0 or 1")


def _check_tables(keys: np.ndarray, inverse: np.ndarray, table_rows: Sequence[int], where: str) -> None:
    """Each sample's key in column ``t`` is a row of table ``t``: in ``[offsets[t], offsets[t+1])``."""
    offsets = table_offsets(table_rows)
    if inverse.shape[1] != offsets.size - 1:
        tables = offsets.size - 1
        raise InvalidArgument(f"{where}: inverse", f"{inverse.shape[1]} columns for {tables} tables")
    used = keys[inverse]
    outside = (used < offsets[:-1]) | (used >= offsets[1:])
    if outside.any():
        i, t = (int(x) for x in np.unravel_index(int(np.argmax(outside)), outside.shape))
        row = int(used[i, t] - offsets[t])
        raise InvalidArgument(
            f"{where}: inverse",
            f"sample {i}, table {t}: row {row} outside the table's [0, {int(table_rows[t])})",
        )


# ---- Batch: data processor -> oracle


@dataclass(frozen=True)
class WireBatch:
    """A decoded ``Batch``: its number, sorted unique keys and the stream's extras.

    ``users`` (``mask_dtype(trainers)`` ``[U]``, ``[U, words]`` for wide masks, or None when the processor
    was not asked) holds, per key, the bit mask of the trainers whose samples use it. ``arrays`` is the
    whole batch when it came with its samples, and None when they came cut per trainer (``slices``).
    """

    number: int
    keys: np.ndarray
    last: bool
    users: np.ndarray | None
    arrays: BatchArrays | None = None


def encode_batch(
    arrays: BatchArrays,
    last: bool,
    users: np.ndarray | None = None,
    slices: int = 0,
    with_samples: bool = True,
) -> list[bytes]:
    """The serialised ``BatchPart``s of one batch: the ``Batch`` alone (with its samples), or with
    ``slices`` > 0 the ``Batch`` without them followed by one ``Samples`` per trainer, in rank order (none
    without ``with_samples``: an oracle shard that does not carry the batch's samples).
    ``users``: the per-key trainer masks as ``trainer_users`` gives them (``mask_dtype(trainers)``: one
    byte a key up to 8 trainers), or None; on the wire, each mask's little-endian bytes."""
    masks = _mask_bytes(users) if users is not None else None
    whole = not slices
    head = [
        (1, arrays.number),
        (2, arrays.dense if whole else None),
        (3, arrays.labels if whole else None),
        (4, arrays.keys),
        (5, arrays.inverse if whole else None),
        (6, last),
        (8, masks),
    ]
    parts = [encode_message([(1, head)])]
    if slices and with_samples:
        if arrays.labels.shape[0] % slices:
            raise ValueError(
                f"batch {arrays.number}: {arrays.labels.shape[0]} samples do not split into {slices}"
            )
        per = arrays.labels.shape[0] // slices
        for rank in range(slices):
            sl = slice(rank * per, (rank + 1) * per)
            sample = [
                (1, arrays.number),
                (2, arrays.dense[sl]),
                (3, arrays.labels[sl]),
                (4, arrays.inverse[sl]),
            ]
            parts.append(encode_message([(3, [*sample, (5, rank)])]))
    return parts


def decode_batch(
    msg: dpb.Batch,
    *,
    num_keys: int,
    batch_size: int,
    num_tables: int,
    trainers: int,
    slices: int = 0,
    table_rows: Sequence[int] | None = None,
) -> WireBatch:
    """Reads and checks a ``Batch``: sorted unique keys in ``[0, num_keys)``, (when present) masks naming
    only trainers ``0..trainers-1``, and unless its samples come in ``slices``, ``batch_size`` samples of
    ``num_tables`` key columns indexing the keys (with them, it must carry none), with finite dense
    features, labels 0 or 1 and (given ``table_rows``) each column's keys inside its table."""
    where = f"batch {msg.number}"
    keys = _tensor(msg, "keys", np.int64, where, ndim=1)
    if keys.size and (keys[0] < 0 or keys[-1] >= num_keys):
        raise InvalidArgument(f"{where}: keys", f"keys outside [0, {num_keys})")
    if keys.size > 1 and not _increasing(keys):
        raise InvalidArgument(f"{where}: keys", "must be sorted and unique")
    users = None
    if msg.HasField("users"):
        users = _masks(msg, "users", where, keys.size, trainers)
        _check_masks(users, trainers, f"{where}: users")
    if slices:
        for name in ("dense", "labels", "inverse"):
            if msg.HasField(name):
                raise InvalidArgument(f"{where}: {name}", f"the samples were asked for in {slices} slices")
        return WireBatch(msg.number, keys, msg.last, users)
    labels = _tensor(msg, "labels", np.float32, where, ndim=1)
    if labels.size != batch_size:
        raise InvalidArgument(f"{where}: labels", f"{labels.size} samples, expected {batch_size}")
    dense = _tensor(msg, "dense", np.float32, where, ndim=2)
    if dense.shape[0] != batch_size:
        raise InvalidArgument(f"{where}: dense", f"{dense.shape[0]} rows, expected {batch_size}")
    inverse = _tensor(msg, "inverse", np.int32, where, shape=(batch_size, num_tables))
    _check_index(inverse, keys.size, f"{where}: inverse")
    _check_values(dense, labels, where)
    if table_rows is not None:
        _check_tables(keys, inverse, table_rows, where)
    return WireBatch(msg.number, keys, msg.last, users, BatchArrays(msg.number, dense, labels, keys, inverse))


@njit(cache=True, nogil=True)
def _increasing(keys):  # type: ignore[no-untyped-def]
    """Whether ``keys`` increase strictly (sorted and unique): one pass, no temporary (and no early exit,
    so that the compiler vectorises it)."""
    wrong = 0
    for i in range(1, keys.size):
        wrong += keys[i] <= keys[i - 1]
    return wrong == 0


def check_samples(data: bytes, batch: int, rank: int, size: int) -> bytes:
    """Checks that a serialised ``BatchPart`` is trainer ``rank``'s ``Samples`` of ``batch``, with ``size``
    labels, and returns it as it is, for the oracle to forward. It reads the scalars and the labels'
    shape only (a few microseconds, no copy), so a processor with another batch size is refused here,
    before the batch is planned; the trainer, which uses the tensors, checks them all (``decode_plan``:
    dtypes, shapes, and the inverse indices against the rows) before it trains on any of them.

    A compiled pass (``_samples_fit``) accepts the parts that pass; any other is read again here, which
    says what is wrong (the oracle checks eight parts a batch: 14 us each here, 4 us compiled)."""
    if _samples_fit(np.frombuffer(data, dtype=np.uint8), batch, rank, size):
        return data
    return _check_samples_read(data, batch, rank, size)


def _check_samples_read(data: bytes, batch: int, rank: int, size: int) -> bytes:
    """``check_samples`` read in Python, field by field: raises ``InvalidArgument`` saying what is
    wrong."""
    where = f"batch {batch}: samples"
    if not data:
        raise InvalidArgument(where, f"expected trainer {rank}'s samples, got an empty part")
    inner = unwrap(data, 3, where)
    if inner is None:
        raise InvalidArgument(where, f"expected trainer {rank}'s samples, got another part")
    scalars, spans = read_shallow(inner, where)
    _check_slice(scalars.get(1, 0), scalars.get(5, 0), batch, rank)
    labels = read_tensor(spans.get(3, memoryview(b"")), f"{where}: labels")
    from_tensor(labels, f"{where}: labels", np.float32, shape=(size,))  # type: ignore[arg-type]
    return data


@njit(cache=True, nogil=True)
def _varint(buf, at, end):  # type: ignore[no-untyped-def]
    """The varint at ``buf[at]`` and where the next field starts (-1: it runs past ``end``), as
    ``wire._read_varint`` reads it."""
    value = np.uint64(0)
    shift = 0
    while at < end and shift <= 63:
        byte = buf[at]
        if shift == 63 and byte & 0x7F > 1:  # (beyond 64 bits: left to the Python reader)
            return value, -1
        value |= np.uint64(byte & 0x7F) << np.uint64(shift)
        at += 1
        shift += 7
        if byte < 0x80:
            return value, at
    return value, -1


@njit(cache=True, nogil=True)
def _next_field(buf, at, end):  # type: ignore[no-untyped-def]
    """The field at ``buf[at]`` as ``wire._read_fields`` reads it: number, wire type, its varint (kind 0)
    or its size (kind 2), where its value starts, and where the next field starts (-1: malformed)."""
    tag, at = _varint(buf, at, end)
    if at < 0:
        return 0, 0, np.uint64(0), -1, -1
    number, kind = int(tag >> np.uint64(3)), int(tag & np.uint64(7))
    if kind == 0:
        value, after = _varint(buf, at, end)
        return number, kind, value, at, after
    if kind == 2:
        size, start = _varint(buf, at, end)
        if start < 0 or size > np.uint64(end - start):  # (compared unsigned: a size of 2^63 or more too)
            return number, kind, size, start, -1
        return number, kind, size, start, start + int(size)
    if kind == 1 or kind == 5:
        return number, kind, np.uint64(0), at, at + (8 if kind == 1 else 4)
    return number, kind, np.uint64(0), at, -1


@njit(cache=True, nogil=True)
def _samples_fit(buf, batch, rank, size):  # type: ignore[no-untyped-def]
    """True when ``buf`` is a ``BatchPart`` holding trainer ``rank``'s ``Samples`` of ``batch`` with
    ``size`` float32 labels, read field by field as ``check_samples`` reads it (the last of a repeated
    field counts); False for anything else, which ``check_samples`` reads again to say why."""
    end = buf.size
    number, kind, _, at, after = _next_field(buf, 0, end)
    if number != 3 or kind != 2 or after != end:  # (one embedded message: the whole part)
        return False
    got_batch = np.int64(0)
    got_rank = np.int64(0)
    labels, labels_end = 0, 0
    while at < end:
        number, kind, value, start, after = _next_field(buf, at, end)
        if after < 0:
            return False
        if kind == 0 and number == 1:
            got_batch = np.int64(value)
        elif kind == 0 and number == 5:
            got_rank = np.int64(value)
        elif kind == 2 and number == 3:
            labels, labels_end = start, after
        at = after
    if at != end or got_batch != batch or got_rank != rank:
        return False
    dtype, dims, first, data = 0, 0, np.int64(0), 0
    at = labels
    while at < labels_end:  # the labels' Tensor: dtype, its dimensions (packed or not), data
        number, kind, value, start, after = _next_field(buf, at, labels_end)
        if after < 0:
            return False
        if number == 1 and kind == 0:
            dtype = int(value)
        elif number == 2 and kind == 0:
            dims += 1
            first = np.int64(value)
        elif number == 2 and kind == 2:
            while start < after:
                dim, start = _varint(buf, start, after)
                if start < 0:
                    return False
                dims += 1
                first = np.int64(dim)
        elif number == 3 and kind == 2:
            data = after - start
        at = after
    return at == labels_end and dtype == _FLOAT32 and dims == 1 and first == size and data == 4 * size


_FLOAT32 = int(tensor_pb2.DTYPE_FLOAT32)


def _check_slice(got_batch: int, got_rank: int, batch: int, rank: int) -> None:
    if (got_batch, got_rank) != (batch, rank):
        raise InvalidArgument(
            f"batch {batch}: samples",
            f"are batch {got_batch}'s for trainer {got_rank}, expected batch {batch}'s for trainer {rank}",
        )


def _samples(
    msg: Any, batch: int, rank: int, size: int, num_dense: int, num_tables: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dense, labels and inverse of a ``Samples`` (the generated class, or ``wire.decode_message``'s)."""
    where = f"batch {batch}: samples"
    _check_slice(msg.batch, msg.rank, batch, rank)
    dense = _tensor(msg, "dense", np.float32, where, shape=(size, num_dense))
    labels = _tensor(msg, "labels", np.float32, where, shape=(size,))
    inverse = _tensor(msg, "inverse", np.int32, where, shape=(size, num_tables))
    _check_values(dense, labels, where)
    return dense, labels, inverse


# ---- Plan: oracle -> trainer


def _mask_bytes(masks: np.ndarray) -> np.ndarray:
    """Trainer masks as uint8 [N, W]: each mask's W little-endian bytes, a wide mask's words in turn (a view
    if already little-endian)."""
    if masks.dtype == np.uint8 and masks.ndim == 1 and masks.flags.c_contiguous:
        return masks.reshape(masks.shape[0], 1)  # (up to 8 trainers: a plan's three masks a batch, a view)
    little = np.ascontiguousarray(masks, dtype=masks.dtype.newbyteorder("<"))
    width = masks.itemsize * (masks.shape[1] if masks.ndim == 2 else 1)
    return little.view(np.uint8).reshape(masks.shape[0], width)


def _rows_fields(rows: SharedPlan) -> list[tuple[int, Any]]:
    """``PlanRows``' fields (``oracle_cacher.proto``) for ``wire.encode_message``."""
    return [
        (1, rows.slots),
        (2, _mask_bytes(rows.users) if rows.users is not None else None),
        (3, rows.sync),
        (4, rows.prefetch),
        (5, rows.prefetch_keys),
        (7, rows.evict),
        (8, rows.evict_keys),
        (9, rows.evict_writer),
        (10, rows.handover_slots),
        (13, rows.handover_critical),
    ]


@dataclass(frozen=True)
class EncodedPlan:
    """One batch's plan as StreamPlans sends it, each a serialised ``PlanPart``: ``rows``, the batch's
    ``PlanRows`` (the same bytes for every trainer), ``samples[rank]``, trainer ``rank``'s ``Samples`` (as
    the data processor sent them), and ``plans[rank]``, its ``Plan``."""

    rows: bytes
    samples: list[bytes]
    plans: list[bytes]

    @property
    def nbytes(self) -> int:
        """Bytes sent for the batch, over all trainers."""
        return sum(len(self.rows) + len(p) for p in self.plans) + sum(len(s) for s in self.samples)


def encode_plans(
    plan: BatchPlan,
    samples: list[bytes],
    batch_size: int,
    checkpoint: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    trainers: int | None = None,
    users: bool = True,
) -> EncodedPlan:
    """``plan`` as StreamPlans sends it: the batch's rows (``PlanRows``), serialised once for all trainers;
    per trainer its ``Samples`` (``samples``, as the data processor sent them: ``check_samples``); and its
    ``Plan``: the plan's scalars and, with ``checkpoint`` (``LookaheadPlanner.cached()``: keys, slots,
    writer rank), the cached rows it writes out. The bytes are what ``PlanPart.SerializeToString`` would
    give (``wire.encode_message``); StreamPlans sends them as they are and a trainer reads its share with
    :func:`decode_plan`. ``trainers``: given when ``samples`` is empty (an oracle shard that does not carry
    the batch's samples). Without ``users`` the rows go without their trainer masks: with LRPP each trainer
    takes the rows its samples use (``SharedPlan.users``), and a trainer receives the same bytes whatever
    the number of trainers but for the masks of the prefetches and hand-overs."""
    trainers = len(samples) if trainers is None else trainers
    shared = shared_plan(plan, users)
    rows = encode_message(
        [(1, [*_rows_fields(shared), (14, plan.batch), (15, shared.prefetch_first), (16, plan.first_since)])]
    )
    scalars: list[tuple[int, Any]] = [  # Plan's fields in field order (oracle_cacher.proto)
        (1, plan.batch),
        (5, plan.slot_high_water),
        (6, batch_size),
        (7, plan.last),
        (8, plan.window),
        (9, plan.depends_on),
        (10, plan.occupancy),
    ]
    # each trainer's bits of the prefetches' and hand-overs' masks (Plan.prefetch_mine, handover_send, _recv)
    h = plan.handovers
    masks = [(14, plan.prefetch_holders), (15, h.source), (16, h.recipients)]
    if checkpoint is not None:
        keys, slots, writer = checkpoint
        bitmaps = [(number, trainer_bitmaps(m, trainers)) for number, m in masks]
        out = []
        for rank in range(trainers):
            mine = writer == rank
            fields = [*scalars, (11, True), (12, keys[mine]), (13, slots[mine])]
            out.append(encode_message([(2, fields + [(n, bits[rank]) for n, bits in bitmaps])]))
        return EncodedPlan(rows, samples, out)
    # every trainer's Plan is the same scalars and bitmaps of the same lengths, so the same length: one
    # compiled pass writes them all into one [trainers, length] array (_plans_into), and a trainer's
    # message is its row
    numbered = np.array(scalars, dtype=np.int64)
    m14, m15, m16 = (_mask_bytes(m) for _, m in masks)
    rows_of = _plans_into(numbered, m14, m15, m16, trainers, _PLAN_MASKS, tensor_pb2.DTYPE_UINT8)
    return EncodedPlan(rows, samples, [row.tobytes() for row in rows_of])


# the field numbers of Plan's three bitmaps (prefetch_mine, handover_send, handover_recv)
_PLAN_MASKS = np.array([14, 15, 16], dtype=np.int64)


@njit(cache=True, nogil=True)
def _varint_size(value):  # type: ignore[no-untyped-def]
    """Bytes of ``value`` (uint64; a negative int64 as its two's complement, ten bytes) as a varint."""
    n = 1
    while value >= np.uint64(0x80):
        value >>= np.uint64(7)
        n += 1
    return n


@njit(cache=True, nogil=True)
def _put_varint(out, at, value):  # type: ignore[no-untyped-def]
    """Writes ``value`` (uint64) as a varint into ``out`` (uint8 [N]) at ``at``; returns the end."""
    while value >= np.uint64(0x80):
        out[at] = np.uint8((value & np.uint64(0x7F)) | np.uint64(0x80))
        value >>= np.uint64(7)
        at += 1
    out[at] = np.uint8(value)
    return at + 1


@njit(cache=True, nogil=True)
def _bitmap_tensor_size(width):  # type: ignore[no-untyped-def]
    """Bytes of a ``Tensor`` of ``width`` uint8 (dtype, shape [width], data: as ``wire`` writes it: the
    data field left out when empty)."""
    w = np.uint64(width)
    dims = _varint_size(w)
    size = 2 + 2 + dims  # dtype's tag and value, shape's tag and length, its one dimension
    if width:
        size += 1 + dims + width
    return size


@njit(cache=True, nogil=True)
def _plans_into(fields, m14, m15, m16, trainers, numbers, dtype):  # type: ignore[no-untyped-def]
    """Every trainer's ``PlanPart`` holding its ``Plan``, as the rows of one uint8 ``[trainers, length]``
    array: the scalars ``fields`` (int64 [F, 2]: number, value, in field order; 0 left out, as proto3
    does) and, in fields ``numbers``, the trainer's bitmaps of the masks ``m14``, ``m15``, ``m16`` (each
    uint8 [N, W], as ``_mask_bytes`` gives them; :func:`_bitmaps_into`). The bytes are what
    ``PlanPart.SerializeToString`` gives for the same message."""
    masks = (m14, m15, m16)
    body = 0
    for i in range(fields.shape[0]):
        if fields[i, 1] != 0:
            body += _varint_size(np.uint64(fields[i, 0] << 3)) + _varint_size(np.uint64(fields[i, 1]))
    widths = np.empty(3, dtype=np.int64)
    for i in range(3):
        widths[i] = (masks[i].shape[0] + 7) // 8
        inner = _bitmap_tensor_size(widths[i])
        body += _varint_size(np.uint64(numbers[i] << 3 | 2)) + _varint_size(np.uint64(inner)) + inner
    length = 1 + _varint_size(np.uint64(body)) + body
    out = np.zeros((trainers, length), dtype=np.uint8)
    first = out[0]
    at = _put_varint(first, 0, np.uint64(2 << 3 | 2))  # PlanPart.plan
    at = _put_varint(first, at, np.uint64(body))
    for i in range(fields.shape[0]):
        if fields[i, 1] != 0:
            at = _put_varint(first, at, np.uint64(fields[i, 0] << 3))
            at = _put_varint(first, at, np.uint64(fields[i, 1]))
    starts = np.empty(3, dtype=np.int64)
    for i in range(3):
        w = np.uint64(widths[i])
        at = _put_varint(first, at, np.uint64(numbers[i] << 3 | 2))
        at = _put_varint(first, at, np.uint64(_bitmap_tensor_size(widths[i])))
        at = _put_varint(first, at, np.uint64(1 << 3))  # Tensor.dtype
        at = _put_varint(first, at, np.uint64(dtype))
        at = _put_varint(first, at, np.uint64(2 << 3 | 2))  # Tensor.shape, packed
        at = _put_varint(first, at, np.uint64(_varint_size(w)))
        at = _put_varint(first, at, w)
        if widths[i]:
            at = _put_varint(first, at, np.uint64(3 << 3 | 2))  # Tensor.data
            at = _put_varint(first, at, w)
        starts[i] = at
        at += widths[i]  # (the bitmap: each trainer's own, below)
    for t in range(1, trainers):
        out[t, :] = first
    for i in range(3):
        _bitmaps_into(masks[i], trainers, out, starts[i])
    return out


def trainer_bitmaps(masks: np.ndarray, trainers: int) -> np.ndarray:
    """uint8 ``[trainers, ceil(N / 8)]``: row ``t`` is trainer ``t``'s bits of the N ``masks`` (bit ``i`` of
    byte ``i // 8`` at ``i % 8``, as ``np.packbits(..., bitorder="little")``)."""
    out = np.zeros((trainers, (masks.shape[0] + 7) // 8), dtype=np.uint8)  # (masks narrower: rows of 0)
    _bitmaps_into(_mask_bytes(masks), trainers, out, 0)
    return out


@njit(cache=True, nogil=True)
def _bitmaps_into(masks, trainers, out, at):  # type: ignore[no-untyped-def]
    """``out[t, at + j]``, for every trainer ``t``: its bits of masks ``8j .. 8j+7`` (``masks``: uint8
    ``[N, W]``, each mask's W little-endian bytes). Byte ``c`` of 8 masks is one word, an 8x8 bit block,
    transposed (Hacker's Delight, 7-3): its byte ``r`` is then trainer ``8c + r``'s 8 bits."""
    count, width = masks.shape
    for c in range(min(width, (trainers + 7) // 8)):
        for j in range((count + 7) // 8):
            x = np.uint64(0)
            for k in range(min(8, count - 8 * j)):
                x |= np.uint64(masks[8 * j + k, c]) << np.uint64(8 * k)
            if x != 0:
                t = (x ^ (x >> np.uint64(7))) & np.uint64(0x00AA00AA00AA00AA)
                x = x ^ t ^ (t << np.uint64(7))
                t = (x ^ (x >> np.uint64(14))) & np.uint64(0x0000CCCC0000CCCC)
                x = x ^ t ^ (t << np.uint64(14))
                t = (x ^ (x >> np.uint64(28))) & np.uint64(0x00000000F0F0F0F0)
                x = x ^ t ^ (t << np.uint64(28))
            for r in range(min(8, trainers - 8 * c)):
                out[8 * c + r, at + j] = np.uint8((x >> np.uint64(8 * r)) & np.uint64(0xFF))


def _check_masks(masks: np.ndarray, trainers: int, field: str) -> None:
    """Each trainer mask names at least one trainer, and only trainers ``0..trainers-1``."""
    if masks.ndim == 1:  # (two reductions, no temporary: a trainer checks every part of every plan)
        everyone = (1 << trainers) - 1
        if masks.size and (int(masks.min()) < 1 or int(masks.max()) > everyone):
            raise InvalidArgument(field, f"masks outside [1, {everyone}] for {trainers} trainers")
        return
    bad = outside_trainers(masks, trainers)
    if not bad.any():
        return
    at = int(np.argmax(bad))
    raise InvalidArgument(
        field, f"mask {at} names no trainer, or one beyond trainers 0..{trainers - 1} ({trainers} trainers)"
    )


def _masks(msg: Any, name: str, where: str, count: int, trainers: int) -> np.ndarray:
    """A mask array (uint8 [count, W] on the wire) as ``mask_dtype(trainers)`` (its values:
    ``_check_masks``)."""
    dtype = mask_dtype(trainers)
    shape = masks_shape(count, trainers)
    raw = _tensor(msg, name, np.uint8, where, shape=(count, dtype.itemsize * max(1, mask_words(trainers))))
    if dtype.itemsize == 1:
        return raw.reshape(shape)  # (bytes are masks as they are)
    return raw.view(dtype.newbyteorder("<")).reshape(shape).astype(dtype, copy=False)


def _field_parts(
    msgs: Sequence[Any], wheres: Sequence[str], name: str, dtype: Any, sizes: Sequence[int] | None = None
) -> tuple[list[bytes], list[int]]:
    """Field ``name`` (a ``Tensor``) of each of ``msgs``: its bytes and its length, each of ``dtype`` and
    one dimension (of ``sizes[i]`` for message ``i`` when given). A part that is not gets
    ``wire.from_tensor``'s error for it; the rest is a few attribute reads a part (a trainer reads about a
    hundred a batch at K=8)."""
    want = np.dtype(dtype)
    code, itemsize = DTYPE_CODES[want], want.itemsize
    datas, lengths = [], []
    for i, msg in enumerate(msgs):
        tensor = getattr(msg, name)
        data = tensor.data
        shape = tensor.shape
        length = len(data) // itemsize
        if (
            tensor.dtype != code
            or len(shape) != 1
            or shape[0] != length
            or length * itemsize != len(data)
            or (sizes is not None and length != sizes[i])
        ):
            expect = {"ndim": 1} if sizes is None else {"shape": (sizes[i],)}
            from_tensor(tensor, (wheres[i], name), want, **expect)
            raise AssertionError(f"{wheres[i]}: {name}: refused here, accepted by from_tensor")
        datas.append(data)
        lengths.append(length)
    return datas, lengths


def _joined(datas: list[bytes], dtype: Any) -> np.ndarray:
    """The parts' bytes as one array (the one part's own bytes when there is one)."""
    return np.frombuffer(datas[0] if len(datas) == 1 else b"".join(datas), dtype=dtype)


@njit(cache=True, nogil=True)
def _move_parts(values, lengths, rows, out):  # type: ignore[no-untyped-def]
    """``out``: ``values``, the parts' indices into their own rows (``lengths[i]`` of part ``i``, which has
    ``rows[i]`` rows) as indices into the parts' rows one after another. Returns the position of the first
    index outside its part's rows (-1: none)."""
    at = np.uint64(0)
    start = np.int32(0)
    for i in range(lengths.size):
        count = np.uint64(rows[i])
        for j in range(at, at + np.uint64(lengths[i])):  # (unsigned: one compare a value, no wrapping)
            v = values[j]
            if np.uint64(np.int64(v)) >= count:
                return np.int64(j)
            out[j] = v + start
        at += np.uint64(lengths[i])
        start += np.int32(count)
    return np.int64(-1)


@njit(cache=True, nogil=True)
def _unpack_parts(packed, nbytes, bits, out):  # type: ignore[no-untyped-def]
    """``out``: the parts' bitmaps (part ``i``: ``bits[i]`` bits in ``nbytes[i]`` bytes of ``packed``, bit
    ``k`` of a byte at ``k``, as ``np.packbits(..., bitorder="little")``) unpacked one after another."""
    at = 0
    written = 0
    for i in range(nbytes.size):
        for k in range(bits[i]):
            out[written + k] = (packed[at + (k >> 3)] >> (k & 7)) & 1
        at += nbytes[i]
        written += bits[i]


def _read_rows(
    msgs: Sequence[opb.PlanRows], batch: int, trainers: int, wheres: Sequence[str]
) -> tuple[SharedPlan, dict[str, list[int]]]:
    """The K oracle shards' ``PlanRows`` of one batch as one, read field by field over the parts: each
    part's arrays of their dtype and of shapes that fit its others, its indices into its own rows in range
    (``prefetch``, ``evict``) and moved past the parts before it, concatenated in shard order (the order
    the samples' inverse indexes, core/oracle_shards.py); the values are ``_check_rows``'. The parts must
    agree on whether masks are sent and on ``first_since``. Also each part's number of prefetches and of
    hand-overs (its bitmaps' lengths)."""
    first = msgs[0]
    for i, msg in enumerate(msgs):
        if not 0 <= msg.first_since <= batch:
            raise InvalidArgument(
                f"{wheres[i]}: first_since", f"must be in [0, {batch}], got {msg.first_since}"
            )
        if i and msg.first_since != first.first_since:
            raise InvalidArgument(
                f"plan {batch}: oracle shard {i}: first_since",
                f"{msg.first_since}, but shard 0 counts from {first.first_since}",
            )
        if i and msg.HasField("users") != first.HasField("users"):
            raise InvalidArgument(
                f"plan {batch}: oracle shard {i}: users",
                "sent, but shard 0's are not" if msg.HasField("users") else "not sent, but shard 0's are",
            )
    slots, counts = _field_parts(msgs, wheres, "slots", np.int32)
    rows = np.array(counts, dtype=np.int64)

    def moved(name: str) -> tuple[np.ndarray, list[int]]:
        datas, lengths = _field_parts(msgs, wheres, name, np.int32)
        values = _joined(datas, np.int32)
        out = np.empty_like(values)
        bad = _move_parts(values, np.array(lengths, dtype=np.int64), rows, out)
        if bad >= 0:
            part = int(np.searchsorted(np.cumsum(lengths), bad, side="right"))
            raise InvalidArgument(
                f"{wheres[part]}: {name}", f"index {int(values[bad])} outside [0, {counts[part]})"
            )
        return out, lengths

    prefetch, fetched = moved("prefetch")
    evict, evicted = moved("evict")
    handover_slots, handed = _field_parts(msgs, wheres, "handover_slots", np.int32)

    def read(name: str, dtype: Any, sizes: list[int]) -> np.ndarray:
        return _joined(_field_parts(msgs, wheres, name, dtype, sizes)[0], dtype)

    users = None
    if first.HasField("users"):
        masks = [_masks(msg, "users", wheres[i], counts[i], trainers) for i, msg in enumerate(msgs)]
        users = masks[0] if len(masks) == 1 else np.concatenate(masks)
    return SharedPlan(
        batch=batch,
        slots=_joined(slots, np.int32),
        users=users,
        sync=read("sync", np.uint8, counts),
        prefetch=prefetch,
        prefetch_keys=read("prefetch_keys", np.int64, fetched),
        prefetch_holders=None,  # (this trainer's bits come with its plan: _trainer_bits)
        evict=evict,
        evict_keys=read("evict_keys", np.int64, evicted),
        evict_writer=read("evict_writer", np.int32, evicted),
        handover_slots=_joined(handover_slots, np.int32),
        handover_source=None,
        handover_recipients=None,
        handover_critical=read("handover_critical", np.bool_, handed),
        prefetch_first=read("prefetch_first", np.bool_, fetched),
        first_since=first.first_since,
    ), {"prefetch": fetched, "handover_slots": handed}


# ---- PlanRows read from their bytes (a trainer reads K of them a batch)
#
# ``_read_rows`` reads parsed messages field by field, a dozen attribute reads and a copy of the data a
# field a part: about 30 us a part with cold caches, so a trainer's receipt grew by a quarter of a
# millisecond from K=1 to K=8. A trainer receives the rows as bytes (``plan_part``), and two compiled
# passes read all K parts: ``_scan_rows`` finds every field and checks what ``_read_rows`` checks of the
# parts' shapes, ``_copy_rows`` copies each field's parts one after another into one block. Any part that
# is not laid out as ``encode_plans`` writes it (or fails a check) is read again as a message by
# ``_read_rows``, which accepts what protobuf accepts and says what is wrong.

# PlanRows' Tensor fields read from bytes, in the block's order: (number, dtype, the field whose length
# each part's must equal, 0: its own). ``users`` (2), a 2-D mask array, is read apart.
_ROWS_LAYOUT = (
    (1, np.int32, 0),  # slots
    (3, np.uint8, 1),  # sync
    (4, np.int32, 0),  # prefetch
    (5, np.int64, 4),  # prefetch_keys
    (15, np.bool_, 4),  # prefetch_first
    (7, np.int32, 0),  # evict
    (8, np.int64, 7),  # evict_keys
    (9, np.int32, 7),  # evict_writer
    (10, np.int32, 0),  # handover_slots
    (13, np.bool_, 10),  # handover_critical
)
_ROWS_NUMBERS = np.array([n for n, _, _ in _ROWS_LAYOUT], dtype=np.int64)
_ROWS_CODES = np.array([int(DTYPE_CODES[np.dtype(t)]) for _, t, _ in _ROWS_LAYOUT], dtype=np.int64)
_ROWS_ITEMSIZES = np.array([np.dtype(t).itemsize for _, t, _ in _ROWS_LAYOUT], dtype=np.int64)
_ROWS_SIZED_BY = np.array([s for _, _, s in _ROWS_LAYOUT], dtype=np.int64)
_USERS_FIELD, _BATCH_FIELD, _FIRST_SINCE_FIELD = 2, 14, 16
_TENSOR_FIELDS_BELOW = 16  # (PlanRows' Tensor fields are numbered 1-15: a table row each)
_UINT8_CODE = int(DTYPE_CODES[np.dtype(np.uint8)])
# a Tensor field's entry in _scan_rows' table: present, dtype, dimensions, the first two, data's start, size
_PRESENT, _DTYPE, _NDIM, _DIM0, _DIM1, _DATA_AT, _DATA_SIZE = range(7)


@njit(cache=True, nogil=True)
def _scan_tensor(buf, at, end, entry):  # type: ignore[no-untyped-def]
    """The ``Tensor`` in ``buf[at:end]`` into ``entry`` (``_PRESENT`` ...): False when it is not one as
    ``wire`` writes it (its data twice, more than two dimensions, another field)."""
    dims = 0
    entry[_DATA_AT] = at
    entry[_DATA_SIZE] = 0  # (no data field: an empty tensor)
    seen_data = False
    while at < end:
        number, kind, value, start, after = _next_field(buf, at, end)
        if after < 0:
            return False
        if number == 1 and kind == 0:
            entry[_DTYPE] = np.int64(value)
        elif number == 2 and kind == 2:  # (packed dimensions, as protobuf writes them)
            while start < after:
                dim, start = _varint(buf, start, after)
                if start < 0 or dims == 2:
                    return False
                entry[_DIM0 + dims] = np.int64(dim)
                dims += 1
        elif number == 2 and kind == 0:
            if dims == 2:
                return False
            entry[_DIM0 + dims] = np.int64(value)
            dims += 1
        elif number == 3 and kind == 2 and not seen_data:
            seen_data = True
            entry[_DATA_AT] = start
            entry[_DATA_SIZE] = after - start
        else:
            return False
        at = after
    entry[_NDIM] = dims
    entry[_PRESENT] = 1
    return True


@njit(cache=True, nogil=True)
def _scan_rows(bufs, batch, width, numbers, codes, itemsizes, sized_by, table, totals, since_out):  # type: ignore[no-untyped-def]
    """Part ``p``'s ``PlanRows`` is ``bufs[p]`` (a tuple of the parts' bytes as they came: no copy joins
    them): each Tensor field's place in it into ``table[p,
    number]``, and each layout field's bytes over the parts into ``totals`` (``users``' last). True when
    every part holds batch ``batch``, the same ``first_since`` (in ``[0, batch]``), every layout field
    once, of its dtype, one dimension and the data that fills it, sized as ``sized_by`` says, and
    ``users`` in every part or in none (uint8 ``[slots, width]``); ``since_out[0]``: that ``first_since``.
    False at anything else, having changed nothing but the outputs."""
    parts = len(bufs)
    first_since = np.int64(-1)
    for p in range(parts):
        buf = bufs[p]
        at, end = 0, buf.size
        got_batch = np.int64(0)  # (proto3 leaves out a zero)
        since = np.int64(0)
        while at < end:
            number, kind, value, start, after = _next_field(buf, at, end)
            if after < 0:
                return False
            if kind == 0 and number == _BATCH_FIELD:
                got_batch = np.int64(value)
            elif kind == 0 and number == _FIRST_SINCE_FIELD:
                since = np.int64(value)
            elif kind == 2 and 0 < number < table.shape[1]:
                entry = table[p, np.int64(number)]  # (_next_field's number is a float to numba)
                if entry[_PRESENT] or not _scan_tensor(buf, start, after, entry):
                    return False
            else:
                return False
            at = after
        if got_batch != batch or since < 0 or since > batch or (p and since != first_since):
            return False
        first_since = since
        users = table[p, _USERS_FIELD]
        if users[_PRESENT] != table[0, _USERS_FIELD, _PRESENT]:
            return False
        if users[_PRESENT] and (
            users[_DTYPE] != _UINT8_CODE
            or users[_NDIM] != 2
            or users[_DIM0] != table[p, 1, _DIM0]
            or users[_DIM1] != width
            or users[_DIM0] > users[_DATA_SIZE]
            or users[_DATA_SIZE] != users[_DIM0] * width
        ):
            return False
        for f in range(numbers.size):
            entry = table[p, numbers[f]]
            count = entry[_DIM0]
            if (
                entry[_PRESENT] == 0
                or entry[_DTYPE] != codes[f]
                or entry[_NDIM] != 1
                or count < 0
                or count > entry[_DATA_SIZE]  # (bounded by the data first: the product cannot wrap)
                or entry[_DATA_SIZE] != count * itemsizes[f]
                or (sized_by[f] and count != table[p, sized_by[f], _DIM0])
            ):
                return False
    for f in range(numbers.size):
        totals[f] = 0
        for p in range(parts):
            totals[f] += table[p, numbers[f], _DATA_SIZE]
    totals[numbers.size] = 0
    for p in range(parts):
        totals[numbers.size] += table[p, _USERS_FIELD, _DATA_SIZE]
    since_out[0] = first_since
    return True


@njit(cache=True, nogil=True)
def _copy_rows(bufs, table, numbers, offsets, block):  # type: ignore[no-untyped-def]
    """Each layout field's data (``users``' last), part after part, into ``block`` from ``offsets[f]``."""
    for f in range(numbers.size + 1):
        number = numbers[f] if f < numbers.size else _USERS_FIELD
        to = np.uint64(offsets[f])
        for p in range(table.shape[0]):
            at, size = np.uint64(table[p, number, _DATA_AT]), np.uint64(table[p, number, _DATA_SIZE])
            buf = bufs[p]
            # (unsigned indices: a loop LLVM makes a memcpy of; a slice's copy took four times as long)
            for i in range(size):
                block[to + i] = buf[at + i]
            to += size


def _rows_from_bytes(
    datas: Sequence[Any], batch: int, trainers: int
) -> tuple[SharedPlan, dict[str, list[int]]] | None:
    """``_read_rows`` of the parts' serialised ``PlanRows`` (bytes-like), read as the bytes are: None when
    a part is not laid out as ``encode_plans`` writes it or fails a check, for ``_read_rows`` to read the
    parts as messages and say what is wrong."""
    k = len(datas)
    bufs = tuple(np.frombuffer(d, dtype=np.uint8) for d in datas)
    dtype = mask_dtype(trainers)
    width = dtype.itemsize * max(1, mask_words(trainers))
    table = np.zeros((k, _TENSOR_FIELDS_BELOW, 7), dtype=np.int64)
    totals = np.empty(_ROWS_NUMBERS.size + 1, dtype=np.int64)
    since = np.empty(1, dtype=np.int64)
    numbers = _ROWS_NUMBERS
    layout = (numbers, _ROWS_CODES, _ROWS_ITEMSIZES, _ROWS_SIZED_BY)
    if not _scan_rows(bufs, batch, width, *layout, table, totals, since):
        return None
    offsets = np.zeros(totals.size + 1, dtype=np.int64)  # (each field 8-aligned in the block)
    np.cumsum((totals + 7) // 8 * 8, out=offsets[1:])
    block = np.empty(int(offsets[-1]), dtype=np.uint8)
    _copy_rows(bufs, table, numbers, offsets, block)
    field: dict[int, np.ndarray] = {
        n: block[offsets[f] : offsets[f] + totals[f]].view(t) for f, (n, t, _) in enumerate(_ROWS_LAYOUT)
    }
    counts = table[:, :, _DIM0].T.copy()  # (counts[number]: each part's length of the field)
    for number in (4, 7):  # (indices into the part's own rows, moved past the parts' before it)
        values = field[number]
        if _move_parts(values, counts[number], counts[1], values) >= 0:
            return None
    users = None
    if table[0, _USERS_FIELD, _PRESENT]:
        raw = block[offsets[-2] : offsets[-2] + totals[-1]].reshape(-1, width)
        users = raw.view(dtype.newbyteorder("<")).reshape(masks_shape(raw.shape[0], trainers))
        users = users.astype(dtype, copy=False)
    return SharedPlan(
        batch=batch,
        slots=field[1],
        users=users,
        sync=field[3],
        prefetch=field[4],
        prefetch_keys=field[5],
        prefetch_holders=None,
        evict=field[7],
        evict_keys=field[8],
        evict_writer=field[9],
        handover_slots=field[10],
        handover_source=None,
        handover_recipients=None,
        handover_critical=field[13],
        prefetch_first=field[15],
        first_since=int(since[0]),
    ), {"prefetch": counts[4].tolist(), "handover_slots": counts[10].tolist()}


def _check_rows(rows: SharedPlan, trainers: int, slot_high_water: int, where: str) -> None:
    """The values of rows ``_read_rows`` read (or of K parts merged, each read so): slots below the
    high-water mark, synchronisation classes, writers and hand-over masks that name trainers of the job,
    one sender a hand-over."""
    _check_index(rows.slots, slot_high_water, f"{where}: slots")
    if rows.sync.size and int(rows.sync.max()) > BACKGROUND:
        raise InvalidArgument(
            f"{where}: sync", f"values must be in [0, {BACKGROUND}], got {int(rows.sync.max())}"
        )
    _check_index(rows.evict_writer, trainers, f"{where}: evict_writer")
    _check_index(rows.handover_slots, slot_high_water, f"{where}: handover_slots")
    if rows.users is not None:
        _check_masks(rows.users, trainers, f"{where}: users")


def _trainer_bits(
    plans: Sequence[opb.Plan], lengths: dict[str, list[int]], wheres: Sequence[str]
) -> TrainerBits:
    """This trainer's bitmaps of each part's plan (``prefetch_mine`` of ``lengths["prefetch"][i]`` bits in
    ``ceil(count / 8)`` bytes, ``handover_send`` and ``handover_recv`` of ``lengths["handover_slots"][i]``),
    each unpacked and concatenated in shard order: the three unpacked in one compiled pass."""
    datas, nbytes, counts = [], [], []
    for name, field in (
        ("prefetch_mine", "prefetch"),
        ("handover_send", "handover_slots"),
        ("handover_recv", "handover_slots"),
    ):
        sizes = [(count + 7) // 8 for count in lengths[field]]
        datas += _field_parts(plans, wheres, name, np.uint8, sizes)[0]
        nbytes += sizes
        counts += lengths[field]
    fetched, handed = sum(lengths["prefetch"]), sum(lengths["handover_slots"])
    out = np.empty(fetched + 2 * handed, dtype=np.bool_)
    _unpack_parts(
        _joined(datas, np.uint8), np.array(nbytes, np.int64), np.array(counts, np.int64), out.view(np.uint8)
    )
    return TrainerBits(out[:fetched], out[fetched : fetched + handed], out[fetched + handed :])


def decode_plan(
    msg: opb.Plan,
    samples: dpb.Samples,
    rows_msg: opb.PlanRows,
    num_tables: int,
    num_dense: int,
    rank: int,
    trainers: int,
) -> TrainerBatch:
    """Reads and checks one ``Plan`` with its batch's ``PlanRows`` and the trainer's ``Samples`` for
    trainer ``rank`` of ``trainers``, with a model of ``num_tables`` tables and ``num_dense`` dense
    features (every index stays inside the arrays it indexes), and cuts the trainer's share out of the
    rows (``core/plans.share``)."""
    return decode_plans([(msg, rows_msg)], samples, num_tables, num_dense, rank, trainers)


def plan_part(part: bytes | opb.PlanPart, where: str) -> tuple[str | None, Any]:
    """A ``PlanPart`` of a trainer's plan stream (its bytes, or the message): which arm it holds ("rows",
    "plan" or "samples"; None: none) and its value. Rows stay bytes, a view of ``part``'s, which
    ``decode_plans`` reads without a parse; anything else is parsed."""
    if isinstance(part, bytes):
        try:
            rows = unwrap(part, 1, where)
        except InvalidArgument:  # (not one field: as protobuf reads it, below)
            rows = None
        if rows is not None:
            return "rows", rows
    message = opb.PlanPart.FromString(part) if isinstance(part, bytes) else part
    kind = message.WhichOneof("part")
    return kind, getattr(message, kind) if kind else None


def decode_plans(
    parts: Sequence[tuple[opb.Plan, opb.PlanRows | bytes | memoryview]],
    samples: dpb.Samples,
    num_tables: int,
    num_dense: int,
    rank: int,
    trainers: int,
) -> TrainerBatch:
    """``decode_plan`` of a batch planned by K oracle shards: shard ``I``'s ``Plan`` and ``PlanRows`` are
    ``parts[I]``. Every part is checked as one plan is, the parts must agree on the batch's facts (its
    number, size, whether it is the last and whether a checkpoint follows), and their rows are merged
    (``merge_rows``): the samples' inverse indexes the merged rows. A part's rows may be a ``PlanRows``
    or its bytes (``plan_part``), which are read without a parse."""
    msg = parts[0][0]
    b = msg.batch
    where = f"plan {b}"
    if not 0 <= rank < trainers:
        raise ValueError(f"rank: must be in [0, {trainers}), got {rank}")
    facts = ("batch", "global_batch_size", "last", "checkpoint")
    for i, (part, _) in enumerate(parts[1:], 1):
        for name in facts:
            if getattr(part, name) != getattr(msg, name):
                raise InvalidArgument(
                    f"{where}: oracle shard {i}: {name}",
                    f"{getattr(part, name)}, but shard 0's plan says {getattr(msg, name)}",
                )
    if msg.global_batch_size < trainers or msg.global_batch_size % trainers:
        raise InvalidArgument(
            f"{where}: global_batch_size", f"{msg.global_batch_size} does not split over {trainers} trainers"
        )
    high_water = max(part.slot_high_water for part, _ in parts)
    slot_high_water = max(1, high_water)
    wheres = [where] if len(parts) == 1 else [f"{where}: oracle shard {i}" for i in range(len(parts))]
    given = [r for _, r in parts]
    read = None
    if not any(isinstance(r, opb.PlanRows) for r in given):  # (their bytes, as a trainer receives them)
        read = _rows_from_bytes(given, b, trainers)
    if read is None:  # (as messages: what protobuf accepts is read, and what is wrong is said)
        rows_parts = [r if isinstance(r, opb.PlanRows) else opb.PlanRows.FromString(bytes(r)) for r in given]
        for i, rows_msg in enumerate(rows_parts):
            if rows_msg.batch != b:
                raise InvalidArgument(f"{wheres[i]}: rows", f"are batch {rows_msg.batch}'s")
        read = _read_rows(rows_parts, b, trainers, [f"{w}: rows" for w in wheres])
    rows, lengths = read
    _check_rows(rows, trainers, slot_high_water, f"{where}: rows")  # (once, over every part's values)
    size = msg.global_batch_size // trainers
    dense, labels, inverse = _samples(samples, b, rank, size, num_dense, num_tables)
    _check_index(inverse, rows.unique, f"batch {b}: samples: inverse")
    checkpoint_keys = checkpoint_slots = None
    if msg.checkpoint:
        keys, slots = [], []
        for part, _ in parts:
            keys.append(_tensor(part, "checkpoint_keys", np.int64, where, ndim=1))
            slots.append(_tensor(part, "checkpoint_slots", np.int32, where, shape=keys[-1].shape))
            _check_index(slots[-1], slot_high_water, f"{where}: checkpoint_slots")
        checkpoint_keys, checkpoint_slots = (
            (np.concatenate(keys), np.concatenate(slots))
            if len(parts) > 1
            else (
                keys[0],
                slots[0],
            )
        )
    bits = _trainer_bits([part for part, _ in parts], lengths, wheres)
    mine = share(rows, inverse, rank, bits)
    if mine.inverse.size and int(mine.inverse.min()) < 0:
        row = int(inverse[mine.inverse < 0][0])
        raise InvalidArgument(
            f"{where}: rows: users",
            f"row {row} is used by trainer {rank}'s samples, but its mask leaves {rank} out",
        )
    return TrainerBatch(
        share=mine,
        dense=dense,
        labels=labels,
        slot_high_water=high_water,
        global_batch_size=msg.global_batch_size,
        last=msg.last,
        lookahead=min(part.lookahead for part, _ in parts),
        occupancy=sum(part.occupancy for part, _ in parts),
        unique_rows=rows.unique,
        checkpoint=msg.checkpoint,
        checkpoint_keys=checkpoint_keys,
        checkpoint_slots=checkpoint_slots,
    )
