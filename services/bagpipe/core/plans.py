"""The plan of a batch, which the oracle makes, and the one input of a trainer's step it becomes.

:class:`BatchPlan` is what the oracle's lookahead planner (``oracle_cacher/lookahead.py``) decides for one
global batch: its rows with their cache slots, holders and synchronisation class, the prefetches,
evictions and hand-overs. Trainer masks (``mask_dtype``) have one bit per trainer: one unsigned integer
up to 64 trainers, and above that a row of uint64 words (``mask_words``), so that masks of N keys are an
``[N, words]`` array; the functions below (``has_trainer``, ``trainers_in``, ...) read either.

The oracle reduces a plan to :class:`SharedPlan`, the part every trainer is told: the batch's rows with
their slots, users and synchronisation class, the prefetches, evictions and hand-overs. It is the same for
all trainers, so the oracle builds and serialises it once per batch. Each trainer then cuts its own share
out of it with :func:`share` (a :class:`TrainerPlan`): the rows its samples use (with a local inverse
index), what it prefetches, which of its rows it updates alone, the synchronisation steps (identical on
every trainer, so the all-reduces line up) and what it writes back. That work runs on the trainers, in
parallel, rather than T times on the oracle's one core. With the trainer's samples and the facts of the
batch, its share is a :class:`TrainerBatch`, the one input of the trainer's step. ``traffic`` counts rows
and bytes per iteration across all trainers; ``bagpipe plan-stats`` and the oracle's metrics use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = [
    "BACKGROUND",
    "CRITICAL",
    "MAX_TRAINERS",
    "PRIVATE",
    "BatchPlan",
    "Handovers",
    "all_trainers",
    "every_trainer",
    "has_trainer",
    "lowest_trainer",
    "mask_dtype",
    "mask_words",
    "masks_shape",
    "named",
    "outside_trainers",
    "trainers_in",
    "trainer_users",
    "SharedPlan",
    "SyncStep",
    "TrainerBits",
    "TrainerPlan",
    "Traffic",
    "TrainerBatch",
    "for_trainer",
    "share",
    "shared_plan",
    "traffic",
]


MAX_TRAINERS = 256
WORD = 64  # trainers a mask word holds: up to that many, a mask is one unsigned integer

# BatchPlan.sync_class: how a row's update reaches the other holders: it has one holder (updated there
# alone); it is all-reduced before the next batch (which reads it); or in the background
PRIVATE, CRITICAL, BACKGROUND = 0, 1, 2


def mask_words(trainers: int) -> int:
    """0 when a mask is one unsigned integer (up to 64 trainers); else the uint64 words of a *wide* mask,
    an array's row: masks of N keys are a uint64 ``[N, words]`` array, trainer ``t`` bit ``t % 64`` of
    word ``t // 64``."""
    if not 1 <= trainers <= MAX_TRAINERS:
        raise ValueError(f"trainers: must be in [1, {MAX_TRAINERS}], got {trainers}")
    return 0 if trainers <= WORD else -(-trainers // WORD)


def mask_dtype(trainers: int) -> np.dtype:
    """The smallest unsigned integer type with one bit per trainer; uint64 for wide masks (``mask_words``)."""
    dtype = _MASK_DTYPES.get(trainers)
    if dtype is None:
        mask_words(trainers)  # (raises for a count out of range)
        raise AssertionError("unreachable")
    return dtype


# (by trainer count, read for every batch and plan; wide masks' words are uint64)
_MASK_DTYPES = {
    t: np.dtype(next((d for d in (np.uint8, np.uint16, np.uint32) if t <= np.iinfo(d).bits), np.uint64))
    for t in range(1, MAX_TRAINERS + 1)
}


def all_trainers(trainers: int) -> np.generic | np.ndarray:
    """The mask of every trainer: a scalar, or a wide mask's ``[words]`` row."""
    words = mask_words(trainers)
    if words:
        row = np.full(words, np.iinfo(np.uint64).max, dtype=np.uint64)
        if trainers % WORD:
            row[-1] = np.uint64((1 << (trainers % WORD)) - 1)
        return row
    dt = mask_dtype(trainers)
    return dt.type((1 << trainers) - 1)


def every_trainer(count: int, trainers: int) -> np.ndarray:
    """``count`` masks of every trainer (a replicated cache: every key used by all)."""
    everyone = all_trainers(trainers)
    if isinstance(everyone, np.ndarray):
        return np.broadcast_to(everyone, (count, everyone.size)).copy()
    return np.full(count, everyone, dtype=mask_dtype(trainers))


def masks_shape(count: int, trainers: int) -> tuple[int, ...]:
    """The shape of ``count`` masks: ``(count,)``, or ``(count, words)`` for wide masks."""
    words = mask_words(trainers)
    return (count, words) if words else (count,)


def has_trainer(masks: np.ndarray, rank: int) -> np.ndarray:
    """bool ``[N]``: the masks that name trainer ``rank``."""
    if masks.ndim == 2:
        return ((masks[:, rank // WORD] >> np.uint64(rank % WORD)) & np.uint64(1)) != 0
    return (masks & masks.dtype.type(1 << rank)) != 0


def trainers_in(masks: np.ndarray) -> np.ndarray:
    """int ``[N]``: how many trainers each mask names."""
    counts = np.bitwise_count(masks)
    return counts.sum(axis=1) if masks.ndim == 2 else counts


def named(masks: np.ndarray) -> np.ndarray:
    """bool ``[N]``: the masks that name at least one trainer."""
    if masks.ndim == 2:  # (the words ORed column by column: ``any(axis=1)`` over 4 words took 10x as long)
        if not masks.shape[1]:
            return np.zeros(masks.shape[0], dtype=bool)
        either = masks[:, 0].copy()
        for w in range(1, masks.shape[1]):
            either |= masks[:, w]
        return either != 0
    return masks != 0


def lowest_trainer(masks: np.ndarray) -> np.ndarray:
    """int32 ``[N]``: the lowest trainer each (non-empty) mask names."""
    if masks.ndim == 2:
        word = np.argmax(masks != 0, axis=1)
        value = masks[np.arange(masks.shape[0]), word]
        lowest = value & (~value + np.uint64(1))
        return (word * WORD + np.bitwise_count(lowest - np.uint64(1))).astype(np.int32)
    one = masks.dtype.type(1)
    lowest = masks & (~masks + one)
    return np.bitwise_count(lowest - one).astype(np.int32)  # (its trailing zeros)


def outside_trainers(masks: np.ndarray, trainers: int) -> np.ndarray:
    """bool ``[N]``: the masks that name no trainer, or one beyond ``trainers``."""
    empty = ~named(masks)
    if masks.ndim == 2:
        words = mask_words(trainers)
        beyond = named(masks[:, words:]) if masks.shape[1] > words else np.zeros_like(empty)
        if trainers % WORD and masks.shape[1] >= words:
            beyond |= masks[:, words - 1] > np.uint64((1 << (trainers % WORD)) - 1)
        return empty | beyond
    everyone = int(all_trainers(trainers))  # type: ignore[arg-type]
    return empty | (masks.astype(np.uint64) > np.uint64(everyone))


def trainer_users(inverse: np.ndarray, unique: int, trainers: int) -> np.ndarray:
    """Per key of a global batch, the bit mask of trainers whose contiguous slice of samples uses it
    (``[unique, words]`` for wide masks, ``mask_words``).

    ``inverse`` is the batch's int32 ``[B, tables]`` index into its ``unique`` keys; trainer ``t`` takes
    samples ``[t*B/T, (t+1)*B/T)``. Per trainer, one scatter of its slice into a byte map of the keys
    (cache-resident), shifted into the mask.
    """
    dt = mask_dtype(trainers)
    words = mask_words(trainers)
    size = inverse.shape[0]
    if size % trainers:
        raise ValueError(f"batch of {size} samples does not split over {trainers} trainers")
    per = size // trainers
    out = np.zeros(masks_shape(unique, trainers), dtype=dt)
    seen = np.zeros(unique, dtype=bool)
    true = np.ones(per * inverse.shape[1], dtype=bool)  # scattering an array is ~20x faster than a scalar
    for t in range(trainers):
        seen.fill(False)
        seen[inverse[t * per : (t + 1) * per].reshape(-1)] = true
        bits = seen.view(np.uint8).astype(dt, copy=False) << dt.type(t % WORD)
        if words:
            out[:, t // WORD] |= bits
        else:
            out += bits
    return out


@dataclass(frozen=True)
class Handovers:
    """Rows copied from one holder to new holders after a batch's update. Arrays are aligned."""

    keys: np.ndarray  # int64 [H]
    slots: np.ndarray  # int32 [H]
    source: np.ndarray  # mask [H]: the one trainer that sends
    recipients: np.ndarray  # mask [H]: trainers that receive
    critical: np.ndarray  # bool [H]: the next batch reads the row


@dataclass(frozen=True)
class BatchPlan:
    """What the trainers do for one global batch.

    Per-key arrays are aligned with ``keys``; ``prefetch`` and ``evict`` index into them. Evicted keys
    are always keys of the batch itself, because only a key's last use in the window expires it.
    """

    batch: int
    # int64 [U], sorted unique global keys (an oracle shard's own rows: its planner writes only what the
    # trainers receive in global terms, slots and the prefetched and evicted keys; LookaheadPlanner's shard)
    keys: np.ndarray
    slots: np.ndarray  # int32 [U]
    ttl: np.ndarray  # int32 [U]
    users: np.ndarray  # mask [U]: trainers whose samples use the key in this batch
    holders: np.ndarray  # mask [U]: trainers that hold the key during this batch
    sync_class: np.ndarray  # uint8 [U]: PRIVATE (one holder), CRITICAL or BACKGROUND (all-reduced)
    prefetch: np.ndarray  # int32 [P]: fetched by their holders before this batch
    prefetch_keys: np.ndarray  # int64 [P]: keys[prefetch] (an oracle shard's: their global keys)
    prefetch_holders: np.ndarray  # mask [P]: holders[prefetch]
    # bool [P]: the key's first use since batch first_since (the planner's first): no batch from then
    # until this one used it, so nothing since then has changed its row
    prefetch_first: np.ndarray
    first_since: int
    evict: np.ndarray  # int32 [E]
    evict_keys: np.ndarray  # int64 [E]: keys[evict] (an oracle shard's: their global keys)
    writer: np.ndarray  # int32 [E]: the trainer that writes each evicted key back
    handovers: Handovers  # after this batch's update
    depends_on: int  # write-backs of this batch must be durable before the prefetches start
    window: int  # batches in the window (the effective L) when the plan was made
    slot_high_water: int
    occupancy: int
    last: bool

    @property
    def unique(self) -> int:
        return int(self.keys.size)

    @property
    def sync(self) -> np.ndarray:
        """bool [U]: the update is all-reduced (the key has more than one holder)."""
        return self.sync_class != PRIVATE

    @property
    def critical(self) -> np.ndarray:
        """bool [U]: ... before the next batch, which reads the key (else in the background)."""
        return self.sync_class == CRITICAL


@dataclass(frozen=True)
class SyncStep:
    slots: np.ndarray  # int32 [C]: all-reduced gradients, applied by every trainer
    local: np.ndarray  # int32 [C]: index into TrainerPlan.slots, -1 when this trainer has no gradient
    handover_slots: np.ndarray  # int32 [H]
    handover_send: np.ndarray  # int32: indices into handover_slots
    handover_recv: np.ndarray  # int32

    @property
    def empty(self) -> bool:
        return not self.slots.size and not self.handover_slots.size


@dataclass(frozen=True)
class TrainerPlan:
    batch: int
    slots: np.ndarray  # int32 [R]
    inverse: np.ndarray  # int32 [b, tables] into slots
    prefetch_keys: np.ndarray  # int64 [P]
    prefetch_slots: np.ndarray  # int32 [P]
    private_rows: np.ndarray  # int32: indices into slots
    critical: SyncStep
    background: SyncStep
    writeback_keys: np.ndarray  # int64 [W]
    writeback_slots: np.ndarray  # int32 [W]
    # bool [P]: first used since batch first_since: unchanged since then (SharedPlan.prefetch_first)
    prefetch_first: np.ndarray
    first_since: int


@dataclass(frozen=True)
class SharedPlan:
    """What every trainer is told about one global batch (``PlanRows`` on the wire). Masks have one bit
    per trainer (``mask_dtype``); indices point into ``slots``, the batch's rows in key order."""

    batch: int
    slots: np.ndarray  # int32 [U]
    # mask [U], or None: each trainer's rows are those its own samples use (LRPP, whose masks the data
    # processors made from the same slices of the samples), so the masks need not be sent
    users: np.ndarray | None
    sync: np.ndarray  # uint8 [U]: PRIVATE, CRITICAL or BACKGROUND
    prefetch: np.ndarray  # int32 [P]
    prefetch_keys: np.ndarray  # int64 [P]
    # mask [P] (None as a trainer reads it: its own bits come with its plan, ``TrainerBits``)
    prefetch_holders: np.ndarray | None
    evict: np.ndarray  # int32 [E]
    evict_keys: np.ndarray  # int64 [E]
    evict_writer: np.ndarray  # int32 [E]
    handover_slots: np.ndarray  # int32 [H]
    handover_source: np.ndarray | None  # mask [H]: one bit (None: as prefetch_holders)
    handover_recipients: np.ndarray | None  # mask [H]
    handover_critical: np.ndarray  # bool [H]
    # bool [P]: the prefetched key's first use since batch first_since, the planner's first (no batch
    # from then until this one used it, so no trainer has changed its row since then)
    prefetch_first: np.ndarray
    first_since: int

    @property
    def unique(self) -> int:
        return int(self.slots.size)


@dataclass(frozen=True)
class TrainerBits:
    """One trainer's bits of a batch's prefetch and hand-over masks, which the oracle sends it alone
    (``Plan.prefetch_mine``, ``handover_send``, ``handover_recv``): bool [P], [H] and [H]."""

    fetch: np.ndarray
    send: np.ndarray
    recv: np.ndarray


@dataclass(frozen=True)
class TrainerBatch:
    """Everything a trainer needs for one global batch, the one input of its step: its share of the plan
    (what it prefetches, updates, synchronises and writes back), its slice of the samples, and the facts of
    the batch (whether a checkpoint follows it, and which cached rows that checkpoint flushes). The oracle
    sends it as a ``Plan`` with the batch's ``PlanRows`` and the trainer's ``Samples``;
    ``codec.decode_plan`` reads and checks it."""

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


def shared_plan(plan: BatchPlan, users: bool = True) -> SharedPlan:
    """The part of ``plan`` that all trainers share (no copy: the planner made every array); without
    ``users`` each trainer takes the rows its samples use (``SharedPlan.users``)."""
    h = plan.handovers
    return SharedPlan(
        batch=plan.batch,
        slots=plan.slots,
        users=plan.users if users else None,
        sync=plan.sync_class,
        prefetch=plan.prefetch,
        prefetch_keys=plan.prefetch_keys,
        prefetch_holders=plan.prefetch_holders,
        evict=plan.evict,
        evict_keys=plan.evict_keys,
        evict_writer=plan.writer,
        handover_slots=h.slots,
        handover_source=h.source,
        handover_recipients=h.recipients,
        handover_critical=h.critical,
        prefetch_first=plan.prefetch_first,
        first_since=plan.first_since,
    )


def share(plan: SharedPlan, inverse: np.ndarray, rank: int, bits: TrainerBits | None = None) -> TrainerPlan:
    """Trainer ``rank``'s share of ``plan``; ``inverse`` is the trainer's own slice of the samples, an
    int32 ``[b, tables]`` index into the batch's rows; ``bits`` its own bits of the prefetch and hand-over
    masks (None: read from the plan's masks)."""
    if bits is None:
        assert (
            plan.prefetch_holders is not None
            and plan.handover_source is not None
            and plan.handover_recipients is not None
        ), "a plan without masks needs the trainer's bits"
        bits = TrainerBits(
            has_trainer(plan.prefetch_holders, rank),
            has_trainer(plan.handover_source, rank),
            has_trainer(plan.handover_recipients, rank),
        )
    flat = np.ascontiguousarray(inverse, dtype=np.int32).reshape(-1)
    if plan.users is not None:
        used = has_trainer(plan.users, rank)
    else:  # the rows its samples use
        used = np.zeros(plan.unique, dtype=bool)
        if (bad := _mark(flat, used)) >= 0:
            raise _outside(inverse, bad, plan.unique)
    rows = _RowsOfTrainer(plan.unique)
    counts = _rows_of_trainer(
        used, plan.slots, plan.sync, rows.position, rows.slots, rows.private, rows.sync_slots, rows.sync_local
    )
    local, private, critical, background = (int(c) for c in counts)
    fetched = _Picked(plan.prefetch.size)
    if (
        _pick(bits.fetch, plan.prefetch_keys, plan.prefetch, plan.slots, plan.prefetch_first, *fetched.out)
        >= 0
    ):
        raise IndexError(f"prefetch: an index outside the batch's {plan.unique} rows")
    written = _Picked(plan.evict.size)
    if _pick_written(plan.evict_writer, rank, plan.evict_keys, plan.evict, plan.slots, *written.out) >= 0:
        raise IndexError(f"evict: an index outside the batch's {plan.unique} rows")
    steps = []
    for at, count, in_step in (
        (0, critical, plan.handover_critical),
        (1, background, ~plan.handover_critical),
    ):
        handed = np.flatnonzero(in_step)
        steps.append(
            SyncStep(
                slots=rows.sync_slots[at, :count],
                local=rows.sync_local[at, :count],
                handover_slots=plan.handover_slots[handed],
                handover_send=np.flatnonzero(bits.send[handed]).astype(np.int32),
                handover_recv=np.flatnonzero(bits.recv[handed]).astype(np.int32),
            )
        )
    mine = np.empty(flat.size, dtype=np.int32)
    if (bad := _gather(rows.position, flat, mine)) >= 0:
        raise _outside(inverse, bad, plan.unique)
    return TrainerPlan(
        batch=plan.batch,
        slots=rows.slots[:local],
        inverse=mine.reshape(inverse.shape),
        prefetch_keys=fetched.keys[: fetched.count],
        prefetch_slots=fetched.slots[: fetched.count],
        private_rows=rows.private[:private],
        critical=steps[0],
        background=steps[1],
        writeback_keys=written.keys[: written.count],
        writeback_slots=written.slots[: written.count],
        prefetch_first=fetched.first[: fetched.count],
        first_since=plan.first_since,
    )


class _RowsOfTrainer:
    """The arrays ``_rows_of_trainer`` fills for a batch of ``unique`` rows (each as long as it may get)."""

    def __init__(self, unique: int) -> None:
        self.position = np.empty(unique, dtype=np.int32)
        self.slots = np.empty(unique, dtype=np.int32)
        self.private = np.empty(unique, dtype=np.int32)
        self.sync_slots = np.empty((2, unique), dtype=np.int32)  # CRITICAL's, then BACKGROUND's
        self.sync_local = np.empty((2, unique), dtype=np.int32)


class _Picked:
    """What ``_pick`` fills: the keys, slots and first-use flags of the rows a trainer takes of a list of
    ``size`` (each as long as it may get), and how many it took (``count``)."""

    def __init__(self, size: int) -> None:
        self.keys = np.empty(size, dtype=np.int64)
        self.slots = np.empty(size, dtype=np.int32)
        self.first = np.empty(size, dtype=np.bool_)
        self.counted = np.zeros(1, dtype=np.int64)
        self.out = (self.keys, self.slots, self.first, self.counted)

    @property
    def count(self) -> int:
        return int(self.counted[0])


@njit(cache=True, nogil=True)
def _pick(chosen, keys, at, slots, first, out_keys, out_slots, out_first, count):  # type: ignore[no-untyped-def]
    """One pass over a list of rows (``keys``, their positions ``at`` among the batch's ``slots``, their
    ``first`` flags), taking those ``chosen``: their keys, slots and flags, in order, written at the
    lists' ends, which grow by whether the row is taken (no branch: the choices come in no order a
    branch could predict). ``count[0]``: how many; returns the first position of a row outside
    ``slots`` (-1: none)."""
    rows = np.uint64(slots.size)
    n = np.int64(0)
    for i in range(keys.size):
        r = np.uint64(np.int64(at[i]))
        if r >= rows:
            return i
        out_keys[n] = keys[i]
        out_slots[n] = slots[r]
        out_first[n] = first[i]
        n += np.int64(chosen[i])
    count[0] = n
    return -1


@njit(cache=True, nogil=True)
def _pick_written(writer, rank, keys, at, slots, out_keys, out_slots, out_first, count):  # type: ignore[no-untyped-def]
    """``_pick`` of the rows whose ``writer`` is ``rank`` (evictions: no flags, ``out_first`` untouched)."""
    rows = np.uint64(slots.size)
    n = np.int64(0)
    for i in range(keys.size):
        r = np.uint64(np.int64(at[i]))
        if r >= rows:
            return i
        out_keys[n] = keys[i]
        out_slots[n] = slots[r]
        n += np.int64(writer[i] == rank)
    count[0] = n
    return -1


@njit(cache=True, nogil=True)
def _mark(inverse, used):  # type: ignore[no-untyped-def]
    """``used[r]`` set for every row ``r`` that ``inverse`` names; returns the first position of an index
    outside ``used`` (-1: none), having marked the ones before it."""
    rows = np.uint64(used.size)
    for j in range(inverse.size):
        r = np.uint64(np.int64(inverse[j]))  # (a negative index wraps past every row)
        if r >= rows:
            return j
        used[r] = True
    return -1


@njit(cache=True, nogil=True)
def _gather(table, index, out):  # type: ignore[no-untyped-def]
    """``out[j] = table[index[j]]``; returns the first position of an index outside ``table`` (-1: none)."""
    rows = np.uint64(table.size)
    for j in range(index.size):
        r = np.uint64(np.int64(index[j]))
        if r >= rows:
            return j
        out[j] = table[r]
    return -1


def _outside(inverse: np.ndarray, at: int, rows: int) -> IndexError:
    return IndexError(f"inverse: index {int(inverse.reshape(-1)[at])} outside the batch's {rows} rows")


@njit(cache=True, nogil=True)
def _rows_of_trainer(used, slots, sync, position, mine, private, sync_slots, sync_local):  # type: ignore[no-untyped-def]
    """One pass over a batch's rows for the trainer whose rows are ``used``: each row's ``position`` among
    them (-1: not its row), their slots (``mine``), which of them it updates alone (``private``, by
    position), and the rows of each all-reduce (``sync_slots[0]``, ``sync_local[0]``: CRITICAL's slots and
    this trainer's position of each; ``[1]``: BACKGROUND's). Returns how many of each it filled. Every
    list is written at its end and grows by whether the row belongs to it, without a branch: the classes
    come in no order a branch could predict (a pass with branches took as long as numpy's dozen passes)."""
    count = np.int64(0)
    privates = np.int64(0)
    critical = np.int64(0)
    background = np.int64(0)
    for i in range(slots.size):
        u = np.int64(used[i])
        at = np.int32(count) if u else np.int32(-1)
        position[i] = at
        slot = slots[i]
        kind = sync[i]
        mine[count] = slot
        private[privates] = np.int32(count)
        privates += u & np.int64(kind == PRIVATE)
        count += u
        sync_slots[0, critical] = slot
        sync_local[0, critical] = at
        critical += np.int64(kind == CRITICAL)
        sync_slots[1, background] = slot
        sync_local[1, background] = at
        background += np.int64(kind == BACKGROUND)
    return count, privates, critical, background


def for_trainer(plan: BatchPlan, inverse: np.ndarray, rank: int, trainers: int) -> TrainerPlan:
    """Trainer ``rank``'s share of ``plan``; ``inverse`` is the global batch's [B, tables] index."""
    per = inverse.shape[0] // trainers
    return share(shared_plan(plan), inverse[rank * per : (rank + 1) * per], rank)


@dataclass(frozen=True)
class Traffic:
    """Rows moved for one batch, summed over trainers. Synchronised rows count once per all-reduce
    (every trainer sends and receives about that many); prefetched rows count once per trainer that
    fetches them."""

    unique: int
    prefetched: int
    written_back: int
    critical_rows: int
    background_rows: int
    critical_bytes: int
    background_bytes: int
    fetch_bytes: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def traffic(plan: BatchPlan, dim: int, state_width: int, delayed: bool = True) -> Traffic:
    """Rows and bytes of ``plan``: gradients are ``dim`` floats, a row with its state ``dim+state``.
    With ``delayed`` False every synchronisation counts as critical (what the plan would have been
    without delayed synchronisation: the cache decisions do not depend on it)."""
    grad, row = 4 * dim, 4 * (dim + state_width)
    h = plan.handovers
    critical = plan.critical if delayed else np.ones_like(plan.critical)
    crit_sync = int((plan.sync & critical).sum())
    bg_sync = int((plan.sync & ~critical).sum())
    crit_hand = int(h.critical.sum()) if delayed else int(h.critical.size)
    bg_hand = int(h.critical.size - crit_hand)
    prefetched = int(trainers_in(plan.holders[plan.prefetch]).sum())
    return Traffic(
        unique=plan.unique,
        prefetched=prefetched,
        written_back=int(plan.evict.size),
        critical_rows=crit_sync + crit_hand,
        background_rows=bg_sync + bg_hand,
        critical_bytes=crit_sync * grad + crit_hand * row,
        background_bytes=bg_sync * grad + bg_hand * row,
        fetch_bytes=(prefetched + int(plan.evict.size)) * row,
    )
