"""The trainer's checkpoints: recovery checkpoints between two batches, and the interchange export.

A recovery checkpoint (``Checkpointer.take``, core/snapshots.py for the layout) is taken after a batch the
plan marks. Once that batch's background synchronisation and write-backs are done, every cached row is
current on its holders and every evicted one on the servers; each trainer then writes the cached rows it
is the designated writer of (the plan lists them) to the servers, which then hold the whole model. Rank 0
(``Sealer``) has each server write what changed since the previous checkpoint, writes the dense model and
optimizer, marks the checkpoint complete and prunes the old ones; the barriers keep every write-back of a
later batch out of the snapshot. The rows stay cached: training goes on as if nothing happened.

``export`` writes the interchange checkpoint (core/checkpoint.py): the dense part here, every embedding row
from the row store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import redis
import torch
import torch.distributed as dist

from bagpipe.control.locks import CHECKPOINT_LOCK_OWNER, RESHARD_LOCK
from bagpipe.control.registry import Registry
from bagpipe.core import checkpoint, snapshots
from bagpipe.core.data import table_offsets
from bagpipe.core.optim import Optimizer, saved_state
from bagpipe.core.optim_config import OptimizerConfig
from bagpipe.core.plans import TrainerBatch
from bagpipe.core.row_store import RowStore
from bagpipe.embedding_server.client import EmbeddingClient
from bagpipe.trainer.cache import EmbeddingCache
from bagpipe.trainer.config import TrainerConfig
from bagpipe.trainer.pipeline import Pipeline
from bagpipe.trainer.sync import Synchronizer

logger = logging.getLogger(__name__)


class CheckpointFailed(Exception):
    """A recovery checkpoint could not be written, and a replay would fail the same way (a full disk or
    quota, a read-only volume: ``snapshots.final``); the message names where."""


@dataclass(frozen=True)
class DenseModel:
    """The part of the model a trainer holds whole: the dense parameters and their optimizer."""

    model: torch.nn.Module
    optimizer: Optimizer
    config: OptimizerConfig

    def parameters(self) -> dict[str, torch.Tensor]:
        """The dense parameters, copied to the CPU."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's name and hyperparameters, and its state of the dense parameters (``dense``)."""
        opt = self.config
        return {
            "name": opt.name,
            "lr": opt.lr,
            "eps": opt.epsilon,
            "betas": list(opt.betas),
            "dense": saved_state(self.optimizer, dict(self.model.named_parameters())),
        }


def export(
    path: str,
    dense: DenseModel,
    store: RowStore,
    config: TrainerConfig,
    optimizer_steps: int,
    meta: dict[str, Any],
) -> None:
    """Writes the interchange checkpoint (core/checkpoint.py) of a model that took ``optimizer_steps``
    optimizer steps: the dense part from ``dense``, every embedding row from ``store``; ``meta`` adds to
    its metadata."""
    model, opt = config.model, config.optimizer
    out: dict[str, Any] = {  # (the sections in the contract's order; put_table fills the tables)
        "dense": dense.parameters(),
        "embeddings": {},
        **({"linear": {}} if model.linear else {}),
        "optimizer": {
            **dense.optimizer_state(),
            "embeddings": {},
            **({"linear": {}} if model.linear else {}),
        },
        "meta": {
            **model.describe(),
            "table_rows": list(config.table_rows),
            "embedding_dim": model.embedding_dim,
            "num_dense": model.num_dense,
            "optimizer_steps": optimizer_steps,
            **meta,
        },
    }
    step = optimizer_steps if opt.name == "adam" else None
    offsets = table_offsets(config.table_rows)
    for t in range(offsets.size - 1):
        keys = np.arange(offsets[t], offsets[t + 1], dtype=np.int64)
        rows, state = store.lookup(keys)
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


class Sealer:
    """(Rank 0 of generation ``generation``.) Seals recovery checkpoints into ``directory``: the servers'
    snapshots, the dense part, the manifest that makes a checkpoint count, then the pruning of old ones.
    ``last`` is the checkpoint the next one follows (0: none yet)."""

    def __init__(
        self,
        directory: str,
        config: TrainerConfig,
        servers: EmbeddingClient,
        dense: DenseModel,
        registry: Registry,
        generation: str,
        last: int,
    ) -> None:
        self.directory = directory
        self.config = config
        self.servers = servers
        self.dense = dense
        self.registry = registry
        self.generation = generation
        self.last = last

    def seal(self, next_batch: int) -> dict[str, float]:
        """Seals checkpoint ``next_batch``; returns the rows and bytes the servers wrote. A checkpoint that
        cannot be written (a full disk) is removed and CheckpointFailed names the directory (the trainer
        exits with ``snapshots.EXIT_CHECKPOINT_FAILED``): the complete ones before it are untouched, and
        replaying would only fail the same way. Any other error is raised as it is (recovered from like
        any failure; the next generation's rank 0 removes what this one began)."""
        directory, previous = self.directory, self.last
        try:
            full = snapshots.full_due(directory, previous, self.config.checkpoint_full_every)
            written = self._write(next_batch, previous, full)
        except (OSError, grpc.RpcError) as e:
            disk_full = (
                snapshots.final(e)
                if isinstance(e, OSError)
                else e.code() == grpc.StatusCode.FAILED_PRECONDITION
                and (e.details() or "").startswith("directory:")
            )
            if not disk_full:  # (a server gone, a volume's passing error)
                raise
            snapshots.discard(directory, next_batch)
            why = e.details() if isinstance(e, grpc.RpcError) else str(e)
            logger.error("checkpoint %d not written: %s", next_batch, why)
            raise CheckpointFailed(
                f"checkpoint {next_batch} could not be written to {directory}: {why}; "
                f"the complete checkpoints before it are intact (latest: {previous or 'none'})"
            ) from None
        self.last = next_batch
        self._prune(next_batch)
        return written

    def _write(self, next_batch: int, previous: int, full: bool) -> dict[str, float]:
        directory = self.directory
        # the map in force stays fixed while the servers write (a re-sharding switch waits for this lock,
        # which is renewed while they do)
        owner = f"{CHECKPOINT_LOCK_OWNER}{self.config.coordination.job}-{next_batch}"
        with self.registry.locked(RESHARD_LOCK, owner):
            files = self.servers.snapshot(directory, next_batch, full)
        snapshots.write_dense(
            directory,
            next_batch,
            {
                "dense": self.dense.parameters(),
                "optimizer": self.dense.optimizer_state(),
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

    def _prune(self, sealed: int) -> None:
        """Prunes only while this generation is in force. The controller reads the newest checkpoint as it
        begins the next generation; had it read before ``sealed`` was complete, it may have chosen the one
        before, which pruning removes once ``sealed`` is full and only one is kept. Recording ``sealed`` in
        the generation's record makes the controller read again if it has not begun the next one yet
        (``Registry.begin_generation``); if it has, this generation is over and prunes nothing (its
        successor's rank 0 does, and first removes what this one wrote after the start)."""
        keep = self.config.keep_checkpoints
        try:
            in_force = self.registry.checkpoint_sealed(self.generation, sealed)
        except redis.RedisError as e:
            logger.warning("checkpoints in %s not pruned: Redis: %s", self.directory, e)
            return
        if not in_force:
            logger.warning("checkpoints not pruned after %d: this trainer's generation is over", sealed)
            return
        try:
            removed = snapshots.prune(self.directory, keep)
        except OSError as e:  # (an old checkpoint left behind costs disk, not correctness)
            logger.warning("checkpoints in %s not pruned: %s", self.directory, e)
        else:
            if removed:
                logger.info("pruned checkpoints %s (keeping %d)", removed, keep)


class Checkpointer:
    """One trainer's side of the recovery checkpoints in generation ``generation``; ``connect`` it to the
    row store before ``take``."""

    def __init__(
        self,
        config: TrainerConfig,
        dense: DenseModel,
        cache: EmbeddingCache,
        sync: Synchronizer,
        pipeline: Pipeline,
        registry: Registry,
        generation: str,
    ) -> None:
        self.config = config
        self.dense = dense
        self.cache = cache
        self.sync = sync
        self.pipeline = pipeline
        self.registry = registry
        self.generation = generation
        self.store: RowStore | None = None
        self.sealer: Sealer | None = None

    def connect(self, store: RowStore, servers: EmbeddingClient) -> None:
        """Rows are written to ``store``; rank 0 has ``servers`` write the checkpoints (recovery
        checkpoints are the servers' files: the shared-memory ideal system writes none)."""
        self.store = store
        directory = self.config.checkpoint_dir
        if self.config.rank == 0 and directory is not None and store is servers:
            self.sealer = Sealer(
                directory,
                self.config,
                servers,
                self.dense,
                self.registry,
                self.generation,
                self.config.resume_batch,
            )

    def take(
        self, plan: TrainerBatch, evaluate: Callable[[int], float]
    ) -> tuple[float, dict[str, float]] | None:
        """A consistent checkpoint after ``plan.batch``; with no ``--checkpoint-dir`` only the flush of
        the cached rows an evaluation needs. ``evaluate(next_batch)`` runs between the two barriers, while
        the servers hold every newest row, and returns the seconds it took. Returns the checkpoint's
        seconds (less the evaluation's) and what rank 0 wrote (rows and bytes; elsewhere the rows this
        trainer flushed), or None with no directory."""
        assert (
            self.store is not None and plan.checkpoint_keys is not None and plan.checkpoint_slots is not None
        )
        directory = self.config.checkpoint_dir
        t0 = time.perf_counter()
        batch = plan.batch
        self.sync.wait_synced(batch)
        self.pipeline.wait_written(batch)
        if plan.checkpoint_keys.size:
            with self.cache.lock.shared():
                rows, state = self.cache.read(self.cache.index(plan.checkpoint_slots))
            self.store.write_back(plan.checkpoint_keys, rows.numpy(), state.numpy())
        self._barrier()
        written = {"rows": float(plan.checkpoint_keys.size), "bytes": 0.0}
        if directory is not None and self.config.rank == 0:
            assert self.sealer is not None, "recovery checkpoints need the embedding servers"
            written = self.sealer.seal(batch + 1)
        evaluated = evaluate(batch + 1)
        self._barrier()
        if directory is None:
            return None
        return time.perf_counter() - t0 - evaluated, written

    def _barrier(self) -> None:
        if self.config.world_size > 1:
            dist.barrier()
