"""Command-line configuration of an embedding server."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bagpipe.config_args import (
    Coordination,
    add_coordination_args,
    add_model_args,
    add_recovery_args,
    add_table_args,
    coordination_of,
    non_negative_float,
    non_negative_int,
    optimizer_argv,
    optimizer_config_of,
    parse_config,
    positive_float,
    positive_int,
    recovery_argv,
    table_argv,
    table_rows_of,
)
from bagpipe.core.model_config import LINEAR_MODELS, row_width
from bagpipe.core.optim_config import OptimizerConfig
from bagpipe.cpu_priority import PRIORITIES
from bagpipe.embedding_server.client import MAX_ROWS_PER_RPC
from bagpipe.embedding_server.shard_store import DEFAULT_MAX_ABS


@dataclass(frozen=True)
class EmbeddingServerConfig:
    """One shard's settings: which shard, the tables and where the initial values come from."""

    shard: int
    initial_shards: int
    table_rows: tuple[int, ...]
    embedding_dim: int
    optimizer: OptimizerConfig
    seed: int
    init_from: str | None
    address: str
    coordination: Coordination = Coordination()
    data: str = "synthetic"  # the training data's source (its schema: how many tables)
    checkpoint_dir: str | None = None
    resume_batch: int = 0
    migration_rows_per_second: float = 0.0
    max_rows_per_request: int = MAX_ROWS_PER_RPC
    max_abs_value: float = DEFAULT_MAX_ABS
    model: str = "dlrm"
    lookup_threads: int = 0
    cpu_priority: str = "normal"  # cpu_priority.PRIORITIES

    @property
    def linear(self) -> bool:
        """Rows carry the model's first-order weight after the embedding."""
        return self.model in LINEAR_MODELS

    @property
    def row_width(self) -> int:
        return row_width(self.model, self.embedding_dim)

    def __post_init__(self) -> None:
        if self.shard < 0:
            raise ValueError(f"shard: must be >= 0, got {self.shard}")
        if self.initial_shards < 1:
            raise ValueError(f"initial_shards: must be >= 1, got {self.initial_shards}")
        if self.migration_rows_per_second < 0:
            raise ValueError(f"migration_rows_per_second: must be >= 0, got {self.migration_rows_per_second}")
        if self.lookup_threads < 0:
            raise ValueError(f"lookup_threads: must be >= 0, got {self.lookup_threads}")
        if self.cpu_priority not in PRIORITIES:
            raise ValueError(f"cpu_priority: one of {', '.join(PRIORITIES)}, got {self.cpu_priority!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bagpipe-embedding-server", description=EmbeddingServerConfig.__doc__)
    p.add_argument("--shard", type=int, required=True, help="this server's shard index")
    p.add_argument(
        "--initial-shards",
        "--num-shards",
        dest="initial_shards",
        type=positive_int,
        default=1,
        help="servers the job's first shard map spreads the rows over (default 1); only the first server "
        "to start uses it: later, the servers registered in Redis are the shards, and re-sharding moves "
        "rows when they change",
    )
    p.add_argument(
        "--max-rows-per-request",
        type=positive_int,
        default=MAX_ROWS_PER_RPC,
        help=f"a lookup or write-back with more keys is refused (default {MAX_ROWS_PER_RPC})",
    )
    p.add_argument(
        "--max-abs-value",
        type=positive_float,
        default=DEFAULT_MAX_ABS,
        help=f"a write-back with a value beyond this (absolute) is refused (default {DEFAULT_MAX_ABS:g})",
    )
    p.add_argument(
        "--migration-rows-per-second",
        type=non_negative_float,
        default=0.0,
        help="re-sharding sends at most this many rows per second from this server (default 0: no "
        "limit), leaving the trainers' transfers their bandwidth",
    )
    p.add_argument(
        "--lookup-threads",
        type=non_negative_int,
        default=0,
        help="threads that work on rows off the event loop: lookups' rows copied into their replies, "
        "several at once, and write-backs stored, one at a time, while no copy runs (default 0: on the "
        "event loop, which is best where the server has no core to spare)",
    )
    p.add_argument(
        "--cpu-priority",
        choices=PRIORITIES,
        default="normal",
        help="normal (default), or idle: every thread of this server runs only on cores that other "
        "processes leave idle (Linux SCHED_IDLE), for a server that shares its cores with trainers, "
        "which prefetch batches ahead and so need its answers later (bagpipe run sets it)",
    )
    p.add_argument("--address", default="127.0.0.1:0", help="host:port to listen on (port 0: any)")
    add_table_args(p)
    add_model_args(p, dense=False)
    add_coordination_args(p)
    add_recovery_args(p)
    return p


def parse(argv: list[str] | None = None) -> EmbeddingServerConfig:
    return parse_config(build_parser(), argv, _config, resume=True)


def _config(a: argparse.Namespace) -> EmbeddingServerConfig:
    return EmbeddingServerConfig(
        shard=a.shard,
        initial_shards=a.initial_shards,
        table_rows=table_rows_of(a),
        embedding_dim=a.embedding_dim,
        optimizer=optimizer_config_of(a),
        seed=a.seed,
        init_from=a.init_from,
        address=a.address,
        coordination=coordination_of(a),
        data=a.data,
        checkpoint_dir=a.checkpoint_dir,
        resume_batch=a.resume_batch,
        migration_rows_per_second=a.migration_rows_per_second,
        max_rows_per_request=a.max_rows_per_request,
        max_abs_value=a.max_abs_value,
        model=a.model,
        lookup_threads=a.lookup_threads,
        cpu_priority=a.cpu_priority,
    )


def argv(c: EmbeddingServerConfig) -> list[str]:
    """The command line ``parse`` reads back to ``c`` (the launcher starts servers with it)."""
    out = ["--shard", str(c.shard), "--initial-shards", str(c.initial_shards), "--address", c.address]
    out += ["--model", c.model, "--embedding-dim", str(c.embedding_dim)]
    out += ["--migration-rows-per-second", repr(c.migration_rows_per_second)]
    out += ["--max-rows-per-request", str(c.max_rows_per_request), "--max-abs-value", repr(c.max_abs_value)]
    out += ["--lookup-threads", str(c.lookup_threads), "--cpu-priority", c.cpu_priority]
    out += table_argv(c.data, c.table_rows) + optimizer_argv(c.optimizer, c.seed, c.init_from)
    return out + c.coordination.argv() + recovery_argv(c.checkpoint_dir, c.resume_batch)
