"""Command-line configuration of a trainer."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bagpipe.config_args import (
    DEFAULT_TRANSFER_BATCHES,
    Coordination,
    add_checkpoint_chain_args,
    add_coordination_args,
    add_eval_args,
    add_model_args,
    add_recovery_args,
    add_table_args,
    coordination_of,
    model_argv,
    model_config_of,
    optimizer_argv,
    optimizer_config_of,
    parse_config,
    positive_int,
    recovery_argv,
    table_argv,
    table_rows_of,
)
from bagpipe.core import snapshots
from bagpipe.core.model_config import ModelConfig
from bagpipe.core.optim_config import OptimizerConfig

DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
DIST_BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class TrainerConfig:
    """Trainer ``rank`` of ``world_size``: model, optimizer, checkpoints and rendezvous."""

    rank: int
    world_size: int
    dist_init: str
    model: ModelConfig
    optimizer: OptimizerConfig
    table_rows: tuple[int, ...]
    seed: int
    init_from: str | None
    save_initial: str | None
    save_final: str | None
    device: str
    coordination: Coordination = Coordination()
    # the process group's backend: auto is NCCL on CUDA and gloo on CPU; trainers that share a GPU
    # (NCCL refuses two ranks on one device) all-reduce their CUDA tensors through gloo
    dist_backend: str = "auto"
    data: str = "synthetic"  # the training data's source: its schema sizes the model's dense input
    cache_rows: int | None = None
    iteration_log: str | None = None
    fetch: str = "prefetch"
    shared_table: str | None = None
    transfer_batches: int = DEFAULT_TRANSFER_BATCHES
    checkpoint_dir: str | None = None
    resume_batch: int = 0
    keep_checkpoints: int = snapshots.DEFAULT_KEEP
    checkpoint_full_every: int = snapshots.DEFAULT_FULL_EVERY
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    eval_data: str | None = None
    eval_every: int = 0
    eval_samples: int = 0
    exit_when_done: bool = False

    def __post_init__(self) -> None:
        if self.transfer_batches < 1:
            raise ValueError(f"transfer_batches: must be >= 1, got {self.transfer_batches}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints: must be >= 1, got {self.keep_checkpoints}")
        if self.checkpoint_full_every < 1:
            raise ValueError(f"checkpoint_full_every: must be >= 1, got {self.checkpoint_full_every}")
        if self.cache_rows is not None and self.cache_rows < 1:
            raise ValueError(f"cache_rows: must be >= 1, got {self.cache_rows}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: must be in [0, {self.world_size}), got {self.rank}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: must be auto, cpu or cuda, got {self.device!r}")
        if self.dist_backend not in DIST_BACKENDS:
            raise ValueError(
                f"dist_backend: must be one of {', '.join(DIST_BACKENDS)}, got {self.dist_backend!r}"
            )
        if self.collective_timeout <= 0:
            raise ValueError(f"collective_timeout: must be > 0 seconds, got {self.collective_timeout}")
        if self.shared_table and self.checkpoint_dir:
            raise ValueError(
                "checkpoint_dir: the shared-memory table (benchmark 'ideal' system) is not checkpointed"
            )
        if len(self.table_rows) != self.model.num_tables:
            raise ValueError(
                f"table_rows: {len(self.table_rows)} tables, the model has {self.model.num_tables}"
            )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bagpipe-trainer", description=TrainerConfig.__doc__)
    p.add_argument("--rank", type=int, required=True, help="this trainer's rank")
    p.add_argument("--world-size", type=int, required=True, help="number of trainers")
    p.add_argument("--dist-init", default="tcp://127.0.0.1:29500", help="torch.distributed init method")
    p.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when present), cpu or cuda; on CUDA, rank r uses GPU r mod the GPUs it sees",
    )
    p.add_argument(
        "--dist-backend",
        choices=DIST_BACKENDS,
        default="auto",
        help="the trainers' process group: auto is nccl on CUDA and gloo on CPU; gloo where trainers "
        "share a GPU (NCCL refuses two ranks on one device)",
    )
    p.add_argument(
        "--save-initial", default=None, help="rank 0 writes the initial interchange checkpoint here"
    )
    p.add_argument("--save-final", default=None, help="rank 0 writes the final interchange checkpoint here")
    p.add_argument("--iteration-log", default=None, help="write one CSV row per iteration here")
    p.add_argument(
        "--fetch",
        choices=["prefetch", "synchronous"],
        default="prefetch",
        help="prefetch: fetch ahead and write back in the background (Bagpipe); synchronous: fetch before "
        "and write back after each step, on the critical path (the no-cache baseline)",
    )
    p.add_argument(
        "--shared-table",
        default=None,
        metavar="PREFIX",
        help="benchmark 'ideal' system: fetch from and write back to a table in shared memory at PREFIX "
        "(e.g. /dev/shm/bagpipe-job) instead of the embedding servers",
    )
    p.add_argument(
        "--exit-when-done",
        action="store_true",
        help="exit after training instead of serving /metrics until SIGTERM",
    )
    p.add_argument(
        "--cache-rows", type=positive_int, default=None, help="cache rows (default: grow as planned)"
    )
    p.add_argument(
        "--transfer-batches",
        type=positive_int,
        default=DEFAULT_TRANSFER_BATCHES,
        help=f"fetch and write back up to this many batches' rows in one call per shard (default "
        f"{DEFAULT_TRANSFER_BATCHES}; 1: one call per batch)",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=DEFAULT_COLLECTIVE_TIMEOUT_S,
        help="seconds a collective (all-reduce, barrier) may wait for a peer before failing (default "
        f"{DEFAULT_COLLECTIVE_TIMEOUT_S:.0f}; the failure detector notices a lost peer well before)",
    )
    add_table_args(p)
    add_model_args(p, dense=True)
    add_eval_args(p)
    add_coordination_args(p)
    add_recovery_args(p)
    add_checkpoint_chain_args(p)
    return p


def parse(argv: list[str] | None = None) -> TrainerConfig:
    return parse_config(build_parser(), argv, _config, resume=True)


def _config(a: argparse.Namespace) -> TrainerConfig:
    table_rows = table_rows_of(a)
    return TrainerConfig(
        rank=a.rank,
        world_size=a.world_size,
        dist_init=a.dist_init,
        model=model_config_of(a, len(table_rows)),
        optimizer=optimizer_config_of(a),
        table_rows=table_rows,
        seed=a.seed,
        init_from=a.init_from,
        save_initial=a.save_initial,
        save_final=a.save_final,
        device=a.device,
        dist_backend=a.dist_backend,
        coordination=coordination_of(a),
        data=a.data,
        cache_rows=a.cache_rows,
        iteration_log=a.iteration_log,
        fetch=a.fetch,
        shared_table=a.shared_table,
        transfer_batches=a.transfer_batches,
        checkpoint_dir=a.checkpoint_dir,
        resume_batch=a.resume_batch,
        keep_checkpoints=a.keep_checkpoints,
        checkpoint_full_every=a.checkpoint_full_every,
        collective_timeout=a.collective_timeout,
        eval_data=a.eval_data,
        eval_every=a.eval_every,
        eval_samples=a.eval_samples,
        exit_when_done=a.exit_when_done,
    )


def argv(c: TrainerConfig) -> list[str]:
    """The command line ``parse`` reads back to ``c`` (the launcher starts trainers with it)."""
    out = ["--rank", str(c.rank), "--world-size", str(c.world_size), "--dist-init", c.dist_init]
    out += [
        "--device",
        c.device,
        "--dist-backend",
        c.dist_backend,
        "--fetch",
        c.fetch,
        "--transfer-batches",
        str(c.transfer_batches),
    ]
    out += ["--collective-timeout", repr(c.collective_timeout)]
    out += table_argv(c.data, c.table_rows) + model_argv(c.model)
    out += optimizer_argv(c.optimizer, c.seed, c.init_from) + c.coordination.argv()
    out += recovery_argv(c.checkpoint_dir, c.resume_batch)
    out += [
        "--keep-checkpoints",
        str(c.keep_checkpoints),
        "--checkpoint-full-every",
        str(c.checkpoint_full_every),
    ]
    for flag, value in (
        ("--save-initial", c.save_initial),
        ("--save-final", c.save_final),
        ("--iteration-log", c.iteration_log),
        ("--shared-table", c.shared_table),
        ("--cache-rows", c.cache_rows),
        ("--eval-data", c.eval_data),
    ):
        out += [flag, str(value)] if value is not None else []
    out += ["--eval-every", str(c.eval_every)] if c.eval_every else []
    out += ["--eval-samples", str(c.eval_samples)] if c.eval_samples else []
    return out + (["--exit-when-done"] if c.exit_when_done else [])
