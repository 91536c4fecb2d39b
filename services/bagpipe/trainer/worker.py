"""The trainer: receive plans, prefetch ahead, train synchronously, write evicted rows back.

Threads:
* receiver — reads the oracle's plan stream (plans arrive only once their prefetch is safe);
* prefetcher — fetches the rows this trainer holds (LRPP) into the cache, in batch order, ahead of compute,
  for up to ``--transfer-batches`` plans in one call per shard, once the first of them is that many
  batches away;
* the calling thread trains: forward and backward on its rows; then, once the previous batch's
  background synchronisation is done, the critical synchronisation (all-reduce of the shared rows the
  next batch reads, then of the dense gradients and the loss), the optimizer (dense, private rows,
  critical rows) and the critical hand-overs of rows to new holders;
* syncer — the background synchronisation of the batch (all-reduce of the other shared rows on a second
  process group, their update, background hand-overs), overlapped with the next batch's forward and
  backward; it then copies the evicted rows out for the writer;
* writer — writes evicted rows back and then reports the batch's write-backs durable to the oracle; it
  gathers up to ``--transfer-batches`` batches into one call per shard, and writes at once whenever the
  training thread waits for a plan (which may depend on these write-backs) or for the write-back itself.

Grouping only ever delays a fetch or a write-back, never advances one, so the oracle's rules still
hold: a plan arrives only once the write-backs it depends on are durable, and its rows cannot change on
the servers before this trainer has trained the batch (they are written back only after eviction).
A Python gRPC call costs about a millisecond of CPU on each side, so fewer, larger calls leave more of
the cores to training where the services share them.
"""

from __future__ import annotations

import csv
import functools
import logging
import queue
import secrets
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
import torch.distributed as dist

from bagpipe import security, serving
from bagpipe.codec import PlanArrays, decode_plan
from bagpipe.control.registry import Registry
from bagpipe.core import checkpoint, snapshots
from bagpipe.core.cache import EmbeddingCache
from bagpipe.core.data import table_offsets
from bagpipe.core.model import batch_loss, build_model
from bagpipe.core.optim import apply_rows, restore_state, saved_state, steps_taken
from bagpipe.core.plans import SyncStep, TrainerPlan
from bagpipe.embedding_server.client import RESHARD_LOCK, EmbeddingClient, call_with_retry
from bagpipe.trainer import metrics
from bagpipe.trainer.config import TrainerConfig
from bagpipe.trainer.evaluation import HeldOut, append_eval, load_held_out
from bagpipe.trainer.shared_table import SharedTable
from bagpipe.v1 import oracle_cacher_pb2 as opb
from bagpipe.v1 import oracle_cacher_pb2_grpc as opb_grpc

logger = logging.getLogger(__name__)

# a plan stream is re-opened at the next batch after this long, so no call waits unboundedly
PLAN_STREAM_WINDOW_S = 60.0


@dataclass(frozen=True)
class _Background:
    """One batch's work for the syncer thread."""

    batch: int
    step: SyncStep
    grads: torch.Tensor
    writeback_keys: np.ndarray
    writeback_slots: np.ndarray


class IterationLog:
    """One CSV row per iteration (the run report's source): stage times, loss, cache and sync figures."""

    def __init__(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # appended to: a restarted trainer goes on in the same file (replayed batches show up again)
        self._header = not Path(path).is_file() or Path(path).stat().st_size == 0
        self._file = open(path, "a", newline="")  # noqa: SIM115 (closed by close())
        self._writer: csv.DictWriter[str] | None = None

    def write(self, row: dict[str, Any]) -> None:
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=list(row))
            if self._header:
                self._writer.writeheader()
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class _Pipeline:
    """Per-batch readiness shared by the threads, with the first error any thread hit."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.received: dict[int, PlanArrays] = {}
        self.ready: set[int] = set()
        self.error: BaseException | None = None
        self.current = -1  # the batch the training thread is on
        self.starving = False  # the training thread waits for a plan or a write-back: write back now

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def wait(self, predicate: Any, starving: bool = False) -> None:
        """Waits for ``predicate``; with ``starving``, flags the wait so the writer flushes its group."""
        with self.cond:
            flagged = starving and not predicate()
            if flagged:
                self.starving = True
                self.cond.notify_all()
            try:
                self.cond.wait_for(lambda: self.error is not None or predicate())
            finally:
                if flagged:  # (only the waiter that raised the flag lowers it: another thread's wait ending
                    self.starving = False  # must not cancel the flush this one asked for)
            if self.error is not None:
                raise RuntimeError("a trainer thread failed") from self.error


class Trainer:
    """One trainer process; ``run()`` trains until the oracle's last plan."""

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.rank = config.rank
        use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        self.registry = Registry(config.redis_url, config.job)
        self.offsets = table_offsets(config.table_rows)
        self.width = config.model.row_width  # floats per stored row (embedding, first-order weight)
        self.state_width = config.optimizer.state_width(self.width)
        self.model = build_model(config.model, seed=config.seed).to(self.device)
        self.params = list(self.model.parameters())
        self.dense_opt = config.optimizer.dense_optimizer(self.params)
        if config.cache_rows is not None:
            self.cache = EmbeddingCache(
                self.width, self.state_width, self.device, capacity=config.cache_rows, fixed=True
            )
        else:
            self.cache = EmbeddingCache(self.width, self.state_width, self.device)
        self.pipeline = _Pipeline()
        self.prefetch_queue: queue.Queue[PlanArrays | None] = queue.Queue()
        self.sync_queue: queue.Queue[_Background | None] = queue.Queue()
        self.writebacks: list[tuple[int, np.ndarray, torch.Tensor, torch.Tensor]] = []  # under pipeline.cond
        self.writebacks_closed = False
        self.transfers = {"lookup_calls": 0, "write_back_calls": 0}
        k, world = config.transfer_batches, config.world_size
        self._prefetch_phase = (config.rank * k) // (2 * world)  # trainers' groups interleave, and ...
        self._write_phase = (
            self._prefetch_phase + k // 2
        )  # ... each one's write-backs fall between its fetches
        self.background_group: Any = None
        self.start_batch = config.resume_batch
        self.step_base = 0  # optimizer steps before batch 0 (Adam's bias correction counts from there)
        self.pipeline.current = self.start_batch - 1
        metrics.FIRST_BATCH.set(self.start_batch)
        self.synced = self.start_batch - 1  # last batch whose background synchronisation is done
        self.written_back = self.start_batch - 1
        self.stage_seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.losses: list[float] = []
        self.step_seconds: dict[str, float] = {}
        self.lookaheads: list[tuple[int, int]] = []  # (batch, L of its plan)
        self.peak_occupancy = 0
        self.client: EmbeddingClient | None = None
        self.on_ready: Any = lambda: None  # called once connected and ready to train
        self.iteration_log = IterationLog(config.iteration_log) if config.iteration_log else None
        self._bytes_seen = (0, 0)
        self._refusals_seen = 0
        self.oracle: opb_grpc.OracleCacherStub | None = None
        self.checkpoints: list[dict[str, float]] = []
        self.held_out: HeldOut | None = None
        self._token = [
            (security.TRAINER_KEY, secrets.token_hex(16))
        ]  # the oracle binds this rank to this process

    # ---- setup
    def _connect(self) -> None:
        shard_map = None
        deadline = time.monotonic() + 120
        while shard_map is None:
            shard_map = self.registry.shard_map()
            if shard_map is None:
                if time.monotonic() > deadline:
                    raise TimeoutError("no shard map in Redis after 120s")
                time.sleep(0.05)
        while True:  # every shard that holds buckets has registered
            shard_map, servers = self.registry.embedding_servers()
            assert shard_map is not None
            if set(shard_map.owners) <= set(servers):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"embedding servers {sorted(set(shard_map.owners) - set(servers))} not registered"
                )
            time.sleep(0.05)
        self.client = EmbeddingClient(
            shard_map,
            servers,
            self.width,
            self.state_width,
            resolver=self.registry.embedding_servers,
        )
        oracle_address = self.registry.wait_for_members("oracle_cacher", 1)["0"]
        self.oracle_channel = serving.channel(oracle_address)
        self.oracle = opb_grpc.OracleCacherStub(self.oracle_channel)

    def _init_dist(self) -> None:
        if self.config.world_size > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            # bounded: a lost peer fails the collective instead of hanging it for gloo's default 30 minutes
            timeout = timedelta(seconds=self.config.collective_timeout)
            dist.init_process_group(
                backend,
                init_method=self.config.dist_init,
                rank=self.rank,
                world_size=self.config.world_size,
                timeout=timeout,
            )
            # background synchronisation runs beside the critical one: its own group, its own order
            self.background_group = dist.new_group(backend=backend, timeout=timeout)

    def _use_shared_table(self) -> None:
        """--shared-table: rank 0 copies the servers' rows into shared memory; all trainers use it."""
        assert self.config.shared_table and isinstance(self.client, EmbeddingClient)
        num_keys, dim = int(self.offsets[-1]), self.width
        if self.rank == 0:
            SharedTable(self.config.shared_table, num_keys, dim, self.state_width, create=True).fill_from(
                self.client
            )
        if self.config.world_size > 1:
            dist.barrier()
        self.remote = self.client
        self.client = SharedTable(self.config.shared_table, num_keys, dim, self.state_width, create=False)  # type: ignore[assignment]

    def _load_initial(self) -> None:
        if self.start_batch:  # resumed: the recovery checkpoint's dense model, not --init-from's
            assert self.config.checkpoint_dir is not None
            ckpt = snapshots.read_dense(self.config.checkpoint_dir, self.start_batch)
        elif self.config.init_from:
            ckpt = checkpoint.load(self.config.init_from)
        else:
            return
        try:
            self.model.load_state_dict({k: v.to(self.device) for k, v in ckpt["dense"].items()})
        except RuntimeError as e:  # names the missing / unexpected parameters and the shapes that differ
            source = self.config.init_from if not self.start_batch else f"checkpoint {self.start_batch}"
            raise SystemExit(
                f"{source}: not a checkpoint of this --model {self.config.model.name}: {e}"
            ) from None
        restore_state(
            self.dense_opt,
            dict(self.model.named_parameters()),
            (ckpt.get("optimizer") or {}).get("dense", {}),
        )
        if self.config.optimizer.name == "adam":  # (Adam's dense step count is the global one)
            self.step_base = steps_taken(self.dense_opt) - self.start_batch

    def _optimizer_step(self, batch: int) -> int:
        """The global optimizer step that training ``batch`` is (1 for the first batch of a fresh model)."""
        return self.step_base + batch + 1

    def _optimizer_header(self) -> dict[str, Any]:
        opt = self.config.optimizer
        return {"name": opt.name, "lr": opt.lr, "eps": opt.epsilon, "betas": list(opt.betas)}

    def export_checkpoint(self, path: str, next_batch: int, meta: dict[str, Any]) -> None:
        """Writes the interchange checkpoint (core/checkpoint.py) after ``next_batch`` batches: dense model
        here, embeddings from the servers."""
        assert self.client is not None
        model, opt = self.config.model, self.config.optimizer
        out: dict[str, Any] = {  # (the sections in the contract's order; put_table fills the tables)
            "dense": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "embeddings": {},
            **({"linear": {}} if model.linear else {}),
            "optimizer": {
                **self._optimizer_header(),
                "dense": saved_state(self.dense_opt, dict(self.model.named_parameters())),
                "embeddings": {},
                **({"linear": {}} if model.linear else {}),
            },
            "meta": {
                **model.describe(),
                "table_rows": list(self.config.table_rows),
                "embedding_dim": model.embedding_dim,
                "num_dense": model.num_dense,
                "optimizer_steps": self.step_base + next_batch,
                **meta,
            },
        }
        step = self.step_base + next_batch if opt.name == "adam" else None
        for t in range(self.offsets.size - 1):
            keys = np.arange(self.offsets[t], self.offsets[t + 1], dtype=np.int64)
            rows, state = self.client.lookup(keys)
            checkpoint.put_table(
                out,
                t,
                torch.from_numpy(rows),
                torch.from_numpy(state),
                model.embedding_dim,
                opt.state_keys,
                model.linear,
                step,
            )
        checkpoint.save(path, out)
        logger.info("wrote checkpoint %s", path)

    # ---- background threads
    def _receive(self) -> None:
        try:
            assert self.oracle is not None
            expected = self.start_batch
            while True:
                request = opb.StreamPlansRequest(rank=self.rank, start=expected)
                try:
                    for msg in self.oracle.StreamPlans(
                        request, timeout=PLAN_STREAM_WINDOW_S, metadata=self._token
                    ):
                        plan = decode_plan(msg, self.config.model.num_tables, self.config.model.num_dense)
                        if plan.batch != expected:
                            raise ValueError(f"plan stream: expected batch {expected}, got {plan.batch}")
                        with self.pipeline.cond:
                            self.pipeline.received[plan.batch] = plan
                            self.pipeline.cond.notify_all()
                        self.prefetch_queue.put(plan)
                        if plan.last:
                            return
                        expected += 1
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
                    continue  # the stream's window ended: re-open it where it stopped
                raise RuntimeError(
                    f"the oracle ended the plan stream before its last plan (at batch {expected})"
                )
        except BaseException as e:
            self.pipeline.fail(e)
        finally:
            self.prefetch_queue.put(None)

    def _prefetch(self) -> None:
        try:
            group_size = self.config.transfer_batches
            pending: list[PlanArrays] = []
            ended = False
            while pending or not ended:
                if not pending:
                    plan = self.prefetch_queue.get()
                    if plan is None:
                        break
                    pending.append(plan)
                first = pending[0].batch
                self.pipeline.wait(lambda f=first: self.pipeline.current >= f - group_size)
                end = self._group_end(first, self._prefetch_phase)
                while not ended and pending[-1].batch < end:  # and whatever else has arrived
                    try:
                        more = self.prefetch_queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        ended = True
                    else:
                        pending.append(more)
                cut = next((i for i, plan in enumerate(pending) if plan.batch > end), len(pending))
                group, pending = pending[:cut], pending[cut:]
                for plan in group:
                    self.cache.ensure_capacity(plan.slot_high_water)
                if self.config.fetch == "prefetch":
                    self._fetch(*(plan.share for plan in group))
                with self.pipeline.cond:
                    self.pipeline.ready.update(plan.batch for plan in group)
                    self.pipeline.cond.notify_all()
        except BaseException as e:
            self.pipeline.fail(e)

    def _fetch(self, *shares: TrainerPlan) -> None:
        """Fetches the rows of ``shares`` (consecutive batches: their keys and slots are distinct, since a
        key or slot comes back only after a write-back that follows training the earlier batch)."""
        assert self.client is not None
        keys = np.concatenate([share.prefetch_keys for share in shares])
        if keys.size:
            slots = np.concatenate([share.prefetch_slots for share in shares])
            rows, state = self.client.lookup(keys)
            self.cache.insert(self._index(slots), torch.from_numpy(rows), torch.from_numpy(state))
            self.transfers["lookup_calls"] += 1

    def _write_back(self) -> None:
        try:
            assert self.client is not None and self.oracle is not None
            cond = self.pipeline.cond
            while True:
                with cond:
                    cond.wait_for(self._write_due)
                    if self.pipeline.error is not None:
                        return
                    group, self.writebacks, closed = self.writebacks, [], self.writebacks_closed
                    cond.notify_all()
                if group:
                    self._write_group(group)
                if closed:
                    return
        except BaseException as e:
            self.pipeline.fail(e)

    def _write_due(self) -> bool:
        """(Under the pipeline's lock.) The queued write-backs reach the end of their group (they are
        consecutive batches, so at most ``--transfer-batches`` of them), or training waits, or the end."""
        if self.pipeline.error is not None or self.writebacks_closed:
            return True
        if not self.writebacks:
            return False
        newest = self.writebacks[-1][0]
        return self.pipeline.starving or newest == self._group_end(newest, self._write_phase)

    def _group_end(self, batch: int, phase: int) -> int:
        """The last batch of the transfer group holding ``batch``: groups are runs of ``--transfer-batches``
        batches shifted by ``phase``, so that the fetches and write-backs of the trainers fall on
        different iterations and their CPU is spread out rather than spent in bursts."""
        k = self.config.transfer_batches
        return batch + (k - 1 - (batch + phase) % k)

    def _write_group(self, group: list[tuple[int, np.ndarray, torch.Tensor, torch.Tensor]]) -> None:
        """Writes the evicted rows of consecutive batches back in one call per shard (an evicted key is
        not used again before its write-back, so no key appears twice), then reports them durable."""
        assert self.client is not None and self.oracle is not None
        keys = np.concatenate([keys for _, keys, _, _ in group])
        if keys.size:
            rows = torch.cat([rows for _, _, rows, _ in group]).numpy()
            state = torch.cat([state for _, _, _, state in group]).numpy()
            self.client.write_back(keys, rows, state)
            self.transfers["write_back_calls"] += 1
        batch = group[-1][0]
        report = opb.ProgressReport(rank=self.rank, trained=batch, written_back=batch)
        call_with_retry(
            functools.partial(
                self.oracle.ReportProgress, report, timeout=serving.RPC_TIMEOUT_S, metadata=self._token
            ),
            "progress",
        )
        with self.pipeline.cond:
            self.written_back = batch
            self.pipeline.cond.notify_all()
        self.registry.set_progress(self.rank, batch)

    def _background(self) -> None:
        """Background synchronisation of each batch in order, then its evicted rows to the writer."""
        try:
            while (work := self.sync_queue.get()) is not None:
                if self.config.world_size > 1 and work.step.slots.size:
                    dist.all_reduce(work.grads, group=self.background_group)
                self._apply(work.step, work.grads, work.batch)
                self._hand_over(work.step, self.background_group)
                with self.cache.lock.shared():
                    rows, state = self.cache.read(self._index(work.writeback_slots))
                with self.pipeline.cond:  # (bounded: the writer keeps up with at most a few groups)
                    self.pipeline.cond.wait_for(
                        lambda: (
                            self.pipeline.error is not None
                            or len(self.writebacks) < 4 * self.config.transfer_batches
                        )
                    )
                    self.writebacks.append((work.batch, work.writeback_keys, rows, state))
                    self.synced = work.batch
                    self.pipeline.cond.notify_all()
        except BaseException as e:
            self.pipeline.fail(e)
        finally:
            with self.pipeline.cond:
                self.writebacks_closed = True
                self.pipeline.cond.notify_all()

    # ---- synchronisation
    def _index(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.astype(np.int64)).to(self.device)

    @staticmethod
    def _gather(grad: torch.Tensor, local: np.ndarray) -> torch.Tensor:
        """[C, dim] gradients in sync order; zero where this trainer did not use the row."""
        out = grad.new_zeros((local.size, grad.shape[1]))
        mine = np.flatnonzero(local >= 0)
        if mine.size:
            index = torch.from_numpy(mine).to(grad.device)
            out.index_copy_(
                0, index, grad.index_select(0, torch.from_numpy(local[mine].astype(np.int64)).to(grad.device))
            )
        return out

    def _apply(self, step: SyncStep, grads: torch.Tensor, batch: int) -> None:
        """Applies the all-reduced ``grads`` of ``step.slots`` (the update of ``batch``)."""
        if step.slots.size:
            with self.cache.lock.shared():
                apply_rows(
                    self.config.optimizer,
                    self.cache.weights,
                    self.cache.state,
                    self._index(step.slots),
                    grads,
                    self._optimizer_step(batch),
                )

    def _hand_over(self, step: SyncStep, group: Any) -> None:
        """Copies rows to their new holders: the sender contributes row and state, everyone else zeros,
        so the all-reduced sum is the sender's copy."""
        if not step.handover_slots.size or self.config.world_size == 1:
            return
        buffer = torch.zeros(
            (step.handover_slots.size, self.cache.dim + self.state_width), device=self.device
        )
        if step.handover_send.size:
            with self.cache.lock.shared():
                sent = self.cache.packed(self._index(step.handover_slots[step.handover_send]))
            buffer.index_copy_(0, self._index(step.handover_send), sent)
        dist.all_reduce(buffer, group=group)
        if step.handover_recv.size:
            with self.cache.lock.shared():
                self.cache.unpack(
                    self._index(step.handover_slots[step.handover_recv]),
                    buffer.index_select(0, self._index(step.handover_recv)),
                )

    # ---- the training step
    def _timed(self, stage: str, start: float) -> float:
        now = time.perf_counter()
        self.step_seconds[stage] += now - start
        return now

    def step(self, batch: int) -> PlanArrays:
        self.step_seconds = dict.fromkeys(metrics.STAGES, 0.0)
        t = started = time.perf_counter()
        with self.pipeline.cond:
            self.pipeline.current = batch
            self.pipeline.cond.notify_all()
        self.pipeline.wait(lambda: batch in self.pipeline.received, starving=True)
        t = self._timed("data_wait", t)
        self.pipeline.wait(lambda: batch in self.pipeline.ready)
        t = self._timed("prefetch_wait", t)
        with self.pipeline.cond:
            plan = self.pipeline.received.pop(batch)
            self.pipeline.ready.discard(batch)
        share = plan.share
        if self.config.fetch == "synchronous":  # the no-cache baseline: fetch on the critical path
            self._fetch(share)
            t = self._timed("prefetch_wait", t)

        dev = self.device
        slots = self._index(share.slots)
        inverse = torch.from_numpy(share.inverse.astype(np.int64)).to(dev)
        dense = torch.from_numpy(np.require(plan.dense, requirements="W")).to(
            dev
        )  # (wire buffers are read-only)
        labels = torch.from_numpy(np.require(plan.labels, requirements="W")).to(dev)
        with self.cache.lock.shared():
            rows = self.cache.weights.index_select(0, slots).requires_grad_()
        loss = batch_loss(self.model(dense, rows[inverse]), labels, plan.global_batch_size)
        t = self._timed("forward", t)
        self.dense_opt.zero_grad(set_to_none=False)
        loss.backward()
        row_grad = rows.grad
        assert row_grad is not None
        t = self._timed("backward", t)

        # the previous batch's background synchronisation ends before this critical one starts
        self.pipeline.wait(lambda: self.synced >= batch - 1)
        critical = self._gather(row_grad, share.critical.local)
        if self.config.world_size > 1 and critical.numel():
            dist.all_reduce(critical)
        t = self._timed("embedding_sync", t)
        flat = torch.cat([p.grad.reshape(-1) for p in self.params] + [loss.detach().reshape(1)])  # type: ignore[union-attr]
        if self.config.world_size > 1:
            dist.all_reduce(flat)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
            offset += n
        t = self._timed("dense_sync", t)
        self.dense_opt.step()
        if share.private_rows.size:
            private = self._index(share.private_rows)
            with self.cache.lock.shared():
                apply_rows(
                    self.config.optimizer,
                    self.cache.weights,
                    self.cache.state,
                    slots.index_select(0, private),
                    row_grad.index_select(0, private),
                    self._optimizer_step(batch),
                )
        self._apply(share.critical, critical, batch)
        t = self._timed("optimizer", t)
        self._hand_over(share.critical, None)
        t = self._timed("embedding_sync", t)
        background = self._gather(row_grad, share.background.local)
        self.sync_queue.put(
            _Background(batch, share.background, background, share.writeback_keys, share.writeback_slots)
        )
        if self.config.fetch == "synchronous":  # ... and write back before the next batch
            self.pipeline.wait(lambda: self.written_back >= batch, starving=True)
        iteration = self._timed("write_back", t) - started
        if plan.checkpoint:
            self._checkpoint(plan)
        for stage, seconds in self.step_seconds.items():
            self.stage_seconds[stage] += seconds
            metrics.STAGE_SECONDS.labels(stage).observe(seconds)
        metrics.ITERATION_SECONDS.observe(iteration)

        used = int(share.slots.size)
        missed = (
            int(np.isin(share.slots, share.prefetch_slots, assume_unique=True).sum())
            if share.prefetch_slots.size
            else 0
        )
        fetched, written = int(share.prefetch_keys.size), int(share.writeback_keys.size)
        crit_rows = int(share.critical.slots.size + share.critical.handover_slots.size)
        bg_rows = int(share.background.slots.size + share.background.handover_slots.size)
        self.counts["iterations"] += 1
        self.counts["samples"] += int(plan.labels.size)
        self.counts["global_samples"] += plan.global_batch_size
        self.counts["rows"] += used
        self.counts["unique_rows"] += plan.unique_rows
        self.counts["misses"] += missed
        self.counts["prefetched"] += fetched
        self.counts["written_back"] += written
        self.counts["critical_rows"] += crit_rows
        self.counts["background_rows"] += bg_rows
        self.counts["private_rows"] += int(share.private_rows.size)
        self.counts["handed_over"] += int(
            share.critical.handover_slots.size + share.background.handover_slots.size
        )
        self.lookaheads.append((batch, plan.lookahead))
        self.peak_occupancy = max(self.peak_occupancy, plan.occupancy)
        self.losses.append(float(flat[-1]))
        metrics.ITERATIONS.inc()
        metrics.SAMPLES.inc(int(plan.labels.size))
        metrics.CACHE_LOOKUPS.inc(used)
        metrics.CACHE_HITS.inc(used - missed)
        metrics.CACHE_MISSES.inc(missed)
        metrics.ROWS_PREFETCHED.inc(fetched)
        metrics.ROWS_WRITTEN_BACK.inc(written)
        metrics.ROWS_SYNCED.labels("critical").inc(crit_rows)
        metrics.ROWS_SYNCED.labels("background").inc(bg_rows)
        metrics.CACHE_OCCUPANCY.set(plan.occupancy)
        metrics.CACHE_CAPACITY.set(self.cache.capacity)
        metrics.LOOKAHEAD.set(plan.lookahead)
        metrics.LOSS.set(self.losses[-1])
        assert self.client is not None
        sent, received = self.client.bytes_sent, self.client.bytes_received
        if isinstance(self.client, EmbeddingClient):
            metrics.SHARD_MAP_VERSION.set(self.client.shard_map.version)
            metrics.SHARD_MAP_REFUSALS.inc(self.client.refusals - self._refusals_seen)
            self._refusals_seen = self.client.refusals
        metrics.BYTES.labels("sent").inc(sent - self._bytes_seen[0])
        metrics.BYTES.labels("received").inc(received - self._bytes_seen[1])
        self._bytes_seen = (sent, received)
        now = time.time()
        metrics.HEARTBEAT.set(now)
        if self.iteration_log is not None:
            self.iteration_log.write(
                {
                    "batch": batch,
                    "time": now,
                    "iteration_seconds": iteration,
                    **{f"{stage}_seconds": sec for stage, sec in self.step_seconds.items()},
                    "loss": self.losses[-1],
                    "samples": int(plan.labels.size),
                    "rows_used": used,
                    "rows_missed": missed,
                    "rows_prefetched": fetched,
                    "rows_written_back": written,
                    "rows_synced_critical": crit_rows,
                    "rows_synced_background": bg_rows,
                    "rows_private": int(share.private_rows.size),
                    "lookahead": plan.lookahead,
                    "cache_occupancy_rows": plan.occupancy,
                    "bytes_sent": sent,
                    "bytes_received": received,
                }
            )
        return plan

    # ---- recovery checkpoints
    def _checkpoint(self, plan: PlanArrays) -> None:
        """A consistent checkpoint after ``plan.batch`` (see core/snapshots.py).

        Once this batch's background synchronisation and write-backs are done, every cached row is current
        on its holders and every evicted one on the servers; each trainer then writes the cached rows it is
        the designated writer of (the plan lists them) to the servers, which then hold the whole model.
        Rank 0 has each server write what changed since the previous checkpoint, writes the dense model and
        optimizer, and marks the checkpoint complete; the barriers keep every write-back of a later batch
        out of the snapshot. The rows stay cached: training goes on as if nothing happened.
        """
        directory = self.config.checkpoint_dir  # (None: a flush for an evaluation only)
        assert (
            self.client is not None and plan.checkpoint_keys is not None and plan.checkpoint_slots is not None
        )
        t0 = time.perf_counter()
        batch = plan.batch
        self.pipeline.wait(lambda: self.synced >= batch)
        self.pipeline.wait(lambda: self.written_back >= batch, starving=True)
        if plan.checkpoint_keys.size:
            with self.cache.lock.shared():
                rows, state = self.cache.read(self._index(plan.checkpoint_slots))
            self.client.write_back(plan.checkpoint_keys, rows.numpy(), state.numpy())
        if self.config.world_size > 1:
            dist.barrier()
        written = {"rows": float(plan.checkpoint_keys.size), "bytes": 0.0}
        if self.rank == 0 and directory is not None:
            written = self._seal_checkpoint(directory, batch + 1)
        evaluated = 0.0
        if self.held_out is not None and self.config.eval_every and (batch + 1) % self.config.eval_every == 0:
            evaluated = self._evaluate(batch + 1)  # (the servers hold every newest row until the barrier)
        if self.config.world_size > 1:
            dist.barrier()
        if directory is None:
            return
        seconds = time.perf_counter() - t0 - evaluated
        self.checkpoints.append({"next_batch": float(batch + 1), "seconds": seconds, **written})
        metrics.CHECKPOINT_SECONDS.observe(seconds)
        metrics.CHECKPOINTS.inc()
        metrics.LAST_CHECKPOINT.set(batch + 1)
        metrics.HEARTBEAT.set(time.time())  # a checkpoint is progress too
        self.registry.put_json("checkpoint", {"next_batch": batch + 1, "time": time.time()})

    def _seal_checkpoint(self, directory: str, next_batch: int) -> dict[str, float]:
        """(Rank 0.) The servers' snapshots, the dense part, then the manifest that makes it count."""
        assert isinstance(self.client, EmbeddingClient)
        # the map in force stays fixed while the servers write (a re-sharding switch waits for this lock)
        with self.registry.locked(RESHARD_LOCK, f"checkpoint-{self.config.job}-{next_batch}"):
            files = self.client.snapshot(directory, next_batch)
        snapshots.write_dense(
            directory,
            next_batch,
            {
                "dense": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                "optimizer": {
                    **self._optimizer_header(),
                    "dense": saved_state(self.dense_opt, dict(self.model.named_parameters())),
                },
                "meta": {"next_batch": next_batch, "trainers": self.config.world_size},
            },
        )
        rows = sum(f[1] for f in files)
        size = sum(f[2] for f in files)
        snapshots.mark_complete(
            directory,
            next_batch,
            {
                "row_files": [f[0] for f in files],
                "rows": rows,
                "bytes": size,
                "time": time.time(),
                "embedding_servers": len(files),
                "trainers": self.config.world_size,
            },
        )
        logger.info("checkpoint %d complete: %d changed rows, %d bytes", next_batch, rows, size)
        return {"rows": float(rows), "bytes": float(size)}

    def _evaluate(self, trained: int) -> float:
        """Logloss and AUC on the held-out data after ``trained`` batches; returns the seconds it took."""
        assert self.held_out is not None and self.client is not None
        result = self.held_out.evaluate(self.model, self.client, self.device, trained)
        metrics.EVAL_LOGLOSS.set(result.logloss)
        metrics.EVAL_AUC.set(result.auc)
        metrics.EVAL_BATCH.set(trained)
        metrics.EVAL_SECONDS.observe(result.seconds)
        if self.rank == 0:
            self.registry.put_json("eval", result.as_dict())
            if self.config.iteration_log:
                append_eval(Path(self.config.iteration_log).parent / "eval.csv", result)
        return result.seconds

    def run(self) -> dict[str, Any]:
        """Trains to the end and returns this trainer's statistics."""
        self._connect()
        if self.config.eval_data:
            samples = load_held_out(
                self.config.eval_data,
                self.config.table_rows,
                self.config.seed,
                self.config.eval_samples,
                4096,
            )
            self.held_out = HeldOut(samples, self.offsets, self.rank, self.config.world_size)
        self._init_dist()
        if self.config.shared_table:
            self._use_shared_table()
        self._load_initial()
        if self.config.save_initial and self.rank == 0:
            self.export_checkpoint(self.config.save_initial, 0, {"steps": 0})
        if self.config.world_size > 1:
            dist.barrier()
        self.on_ready()
        threads = [
            threading.Thread(target=self._receive, name="receiver", daemon=True),
            threading.Thread(target=self._prefetch, name="prefetcher", daemon=True),
            threading.Thread(target=self._background, name="syncer", daemon=True),
            threading.Thread(target=self._write_back, name="writer", daemon=True),
        ]
        for th in threads:
            th.start()
        start = time.perf_counter()
        batch = self.start_batch
        while True:
            plan = self.step(batch)
            if plan.last:
                break
            batch += 1
        self.sync_queue.put(None)
        threads[3].join()
        if self.pipeline.error is not None:
            raise RuntimeError("a trainer thread failed") from self.pipeline.error
        elapsed = time.perf_counter() - start
        metrics.HEARTBEAT.set(time.time())
        if self.config.world_size > 1:
            dist.barrier()  # every trainer's write-backs are durable
        if self.held_out is not None and not (
            self.held_out.results and self.held_out.results[-1].batch == batch + 1
        ):
            self._evaluate(batch + 1)
        if self.config.save_final and self.rank == 0:
            self.export_checkpoint(self.config.save_final, batch + 1, {"steps": batch + 1})
        stats = self.statistics(elapsed)
        self.registry.put_json(f"stats:{self.rank}", stats)
        metrics.FINISHED.set(1)
        return stats

    def _lookahead_stats(self) -> dict[str, float]:
        """L over the plans whose window did not reach the end of the data (the tail's shrinks anyway)."""
        final = self.lookaheads[-1][0] if self.lookaheads else 0
        inner = [w for b, w in self.lookaheads if b + w <= final] or [w for _, w in self.lookaheads] or [0]
        return {"min": min(inner), "max": max(inner), "mean": sum(inner) / len(inner)}

    def statistics(self, elapsed: float) -> dict[str, Any]:
        it = max(1, self.counts["iterations"])
        assert self.client is not None
        return {
            "rank": self.rank,
            "first_batch": self.start_batch,
            "checkpoints": self.checkpoints,
            "evaluations": [r.as_dict() for r in self.held_out.results] if self.held_out is not None else [],
            "iterations": self.counts["iterations"],
            "seconds": elapsed,
            "samples_per_second": self.counts["global_samples"] / elapsed if elapsed > 0 else 0.0,
            "stage_seconds_per_iteration": {s: self.stage_seconds[s] / it for s in metrics.STAGES},
            "unique_rows_per_iteration": self.counts["unique_rows"] / it,
            "rows_per_iteration": self.counts["rows"] / it,
            "rows_prefetched_per_iteration": self.counts["prefetched"] / it,
            "rows_written_back_per_iteration": self.counts["written_back"] / it,
            "rows_private_per_iteration": self.counts["private_rows"] / it,
            "rows_synced_critical_per_iteration": self.counts["critical_rows"] / it,
            "rows_synced_background_per_iteration": self.counts["background_rows"] / it,
            "rows_handed_over": self.counts["handed_over"],
            "lookup_calls": self.transfers["lookup_calls"],
            "write_back_calls": self.transfers["write_back_calls"],
            "cache_hit_rate": 1.0 - self.counts["misses"] / max(1, self.counts["rows"]),
            "cache_capacity_rows": self.cache.capacity,
            "cache_peak_occupancy_rows": self.peak_occupancy,
            "lookahead": self._lookahead_stats(),
            "bytes_sent": self.client.bytes_sent,
            "bytes_received": self.client.bytes_received,
            "losses": self.losses,
        }

    def close(self) -> None:
        if isinstance(self.client, SharedTable):
            if self.rank == 0:
                self.client.unlink()
            self.client = getattr(self, "remote", None)
        if self.iteration_log is not None:
            self.iteration_log.close()
        if self.client is not None:
            self.client.close()
        if self.config.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.registry.close()
