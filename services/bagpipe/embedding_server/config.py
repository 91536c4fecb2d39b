"""Command-line configuration of an embedding server."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bagpipe.config_args import (
    add_coordination_args,
    add_model_args,
    add_recovery_args,
    add_table_args,
    check_resume,
    table_rows_of,
)


@dataclass(frozen=True)
class EmbeddingServerConfig:
    """One shard's settings: which shard, the tables and where the initial values come from."""

    shard: int
    num_shards: int
    table_rows: tuple[int, ...]
    embedding_dim: int
    optimizer: str
    seed: int
    init_from: str | None
    address: str
    redis_url: str
    job: str
    checkpoint_dir: str | None = None
    resume_batch: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(f"shard: must be in [0, {self.num_shards}), got {self.shard}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bagpipe-embedding-server", description=EmbeddingServerConfig.__doc__)
    p.add_argument("--shard", type=int, required=True, help="this server's shard index")
    p.add_argument("--num-shards", type=int, required=True, help="number of embedding servers")
    p.add_argument("--address", default="127.0.0.1:0", help="host:port to listen on (port 0: any)")
    add_table_args(p)
    add_model_args(p, dense=False)
    add_coordination_args(p)
    add_recovery_args(p)
    return p


def parse(argv: list[str] | None = None) -> EmbeddingServerConfig:
    a = build_parser().parse_args(argv)
    check_resume(a)
    return EmbeddingServerConfig(
        shard=a.shard,
        num_shards=a.num_shards,
        table_rows=table_rows_of(a),
        embedding_dim=a.embedding_dim,
        optimizer=a.optimizer,
        seed=a.seed,
        init_from=a.init_from,
        address=a.address,
        redis_url=a.redis,
        job=a.job,
        checkpoint_dir=a.checkpoint_dir,
        resume_batch=a.resume_batch,
    )
