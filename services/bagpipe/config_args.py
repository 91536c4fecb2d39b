"""The flags several configs share, each declared once by a field function (``table_rows_field``), and the
groups ``bagpipe run`` makes of them (``add_cache_args``), so every tier spells and parses them alike.

(Over 400 lines: one declaration for each shared flag, with the readers they need.)
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from bagpipe import flags, tls
from bagpipe.core.data import scaled_table_rows
from bagpipe.core.model_config import (
    DEFAULT_CROSS_LAYERS,
    DEFAULT_DEEP_MLP,
    MODELS,
    ModelConfig,
    model_class,
)
from bagpipe.core.optim_config import OptimizerConfig
from bagpipe.core.schema import TABLE_KINDS, schema_of
from bagpipe.flags import flag

C = TypeVar("C")

DEFAULT_SCALE = 0.01
DEFAULT_MAX_LOOKAHEAD = 200
DEFAULT_REUSE_DELAY = 24
# batches a trainer fetches or writes back in one call per shard (gRPC costs ~1 ms of CPU a call)
DEFAULT_TRANSFER_BATCHES = 8
# batches between consistent checkpoints: a checkpoint pauses training for about one write-back group and
# a snapshot of the rows changed since the last one (bench/recovery.py measures its share of the time)
DEFAULT_CHECKPOINT_EVERY = 50
CACHE_MODES = ("lrpp", "replicated")
SYNC_MODES = ("delayed", "critical")


def int_list(text: str) -> tuple[int, ...]:
    """Parses ``"64,16"``; argparse reports the ValueError with the flag's name."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def data_field(positional: bool = False) -> Any:
    """``--data``: the training data's source, synthetic unless given (``positional``: the dataclass field
    has no default of its own)."""
    what = (
        "'synthetic' (Criteo-Kaggle-like skewed generator), 'criteo:PATH[,PATH...]' (Criteo TSV files), "
        "'avazu:PATH[,PATH...]' (Avazu CSV files), or 'csv:', 'tsv:' or 'parquet:PATH[,PATH...]' laid out as "
        "--schema says"
    )
    return flag(what, text_default="synthetic") if positional else flag(what, default="synthetic")


def scale_field() -> Any:
    return flag("synthetic data: Kaggle cardinalities times this factor", default=DEFAULT_SCALE, parse=float)


def _add_scale(p: Any) -> None:
    flags.add_flags(p, _Tables, only=("scale",))


TABLE_ROWS_HELP = (
    "rows of each table, comma-separated: 26 for synthetic and criteo:, 22 for avazu: (default: the Kaggle "
    "cardinalities for criteo:, scaled by --scale for synthetic; Avazu's for avazu:)"
)


def table_rows_field(resolved: bool = True) -> Any:
    """``--table-rows``; ``resolved``: the field holds the tables' sizes, when the flag is left out the
    source's own (Kaggle's scaled by ``--scale`` for synthetic data, the Kaggle cardinalities for criteo:,
    Avazu's for avazu:); else what was given, or None (``RunConfig``, which has ``scale`` beside it)."""
    show = _ints
    if not resolved:
        return flag(TABLE_ROWS_HELP, default=None, parse=int_list, show=show)
    return flag(
        TABLE_ROWS_HELP,
        parse=int_list,
        show=show,
        read=lambda value, a: source_tables(a.data, value, a.scale, getattr(a, "schema", None)),
        adds=_add_scale,
        required=False,
    )


def table_rows_of(args: Any) -> tuple[int, ...]:
    """The tables' sizes of ``args`` (parsed flags, or a ``RunConfig``): ``table_rows``, or the source's
    default."""
    return source_tables(args.data, args.table_rows, args.scale, getattr(args, "schema", None))


def source_tables(
    data: str, table_rows: tuple[int, ...] | None, scale: float, schema: str | None = None
) -> tuple[int, ...]:
    """``table_rows`` if given (checked against the source's number of tables), else the source's own
    (its schema's; Kaggle's scaled by ``scale`` for synthetic data); ValueError names the field that is
    wrong."""
    if table_rows is not None and schema is None and data.partition(":")[0] in TABLE_KINDS:
        return tuple(table_rows)  # (the layout is inferred from the files, by those that read them)
    layout = schema_of(data, schema)
    if table_rows is not None:
        if len(table_rows) != layout.num_tables:
            raise ValueError(
                f"table_rows: expected {layout.num_tables} values for {data.partition(':')[0]} data, "
                f"got {len(table_rows)}"
            )
        return tuple(table_rows)
    if data == "synthetic":
        if not 0 < scale <= 1:
            raise ValueError(f"scale: must be in (0, 1], got {scale}")
        return tuple(scaled_table_rows(scale))
    if layout.table_rows is None:
        missing = [c.name for c in layout.categorical if c.rows is None]
        raise ValueError(
            f"table_rows: {layout.source} gives no rows for {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + ": give --table-rows, one per categorical column, or rows in the schema"
        )
    return layout.table_rows


def schema_field() -> Any:
    return flag(
        "the layout of csv:, tsv: and parquet: data: a schema file (YAML or JSON: each column's name, role, "
        "table rows and hashing; docs/data.md), or criteo or avazu (default: inferred from the first file's "
        "header and types, with --table-rows)",
        default=None,
        metavar="FILE",
    )


def model_name(text: str) -> str:
    """``--model``: a built-in model, or ``MODULE:CLASS`` whose class is imported here to check it (argparse
    reports what failed under the flag's name)."""
    if text not in MODELS:
        try:
            model_class(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("model: ")) from None
    return text


def model_field() -> Any:
    return flag(
        "dlrm, wdl (Wide&Deep), deepfm, dcn (Deep&Cross), or MODULE:CLASS: your own torch.nn.Module "
        "subclass, importable by every trainer and embedding server (docs/models.md)",
        default="dlrm",
        parse=model_name,
        metavar="{" + ",".join(MODELS) + ",MODULE:CLASS}",
    )


def embedding_dim_field(positional: bool = False) -> Any:
    what = "embedding dimension"
    if positional:
        return flag(what, parse=positive_int, text_default=16)
    return flag(what, default=16, parse=positive_int)


def seed_field(positional: bool = False) -> Any:
    what = "seed of the initial model and synthetic data"
    if positional:
        return flag(what, parse=non_negative_int, text_default=0)
    return flag(what, default=0, parse=non_negative_int)


def init_from_field(positional: bool = False) -> Any:
    what = "start from this interchange checkpoint"
    return flag(what, required=False) if positional else flag(what, default=None)


def add_model_args(p: argparse.ArgumentParser, dense: bool = True) -> None:
    """The model and optimizer flags; ``dense``: also the dense part's sizes (trainers, ``bagpipe run``).
    Embedding servers take the rest: the model decides the row width, the optimizer the state width."""
    g = p.add_argument_group("model and optimizer")
    _add_model_shape(g, dense)
    flags.add_flags(g, OptimizerConfig)
    flags.add_flags(g, _Model, only=("seed", "init_from"))


def add_model_shape_args(p: Any) -> None:
    """The model's flags (a trainer's ``model`` field is made of them): which model, and its sizes."""
    _add_model_shape(p.add_argument_group("model"), dense=True)


def _add_model_shape(g: Any, dense: bool) -> None:
    shape = ("bottom_mlp", "top_mlp", "deep_mlp", "cross_layers") if dense else ()
    flags.add_flags(g, _Model, only=("model", "embedding_dim", *shape))


def bottom_mlp_field() -> Any:
    return flag(
        "dlrm: bottom MLP sizes, the last = --embedding-dim (default 64,DIM)",
        default=None,
        parse=int_list,
        show=_ints,
    )


def top_mlp_field() -> Any:
    return flag("dlrm: top MLP sizes, the last = 1 (default 64,1)", default=None, parse=int_list, show=_ints)


def deep_mlp_field() -> Any:
    return flag(
        "wdl/deepfm/dcn: the deep tower's hidden sizes (default: "
        + "; ".join(f"{m} {_ints(s)}" for m, s in DEFAULT_DEEP_MLP.items())
        + ")",
        default=(),
        parse=int_list,
        show=_ints,
    )


def cross_layers_field() -> Any:
    return flag("dcn: cross layers", default=DEFAULT_CROSS_LAYERS, parse=positive_int)


def model_config_of(args: Any, num_tables: int) -> ModelConfig:
    """The model the flags describe (parsed flags, or a ``RunConfig``); ValueError names the field that is
    wrong."""
    bottom, top, deep = args.bottom_mlp, args.top_mlp, tuple(args.deep_mlp or ())
    if args.model not in MODELS:  # (a model class of the user's sizes itself)
        for name, value in (("bottom_mlp", bottom), ("top_mlp", top), ("deep_mlp", deep)):
            if value:
                raise ValueError(
                    f"{name}: sizes a built-in model; a model class ({args.model}) is built from "
                    "--embedding-dim and the data's sizes alone"
                )
    return ModelConfig(
        num_tables=num_tables,
        num_dense=schema_of(args.data, getattr(args, "schema", None)).num_dense,
        embedding_dim=args.embedding_dim,
        name=args.model,
        bottom_mlp=bottom or (64, args.embedding_dim),
        top_mlp=top or (64, 1),
        deep_mlp=deep,
        cross_layers=args.cross_layers,
    )


def optimizer_config_of(args: Any) -> OptimizerConfig:
    """The optimizer the flags describe (ValueError names the field that is wrong)."""
    return flags.config_of(OptimizerConfig, args)


def model_argv(model: ModelConfig) -> list[str]:
    """The flags ``add_model_args(dense=True)`` parses back to ``model`` (with ``--data`` and
    ``--table-rows`` for its tables and dense features)."""
    out = ["--model", model.name, "--embedding-dim", str(model.embedding_dim)]
    if model.name not in MODELS:
        return out  # (a model class of the user's: no sizes of its own)
    out += ["--bottom-mlp", _ints(model.bottom_mlp), "--top-mlp", _ints(model.top_mlp)]  # (dlrm's)
    out += ["--deep-mlp", _ints(model.deep_mlp)] if model.deep_mlp else []  # (the others')
    return out + ["--cross-layers", str(model.cross_layers)]


def _ints(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def tensorboard_field() -> Any:
    return flag(
        "trainer 0 writes TensorBoard event files here (torch.utils.tensorboard): loss, stage times, cache "
        "hit rate, rows per iteration, evaluations, checkpoints and recoveries",
        default=None,
        metavar="DIR",
    )


def eval_data_field() -> Any:
    return flag(
        "held-out data for logloss and ROC AUC: a file source like --data's (criteo:PATH, avazu:PATH), or "
        "'synthetic' (unseen samples of the synthetic generator)",
        default=None,
        metavar="SOURCE",
    )


def eval_every_field() -> Any:
    return flag(
        "evaluate after every this many batches too (0: at the end only)", default=0, parse=non_negative_int
    )


def eval_samples_field() -> Any:
    return flag(
        "held-out samples to use (0: the whole file; 16384 for synthetic)", default=0, parse=non_negative_int
    )


def add_eval_args(p: argparse.ArgumentParser) -> None:
    """Held-out evaluation (trainers and ``bagpipe run``)."""
    flags.add_flags(p.add_argument_group("evaluation"), _Evaluation)


@dataclass(frozen=True)
class Coordination:
    """What every service process shares: where Redis is, the job, logging and how it is reached."""

    redis_url: str = flag("Redis URL", default="redis://127.0.0.1:6379/0", name="redis")
    job: str = flag("job name (namespaces the Redis keys)", default="bagpipe")
    log_level: str = flag("logging level", default="INFO")
    advertise_host: str | None = flag(
        "host other services use to reach this one, registered in Redis (default: the listening host, "
        "127.0.0.1 for a wildcard; in Kubernetes the pod IP)",
        default=None,
    )
    metrics_address: str = flag(
        "host:port of the HTTP endpoint with /metrics, /healthz and /readyz (port 0: any free port)",
        default="127.0.0.1:0",
    )

    def argv(self) -> list[str]:
        return flags.argv(self)


def command_line(
    cls: type[C], prog: str
) -> tuple[Callable[[], argparse.ArgumentParser], Callable[[list[str] | None], C], Callable[[C], list[str]]]:
    """A service's ``build_parser``, ``parse`` and ``argv``, all from its config's declarations (with the
    TLS flags every process takes, which are the environment's, not the config's)."""

    def build_parser() -> argparse.ArgumentParser:
        p = flags.parser(cls, prog, cls.__doc__ or "")
        tls.add_tls_args(p)
        return p

    def parse(args: list[str] | None = None) -> C:
        return flags.parse(cls, build_parser(), args)

    return build_parser, parse, flags.argv


def add_coordination_args(p: argparse.ArgumentParser) -> None:
    tls.add_tls_args(p)
    flags.add_flags(p.add_argument_group("coordination"), Coordination)


def _number(text: str, convert: type[int] | type[float], low: float, inclusive: bool) -> Any:
    """Parses ``text`` as ``convert`` and checks it against ``low``; argparse names the flag on error."""
    try:
        value = convert(text)
    except ValueError:
        kind = "an integer" if convert is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
    if not (value >= low if inclusive else value > low):
        raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low:g}, got {value}")
    return value


def positive_int(text: str) -> int:
    return int(_number(text, int, 1, inclusive=True))


def non_negative_int(text: str) -> int:
    return int(_number(text, int, 0, inclusive=True))


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({f"{p}I{b}": 1 << (10 * n) for n, p in enumerate("KMGT", 1) for b in ("", "B")})  # (2Gi, 2GiB)


def byte_size(text: str) -> int:
    """A number of bytes, with a unit or not: ``2GiB`` (or Kubernetes's ``2Gi``), ``512MiB``, ``1.5GB``,
    ``4096``."""
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number) :].upper()
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        wanted = "a size such as 2GiB, 512MiB or 4096"
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, got {text!r}")
    return int(value)


def batch_or_latest(text: str) -> int | str:
    """A batch number (>= 0), or ``latest``: the newest complete checkpoint in --checkpoint-dir."""
    return "latest" if text == "latest" else non_negative_int(text)


def resolve_latest(value: int | str, checkpoint_dir: str | None, flag: str) -> int:
    """``batch_or_latest``'s value as a batch: ``latest`` is the newest complete checkpoint in
    ``checkpoint_dir`` (0 when there is none yet: a run's first start)."""
    if value != "latest":
        return int(value)
    from bagpipe.core import snapshots

    if not checkpoint_dir:
        raise SystemExit(f"{flag} latest: needs --checkpoint-dir")
    found = snapshots.latest(checkpoint_dir) or 0
    logging.getLogger(__name__).info("%s latest: %s", flag, found or f"no checkpoint in {checkpoint_dir}")
    return found


def positive_float(text: str) -> float:
    return float(_number(text, float, 0, inclusive=False))


def non_negative_float(text: str) -> float:
    return float(_number(text, float, 0, inclusive=True))


def lookahead_field() -> Any:
    return flag(
        "lookahead L in batches (default: automatic, the largest L up to --max-lookahead whose plan fits "
        "--cache-rows; a tight cache shrinks even a given L)",
        parse=positive_int,
        required=False,
    )


def max_lookahead_field() -> Any:
    return flag("upper bound of the automatic L", default=DEFAULT_MAX_LOOKAHEAD, parse=positive_int)


def cache_rows_field() -> Any:
    return flag(
        "rows each trainer's cache holds (default: unbounded, the cache grows as planned)",
        default=None,
        parse=positive_int,
    )


def oracles_field() -> Any:
    """--oracles: the job's oracle shards (core/oracle_shards.py); every service that talks to the oracle
    takes it, to reach all of them."""
    return flag(
        "oracle shards of the job: each plans the keys of its buckets for every trainer, with its part of "
        "--cache-rows (core/oracle_shards.py)",
        default=1,
        parse=positive_int,
    )


def reuse_delay_field() -> Any:
    return flag(
        "batches a freed cache slot waits before reuse, so prefetches run ahead of write-backs (at most L)",
        default=DEFAULT_REUSE_DELAY,
        parse=positive_int,
    )


def cache_mode_field() -> Any:
    return flag(
        "lrpp: a row used by one trainer lives and is updated there only; replicated: every trainer fetches "
        "and all-reduces every row",
        default="lrpp",
        choices=CACHE_MODES,
    )


def delayed_sync_field() -> Any:
    """``--sync delayed|critical``, read as whether synchronisation may be delayed."""
    return flag(
        "delayed: rows the next batch does not read are synchronised in the background; critical: "
        "everything before the next batch",
        default=True,
        name="sync",
        parse=str,
        choices=SYNC_MODES,
        read=lambda value, a: value == "delayed",
        show=lambda delayed: "delayed" if delayed else "critical",
        text_default="delayed",
    )


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """The oracle's cache planning flags (``bagpipe run`` and the oracle take the same ones)."""
    flags.add_flags(p.add_argument_group("cache"), _Cache)


def checkpoint_dir_field() -> Any:
    return flag(
        "directory of the job's recovery checkpoints, shared by trainers and embedding servers", default=None
    )


def resume_batch_field() -> Any:
    """``--resume-batch``: a complete checkpoint of ``--checkpoint-dir``, its whole chain there (``latest``:
    the newest, or 0 when there is none)."""
    return flag(
        "begin at this batch from the complete checkpoint of that name in --checkpoint-dir (0: from the "
        "start; latest: from the newest complete one, or the start when there is none)",
        default=0,
        parse=batch_or_latest,
        read=lambda value, a: resume_batch_of(value, a.checkpoint_dir),
        text_default=0,
    )


def keep_checkpoints_field() -> Any:
    from bagpipe.core import snapshots

    return flag(
        "complete checkpoints kept; older ones are removed, except the links the kept ones stand on",
        default=snapshots.DEFAULT_KEEP,
        parse=positive_int,
    )


def checkpoint_full_every_field() -> Any:
    from bagpipe.core import snapshots

    return flag(
        "every this many checkpoints one is full (every row not initial), so a restore reads at most this "
        "many files a server however long the run (1: every one full)",
        default=snapshots.DEFAULT_FULL_EVERY,
        parse=positive_int,
    )


def add_checkpoint_chain_args(p: argparse.ArgumentParser) -> None:
    """How many checkpoints are kept, and how often one is full (trainer rank 0 writes them)."""
    flags.add_flags(p.add_argument_group("checkpoint chain"), _Chain)


def resume_batch_of(value: int | str, checkpoint_dir: str | None) -> int:
    """--resume-batch needs the complete checkpoint it names, and its whole chain; fails early, naming
    what is missing. ``latest`` becomes the newest complete checkpoint's batch."""
    batch = resolve_latest(value, checkpoint_dir, "--resume-batch")
    refused = checkpoint_refusal("--resume-batch", batch, checkpoint_dir)
    if refused is not None:
        raise SystemExit(refused)
    return batch


def checkpoint_refusal(flag: str, batch: int, checkpoint_dir: str | None) -> str | None:
    """Why ``flag``'s ``batch`` cannot be begun at (None when it can): batch 0 always can; any other needs
    the complete checkpoint of that name in ``checkpoint_dir`` and its whole chain there."""
    if not batch:
        return None
    from bagpipe.core import snapshots

    if not checkpoint_dir:
        return f"{flag}: needs --checkpoint-dir"
    done = snapshots.complete(checkpoint_dir)
    if batch not in done:
        listed = ", ".join(map(str, done)) or "none"
        return f"{flag}: no complete checkpoint {batch} in {checkpoint_dir} (complete: {listed})"
    try:
        snapshots.files_of(checkpoint_dir, batch)
    except snapshots.BrokenChain as e:
        return f"{flag}: {e}"
    return None


# the groups of flags ``bagpipe run`` takes from the declarations above
@dataclass(frozen=True)
class _Cache:
    lookahead: int | None = lookahead_field()
    max_lookahead: int = max_lookahead_field()
    cache_rows: int | None = cache_rows_field()
    reuse_delay: int = reuse_delay_field()
    cache_mode: str = cache_mode_field()
    delayed_sync: bool = delayed_sync_field()


@dataclass(frozen=True)
class _Tables:
    scale: float = scale_field()


@dataclass(frozen=True)
class _Model:
    model: str = model_field()
    embedding_dim: int = embedding_dim_field()
    bottom_mlp: tuple[int, ...] | None = bottom_mlp_field()
    top_mlp: tuple[int, ...] | None = top_mlp_field()
    deep_mlp: tuple[int, ...] = deep_mlp_field()
    cross_layers: int = cross_layers_field()
    seed: int = seed_field()
    init_from: str | None = init_from_field()


@dataclass(frozen=True)
class _Evaluation:
    eval_data: str | None = eval_data_field()
    eval_every: int = eval_every_field()
    eval_samples: int = eval_samples_field()


@dataclass(frozen=True)
class _Chain:
    keep_checkpoints: int = keep_checkpoints_field()
    checkpoint_full_every: int = checkpoint_full_every_field()
