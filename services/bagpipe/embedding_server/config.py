"""An embedding server's configuration: each field its flag (``bagpipe.flags``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bagpipe import flags
from bagpipe.config_args import (
    Coordination,
    byte_size,
    checkpoint_dir_field,
    command_line,
    data_field,
    embedding_dim_field,
    init_from_field,
    model_field,
    non_negative_float,
    non_negative_int,
    oracles_field,
    positive_float,
    positive_int,
    resume_batch_field,
    schema_field,
    seed_field,
    table_rows_field,
)
from bagpipe.core.model_config import first_order, is_builtin, model_class, row_width
from bagpipe.core.optim_config import OptimizerConfig
from bagpipe.cpu_priority import PRIORITIES
from bagpipe.embedding_server.row_tier import POLICIES, TierSpec
from bagpipe.embedding_server.shard_store import DEFAULT_MAX_ABS
from bagpipe.flags import flag


@dataclass(frozen=True)
class EmbeddingServerConfig:
    """One shard's settings: which shard, the tables and where the initial values come from."""

    shard: int = flag("this server's shard index", parse=int)
    initial_shards: int = flag(
        "servers the job's first shard map spreads the rows over; only the first server to start uses it: "
        "later, the servers registered in Redis are the shards, and re-sharding moves rows when they change",
        parse=positive_int,
        text_default=1,
        aliases=("--num-shards",),
    )
    table_rows: tuple[int, ...] = table_rows_field()
    embedding_dim: int = embedding_dim_field(positional=True)
    optimizer: OptimizerConfig = flags.group()  # (its flags: --optimizer, --lr, ...)
    seed: int = seed_field(positional=True)
    init_from: str | None = init_from_field(positional=True)
    address: str = flag("host:port to listen on (port 0: any)", text_default="127.0.0.1:0")
    coordination: Coordination = Coordination()
    data: str = data_field()  # (the training data's source: its schema says how many tables)
    checkpoint_dir: str | None = checkpoint_dir_field()
    resume_batch: int = resume_batch_field()
    migration_rows_per_second: float = flag(
        "re-sharding sends at most this many rows per second from this server (0: no limit), leaving the "
        "trainers' transfers their bandwidth",
        default=0.0,
        parse=non_negative_float,
    )
    max_abs_value: float = flag(
        "a write-back with a value beyond this (absolute) is refused",
        default=DEFAULT_MAX_ABS,
        parse=positive_float,
        show=repr,
    )
    model: str = model_field()
    lookup_threads: int = flag(
        "threads that work on rows off the event loop: lookups' rows copied into their replies, several at "
        "once, and write-backs stored, one at a time, while no copy runs (0: on the event loop, which is "
        "best where the server has no core to spare)",
        default=0,
        parse=non_negative_int,
    )
    cpu_priority: str = flag(
        "normal, or idle: every thread of this server runs only on cores that other processes leave idle "
        "(Linux SCHED_IDLE), for a server that shares its cores with trainers, which prefetch batches ahead "
        "and so need its answers later (bagpipe run sets it)",
        default="normal",
        choices=PRIORITIES,
    )
    schema: str | None = schema_field()  # (the data's layout: how many tables)
    row_memory: int | None = flag(
        "bytes of rows and their optimizer state this server keeps in memory (e.g. 2GiB); the others lie in "
        "files under --row-disk, read back ahead of the batches that need them (none: every row in memory)",
        default=None,
        parse=byte_size,
        metavar="SIZE",
    )
    row_policy: str = flag(
        "what the row tier keeps in memory and when it reads from disk: lookahead (the oracle's plans: "
        "Belady's eviction, rows read before their fetch); for benchmarks only, lru (history-based eviction, "
        "reads on demand) and next-batch (LRU, the next batch's rows read ahead)",
        default="lookahead",
        choices=POLICIES,
    )
    oracles: int = oracles_field()  # (a row tier follows every oracle shard's fetch stream)
    row_disk: str | None = flag(
        "directory of the rows beyond --row-memory: a local volume (this server's files in it are its own, "
        "and removed when it stops)",
        default=None,
    )

    @property
    def linear(self) -> bool:
        """Rows carry the model's first-order weight after the embedding (a model class of the user's says
        so by ``first_order``: it is imported to read it)."""
        return first_order(self.model)

    @property
    def row_width(self) -> int:
        return row_width(self.model, self.embedding_dim)

    @property
    def tier(self) -> TierSpec | None:
        """``--row-memory`` and ``--row-disk``, or None (every row in memory)."""
        if self.row_memory is None or self.row_disk is None:
            return None
        return TierSpec(self.row_memory, Path(self.row_disk), self.row_policy)

    def __post_init__(self) -> None:
        if not is_builtin(self.model):
            model_class(self.model)  # (ValueError "model: ...": the server needs its row width)
        if self.shard < 0:
            raise ValueError(f"shard: must be >= 0, got {self.shard}")
        if self.initial_shards < 1:
            raise ValueError(f"initial_shards: must be >= 1, got {self.initial_shards}")
        if self.migration_rows_per_second < 0:
            raise ValueError(f"migration_rows_per_second: must be >= 0, got {self.migration_rows_per_second}")
        if self.lookup_threads < 0:
            raise ValueError(f"lookup_threads: must be >= 0, got {self.lookup_threads}")
        if (self.row_memory is None) != (self.row_disk is None):
            given = "row_memory" if self.row_memory is not None else "row_disk"
            other = "--row-disk" if self.row_memory is not None else "--row-memory"
            raise ValueError(f"{given}: needs {other} too")
        if self.row_memory is not None and self.row_memory < 4 * self.row_width * 2:
            raise ValueError(f"row_memory: must hold at least two rows, got {self.row_memory} bytes")
        if self.cpu_priority not in PRIORITIES:
            raise ValueError(f"cpu_priority: one of {', '.join(PRIORITIES)}, got {self.cpu_priority!r}")


# the service's command line: ``python -m`` parses it, ``bagpipe run`` and the chart write it
build_parser, parse, argv = command_line(EmbeddingServerConfig, "bagpipe-embedding-server")
