"""A trainer's configuration: each field its flag (``bagpipe.flags``)."""

from __future__ import annotations

from dataclasses import dataclass

from bagpipe import flags
from bagpipe.config_args import (
    DEFAULT_TRANSFER_BATCHES,
    Coordination,
    add_model_shape_args,
    cache_rows_field,
    checkpoint_dir_field,
    checkpoint_full_every_field,
    command_line,
    data_field,
    eval_data_field,
    eval_every_field,
    eval_samples_field,
    init_from_field,
    keep_checkpoints_field,
    model_argv,
    model_config_of,
    oracles_field,
    positive_int,
    resume_batch_field,
    schema_field,
    seed_field,
    table_rows_field,
    table_rows_of,
    tensorboard_field,
)
from bagpipe.core.model_config import ModelConfig
from bagpipe.core.optim_config import OptimizerConfig
from bagpipe.core.schema import TABLE_KINDS
from bagpipe.flags import flag

DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
DIST_BACKENDS = ("auto", "nccl", "gloo")
FETCH_MODES = ("prefetch", "synchronous")


@dataclass(frozen=True)
class TrainerConfig:
    """Trainer ``rank`` of ``world_size``: model, optimizer, checkpoints and rendezvous."""

    rank: int = flag("this trainer's rank", parse=int)
    world_size: int = flag("number of trainers", parse=int)
    dist_init: str = flag("torch.distributed init method", text_default="tcp://127.0.0.1:29500")
    model: ModelConfig = flag(
        "the model: --model and its sizes",
        read=lambda value, a: model_config_of(a, len(table_rows_of(a))),
        adds=add_model_shape_args,
        write=model_argv,
        required=False,
    )
    optimizer: OptimizerConfig = flags.group()  # (its flags: --optimizer, --lr, ...)
    table_rows: tuple[int, ...] = table_rows_field()
    seed: int = seed_field(positional=True)
    init_from: str | None = init_from_field(positional=True)
    save_initial: str | None = flag("rank 0 writes the initial interchange checkpoint here", required=False)
    save_final: str | None = flag("rank 0 writes the final interchange checkpoint here", required=False)
    device: str = flag(
        "auto (CUDA when present), cpu or cuda; on CUDA, rank r uses GPU r mod the GPUs it sees",
        text_default="auto",
    )
    coordination: Coordination = Coordination()
    dist_backend: str = flag(
        "the trainers' process group: auto is nccl on CUDA and gloo on CPU; gloo where trainers share a GPU "
        "(NCCL refuses two ranks on one device)",
        default="auto",
        choices=DIST_BACKENDS,
    )
    data: str = data_field()  # (the training data's source: its schema sizes the model's dense input)
    cache_rows: int | None = cache_rows_field()
    iteration_log: str | None = flag("write one CSV row per iteration here", default=None)
    tensorboard: str | None = tensorboard_field()
    fetch: str = flag(
        "prefetch: fetch ahead and write back in the background (Bagpipe); synchronous: fetch before and "
        "write back after each step, on the critical path (the no-cache baseline)",
        default="prefetch",
        choices=FETCH_MODES,
    )
    shared_table: str | None = flag(
        "benchmark 'ideal' system: fetch from and write back to a table in shared memory at PREFIX (e.g. "
        "/dev/shm/bagpipe-job) instead of the embedding servers",
        default=None,
        metavar="PREFIX",
    )
    transfer_batches: int = flag(
        "fetch and write back up to this many batches' rows in one call per shard (1: one call per batch)",
        default=DEFAULT_TRANSFER_BATCHES,
        parse=positive_int,
    )
    checkpoint_dir: str | None = checkpoint_dir_field()
    resume_batch: int = resume_batch_field()
    keep_checkpoints: int = keep_checkpoints_field()
    checkpoint_full_every: int = checkpoint_full_every_field()
    collective_timeout: float = flag(
        "seconds a collective (all-reduce, barrier) may wait for a peer before failing (the failure detector "
        "notices a lost peer well before)",
        default=DEFAULT_COLLECTIVE_TIMEOUT_S,
        show=repr,
    )
    eval_data: str | None = eval_data_field()
    eval_every: int = eval_every_field()
    eval_samples: int = eval_samples_field()
    schema: str | None = schema_field()
    oracles: int = oracles_field()
    serve_after_done: bool = flag(
        "after the job's end keep serving /metrics until SIGTERM instead of exiting (the local launcher "
        "reads the trainers' last metrics; a Job's pod must exit to complete)",
        default=False,
    )

    def __post_init__(self) -> None:
        if self.oracles < 1:
            raise ValueError(f"oracles: must be >= 1, got {self.oracles}")
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
        if self.eval_data:
            eval_kind, _, paths = self.eval_data.partition(":")
            kind = self.data.partition(":")[0]
            if self.eval_data == "synthetic":
                if self.data != "synthetic":
                    raise ValueError("eval_data: synthetic held-out samples need --data synthetic")
            elif eval_kind not in ("criteo", "avazu", *TABLE_KINDS) or not paths:
                raise ValueError(
                    f"eval_data: expected 'synthetic' or a file source like --data's (KIND:PATH), got "
                    f"{self.eval_data!r}"
                )
            elif eval_kind != kind:
                raise ValueError(f"eval_data: {eval_kind}: data is not in the format of --data {kind}")
        elif self.eval_every:
            raise ValueError("eval_every: needs --eval-data")
        if len(self.table_rows) != self.model.num_tables:
            raise ValueError(
                f"table_rows: {len(self.table_rows)} tables, the model has {self.model.num_tables}"
            )


# the service's command line: ``python -m`` parses it, ``bagpipe run`` and the chart write it
build_parser, parse, argv = command_line(TrainerConfig, "bagpipe-trainer")
