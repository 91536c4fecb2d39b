"""``RunConfig``: one ``bagpipe run`` job, built once, frozen, and handed to every part of the run.

Each field is the flag of the same name (``batch_size`` is ``--batch-size``), declared once: the flags a
service also takes are that service's declarations (``flags.like``), or the shared field functions of
``config_args``. ``bagpipe run``'s parser is derived from this class, and so is the Python API
(``bagpipe.RunConfig``): ``RunConfig(model="dcn", trainers=4)`` is ``bagpipe run --model dcn
--trainers 4``.

A value is checked where it is declared: the flag's own reader (``--lr`` a number, ``--trainers`` >= 1),
and the rules of the services' configs, which the run builds for every process (the batch size divides by
the trainers in ``OracleConfig``, the model's sizes in ``ModelConfig``). A ``RunConfig`` that could not
start raises ``ValueError`` naming the field as it is built, before anything starts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bagpipe import flags
from bagpipe.config_args import (
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_TRANSFER_BATCHES,
    Coordination,
    _Cache,
    _Chain,
    _Evaluation,
    _Model,
    _Tables,
    byte_size,
    data_field,
    non_negative_float,
    non_negative_int,
    positive_int,
    table_rows_field,
)
from bagpipe.controller.config import ControllerConfig
from bagpipe.core.model_config import is_builtin
from bagpipe.core.optim_config import OptimizerConfig
from bagpipe.cpu_priority import PRIORITIES
from bagpipe.data_processor.config import SourceConfig
from bagpipe.embedding_server.row_tier import POLICIES
from bagpipe.flags import flag, like
from bagpipe.oracle_cacher.config import OracleConfig
from bagpipe.trainer.config import TrainerConfig

# rows per second each embedding server sends while re-sharding a local run: there the services share the
# trainers' cores; at the quick profile's size this keeps iterations during a migration as fast as the
# others (bench/resharding.py), where no limit makes them about 1.6x slower on 2 cores
DEFAULT_MIGRATION_RATE = 50_000.0
SYSTEMS = ("bagpipe", "no-cache", "ideal")
DEVICES = ("auto", "cpu", "cuda")
# what --resume takes from the invocation that resumes, not from the stopped run: how it is shown
OWN_ON_RESUME = ("resume", "quiet", "report")
# what an older config.json holds beside the flags (the subcommand; TLS files, which are the environment's)
LEGACY = frozenset({"command", "tls_cert", "tls_key", "tls_ca", "tls_server_name"})


@dataclass(frozen=True)
class RunConfig:
    """One training job: every service as a local process (``bagpipe run``)."""

    # data and input checking
    data: str = data_field()
    scale: float = like(_Tables, "scale")
    table_rows: tuple[int, ...] | None = table_rows_field(resolved=False)
    zipf_alpha: float | None = like(SourceConfig, "zipf_alpha")
    hot_fraction: float | None = like(SourceConfig, "hot_fraction")
    hot_share: float | None = like(SourceConfig, "hot_share")
    skip_bad_rows: bool = like(SourceConfig, "skip_bad_rows")
    shuffle_seed: int | None = like(SourceConfig, "shuffle_seed")
    shuffle_buffer: int = like(SourceConfig, "shuffle_buffer")
    schema: str | None = like(SourceConfig, "schema")
    # model and optimizer
    model: str = like(_Model, "model")
    embedding_dim: int = like(_Model, "embedding_dim")
    bottom_mlp: tuple[int, ...] | None = like(_Model, "bottom_mlp")
    top_mlp: tuple[int, ...] | None = like(_Model, "top_mlp")
    deep_mlp: tuple[int, ...] = like(_Model, "deep_mlp")
    cross_layers: int = like(_Model, "cross_layers")
    optimizer: str = like(OptimizerConfig, "name", name=None)
    lr: float = like(OptimizerConfig, "lr")
    eps: float | None = like(OptimizerConfig, "eps", omit=None)
    momentum: float = like(OptimizerConfig, "momentum")
    weight_decay: float = like(OptimizerConfig, "weight_decay")
    seed: int = like(_Model, "seed")
    init_from: str | None = like(_Model, "init_from")
    # evaluation
    eval_data: str | None = like(_Evaluation, "eval_data")
    eval_every: int = like(_Evaluation, "eval_every")
    eval_samples: int = like(_Evaluation, "eval_samples")
    # job
    batch_size: int = flag("global batch size", default=2048, parse=positive_int)
    iterations: int = flag("global batches to train (0: the whole data)", default=300, parse=non_negative_int)
    trainers: int = flag("number of trainers", default=2, parse=positive_int)
    embedding_servers: int = flag("number of embedding servers", default=2, parse=positive_int)
    data_processors: int = flag("number of data processors", default=1, parse=positive_int)
    device: str = flag(
        "trainer device: auto (CUDA when torch sees one), cpu or cuda", default="auto", choices=DEVICES
    )
    transfer_batches: int = flag(
        "trainers fetch and write back up to this many batches' rows in one call per shard",
        default=DEFAULT_TRANSFER_BATCHES,
        parse=positive_int,
    )
    save_initial: str | None = flag("write the initial interchange checkpoint here", default=None)
    save_final: str | None = flag("write the final interchange checkpoint here", default=None)
    run_dir: str | None = flag("where logs and the summary go (default runs/<time>)", default=None)
    quiet: bool = flag("no progress bar", default=False)
    report: bool = flag(
        "report.html and plots at the end (--no-report for scripted runs: the tests, the benchmarks); the "
        "summary, metrics and checkpoints are written as always",
        default=True,
    )
    log_level: str = like(Coordination, "log_level", help="services' logging level")
    tensorboard: str | None = like(TrainerConfig, "tensorboard")
    # cache
    lookahead: int | None = like(_Cache, "lookahead", default=None, required=None)
    max_lookahead: int = like(_Cache, "max_lookahead")
    cache_rows: int | None = like(_Cache, "cache_rows")
    reuse_delay: int = like(_Cache, "reuse_delay")
    cache_mode: str = like(_Cache, "cache_mode")
    sync: str = like(
        _Cache, "delayed_sync", default="delayed", name=None, read=None, show=str, text_default=None
    )
    planner_threads: int = like(OracleConfig, "planner_threads")
    oracles: int = like(OracleConfig, "oracles")
    # failures and recovery
    checkpoint_every: int = flag(
        "a consistent, incremental checkpoint after every this many batches, from which the job recovers "
        "exactly (0: none)",
        default=DEFAULT_CHECKPOINT_EVERY,
        parse=non_negative_int,
    )
    checkpoint_dir: str | None = flag("where checkpoints go (default RUN_DIR/checkpoints)", default=None)
    failure_timeout: float = like(ControllerConfig, "failure_timeout")
    max_restarts: int = like(ControllerConfig, "max_restarts")
    resume: str | None = flag(
        "go on with a stopped or crashed run from its last checkpoint, with its own flags",
        default=None,
        metavar="RUN_DIR",
    )
    keep_checkpoints: int = like(_Chain, "keep_checkpoints")
    checkpoint_full_every: int = like(_Chain, "checkpoint_full_every")
    # scaling
    migration_rows_per_second: float = flag(
        "re-sharding (bagpipe scale) sends at most this many rows per second from each embedding server, so "
        "that training keeps its share of the cores and the network (0: no limit)",
        default=DEFAULT_MIGRATION_RATE,
        parse=non_negative_float,
        show=lambda v: f"{v:g}",
    )
    lookup_threads: int = flag(
        "threads per embedding server that work on rows off its event loop: lookups' rows copied into their "
        "replies, several at once, and write-backs stored, one at a time (0: on the event loop, best where "
        "the servers have no cores to spare, as on one machine)",
        default=0,
        parse=non_negative_int,
    )
    embedding_server_priority: str = flag(
        "CPU priority of the embedding servers, which share this machine's cores with the trainers: idle "
        "runs them only on cores the trainers leave idle (Linux SCHED_IDLE), where a prefetching trainer, "
        "which needs their answers batches later, loses nothing to them; normal, as every other process; "
        "auto: idle, but normal with --system no-cache, whose trainers wait for every fetch, and with "
        "--row-memory, whose disk reads must keep ahead of the fetches",
        default="auto",
        choices=("auto", *PRIORITIES),
    )
    row_memory: int | None = flag(
        "bytes of rows and optimizer state each embedding server keeps in memory (e.g. 2GiB), the others in "
        "files under --row-disk (none: every row in memory)",
        default=None,
        parse=byte_size,
        metavar="SIZE",
    )
    row_policy: str = flag(
        "the row tier's policy: lookahead (the oracle's plans); for benchmarks only, lru or next-batch",
        default="lookahead",
        choices=POLICIES,
    )
    row_disk: str | None = flag(
        "directory of the embedding servers' rows beyond --row-memory, a local disk (default with "
        "--row-memory: RUN_DIR/rows)",
        default=None,
    )
    # benchmarking
    system: str = flag(
        "bagpipe; no-cache: L=1, every row fetched before and written back after each step on the critical "
        "path; ideal: embeddings in shared memory beside the trainers, no network transfers",
        default="bagpipe",
        choices=SYSTEMS,
    )
    embedding_server_netns: str | None = flag(
        "run the embedding servers in this network namespace (the benchmark's limited link)",
        default=None,
        metavar="NAME",
    )
    netns_addresses: str = flag(
        "the link's address on this side and inside the namespace",
        default="10.231.0.1,10.231.0.2",
        metavar="HOST_IP,NETNS_IP",
    )
    # monitoring
    prometheus: bool = flag(
        "also start a real Prometheus server scraping every service (binary: make tools)", default=False
    )
    prometheus_port: int = flag("its port (0: any free port)", default=0, parse=non_negative_int)
    prometheus_linger: float = flag(
        "seconds Prometheus stays up after training, for queries", default=0.0, parse=non_negative_float
    )

    # the flags of `bagpipe run --help`, by group
    GROUPS = {
        "data and input checking": (
            "data", "scale", "table_rows", "zipf_alpha", "hot_fraction", "hot_share", "skip_bad_rows",
            "shuffle_seed", "shuffle_buffer", "schema",
        ),
        "model and optimizer": (
            "model", "embedding_dim", "bottom_mlp", "top_mlp", "deep_mlp", "cross_layers", "optimizer", "lr",
            "eps", "momentum", "weight_decay", "seed", "init_from",
        ),
        "evaluation": ("eval_data", "eval_every", "eval_samples"),
        "job": (
            "batch_size", "iterations", "trainers", "embedding_servers", "data_processors", "device",
            "transfer_batches", "save_initial", "save_final", "run_dir", "quiet", "report", "log_level",
        ),
        "cache": (
            "lookahead",
            "max_lookahead",
            "cache_rows",
            "reuse_delay",
            "cache_mode",
            "sync",
            "planner_threads",
            "oracles",
        ),
        "failures and recovery": (
            "checkpoint_every", "checkpoint_dir", "failure_timeout", "max_restarts", "resume",
            "keep_checkpoints", "checkpoint_full_every",
        ),
        "scaling": (
            "migration_rows_per_second", "lookup_threads", "embedding_server_priority", "row_memory",
            "row_disk", "row_policy",
        ),
        "benchmarking": ("system", "embedding_server_netns", "netns_addresses"),
        "monitoring": ("prometheus", "prometheus_port", "prometheus_linger", "tensorboard"),
    }  # fmt: skip

    def __post_init__(self) -> None:
        try:
            self._check()
        except ValueError as e:  # (a ConfigError too: its text is "field: why" as well)
            raise flags.ConfigError.of(RunConfig, e) from None

    def _check(self) -> None:
        flags.check(self)  # each value as its flag would read it (types, ranges, choices)
        if self.data == "synthetic" and self.iterations == 0:
            raise ValueError("iterations: synthetic data is endless; give a number of iterations")
        # (a model class of the user's takes none of the sizes: model_config_of says so)
        if is_builtin(self.model) and self.model != "dlrm" and (self.bottom_mlp or self.top_mlp):
            field = "bottom_mlp" if self.bottom_mlp else "top_mlp"
            raise ValueError(f"{field}: belongs to --model dlrm; {self.model} takes --deep-mlp")
        if self.model == "dlrm" and self.deep_mlp:
            raise ValueError(
                "deep_mlp: belongs to --model wdl, deepfm or dcn; dlrm takes --bottom-mlp/--top-mlp"
            )
        if self.eval_every and not self.eval_data:
            raise ValueError("eval_every: needs --eval-data")
        if len(self.netns_addresses.split(",")) != 2:
            raise ValueError(f"netns_addresses: expected HOST_IP,NETNS_IP, got {self.netns_addresses!r}")
        from bagpipe.local import configs  # (the services' configs: their rules, as the run builds them)

        configs.check(self)

    def argv(self) -> list[str]:
        """The ``bagpipe run`` flags that give this config back (defaults left out)."""
        return flags.argv(self)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, saved: dict[str, Any], where: str = "config.json") -> RunConfig:
        """A config saved by :meth:`to_json` (a run's ``config.json``, its record left aside); a name that
        is no field is an error naming it, as is a value that is wrong."""
        saved = {k: v for k, v in saved.items() if k not in LEGACY}
        if "no_report" in saved:  # (config.json of a run before --report)
            saved["report"] = not saved.pop("no_report")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(saved) - names)
        if unknown:
            raise ValueError(f"{where}: not a flag of bagpipe run: {', '.join(unknown)}")
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
        return cls(**values)

    def resumed(self) -> RunConfig:
        """``resume``: the stopped run's own config (its ``config.json``), with how this invocation shows
        the run (``OWN_ON_RESUME``)."""
        assert self.resume is not None
        path = Path(self.resume) / "config.json"
        if not path.is_file():
            raise ValueError(f"resume: {path} not found (not a run directory of `bagpipe run`?)")
        from bagpipe.local.record import flags_of

        saved = RunConfig.from_json(flags_of(json.loads(path.read_text())), str(path))
        return dataclasses.replace(saved, **{k: getattr(self, k) for k in OWN_ON_RESUME})

    def checkpoints(self, run_dir: Path) -> Path:
        """Where the run's recovery checkpoints go."""
        return Path(self.checkpoint_dir) if self.checkpoint_dir else run_dir / "checkpoints"
