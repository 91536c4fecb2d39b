"""From one logical plan (``BatchPlan``) to what each trainer does, and what it costs in traffic.

``for_trainer`` cuts a plan into one trainer's share: the rows its samples use (with a local inverse
index), what it prefetches, which of its rows it updates alone, the synchronisation steps (identical on
every trainer, so the all-reduces line up) and what it writes back. ``traffic`` counts rows and bytes
per iteration across all trainers; ``bagpipe plan-stats`` and the oracle's metrics use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bagpipe.core.lookahead import BatchPlan

__all__ = ["Splitter", "SyncStep", "TrainerPlan", "Traffic", "for_trainer", "traffic"]


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


class Splitter:
    """Cuts one plan into every trainer's share. What all trainers share (which rows synchronise, in which
    step, the hand-overs of each step) is worked out once per plan, not once per trainer; per trainer
    only its own rows, its position map and its masks are computed."""

    def __init__(self, plan: BatchPlan, inverse: np.ndarray, trainers: int) -> None:
        self.plan, self.inverse = plan, inverse
        self.per = inverse.shape[0] // trainers
        h = plan.handovers
        steps = []
        for rows, handed in (
            (plan.sync & plan.critical, h.critical),
            (plan.sync & ~plan.critical, ~h.critical),
        ):
            index = np.flatnonzero(rows)
            chosen = np.flatnonzero(handed)
            steps.append((index, plan.slots[index], h.slots[chosen], h.source[chosen], h.recipients[chosen]))
        self._steps = steps
        self._unsynced = ~plan.sync
        self._prefetch_holders = plan.holders[plan.prefetch]

    def share(self, rank: int) -> TrainerPlan:
        """Trainer ``rank``'s share."""
        plan = self.plan
        bit = plan.users.dtype.type(1 << rank)
        local = np.flatnonzero((plan.users & bit) != 0)
        position = np.full(plan.unique, -1, dtype=np.int32)
        position[local] = np.arange(local.size, dtype=np.int32)
        fetch = plan.prefetch[(self._prefetch_holders & bit) != 0]
        written = plan.evict[plan.writer == rank]
        critical, background = (
            SyncStep(
                slots=slots,
                local=position[index],
                handover_slots=handover_slots,
                handover_send=np.flatnonzero((source & bit) != 0).astype(np.int32),
                handover_recv=np.flatnonzero((recipients & bit) != 0).astype(np.int32),
            )
            for index, slots, handover_slots, source, recipients in self._steps
        )
        return TrainerPlan(
            batch=plan.batch,
            slots=plan.slots[local],
            inverse=position[self.inverse[rank * self.per : (rank + 1) * self.per]],
            prefetch_keys=plan.keys[fetch],
            prefetch_slots=plan.slots[fetch],
            private_rows=np.flatnonzero(self._unsynced[local]).astype(np.int32),
            critical=critical,
            background=background,
            writeback_keys=plan.keys[written],
            writeback_slots=plan.slots[written],
        )


def for_trainer(plan: BatchPlan, inverse: np.ndarray, rank: int, trainers: int) -> TrainerPlan:
    """Trainer ``rank``'s share of ``plan``; ``inverse`` is the global batch's [B, tables] index. (To cut
    a plan for every trainer, one ``Splitter`` shares the common work.)"""
    return Splitter(plan, inverse, trainers).share(rank)


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
    prefetched = int(np.bitwise_count(plan.holders[plan.prefetch]).sum())
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
