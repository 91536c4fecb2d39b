"""The oracle cacher's configuration: each field its flag (``bagpipe.flags``)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from bagpipe.config_args import (
    CACHE_MODES,
    Coordination,
    batch_or_latest,
    cache_mode_field,
    cache_rows_field,
    command_line,
    data_field,
    delayed_sync_field,
    lookahead_field,
    max_lookahead_field,
    non_negative_int,
    oracles_field,
    positive_int,
    resolve_latest,
    reuse_delay_field,
    schema_field,
    table_rows_field,
)
from bagpipe.core.plans import MAX_TRAINERS
from bagpipe.core.shard_map import DEFAULT_BUCKETS
from bagpipe.flags import flag


def _add_checkpoint_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="the job's recovery checkpoints (read only, for --start-batch latest)",
    )


def planner_cores() -> int:
    """The most threads a planner may have here: numba's thread count, as numba reckons it without
    importing it (``NUMBA_NUM_THREADS``, else the cores this process may run on)."""
    if os.environ.get("NUMBA_NUM_THREADS"):
        return int(os.environ["NUMBA_NUM_THREADS"])
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class OracleConfig:
    """Lookahead planning for ``trainers`` trainers over ``table_rows`` tables."""

    table_rows: tuple[int, ...] = table_rows_field()
    batch_size: int = flag("global batch size", parse=int)
    trainers: int = flag("number of trainers", parse=int)
    lookahead: int | None = lookahead_field()
    data_processors: int = flag("number of data processors to read from", parse=int, text_default=1)
    iterations: int = flag("batches to plan (0: until the data ends)", parse=int, text_default=0)
    address: str = flag("host:port to listen on (port 0: any)", default="127.0.0.1:0")
    coordination: Coordination = Coordination()
    data: str = data_field()  # (the training data's source: its schema says how many tables)
    cache_rows: int | None = cache_rows_field()
    max_lookahead: int = max_lookahead_field()
    reuse_delay: int = reuse_delay_field()
    cache_mode: str = cache_mode_field()
    delayed_sync: bool = delayed_sync_field()
    checkpoint_every: int = flag(
        "a consistent checkpoint after every this many batches (0: none)", default=0, parse=non_negative_int
    )
    eval_every: int = flag(
        "the trainers evaluate after every this many batches: plan a checkpoint there too",
        default=0,
        parse=non_negative_int,
    )
    start_batch: int = flag(
        "plan from this batch on (a run resumed from the checkpoint of that name; latest: the newest "
        "complete one in --checkpoint-dir, or 0 when there is none)",
        default=0,
        parse=batch_or_latest,
        read=lambda value, a: resolve_latest(value, a.checkpoint_dir, "--start-batch"),
        adds=_add_checkpoint_dir,
        text_default=0,
    )
    schema: str | None = schema_field()  # (the data's layout: how many tables)
    planner_threads: int = flag(
        "threads that plan each batch, its keys split between them (the same plans; at most the cores "
        "numba sees)",
        default=1,
        parse=positive_int,
    )
    oracles: int = oracles_field()
    shard: int = flag("this oracle shard's index, in [0, --oracles)", default=0, parse=non_negative_int)

    @property
    def window(self) -> int:
        """The most batches the window may hold: --lookahead, or --max-lookahead when L is automatic."""
        return self.lookahead if self.lookahead is not None else self.max_lookahead

    def __post_init__(self) -> None:
        if self.trainers < 1:
            raise ValueError(f"trainers: must be >= 1, got {self.trainers}")
        if self.batch_size < 1 or self.batch_size % self.trainers:
            raise ValueError(
                f"batch_size: must be a positive multiple of trainers ({self.trainers}), got "
                f"{self.batch_size}"
            )
        if self.lookahead is not None and self.lookahead < 1:
            raise ValueError(f"lookahead: must be >= 1, got {self.lookahead}")
        if self.max_lookahead < 1:
            raise ValueError(f"max_lookahead: must be >= 1, got {self.max_lookahead}")
        if self.lookahead is not None and self.lookahead > self.max_lookahead:
            raise ValueError(f"lookahead: {self.lookahead} is over --max-lookahead {self.max_lookahead}")
        if self.reuse_delay < 1:
            raise ValueError(f"reuse_delay: must be >= 1, got {self.reuse_delay}")
        if self.cache_rows is not None and self.cache_rows < 1:
            raise ValueError(f"cache_rows: must be >= 1, got {self.cache_rows}")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode: must be one of {', '.join(CACHE_MODES)}, got {self.cache_mode!r}")
        if self.trainers > MAX_TRAINERS:
            raise ValueError(f"trainers: at most {MAX_TRAINERS}, got {self.trainers}")
        cores = planner_cores()
        if not 1 <= self.planner_threads <= cores:
            raise ValueError(
                f"planner_threads: must be in [1, {cores}] (the cores here), got {self.planner_threads}"
            )
        if self.oracles < 1:
            raise ValueError(f"oracles: must be >= 1, got {self.oracles}")
        if not 0 <= self.shard < self.oracles:
            raise ValueError(f"shard: must be in [0, {self.oracles}) (--oracles), got {self.shard}")
        buckets = min(DEFAULT_BUCKETS, sum(self.table_rows))  # (a shard owns whole key buckets)
        if self.table_rows and self.oracles > buckets:
            raise ValueError(f"oracles: at most {buckets}, a key bucket a shard, got {self.oracles}")
        if self.data_processors < 1:
            raise ValueError(f"data_processors: must be >= 1, got {self.data_processors}")
        if self.iterations < 0:
            raise ValueError(f"iterations: must be >= 0 (0: until the data ends), got {self.iterations}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every: must be >= 0 (0: at the end only), got {self.eval_every}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every: must be >= 0 (0: never), got {self.checkpoint_every}")
        if self.start_batch < 0 or (self.iterations and self.start_batch >= self.iterations):
            raise ValueError(
                f"start_batch: must be in [0, {self.iterations or 'the end'}), got {self.start_batch}"
            )

    def checkpoint_after(self, batch: int) -> bool:
        """A consistent checkpoint follows ``batch`` (never the last one: the final model covers it): every
        ``checkpoint_every`` batches, and every ``eval_every`` (an evaluation needs the same flush of the
        trainers' cached rows to the servers, so it is a checkpoint too)."""
        return any(
            every > 0 and (batch + 1) % every == 0 for every in (self.checkpoint_every, self.eval_every)
        )


# the service's command line: ``python -m`` parses it, ``bagpipe run`` and the chart write it
build_parser, parse, argv = command_line(OracleConfig, "bagpipe-oracle-cacher")
