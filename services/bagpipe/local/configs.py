"""Each service's configuration for one generation of a local job, from the run's ``RunConfig``.

The launcher builds the services' own config objects here and starts each process with the command line
its ``parse`` reads back to the same object (``argv`` in each service's config module; the tests check
the round trip), so a flag is spelled in one place: the service's parser. :func:`check` builds them all
once as the ``RunConfig`` is made, so a rule of a service refuses a run before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bagpipe.config_args import Coordination, model_config_of, optimizer_config_of, table_rows_of
from bagpipe.controller.config import ControllerConfig
from bagpipe.data_processor.config import DataProcessorConfig, SourceConfig
from bagpipe.embedding_server.config import EmbeddingServerConfig
from bagpipe.oracle_cacher.config import OracleConfig
from bagpipe.trainer.config import TrainerConfig

if TYPE_CHECKING:
    from bagpipe.local.run_config import RunConfig


@dataclass(frozen=True)
class GenerationSpec:
    """What the processes of a run share: Redis, the job's name, its checkpoints and run directory (where a
    generation begins is the controller's, in Redis)."""

    redis_url: str
    job: str
    checkpoint_every: int  # 0: no recovery checkpoints
    checkpoints: Path | None  # where they go
    run_dir: Path

    def coordination(self, args: RunConfig, **where: str) -> Coordination:
        """Redis and the job as the generation's, ``where`` (e.g. ``metrics_address``) as given."""
        return Coordination(
            **{"redis_url": self.redis_url, "job": self.job, "log_level": args.log_level, **where}
        )

    @property
    def checkpoint_dir(self) -> str | None:
        return str(self.checkpoints) if self.checkpoint_every and self.checkpoints else None


def embedding_server(
    args: RunConfig,
    gen: GenerationSpec,
    shard: int,
    netns_addresses: str | None = None,
) -> EmbeddingServerConfig:
    """Server ``shard``'s configuration, the same for one of the run's first and for one joining it
    (``bagpipe scale``), which holds no rows until they move to it. (What it loads at start is the
    launcher's ``--resume-batch latest``.) With ``netns_addresses`` ("HOST_IP,NETNS_IP") it listens inside
    a network namespace and reaches Redis over its link."""
    coordination = gen.coordination(args)
    address = "127.0.0.1:0"
    if netns_addresses:
        host_ip, netns_ip = netns_addresses.split(",")
        address = f"{netns_ip}:0"
        coordination = gen.coordination(
            args, metrics_address=address, redis_url=gen.redis_url.replace("127.0.0.1", host_ip)
        )
    return EmbeddingServerConfig(
        shard=shard,
        initial_shards=args.embedding_servers,
        table_rows=table_rows_of(args),
        embedding_dim=args.embedding_dim,
        optimizer=optimizer_config_of(args),
        seed=args.seed,
        init_from=args.init_from,
        address=address,
        coordination=coordination,
        data=args.data,
        schema=args.schema,
        checkpoint_dir=gen.checkpoint_dir,  # (a joining server too: it rebuilds from there on a roll-back)
        migration_rows_per_second=args.migration_rows_per_second,
        model=args.model,
        lookup_threads=args.lookup_threads,
        cpu_priority=embedding_server_priority(args),
        row_memory=args.row_memory,
        row_policy=args.row_policy,
        row_disk=(args.row_disk or str(gen.run_dir / "rows")) if args.row_memory else args.row_disk,
        oracles=args.oracles,
    )


def embedding_server_priority(args: RunConfig) -> str:
    """``--embedding-server-priority``; auto: idle, but normal for the no-cache baseline, whose trainers
    wait for each fetch (its servers are on the critical path, and idle ones would slow it unfairly), and
    with ``--row-memory``, whose reads from disk must keep ahead of the trainers' fetches."""
    if args.embedding_server_priority == "auto":  # (a row tier's disk reads must keep ahead of the fetches)
        return "normal" if args.system == "no-cache" or args.row_memory else "idle"
    return args.embedding_server_priority


def data_processor(args: RunConfig, gen: GenerationSpec, index: int) -> DataProcessorConfig:
    return DataProcessorConfig(
        source=source(args), batch_size=args.batch_size, index=index, coordination=gen.coordination(args)
    )


def source(args: RunConfig) -> SourceConfig:
    """The training data's source, as every data processor reads it."""
    return SourceConfig(
        data=args.data,
        table_rows=table_rows_of(args),
        seed=args.seed,
        zipf_alpha=args.zipf_alpha,
        hot_fraction=args.hot_fraction,
        hot_share=args.hot_share,
        skip_bad_rows=args.skip_bad_rows,
        shuffle_seed=args.shuffle_seed,
        shuffle_buffer=args.shuffle_buffer,
        schema=args.schema,
    )


def oracle(args: RunConfig, gen: GenerationSpec, shard: int = 0) -> OracleConfig:
    """Oracle shard ``shard``'s plan (of ``--oracles``), as ``bagpipe run`` asked (``--system no-cache``:
    L=1, critical sync); it plans a flush (a checkpoint) at every evaluation point too. With the embedding
    servers in a network namespace and a row tier, it listens on the host's end of their link, where their
    fetch streams reach it."""
    no_cache = args.system == "no-cache"
    address = "127.0.0.1:0"
    if args.embedding_server_netns and args.row_memory:  # (a row tier's servers follow its fetch stream)
        address = f"{args.netns_addresses.split(',')[0]}:0"
    return OracleConfig(
        address=address,
        table_rows=table_rows_of(args),
        batch_size=args.batch_size,
        trainers=args.trainers,
        lookahead=1 if no_cache else args.lookahead,
        data_processors=args.data_processors,
        iterations=args.iterations,
        coordination=gen.coordination(args),
        data=args.data,
        cache_rows=args.cache_rows,
        max_lookahead=args.max_lookahead,
        reuse_delay=args.reuse_delay,
        cache_mode=args.cache_mode,
        delayed_sync=not no_cache and args.sync == "delayed",
        checkpoint_every=gen.checkpoint_every,
        eval_every=args.eval_every,
        schema=args.schema,
        planner_threads=args.planner_threads,
        oracles=args.oracles,
        shard=shard,
    )


def gpu_nodes() -> bool:
    """Whether this host has GPU device files (NVIDIA's, AMD's for ROCm, or WSL2's GPU bridge): without
    them, torch cannot see a CUDA device, and the launcher need not import it to count them."""
    dev = Path("/dev")
    return any((dev / name).exists() for name in ("kfd", "dxg")) or any(dev.glob("nvidia[0-9]*"))


def dist_backend(args: RunConfig) -> str:
    """The local job's trainers all run on this host: where CUDA trainers outnumber its GPUs, some share
    one, which NCCL refuses, so their process group is gloo (it all-reduces CUDA tensors too)."""
    if args.device == "cpu" or not gpu_nodes():
        return "auto"
    import torch  # (a second of the launcher's start-up, before anything spawns: only where GPUs may be)

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "gloo" if 0 < gpus < args.trainers else "auto"


def trainer(
    args: RunConfig, gen: GenerationSpec, rank: int, dist_init: str, backend: str | None = None
) -> TrainerConfig:
    """Trainer ``rank``; ``--system``: no-cache fetches synchronously, ideal uses a shared-memory table."""
    table_rows = table_rows_of(args)
    return TrainerConfig(
        rank=rank,
        world_size=args.trainers,
        dist_init=dist_init,
        model=model_config_of(args, len(table_rows)),
        optimizer=optimizer_config_of(args),
        table_rows=table_rows,
        seed=args.seed,
        init_from=args.init_from,
        save_initial=args.save_initial if rank == 0 else None,  # (written only by a generation from 0)
        save_final=args.save_final if rank == 0 else None,
        device=args.device,
        dist_backend=backend or dist_backend(args),
        coordination=gen.coordination(args),
        data=args.data,
        cache_rows=args.cache_rows,
        iteration_log=str(gen.run_dir / "metrics" / f"trainer-{rank}.csv"),
        tensorboard=args.tensorboard if rank == 0 else None,
        fetch="synchronous" if args.system == "no-cache" else "prefetch",
        shared_table=f"/dev/shm/bagpipe-{gen.job}" if args.system == "ideal" else None,
        transfer_batches=args.transfer_batches,
        checkpoint_dir=gen.checkpoint_dir,
        keep_checkpoints=args.keep_checkpoints,
        checkpoint_full_every=args.checkpoint_full_every,
        collective_timeout=max(60.0, 6 * args.failure_timeout),
        eval_data=args.eval_data,
        eval_every=args.eval_every,
        eval_samples=args.eval_samples,
        schema=args.schema,
        serve_after_done=True,  # (the launcher reads every trainer's last metrics, then stops it)
        oracles=args.oracles,
    )


def rendezvous_url(run_dir: Path) -> str:
    """The trainers' ``--dist-init``: a file store, not a TCP port (a port picked free here may be taken by
    another service's listener before rank 0 binds it). Each generation meets in a file of its own (the
    trainers add its id: a store file is never reused). The path is absolute: in ``file://runs/x`` a
    relative run directory would be read as a host name, and the trainers would wait on a file nobody
    writes."""
    rendezvous = run_dir.resolve() / "rendezvous"
    rendezvous.mkdir(parents=True, exist_ok=True)
    # (not Path.as_uri(): torch reads the path without undoing percent-encoding)
    return f"file://{rendezvous / 'store'}"


def checkpoint_every(args: RunConfig) -> int:
    """Batches between consistent checkpoints (0: none; the shared-memory 'ideal' system has none)."""
    return 0 if args.system == "ideal" else args.checkpoint_every


def controller(args: RunConfig, gen: GenerationSpec, prometheus_url: str | None) -> ControllerConfig:
    return ControllerConfig(
        trainers=args.trainers,
        oracles=args.oracles,
        coordination=gen.coordination(args),
        checkpoint_dir=gen.checkpoint_dir,
        prometheus_url=prometheus_url,
        failure_timeout=args.failure_timeout,
        max_restarts=args.max_restarts,
        kill="local",
    )


# the run's field for a service's field of another name, in a service's ValueError
RUN_FIELD = {
    "initial_shards": "embedding_servers",
    "cpu_priority": "embedding_server_priority",
    "delayed_sync": "sync",
    "world_size": "trainers",
    "name": "model",
}


def check(args: RunConfig) -> None:
    """Builds every service's config of the run, as its first generation starts them: a rule of one that
    refuses a value raises ValueError naming the run's field (``batch_size: must be a positive multiple of
    trainers (3), got 100``)."""
    every = checkpoint_every(args)
    gen = GenerationSpec("redis://127.0.0.1:6379/0", "check", every, Path("checkpoints"), Path("."))
    try:
        controller(args, gen, None)
        for shard in range(args.embedding_servers):
            embedding_server(args, gen, shard)
        data_processor(args, gen, 0)
        oracle(args, gen)
        trainer(args, gen, 0, "file:///dev/null", backend="auto")
    except ValueError as e:
        field, sep, why = str(e).partition(": ")
        if sep and field in RUN_FIELD:
            raise ValueError(f"{RUN_FIELD[field]}: {why}") from None
        raise
