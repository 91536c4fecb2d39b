"""The wire messages of the training path, built and read in one place.

* ``Batch`` (data processor -> oracle): :func:`encode_batch` / :func:`decode_batch`.
* ``Plan`` (oracle -> one trainer): :func:`encode_plans` splits a global plan into one message per
  trainer; :func:`decode_plan` reads one back into :class:`PlanArrays`.

Decoding validates everything the receiver indexes with (dtypes, shapes, index ranges, trainer masks)
and raises :class:`~bagpipe.errors.InvalidArgument` naming the batch and the field, so a bad message is
refused before it changes any state. Decoded arrays are read-only views of the message bytes (no copy).
Tensors themselves are raw little-endian bytes (``bagpipe.wire``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bagpipe.core.data import BatchArrays
from bagpipe.core.lookahead import BatchPlan, all_trainers
from bagpipe.core.plans import Splitter, SyncStep, TrainerPlan
from bagpipe.errors import InvalidArgument
from bagpipe.v1 import data_processor_pb2 as dpb
from bagpipe.v1 import oracle_cacher_pb2 as opb
from bagpipe.wire import encode_message, from_tensor, to_tensor


def _tensor(msg: Any, name: str, dtype: Any, where: str, **kw: Any) -> np.ndarray:
    return from_tensor(getattr(msg, name), f"{where}: {name}", dtype, **kw)


def _check_index(values: np.ndarray, bound: int, field: str, allow_missing: bool = False) -> None:
    low = -1 if allow_missing else 0
    if values.size and (values.min() < low or values.max() >= bound):
        bad = values[(values < low) | (values >= bound)][0]
        raise InvalidArgument(field, f"index {int(bad)} outside [{low}, {bound})")


# ---- Batch: data processor -> oracle


@dataclass(frozen=True)
class WireBatch:
    """A decoded ``Batch``: :class:`~bagpipe.core.data.BatchArrays` plus the stream's extras.

    ``users`` (uint64 ``[U]``, or None when the processor was not asked) holds, per key, the bit mask of
    the trainers whose samples use it.
    """

    arrays: BatchArrays
    last: bool
    users: np.ndarray | None

    @property
    def number(self) -> int:
        return self.arrays.number


def encode_batch(arrays: BatchArrays, last: bool, users: np.ndarray | None = None) -> dpb.Batch:
    """``users``: the per-key trainer masks (uint64; int64 on the wire, the same bits) or None."""
    return dpb.Batch(
        number=arrays.number,
        dense=to_tensor(arrays.dense),
        labels=to_tensor(arrays.labels),
        keys=to_tensor(arrays.keys),
        inverse=to_tensor(arrays.inverse),
        last=last,
        users=to_tensor(np.asarray(users, dtype=np.uint64).view(np.int64)) if users is not None else None,
    )


def decode_batch(
    msg: dpb.Batch, *, num_keys: int, batch_size: int, num_tables: int, trainers: int
) -> WireBatch:
    """Reads and checks a ``Batch``: ``batch_size`` samples, ``num_tables`` key columns indexing sorted
    unique keys in ``[0, num_keys)``, and (when present) masks naming only trainers ``0..trainers-1``."""
    where = f"batch {msg.number}"
    labels = _tensor(msg, "labels", np.float32, where, ndim=1)
    if labels.size != batch_size:
        raise InvalidArgument(f"{where}: labels", f"{labels.size} samples, expected {batch_size}")
    dense = _tensor(msg, "dense", np.float32, where, ndim=2)
    if dense.shape[0] != batch_size:
        raise InvalidArgument(f"{where}: dense", f"{dense.shape[0]} rows, expected {batch_size}")
    keys = _tensor(msg, "keys", np.int64, where, ndim=1)
    if keys.size and (keys[0] < 0 or keys[-1] >= num_keys):
        raise InvalidArgument(f"{where}: keys", f"keys outside [0, {num_keys})")
    if keys.size > 1 and not (keys[1:] > keys[:-1]).all():
        raise InvalidArgument(f"{where}: keys", "must be sorted and unique")
    inverse = _tensor(msg, "inverse", np.int32, where, shape=(batch_size, num_tables))
    _check_index(inverse, keys.size, f"{where}: inverse")
    users = None
    if msg.HasField("users"):
        users = _tensor(msg, "users", np.int64, where, shape=(keys.size,)).view(np.uint64)
        everyone = int(all_trainers(trainers))
        if users.size and (users.min() < 1 or users.max() > everyone):
            raise InvalidArgument(f"{where}: users", f"masks outside [1, {everyone}] for {trainers} trainers")
    arrays = BatchArrays(msg.number, dense, labels, keys, inverse)
    return WireBatch(arrays, msg.last, users)


# ---- Plan: oracle -> trainer


@dataclass(frozen=True)
class PlanArrays:
    """A decoded ``Plan``: this trainer's share of one global batch (see core/plans.py)."""

    share: TrainerPlan
    dense: np.ndarray
    labels: np.ndarray
    slot_high_water: int
    global_batch_size: int
    last: bool
    lookahead: int
    occupancy: int
    unique_rows: int
    checkpoint: bool = False
    checkpoint_keys: np.ndarray | None = None
    checkpoint_slots: np.ndarray | None = None

    @property
    def batch(self) -> int:
        return self.share.batch


def _sync_fields(step: SyncStep) -> list[tuple[int, Any]]:
    """``Sync``'s fields (``oracle_cacher.proto``) for ``wire.encode_message``."""
    return [
        (1, step.slots),
        (2, step.local),
        (3, step.handover_slots),
        (4, step.handover_send),
        (5, step.handover_recv),
    ]


def _decode_sync(msg: opb.Sync, rows: int, where: str) -> SyncStep:
    slots = _tensor(msg, "slots", np.int32, where, ndim=1)
    local = _tensor(msg, "local", np.int32, where, shape=slots.shape)
    handover = _tensor(msg, "handover_slots", np.int32, where, ndim=1)
    send = _tensor(msg, "handover_send", np.int32, where, ndim=1)
    recv = _tensor(msg, "handover_recv", np.int32, where, ndim=1)
    _check_index(local, rows, f"{where}: local", allow_missing=True)
    _check_index(send, handover.size, f"{where}: handover_send")
    _check_index(recv, handover.size, f"{where}: handover_recv")
    return SyncStep(slots, local, handover, send, recv)


def encode_plans(
    plan: BatchPlan,
    batch: BatchArrays,
    trainers: int,
    checkpoint: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> list[bytes]:
    """One serialised ``Plan`` per trainer: its share of ``plan`` (core/plans.py) and its contiguous slice
    of the samples; with ``checkpoint`` (``LookaheadPlanner.cached()``: keys, slots, writer rank), the
    cached rows each trainer writes out. The bytes are what ``Plan.SerializeToString`` would give
    (``wire.encode_message``: each array copied once, straight into the message); StreamPlans sends them
    as they are and a trainer reads them with :func:`decode_plan`."""
    size = int(batch.labels.shape[0])
    per = size // trainers
    splitter = Splitter(plan, batch.inverse, trainers)
    out = []
    for rank in range(trainers):
        share = splitter.share(rank)
        sl = slice(rank * per, (rank + 1) * per)
        # Plan's fields in field order (oracle_cacher.proto)
        fields: list[tuple[int, Any]] = [
            (1, plan.batch),
            (2, share.slots),
            (3, batch.dense[sl]),
            (4, batch.labels[sl]),
            (5, share.inverse),
            (6, share.prefetch_keys),
            (7, share.prefetch_slots),
            (8, share.private_rows),
            (9, _sync_fields(share.critical)),
            (10, _sync_fields(share.background)),
            (11, share.writeback_keys),
            (12, share.writeback_slots),
            (13, plan.slot_high_water),
            (14, size),
            (15, plan.last),
            (16, plan.window),
            (17, plan.depends_on),
            (18, plan.occupancy),
            (19, plan.unique),
        ]
        if checkpoint is not None:
            keys, slots, writer = checkpoint
            mine = writer == rank
            fields += [(20, True), (21, keys[mine]), (22, slots[mine])]
        out.append(encode_message(fields))
    return out


def decode_plan(msg: opb.Plan, num_tables: int, num_dense: int) -> PlanArrays:
    """Reads and checks one trainer's ``Plan`` for a model with ``num_tables`` tables and
    ``num_dense`` dense features: every slot index stays inside the arrays it indexes."""
    b = msg.batch
    where = f"plan {b}"
    slots = _tensor(msg, "slots", np.int32, where, ndim=1)
    labels = _tensor(msg, "labels", np.float32, where, ndim=1)
    inverse = _tensor(msg, "inverse", np.int32, where, shape=(labels.size, num_tables))
    _check_index(inverse, slots.size, f"{where}: inverse")
    prefetch_keys = _tensor(msg, "prefetch_keys", np.int64, where, ndim=1)
    private = _tensor(msg, "private_rows", np.int32, where, ndim=1)
    _check_index(private, slots.size, f"{where}: private_rows")
    writeback_keys = _tensor(msg, "writeback_keys", np.int64, where, ndim=1)
    checkpoint_keys = checkpoint_slots = None
    if msg.checkpoint:
        checkpoint_keys = _tensor(msg, "checkpoint_keys", np.int64, where, ndim=1)
        checkpoint_slots = _tensor(msg, "checkpoint_slots", np.int32, where, shape=checkpoint_keys.shape)
        _check_index(checkpoint_slots, max(1, msg.slot_high_water), f"{where}: checkpoint_slots")
    share = TrainerPlan(
        batch=b,
        slots=slots,
        inverse=inverse,
        prefetch_keys=prefetch_keys,
        prefetch_slots=_tensor(msg, "prefetch_slots", np.int32, where, shape=prefetch_keys.shape),
        private_rows=private,
        critical=_decode_sync(msg.critical, slots.size, f"{where}: critical"),
        background=_decode_sync(msg.background, slots.size, f"{where}: background"),
        writeback_keys=writeback_keys,
        writeback_slots=_tensor(msg, "writeback_slots", np.int32, where, shape=writeback_keys.shape),
    )
    return PlanArrays(
        share=share,
        dense=_tensor(msg, "dense", np.float32, where, shape=(labels.size, num_dense)),
        labels=labels,
        slot_high_water=msg.slot_high_water,
        global_batch_size=msg.global_batch_size,
        last=msg.last,
        lookahead=msg.lookahead,
        occupancy=msg.occupancy,
        unique_rows=msg.unique_rows,
        checkpoint=msg.checkpoint,
        checkpoint_keys=checkpoint_keys,
        checkpoint_slots=checkpoint_slots,
    )
