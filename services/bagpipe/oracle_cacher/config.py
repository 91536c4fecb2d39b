"""Command-line configuration of the oracle cacher."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bagpipe.config_args import (
    CACHE_MODES,
    DEFAULT_MAX_LOOKAHEAD,
    DEFAULT_REUSE_DELAY,
    Coordination,
    add_cache_args,
    add_coordination_args,
    add_table_args,
    batch_or_latest,
    coordination_of,
    non_negative_int,
    parse_config,
    resolve_latest,
    table_argv,
    table_rows_of,
)
from bagpipe.core.plans import MAX_TRAINERS


@dataclass(frozen=True)
class OracleConfig:
    """Lookahead planning for ``trainers`` trainers over ``table_rows`` tables."""

    table_rows: tuple[int, ...]
    batch_size: int
    trainers: int
    lookahead: int | None
    data_processors: int
    iterations: int
    address: str = "127.0.0.1:0"
    coordination: Coordination = Coordination()
    data: str = "synthetic"  # the training data's source (its schema: how many tables)
    cache_rows: int | None = None
    max_lookahead: int = DEFAULT_MAX_LOOKAHEAD
    reuse_delay: int = DEFAULT_REUSE_DELAY
    cache_mode: str = "lrpp"
    delayed_sync: bool = True
    checkpoint_every: int = 0
    eval_every: int = 0
    start_batch: int = 0

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
        if self.reuse_delay < 1:
            raise ValueError(f"reuse_delay: must be >= 1, got {self.reuse_delay}")
        if self.cache_rows is not None and self.cache_rows < 1:
            raise ValueError(f"cache_rows: must be >= 1, got {self.cache_rows}")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode: must be one of {', '.join(CACHE_MODES)}, got {self.cache_mode!r}")
        if self.trainers > MAX_TRAINERS:
            raise ValueError(f"trainers: at most {MAX_TRAINERS}, got {self.trainers}")
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bagpipe-oracle-cacher", description=OracleConfig.__doc__)
    p.add_argument("--batch-size", type=int, required=True, help="global batch size")
    p.add_argument("--trainers", type=int, required=True, help="number of trainers")
    add_cache_args(p)
    p.add_argument("--data-processors", type=int, default=1, help="number of data processors to read from")
    p.add_argument("--iterations", type=int, default=0, help="batches to plan (0: until the data ends)")
    p.add_argument("--address", default="127.0.0.1:0", help="host:port to listen on (port 0: any)")
    p.add_argument(
        "--checkpoint-every",
        type=non_negative_int,
        default=0,
        help="a consistent checkpoint after every this many batches (default 0: none)",
    )
    p.add_argument(
        "--eval-every",
        type=non_negative_int,
        default=0,
        help="the trainers evaluate after every this many batches: plan a checkpoint there too",
    )
    p.add_argument(
        "--start-batch",
        type=batch_or_latest,
        default=0,
        help="plan from this batch on (a run resumed from the checkpoint of that name; latest: the newest "
        "complete one in --checkpoint-dir, or 0 when there is none)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="the job's recovery checkpoints (read only, for --start-batch latest)",
    )
    add_table_args(p)
    add_coordination_args(p)
    return p


def parse(argv: list[str] | None = None) -> OracleConfig:
    return parse_config(build_parser(), argv, _config)


def _config(a: argparse.Namespace) -> OracleConfig:
    return OracleConfig(
        table_rows=table_rows_of(a),
        batch_size=a.batch_size,
        trainers=a.trainers,
        lookahead=a.lookahead,
        cache_rows=a.cache_rows,
        max_lookahead=a.max_lookahead,
        reuse_delay=a.reuse_delay,
        cache_mode=a.cache_mode,
        delayed_sync=a.sync == "delayed",
        data_processors=a.data_processors,
        iterations=a.iterations,
        address=a.address,
        coordination=coordination_of(a),
        data=a.data,
        checkpoint_every=a.checkpoint_every,
        eval_every=a.eval_every,
        start_batch=resolve_latest(a.start_batch, a.checkpoint_dir, "--start-batch"),
    )


def argv(c: OracleConfig) -> list[str]:
    """The command line ``parse`` reads back to ``c`` (the launcher starts the oracle with it)."""
    out = ["--batch-size", str(c.batch_size), "--trainers", str(c.trainers)]
    out += ["--data-processors", str(c.data_processors), "--iterations", str(c.iterations)]
    out += ["--address", c.address, "--checkpoint-every", str(c.checkpoint_every)]
    out += ["--eval-every", str(c.eval_every), "--start-batch", str(c.start_batch)]
    out += ["--max-lookahead", str(c.max_lookahead), "--reuse-delay", str(c.reuse_delay)]
    out += ["--cache-mode", c.cache_mode, "--sync", "delayed" if c.delayed_sync else "critical"]
    out += ["--lookahead", str(c.lookahead)] if c.lookahead is not None else []
    out += ["--cache-rows", str(c.cache_rows)] if c.cache_rows is not None else []
    return out + table_argv(c.data, c.table_rows) + c.coordination.argv()
