"""Synchronous training across trainers: what keeps every cached copy of a row identical.

Each batch's plan splits the rows this trainer used into private rows (no other trainer holds them:
updated locally), critical rows (read by the next batch somewhere: all-reduced and updated before it
starts) and background rows (all-reduced and updated on the syncer thread, overlapped with the next
batch's forward and backward, on a second process group so the two orders never interleave). Rows
that move to a new holder are handed over: the sender contributes row and state, everyone else zeros.
The dense gradients and the loss go in one flat all-reduce.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bagpipe.core.optim import OptimizerConfig, apply_rows
from bagpipe.core.plans import SyncStep, TrainerPlan
from bagpipe.trainer.cache import EmbeddingCache
from bagpipe.trainer.pipeline import Pipeline


@dataclass(frozen=True)
class _Background:
    """One batch's work for the syncer thread."""

    batch: int
    step: SyncStep
    grads: torch.Tensor
    writeback_keys: np.ndarray
    writeback_slots: np.ndarray


def backend_for(choice: str, device: torch.device) -> str:
    """``--dist-backend``: auto is NCCL for CUDA trainers and gloo on CPU."""
    if choice != "auto":
        return choice
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float) -> Any:
    """Joins the trainers' process group (``backend``: nccl or gloo, which also all-reduces CUDA tensors);
    returns the second group background synchronisation uses."""
    # bounded: a lost peer fails the collective instead of hanging it for gloo's default 30 minutes
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    return dist.new_group(backend=backend, timeout=timeout)


def gather_rows(grad: torch.Tensor, local: np.ndarray) -> torch.Tensor:
    """[C, dim] gradients in sync order; zero where this trainer did not use the row (``local`` < 0)."""
    out = grad.new_zeros((local.size, grad.shape[1]))
    mine = np.flatnonzero(local >= 0)
    if mine.size:
        index = torch.from_numpy(mine).to(grad.device)
        out.index_copy_(
            0, index, grad.index_select(0, torch.from_numpy(local[mine].astype(np.int64)).to(grad.device))
        )
    return out


class Synchronizer:
    """The all-reduces, row updates and hand-overs of one trainer, critical and background."""

    def __init__(
        self,
        cache: EmbeddingCache,
        optimizer: OptimizerConfig,
        world_size: int,
        pipeline: Pipeline,
        optimizer_step: Callable[[int], int],
    ) -> None:
        self.cache = cache
        self.optimizer = optimizer
        self.world_size = world_size
        self.pipeline = pipeline
        self.optimizer_step = optimizer_step  # batch -> the global optimizer step that trains it
        self.background_group: Any = None
        self.synced = pipeline.start_batch - 1  # last batch whose background synchronisation is done
        self._queue: queue.Queue[_Background | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self, background_group: Any) -> None:
        self.background_group = background_group
        self._thread = threading.Thread(target=self._background, name="syncer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """After the last batch: the syncer finishes what is queued, then closes the write-backs."""
        self._queue.put(None)

    # ---- the training thread's side
    def wait_synced(self, batch: int) -> None:
        self.pipeline.wait(lambda: self.synced >= batch)

    def critical(self, batch: int, share: TrainerPlan, row_grad: torch.Tensor) -> torch.Tensor:
        """The all-reduced gradients of ``batch``'s critical rows (the rows the next batch reads), once
        the previous batch's background synchronisation is done (the two never run side by side)."""
        self.wait_synced(batch - 1)
        grads = gather_rows(row_grad, share.critical.local)
        if self.world_size > 1 and grads.numel():
            dist.all_reduce(grads)
        return grads

    def all_reduce_dense(self, params: Sequence[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        """Sums the dense gradients (in place) and the loss over the trainers in one all-reduce; returns
        the summed loss."""
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])  # type: ignore[union-attr]
        if self.world_size > 1:
            dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
            offset += n
        return flat[-1]

    def update(
        self,
        batch: int,
        share: TrainerPlan,
        slots: torch.Tensor,
        row_grad: torch.Tensor,
        critical: torch.Tensor,
    ) -> None:
        """The embedding update of ``batch`` on the training thread: private rows with their own
        gradients, critical rows with the all-reduced ones."""
        if share.private_rows.size:
            private = self.cache.index(share.private_rows)
            with self.cache.lock.shared():
                apply_rows(
                    self.optimizer,
                    self.cache.weights,
                    self.cache.state,
                    slots.index_select(0, private),
                    row_grad.index_select(0, private),
                    self.optimizer_step(batch),
                )
        self._apply(share.critical, critical, batch)

    def hand_over_critical(self, share: TrainerPlan) -> None:
        self._hand_over(share.critical, None)

    def submit_background(self, batch: int, share: TrainerPlan, row_grad: torch.Tensor) -> None:
        """Queues ``batch``'s background synchronisation (and then its write-backs) for the syncer."""
        grads = gather_rows(row_grad, share.background.local)
        self._queue.put(
            _Background(batch, share.background, grads, share.writeback_keys, share.writeback_slots)
        )

    # ---- the syncer thread
    def _background(self) -> None:
        """Background synchronisation of each batch in order, then its evicted rows to the writer."""
        pipeline = self.pipeline
        try:
            while (work := self._queue.get()) is not None:
                if self.world_size > 1 and work.step.slots.size:
                    dist.all_reduce(work.grads, group=self.background_group)
                self._apply(work.step, work.grads, work.batch)
                self._hand_over(work.step, self.background_group)
                with self.cache.lock.shared():
                    rows, state = self.cache.read(self.cache.index(work.writeback_slots))
                pipeline.queue_write_back(work.batch, work.writeback_keys, rows, state)
                with pipeline.cond:
                    self.synced = work.batch
                    pipeline.cond.notify_all()
        except BaseException as e:
            pipeline.fail(e)
        finally:
            pipeline.close_writes()

    # ---- both
    def _apply(self, step: SyncStep, grads: torch.Tensor, batch: int) -> None:
        """Applies the all-reduced ``grads`` of ``step.slots`` (the update of ``batch``)."""
        if step.slots.size:
            with self.cache.lock.shared():
                apply_rows(
                    self.optimizer,
                    self.cache.weights,
                    self.cache.state,
                    self.cache.index(step.slots),
                    grads,
                    self.optimizer_step(batch),
                )

    def _hand_over(self, step: SyncStep, group: Any) -> None:
        """Copies rows to their new holders: the sender contributes row and state, everyone else zeros,
        so the all-reduced sum is the sender's copy."""
        if not step.handover_slots.size or self.world_size == 1:
            return
        cache = self.cache
        buffer = torch.zeros((step.handover_slots.size, cache.dim + cache.state_width), device=cache.device)
        if step.handover_send.size:
            with cache.lock.shared():
                sent = cache.packed(cache.index(step.handover_slots[step.handover_send]))
            buffer.index_copy_(0, cache.index(step.handover_send), sent)
        dist.all_reduce(buffer, group=group)
        if step.handover_recv.size:
            with cache.lock.shared():
                cache.unpack(
                    cache.index(step.handover_slots[step.handover_recv]),
                    buffer.index_select(0, cache.index(step.handover_recv)),
                )
