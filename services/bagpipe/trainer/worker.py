"""The trainer: one process of synchronous training with Bagpipe's cache.

``step()`` trains one batch, in the order TorchRec's ``TrainPipeline.progress()`` would read: take the
batch's plan once its rows are prefetched (pipeline.py), forward and backward on the cached rows, the
critical synchronisation (sync.py: the shared rows the next batch reads, then the dense gradients and the
loss), the optimizer (dense, private rows, critical rows) and the critical hand-overs; the background
synchronisation and the write-backs go on behind, overlapped with the next batch. stats.py records it.

Threads: receiver, prefetcher and writer (pipeline.py), syncer (sync.py); the calling thread trains.
Recovery checkpoints (checkpointing.py) and held-out evaluation happen between two batches, where the
plan asks for them.
"""

from __future__ import annotations

import gc
import logging
import secrets
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bagpipe import security, serving
from bagpipe.control.registry import Registry
from bagpipe.core import checkpoint, snapshots
from bagpipe.core.data import table_offsets
from bagpipe.core.embedding_init import InitialRows
from bagpipe.core.model import batch_logits, batch_loss, build_model
from bagpipe.core.optim import dense_optimizer, restore_state, steps_taken
from bagpipe.core.plans import TrainerBatch
from bagpipe.core.row_store import RowStore
from bagpipe.embedding_server.client import EmbeddingClient
from bagpipe.trainer import checkpointing, faults, metrics
from bagpipe.trainer.cache import EmbeddingCache
from bagpipe.trainer.checkpointing import Checkpointer, DenseModel
from bagpipe.trainer.config import TrainerConfig
from bagpipe.trainer.evaluation import HeldOut, append_eval, load_held_out
from bagpipe.trainer.pipeline import Pipeline, oracle_stub
from bagpipe.trainer.shared_table import SharedTable
from bagpipe.trainer.stats import StageTimer, TrainerStats
from bagpipe.trainer.sync import Synchronizer, backend_for, init_process_group
from bagpipe.v1 import oracle_cacher_pb2_grpc as opb_grpc

logger = logging.getLogger(__name__)


def trainer_device(choice: str, rank: int) -> torch.device:
    """``--device``: CPU, or the GPU ``rank`` mod the GPUs this process sees (one GPU per trainer where
    there are as many, each trainer on its own where a pod is given one)."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device here")
    return torch.device("cuda", rank % torch.cuda.device_count())


class Trainer:
    """One trainer process of generation ``generation`` (control/generation.py); ``run()`` trains until
    the oracle's last plan."""

    def __init__(self, config: TrainerConfig, generation: str) -> None:
        """``generation``: the id of the generation this process trains in, which fences its writes to Redis
        (progress, statistics, a checkpoint sealed: ``Registry``)."""
        self.config = config
        self.rank = config.rank
        self.device = trainer_device(config.device, self.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL's barrier and object collectives use the current one
        self.registry = Registry(config.coordination.redis_url, config.coordination.job, fence=generation)
        self.offsets = table_offsets(config.table_rows)
        self.width = config.model.row_width  # floats per stored row (embedding, first-order weight)
        self.state_width = config.optimizer.state_width(self.width)
        self.model = build_model(config.model, seed=config.seed).to(self.device)
        self.params = list(self.model.parameters())
        self.dense_opt = dense_optimizer(config.optimizer, self.params, self.device)
        self.dense = DenseModel(self.model, self.dense_opt, config.optimizer)
        fixed = config.cache_rows is not None  # --cache-rows: a hard bound; otherwise it grows
        self.cache = EmbeddingCache(
            self.width, self.state_width, self.device, capacity=config.cache_rows or 1024, fixed=fixed
        )
        self.start_batch = config.resume_batch
        self.step_base = 0  # optimizer steps before batch 0 (Adam's bias correction counts from there)
        # the oracle binds this rank to this process
        self._token = [(security.TRAINER_KEY, secrets.token_hex(16))]
        self.pipeline = Pipeline(config, self.cache, self.registry, self._token, self.start_batch)
        self.sync = Synchronizer(
            self.cache, config.optimizer, config.world_size, self.pipeline, self._optimizer_step
        )
        self.checkpoints = Checkpointer(
            config, self.dense, self.cache, self.sync, self.pipeline, self.registry, generation
        )
        self.stats = TrainerStats(
            self.rank, self.start_batch, config.iteration_log, config.tensorboard if self.rank == 0 else None
        )
        self.servers: EmbeddingClient | None = None  # the embedding servers
        self.store: RowStore | None = None  # where rows are fetched from: the servers or --shared-table
        self.oracles: list[opb_grpc.OracleCacherStub] = []  # shard I's at I
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
        # every oracle shard (--oracles): each sends its part of every batch's plan
        oracles = self.registry.wait_for_members("oracle_cacher", self.config.oracles)
        # (progress reports are retried by gRPC itself: nothing but the server's restart to wait for)
        self.oracle_channels = [
            serving.channel(oracles[str(shard)], serving.retrying("OracleCacher", "ReportProgress"))
            for shard in range(self.config.oracles)
        ]
        self.oracles = [oracle_stub(channel) for channel in self.oracle_channels]

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

    def export_checkpoint(self, path: str, next_batch: int, meta: dict[str, Any]) -> None:
        """The interchange checkpoint after ``next_batch`` batches (checkpointing.export)."""
        assert self.store is not None
        checkpointing.export(path, self.dense, self.store, self.config, self.step_base + next_batch, meta)

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

    # ---- between two batches
    def _checkpoint(self, plan: TrainerBatch) -> None:
        """A recovery checkpoint after ``plan.batch`` (checkpointing.py), or with no --checkpoint-dir the
        flush an evaluation needs; the held-out evaluation, where due, while the servers hold every row."""
        with metrics.heartbeat_while("checkpoint"):
            taken = self.checkpoints.take(plan, self._evaluate_if_due)
            if taken is not None:
                self.stats.record_checkpoint(plan.batch + 1, *taken)

    def _evaluate_if_due(self, trained: int) -> float:
        """``_evaluate`` after ``trained`` batches if --eval-every asks for it then; the seconds it took."""
        every = self.config.eval_every
        if self.held_out is None or not every or trained % every:
            return 0.0
        return self._evaluate(trained)

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
        # The first batch waits for the pipeline's fill: the oracle plans L batches ahead before it sends the
        # first plan (after a restart of the whole job its processors and itself start over too), then its
        # first rows. No deadline bounds the wait for the plan (the plan stream is opened again when its
        # window ends), so the heartbeat goes on through the first batch for at most the collectives'
        # timeout: an oracle that hangs is still found, its trainers stuck.
        with metrics.heartbeat_while("the first batch", at_most=self.config.collective_timeout):
            last = self.step(batch).last
        while not last:
            batch += 1
            last = self.step(batch).last
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
        assert self.store is not None and self.oracles and self.servers is not None
        # asked before the barrier, so before any trainer trains a batch: if no row of the servers has
        # changed yet, the rows the plans use for the first time are computed here, not fetched
        untouched = self.servers.untouched()
        logger.info("embedding servers untouched before batch %d: %s", self.start_batch, untouched)
        self.pipeline.connect(self.store, self.oracles, self.servers.initial_of if untouched else None)
        self.checkpoints.connect(self.store, self.servers)
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
