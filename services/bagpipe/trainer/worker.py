"""The trainer: one process of synchronous training with Bagpipe's cache.

(Over 400 lines: one training step in order, with its checkpoint and evaluation points.)

``step()`` trains one batch, in the order TorchRec's ``TrainPipeline.progress()`` would read: take the
batch's plan once its rows are prefetched (pipeline.py), forward and backward on the cached rows, the
critical synchronisation (sync.py: the shared rows the next batch reads, then the dense gradients and the
loss), the optimizer (dense, private rows, critical rows) and the critical hand-overs; the background
synchronisation and the write-backs go on behind, overlapped with the next batch. stats.py records it.

Threads: receiver, prefetcher and writer (pipeline.py), syncer (sync.py); the calling thread trains.
Recovery checkpoints (``_checkpoint``) and held-out evaluation happen between two batches, where the
plan asks for them.
"""

from __future__ import annotations

import gc
import logging
import secrets
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
import torch.distributed as dist

from bagpipe import security, serving
from bagpipe.control.locks import CHECKPOINT_LOCK_OWNER, RESHARD_LOCK
from bagpipe.control.registry import Registry
from bagpipe.core import checkpoint, snapshots
from bagpipe.core.data import table_offsets
from bagpipe.core.embedding_init import InitialRows
from bagpipe.core.model import batch_logits, batch_loss, build_model
from bagpipe.core.optim import dense_optimizer, restore_state, saved_state, steps_taken
from bagpipe.core.plans import TrainerBatch
from bagpipe.core.row_store import RowStore
from bagpipe.embedding_server.client import EmbeddingClient
from bagpipe.trainer import faults, metrics
from bagpipe.trainer.cache import EmbeddingCache
from bagpipe.trainer.config import TrainerConfig
from bagpipe.trainer.evaluation import HeldOut, append_eval, load_held_out
from bagpipe.trainer.pipeline import Pipeline
from bagpipe.trainer.shared_table import SharedTable
from bagpipe.trainer.stats import StageTimer, TrainerStats
from bagpipe.trainer.sync import Synchronizer, backend_for, init_process_group
from bagpipe.v1 import oracle_cacher_pb2_grpc as opb_grpc

logger = logging.getLogger(__name__)


class CheckpointFailed(Exception):
    """A recovery checkpoint could not be written, and a replay would fail the same way (a full disk or
    quota, a read-only volume: ``snapshots.final``); the message names where."""


def trainer_device(choice: str, rank: int) -> torch.device:
    """``--device``: CPU, or the GPU ``rank`` mod the GPUs this process sees (one GPU per trainer where
    there are as many, each trainer on its own where a pod is given one)."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device here")
    return torch.device("cuda", rank % torch.cuda.device_count())


class Trainer:
    """One trainer process; ``run()`` trains until the oracle's last plan."""

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.rank = config.rank
        self.device = trainer_device(config.device, self.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL's barrier and object collectives use the current one
        self.registry = Registry(config.coordination.redis_url, config.coordination.job)
        self.offsets = table_offsets(config.table_rows)
        self.width = config.model.row_width  # floats per stored row (embedding, first-order weight)
        self.state_width = config.optimizer.state_width(self.width)
        self.model = build_model(config.model, seed=config.seed).to(self.device)
        self.params = list(self.model.parameters())
        self.dense_opt = dense_optimizer(config.optimizer, self.params, self.device)
        fixed = config.cache_rows is not None  # --cache-rows: a hard bound; otherwise it grows
        self.cache = EmbeddingCache(
            self.width, self.state_width, self.device, capacity=config.cache_rows or 1024, fixed=fixed
        )
        self.start_batch = config.resume_batch
        self._last_checkpoint = config.resume_batch  # the checkpoint the next one follows (0: none yet)
        self.step_base = 0  # optimizer steps before batch 0 (Adam's bias correction counts from there)
        # the oracle binds this rank to this process
        self._token = [(security.TRAINER_KEY, secrets.token_hex(16))]
        self.pipeline = Pipeline(config, self.cache, self.registry, self._token, self.start_batch)
        self.sync = Synchronizer(
            self.cache, config.optimizer, config.world_size, self.pipeline, self._optimizer_step
        )
        self.stats = TrainerStats(
            self.rank, self.start_batch, config.iteration_log, config.tensorboard if self.rank == 0 else None
        )
        self.servers: EmbeddingClient | None = None  # the embedding servers
        self.store: RowStore | None = None  # where rows are fetched from: the servers or --shared-table
        self.oracle: opb_grpc.OracleCacherStub | None = None
        self.held_out: HeldOut | None = None
        self.on_ready: Any = lambda: None  # called once connected and ready to train
        self._background_group: Any = None  # the background synchronisation's process group

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
        self.servers = EmbeddingClient(
            shard_map,
            servers,
            self.width,
            self.state_width,
            resolver=self.registry.embedding_servers,
            # the servers' initial rows (the job's seed): those still initial are computed here, not sent
            initial=InitialRows(self.offsets, self.width, self.config.seed),
        )
        self.store = self.servers
        oracle_address = self.registry.wait_for_members("oracle_cacher", 1)["0"]
        # (progress reports are retried by gRPC itself: nothing but the server's restart to wait for)
        self.oracle_channel = serving.channel(
            oracle_address, serving.retrying("OracleCacher", "ReportProgress")
        )
        self.oracle = opb_grpc.OracleCacherStub(self.oracle_channel)

    def _use_shared_table(self) -> None:
        """--shared-table: rank 0 copies the servers' rows into shared memory; all trainers use it."""
        assert self.config.shared_table and self.servers is not None
        num_keys, dim = int(self.offsets[-1]), self.width
        if self.rank == 0:
            SharedTable(self.config.shared_table, num_keys, dim, self.state_width, create=True).fill_from(
                self.servers
            )
        if self.config.world_size > 1:
            dist.barrier()
        self.store = SharedTable(self.config.shared_table, num_keys, dim, self.state_width, create=False)

    def _load_initial(self) -> None:
        if self.start_batch:  # resumed: the recovery checkpoint's dense model, not --init-from's
            assert self.config.checkpoint_dir is not None
            ckpt = snapshots.read_dense(self.config.checkpoint_dir, self.start_batch)
        elif self.config.init_from:  # (an interchange checkpoint, or TorchRec DLRM's state dict)
            model = self.config.model
            try:
                ckpt = checkpoint.load_init(
                    self.config.init_from, model.name, model.embedding_dim, self.config.table_rows, model
                )
            except ValueError as e:
                raise SystemExit(f"--init-from {self.config.init_from}: {e}") from None
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

    def _dense_state(self) -> dict[str, Any]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def export_checkpoint(self, path: str, next_batch: int, meta: dict[str, Any]) -> None:
        """Writes the interchange checkpoint (core/checkpoint.py) after ``next_batch`` batches: dense model
        here, embeddings from the row store."""
        assert self.store is not None
        model, opt = self.config.model, self.config.optimizer
        out: dict[str, Any] = {  # (the sections in the contract's order; put_table fills the tables)
            "dense": self._dense_state(),
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
            rows, state = self.store.lookup(keys)
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

    # ---- the training step
    def step(self, batch: int) -> TrainerBatch:
        """Trains ``batch``; returns its plan (``plan.last`` ends the run)."""
        timer = StageTimer(self.device)
        plan = self.pipeline.next_plan(batch, timer)
        share, sync = plan.share, self.sync
        slots = self.cache.index(share.slots)
        dense = torch.from_numpy(np.require(plan.dense, requirements="W")).to(self.device)  # (wire buffers
        labels = torch.from_numpy(np.require(plan.labels, requirements="W")).to(self.device)  # are read-only)
        inverse = self.cache.index(share.inverse)
        with self.cache.lock.shared():
            rows = self.cache.weights.index_select(0, slots).requires_grad_()
        with faults.model_step(batch):  # (an error here is the model's: a replay would meet it again)
            loss = batch_loss(batch_logits(self.model, dense, rows, inverse), labels, plan.global_batch_size)
            timer.mark("forward")
            self.dense_opt.zero_grad(set_to_none=False)
            loss.backward()
        row_grad = rows.grad
        assert row_grad is not None
        timer.mark("backward")

        critical = sync.critical(batch, share, row_grad)
        timer.mark("embedding_sync")
        global_loss = sync.all_reduce_dense(self.params, loss)
        timer.mark("dense_sync")
        self.dense_opt.step()
        sync.update(batch, share, slots, row_grad, critical)
        timer.mark("optimizer")
        sync.hand_over_critical(share)
        timer.mark("embedding_sync")
        sync.submit_background(batch, share, row_grad)
        if self.config.fetch == "synchronous":  # the no-cache baseline writes back before the next batch
            self.pipeline.wait_written(batch)
        timer.mark("write_back")

        loss_value = faults.finite_loss(batch, global_loss, self.config)  # (a diverged model: no checkpoint)
        if plan.checkpoint:
            self._checkpoint(plan)
        assert self.store is not None
        self.stats.record(plan, timer, loss_value, self.cache.capacity, self.store)
        return plan

    # ---- recovery checkpoints
    def _checkpoint(self, plan: TrainerBatch) -> None:
        """A consistent checkpoint after ``plan.batch`` (see core/snapshots.py).

        Once this batch's background synchronisation and write-backs are done, every cached row is current
        on its holders and every evicted one on the servers; each trainer then writes the cached rows it is
        the designated writer of (the plan lists them) to the servers, which then hold the whole model.
        Rank 0 has each server write what changed since the previous checkpoint, writes the dense model and
        optimizer, and marks the checkpoint complete; the barriers keep every write-back of a later batch
        out of the snapshot. The rows stay cached: training goes on as if nothing happened.
        """
        directory = self.config.checkpoint_dir  # (None: a flush for an evaluation only)
        with metrics.heartbeat_while("checkpoint"):
            self._flush_and_seal(plan, directory)

    def _flush_and_seal(self, plan: TrainerBatch, directory: str | None) -> None:
        assert (
            self.store is not None and plan.checkpoint_keys is not None and plan.checkpoint_slots is not None
        )
        t0 = time.perf_counter()
        batch = plan.batch
        self.sync.wait_synced(batch)
        self.pipeline.wait_written(batch)
        if plan.checkpoint_keys.size:
            with self.cache.lock.shared():
                rows, state = self.cache.read(self.cache.index(plan.checkpoint_slots))
            self.store.write_back(plan.checkpoint_keys, rows.numpy(), state.numpy())
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
        self.stats.record_checkpoint(batch + 1, time.perf_counter() - t0 - evaluated, written)

    def _seal_checkpoint(self, directory: str, next_batch: int) -> dict[str, float]:
        """(Rank 0.) The servers' snapshots, the dense part, the manifest that makes it count, then the
        pruning of old checkpoints. A checkpoint that cannot be written (a full disk) is removed and
        CheckpointFailed names the directory (the trainer exits with ``snapshots.EXIT_CHECKPOINT_FAILED``):
        the complete ones before it are untouched, and replaying would only fail the same way."""
        previous = self._last_checkpoint
        try:
            full = snapshots.full_due(directory, previous, self.config.checkpoint_full_every)
            written = self._write_checkpoint(directory, next_batch, previous, full)
        except (OSError, grpc.RpcError) as e:
            disk_full = (
                snapshots.final(e)
                if isinstance(e, OSError)
                else e.code() == grpc.StatusCode.FAILED_PRECONDITION
                and (e.details() or "").startswith("directory:")
            )
            if not disk_full:
                # (a server gone, a volume's passing error: recovered from like any failure; the next
                # generation's rank 0 removes what this one began)
                raise
            snapshots.discard(directory, next_batch)
            why = e.details() if isinstance(e, grpc.RpcError) else str(e)
            logger.error("checkpoint %d not written: %s", next_batch, why)
            raise CheckpointFailed(
                f"checkpoint {next_batch} could not be written to {directory}: {why}; "
                f"the complete checkpoints before it are intact (latest: {previous or 'none'})"
            ) from None
        self._last_checkpoint = next_batch
        try:
            removed = snapshots.prune(directory, self.config.keep_checkpoints)
        except OSError as e:  # (an old checkpoint left behind costs disk, not correctness)
            logger.warning("checkpoints in %s not pruned: %s", directory, e)
        else:
            if removed:
                logger.info("pruned checkpoints %s (keeping %d)", removed, self.config.keep_checkpoints)
        return written

    def _write_checkpoint(
        self, directory: str, next_batch: int, previous: int, full: bool
    ) -> dict[str, float]:
        # recovery checkpoints are the servers' files (the shared-memory ideal system writes none)
        assert self.servers is not None and self.store is self.servers
        # the map in force stays fixed while the servers write (a re-sharding switch waits for this lock,
        # which is renewed while they do)
        owner = f"{CHECKPOINT_LOCK_OWNER}{self.config.coordination.job}-{next_batch}"
        with self.registry.locked(RESHARD_LOCK, owner):
            files = self.servers.snapshot(directory, next_batch, full)
        snapshots.write_dense(
            directory,
            next_batch,
            {
                "dense": self._dense_state(),
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
                "previous": previous,
                "full": full,
                "row_files": [f[0] for f in files],
                "rows": rows,
                "bytes": size,
                "time": time.time(),
                "embedding_servers": len(files),
                "trainers": self.config.world_size,
            },
        )
        logger.info(
            "checkpoint %d complete (%s): %d rows, %d bytes",
            next_batch,
            "full" if full else f"after {previous}",
            rows,
            size,
        )
        return {"rows": float(rows), "bytes": float(size)}

    def _evaluate(self, trained: int) -> float:
        """Logloss and AUC on the held-out data after ``trained`` batches; returns the seconds it took."""
        assert self.held_out is not None and self.store is not None
        result = self.held_out.evaluate(self.model, self.store, self.device, trained)
        metrics.EVAL_LOGLOSS.set(result.logloss)
        metrics.EVAL_AUC.set(result.auc)
        metrics.EVAL_BATCH.set(trained)
        metrics.EVAL_SECONDS.observe(result.seconds)
        if self.rank == 0:
            self.registry.put_json("eval", result.as_dict())
            if self.config.iteration_log:
                append_eval(Path(self.config.iteration_log).parent / "eval.csv", result)
            if self.stats.tensorboard is not None:
                self.stats.tensorboard.evaluation(result.as_dict())
        return result.seconds

    # ---- the run
    def run(self) -> dict[str, Any]:
        """Trains to the end and returns this trainer's statistics."""
        with metrics.heartbeat_while("setup"):  # (connecting, the rendezvous, loading the checkpoint)
            self._set_up()
        self.on_ready()
        self.pipeline.start()
        self.sync.start(self._background_group)
        start = time.perf_counter()
        batch = self.start_batch
        while not self.step(batch).last:
            batch += 1
        return self._finish(batch, start)

    def _set_up(self) -> None:
        config = self.config
        self._connect()
        if config.eval_data:
            samples = load_held_out(
                config.eval_data,
                config.table_rows,
                config.seed,
                config.eval_samples,
                4096,
                config.schema,
                like=config.data,
            )
            self.held_out = HeldOut(samples, self.offsets, self.rank, config.world_size)
        self._background_group = None
        if config.world_size > 1:
            self._background_group = init_process_group(
                self.rank,
                config.world_size,
                config.dist_init,
                backend_for(config.dist_backend, self.device),
                config.collective_timeout,
            )
        if config.shared_table:
            self._use_shared_table()
        self._load_initial()
        if config.save_initial and self.rank == 0 and not self.start_batch:
            self.export_checkpoint(config.save_initial, 0, {"steps": 0})
        # what setup left (torch and the modules: about 330 k objects) is never garbage: frozen, the
        # collector's full passes skip it (one took 0.14-0.4 s here, and every trainer waits for the one
        # that runs it)
        gc.collect()
        gc.freeze()
        assert self.store is not None and self.oracle is not None and self.servers is not None
        # asked before the barrier, so before any trainer trains a batch: if no row of the servers has
        # changed yet, the rows the plans use for the first time are computed here, not fetched
        untouched = self.servers.untouched()
        logger.info("embedding servers untouched before batch %d: %s", self.start_batch, untouched)
        self.pipeline.connect(self.store, self.oracle, self.servers.initial_of if untouched else None)
        if config.world_size > 1:
            dist.barrier()

    def _finish(self, batch: int, start: float) -> dict[str, Any]:
        config = self.config
        self.sync.stop()
        self.pipeline.join_writer()
        self.pipeline.raise_error()
        elapsed = time.perf_counter() - start
        metrics.HEARTBEAT.set(time.time())
        if config.world_size > 1:
            dist.barrier()  # every trainer's write-backs are durable
        with metrics.heartbeat_while("final evaluation and export"):
            if self.held_out is not None and not (
                self.held_out.results and self.held_out.results[-1].batch == batch + 1
            ):
                self._evaluate(batch + 1)
            if config.save_final and self.rank == 0:
                self.export_checkpoint(config.save_final, batch + 1, {"steps": batch + 1})
        stats = self.statistics(elapsed)
        self.registry.put_json(f"stats:{self.rank}", stats)
        metrics.FINISHED.set(1)
        return stats

    def statistics(self, elapsed: float) -> dict[str, Any]:
        assert self.store is not None
        return {
            **self.stats.summary(elapsed, self.pipeline.transfers, self.cache.capacity, self.store),
            "evaluations": [r.as_dict() for r in self.held_out.results] if self.held_out is not None else [],
        }

    def close(self) -> None:
        if isinstance(self.store, SharedTable) and self.rank == 0:
            self.store.unlink()
        self.stats.close()
        if self.servers is not None:
            self.servers.close()
        if self.config.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.registry.close()
