"""The trainer: receive plans, prefetch ahead, train synchronously, write evicted rows back.

Threads:
* receiver — reads the oracle's plan stream (plans arrive only once their prefetch is safe);
* prefetcher — fetches each plan's missing rows into the cache, in batch order, ahead of compute;
* writer — writes evicted rows back and then reports the batch's write-backs durable to the oracle;
* the calling thread trains: forward, backward, all-reduce (embedding rows, then dense gradients and
  the loss in one flat buffer), optimizer, and hands evicted rows to the writer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bagpipe import serving
from bagpipe.control.registry import Registry
from bagpipe.core import checkpoint
from bagpipe.core.cache import EmbeddingCache
from bagpipe.core.data import table_offsets
from bagpipe.core.model import DLRM, batch_loss
from bagpipe.core.optim import apply_rows, restore_sums, saved_sums
from bagpipe.embedding_server.client import EmbeddingClient, call_with_retry
from bagpipe.trainer import metrics
from bagpipe.trainer.config import TrainerConfig
from bagpipe.v1 import oracle_cacher_pb2 as opb
from bagpipe.v1 import oracle_cacher_pb2_grpc as opb_grpc
from bagpipe.wire import from_tensor

logger = logging.getLogger(__name__)

PLAN_STREAM_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class PlanArrays:
    """A decoded Plan."""

    batch: int
    keys: np.ndarray
    slots: np.ndarray
    prefetch: np.ndarray
    writeback: np.ndarray
    slot_high_water: int
    dense: np.ndarray
    labels: np.ndarray
    inverse: np.ndarray
    global_batch_size: int
    last: bool

    @classmethod
    def decode(cls, msg: opb.Plan, num_tables: int) -> PlanArrays:
        keys = from_tensor(msg.keys, "keys", np.int64, ndim=1)
        u = keys.size
        labels = from_tensor(msg.labels, "labels", np.float32, ndim=1)
        inverse = from_tensor(msg.inverse, "inverse", np.int32, shape=(labels.size, num_tables))
        if inverse.size and (inverse.min() < 0 or inverse.max() >= u):
            raise ValueError(f"plan {msg.batch}: inverse index outside [0, {u})")
        return cls(
            batch=msg.batch,
            keys=keys,
            slots=from_tensor(msg.slots, "slots", np.int32, shape=(u,)),
            prefetch=from_tensor(msg.prefetch, "prefetch", np.int32, ndim=1),
            writeback=from_tensor(msg.writeback, "writeback", np.int32, ndim=1),
            slot_high_water=msg.slot_high_water,
            dense=from_tensor(msg.dense, "dense", np.float32, ndim=2),
            labels=labels,
            inverse=inverse,
            global_batch_size=msg.global_batch_size,
            last=msg.last,
        )


class _Pipeline:
    """Per-batch readiness shared by the threads, with the first error any thread hit."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.received: dict[int, PlanArrays] = {}
        self.ready: set[int] = set()
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def wait(self, predicate: Any) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.error is not None or predicate())
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
        self.state_width = config.optimizer.state_width(config.model.embedding_dim)
        self.model = DLRM(config.model, seed=config.seed).to(self.device)
        self.params = list(self.model.parameters())
        self.dense_opt = config.optimizer.dense_optimizer(self.params)
        self.cache = EmbeddingCache(config.model.embedding_dim, self.state_width, self.device)
        self.pipeline = _Pipeline()
        self.prefetch_queue: queue.Queue[PlanArrays | None] = queue.Queue()
        self.writeback_queue: queue.Queue[tuple[int, np.ndarray, torch.Tensor, torch.Tensor] | None] = queue.Queue(maxsize=8)
        self.written_back = -1
        self.stage_seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.losses: list[float] = []
        self.client: EmbeddingClient | None = None
        self.oracle: opb_grpc.OracleCacherStub | None = None

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
        servers = self.registry.wait_for_members("embedding_server", shard_map.num_shards)
        self.client = EmbeddingClient(
            shard_map, {int(k): v for k, v in servers.items()}, self.config.model.embedding_dim, self.state_width
        )
        oracle_address = self.registry.wait_for_members("oracle_cacher", 1)["0"]
        self.oracle_channel = serving.channel(oracle_address)
        self.oracle = opb_grpc.OracleCacherStub(self.oracle_channel)

    def _init_dist(self) -> None:
        if self.config.world_size > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=self.config.dist_init, rank=self.rank, world_size=self.config.world_size
            )

    def _load_initial(self) -> None:
        if not self.config.init_from:
            return
        ckpt = checkpoint.load(self.config.init_from)
        self.model.load_state_dict({k: v.to(self.device) for k, v in ckpt["dense"].items()})
        restore_sums(self.dense_opt, dict(self.model.named_parameters()), (ckpt.get("optimizer") or {}).get("dense", {}))

    def export_checkpoint(self, path: str, meta: dict[str, Any]) -> None:
        """Writes the interchange checkpoint: dense model here, embeddings from the servers."""
        assert self.client is not None
        embeddings, emb_state = {}, {}
        for t in range(self.offsets.size - 1):
            keys = np.arange(self.offsets[t], self.offsets[t + 1], dtype=np.int64)
            rows, state = self.client.lookup(keys)
            embeddings[str(t)] = torch.from_numpy(rows)
            if self.state_width:
                emb_state[str(t)] = {"sum": torch.from_numpy(state)}
        dense_state = saved_sums(self.dense_opt, dict(self.model.named_parameters()))
        checkpoint.save(
            path,
            {
                "dense": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                "embeddings": embeddings,
                "optimizer": {
                    "name": self.config.optimizer.name,
                    "lr": self.config.optimizer.lr,
                    "dense": dense_state,
                    "embeddings": emb_state,
                },
                "meta": {
                    "model": "dlrm",
                    "table_rows": list(self.config.table_rows),
                    "embedding_dim": self.config.model.embedding_dim,
                    "bottom_mlp": list(self.config.model.bottom_mlp),
                    "top_mlp": list(self.config.model.top_mlp),
                    **meta,
                },
            },
        )
        logger.info("wrote checkpoint %s", path)

    # ---- background threads
    def _receive(self) -> None:
        try:
            assert self.oracle is not None
            request = opb.StreamPlansRequest(rank=self.rank, start=0)
            for msg in self.oracle.StreamPlans(request, timeout=PLAN_STREAM_TIMEOUT_S):
                plan = PlanArrays.decode(msg, self.config.model.num_tables)
                with self.pipeline.cond:
                    self.pipeline.received[plan.batch] = plan
                    self.pipeline.cond.notify_all()
                self.prefetch_queue.put(plan)
                if plan.last:
                    break
        except BaseException as e:
            self.pipeline.fail(e)
        finally:
            self.prefetch_queue.put(None)

    def _prefetch(self) -> None:
        try:
            assert self.client is not None
            while (plan := self.prefetch_queue.get()) is not None:
                self.cache.ensure_capacity(plan.slot_high_water)
                if plan.prefetch.size:
                    rows, state = self.client.lookup(plan.keys[plan.prefetch])
                    slots = torch.from_numpy(plan.slots[plan.prefetch].astype(np.int64)).to(self.device)
                    self.cache.insert(slots, torch.from_numpy(rows), torch.from_numpy(state))
                with self.pipeline.cond:
                    self.pipeline.ready.add(plan.batch)
                    self.pipeline.cond.notify_all()
        except BaseException as e:
            self.pipeline.fail(e)

    def _write_back(self) -> None:
        try:
            assert self.client is not None and self.oracle is not None
            while (item := self.writeback_queue.get()) is not None:
                batch, keys, rows, state = item
                if keys.size:
                    self.client.write_back(keys, rows.numpy(), state.numpy())
                report = opb.ProgressReport(rank=self.rank, trained=batch, written_back=batch)
                call_with_retry(lambda r=report: self.oracle.ReportProgress(r, timeout=serving.RPC_TIMEOUT_S), "progress")
                self.written_back = batch
                self.registry.set_progress(self.rank, batch)
        except BaseException as e:
            self.pipeline.fail(e)

    # ---- the training step
    def _timed(self, stage: str, start: float) -> float:
        now = time.perf_counter()
        self.stage_seconds[stage] += now - start
        metrics.STAGE_SECONDS.labels(stage).observe(now - start)
        return now

    def step(self, batch: int) -> PlanArrays:
        t = time.perf_counter()
        self.pipeline.wait(lambda: batch in self.pipeline.received)
        t = self._timed("data_wait", t)
        self.pipeline.wait(lambda: batch in self.pipeline.ready)
        t = self._timed("prefetch_wait", t)
        with self.pipeline.cond:
            plan = self.pipeline.received.pop(batch)
            self.pipeline.ready.discard(batch)

        dev = self.device
        slots = torch.from_numpy(plan.slots.astype(np.int64)).to(dev)
        inverse = torch.from_numpy(plan.inverse.astype(np.int64)).to(dev)
        dense = torch.from_numpy(plan.dense).to(dev)
        labels = torch.from_numpy(plan.labels).to(dev)
        with self.cache.lock:
            rows = self.cache.weights.index_select(0, slots).requires_grad_()
            loss = batch_loss(self.model(dense, rows[inverse]), labels, plan.global_batch_size)
            t = self._timed("forward", t)
            self.dense_opt.zero_grad(set_to_none=False)
            loss.backward()
            t = self._timed("backward", t)
            row_grad = rows.grad
            assert row_grad is not None
            if self.config.world_size > 1:
                dist.all_reduce(row_grad)
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
            apply_rows(self.config.optimizer, self.cache.weights, self.cache.state, slots, row_grad)
            t = self._timed("optimizer", t)
            wb = plan.writeback
            wb_rows, wb_state = self.cache.read(slots[torch.from_numpy(wb.astype(np.int64)).to(dev)])
        self.writeback_queue.put((batch, plan.keys[wb], wb_rows, wb_state))
        self._timed("write_back", t)

        u, p = int(plan.keys.size), int(plan.prefetch.size)
        self.counts["iterations"] += 1
        self.counts["samples"] += int(plan.labels.size)
        self.counts["global_samples"] += plan.global_batch_size
        self.counts["rows"] += u
        self.counts["prefetched"] += p
        self.counts["written_back"] += int(wb.size)
        self.losses.append(float(flat[-1]))
        metrics.ITERATIONS.inc()
        metrics.SAMPLES.inc(int(plan.labels.size))
        metrics.CACHE_HITS.inc(u - p)
        metrics.CACHE_MISSES.inc(p)
        metrics.ROWS_PREFETCHED.inc(p)
        metrics.ROWS_WRITTEN_BACK.inc(int(wb.size))
        metrics.LOSS.set(self.losses[-1])
        metrics.HEARTBEAT.set(time.time())
        return plan

    def run(self) -> dict[str, Any]:
        """Trains to the end and returns this trainer's statistics."""
        self._connect()
        self._init_dist()
        self._load_initial()
        if self.config.save_initial and self.rank == 0:
            self.export_checkpoint(self.config.save_initial, {"steps": 0})
        if self.config.world_size > 1:
            dist.barrier()
        threads = [
            threading.Thread(target=self._receive, name="receiver", daemon=True),
            threading.Thread(target=self._prefetch, name="prefetcher", daemon=True),
            threading.Thread(target=self._write_back, name="writer", daemon=True),
        ]
        for th in threads:
            th.start()
        start = time.perf_counter()
        batch = 0
        while True:
            plan = self.step(batch)
            if plan.last:
                break
            batch += 1
        self.writeback_queue.put(None)
        threads[2].join()
        if self.pipeline.error is not None:
            raise RuntimeError("a trainer thread failed") from self.pipeline.error
        elapsed = time.perf_counter() - start
        if self.config.world_size > 1:
            dist.barrier()  # every trainer's write-backs are durable
        if self.config.save_final and self.rank == 0:
            self.export_checkpoint(self.config.save_final, {"steps": batch + 1})
        stats = self.statistics(elapsed)
        self.registry.put_json(f"stats:{self.rank}", stats)
        return stats

    def statistics(self, elapsed: float) -> dict[str, Any]:
        it = max(1, self.counts["iterations"])
        assert self.client is not None
        return {
            "rank": self.rank,
            "iterations": self.counts["iterations"],
            "seconds": elapsed,
            "samples_per_second": self.counts["global_samples"] / elapsed if elapsed > 0 else 0.0,
            "stage_seconds_per_iteration": {s: self.stage_seconds[s] / it for s in metrics.STAGES},
            "rows_per_iteration": self.counts["rows"] / it,
            "rows_prefetched_per_iteration": self.counts["prefetched"] / it,
            "rows_written_back_per_iteration": self.counts["written_back"] / it,
            "cache_hit_rate": 1.0 - self.counts["prefetched"] / max(1, self.counts["rows"]),
            "cache_capacity_rows": self.cache.capacity,
            "bytes_sent": self.client.bytes_sent,
            "bytes_received": self.client.bytes_received,
            "losses": self.losses,
        }

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.config.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.registry.close()
