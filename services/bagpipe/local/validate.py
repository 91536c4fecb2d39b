"""Checks every flag and input path of ``bagpipe run`` before any process starts.

A bad value stops the run at once with one line naming the flag (or file) and what is wrong, instead of a
child process's traceback seconds later, or a hang.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bagpipe.config_args import optimizer_config_of, table_rows_of
from bagpipe.core.data import DataFormatError, SyntheticConfig
from bagpipe.data_processor.config import SourceConfig


class BadFlag(SystemExit):
    """``bagpipe run`` cannot start: the message names the flag or file."""

    def __init__(self, flag: str, why: str) -> None:
        super().__init__(f"bagpipe run: {flag}: {why}")


def _at_least(args: argparse.Namespace, low: int, *names: str) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise BadFlag("--" + name.replace("_", "-"), f"must be >= {low}, got {value}")


def _readable_file(flag: str, path: str) -> None:
    p = Path(path)
    if not p.exists():
        raise BadFlag(flag, f"{path}: no such file")
    if not p.is_file():
        raise BadFlag(flag, f"{path}: not a regular file")
    if not os.access(p, os.R_OK):
        raise BadFlag(flag, f"{path}: not readable")
    if p.stat().st_size == 0:
        raise BadFlag(flag, f"{path}: empty file")


def validate_run_args(args: argparse.Namespace) -> None:
    """Raises BadFlag (a SystemExit with one line) for the first bad flag or input of ``bagpipe run``."""
    if getattr(args, "resume", None):
        return  # the stopped run's own flags, checked when it started
    _at_least(args, 1, "trainers", "embedding_servers", "data_processors", "batch_size", "embedding_dim")
    _at_least(args, 0, "iterations", "seed")
    if args.batch_size % args.trainers:
        raise BadFlag("--batch-size", f"{args.batch_size} is not a multiple of --trainers {args.trainers}")
    if not args.lr > 0:
        raise BadFlag("--lr", f"must be > 0, got {args.lr}")
    if args.device not in ("auto", "cpu", "cuda"):
        raise BadFlag("--device", f"expected auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda":
        import torch  # (only here: a second of every job's start-up otherwise)

        if not torch.cuda.is_available():
            raise BadFlag("--device", "cuda, but torch sees no CUDA device here")
    try:
        optimizer_config_of(args)
    except ValueError as e:
        field, _, why = str(e).partition(": ")
        raise BadFlag("--" + field.replace("_", "-"), why) from None
    if args.model == "dlrm":
        if args.bottom_mlp and args.bottom_mlp[-1] != args.embedding_dim:
            raise BadFlag(
                "--bottom-mlp",
                f"its last layer ({args.bottom_mlp[-1]}) must equal --embedding-dim ({args.embedding_dim}): "
                "DLRM's interaction takes dot products of the two",
            )
        if args.top_mlp and args.top_mlp[-1] != 1:
            raise BadFlag(
                "--top-mlp", f"its last layer must be 1 (the click logit), got {list(args.top_mlp)}"
            )
    elif args.bottom_mlp or args.top_mlp:
        raise BadFlag("--bottom-mlp/--top-mlp", f"belong to --model dlrm; {args.model} takes --deep-mlp")
    if args.deep_mlp and args.model == "dlrm":
        raise BadFlag(
            "--deep-mlp", "belongs to --model wdl, deepfm or dcn; dlrm takes --bottom-mlp/--top-mlp"
        )
    if args.data == "synthetic":
        if args.iterations == 0:
            raise BadFlag("--iterations", "synthetic data is endless; give a number of iterations")
        try:
            table_rows = table_rows_of(args)
        except SystemExit as e:
            raise BadFlag(*str(e).split(": ", 1)) from None
        hot = args.hot_fraction is not None or args.hot_share is not None
        try:
            SyntheticConfig(
                table_rows=table_rows,
                seed=args.seed,
                zipf_alpha=None if hot else args.zipf_alpha,
                hot_fraction=args.hot_fraction,
                hot_share=args.hot_share,
            )
        except ValueError as e:
            field, _, why = str(e).partition(": ")
            raise BadFlag("--" + field.replace("_", "-"), why) from None
    elif args.data.partition(":")[0] in ("criteo", "avazu"):
        kind, _, listed = args.data.partition(":")
        paths = [p for p in listed.split(",") if p]
        if not paths:
            raise BadFlag("--data", f"{kind}: needs at least one path ({kind}:PATH[,PATH...])")
        for path in paths:
            _readable_file("--data", path)
        try:
            table_rows = table_rows_of(args)
        except SystemExit as e:
            raise BadFlag(*str(e).split(": ", 1)) from None
        source = SourceConfig(args.data, table_rows, skip_bad_rows=getattr(args, "skip_bad_rows", False))
        try:
            source.check_head()  # (what every data processor checks as it starts)
        except DataFormatError as e:
            raise BadFlag("--data", f"bad data: {e}") from None
    else:
        raise BadFlag(
            "--data",
            f"expected 'synthetic', 'criteo:PATH[,PATH...]' or 'avazu:PATH[,PATH...]', got {args.data!r}",
        )
    if getattr(args, "shuffle_seed", None) is not None and args.data == "synthetic":
        raise BadFlag("--shuffle-seed", "synthetic samples are drawn at random already; it applies to files")
    if args.init_from:
        _readable_file("--init-from", args.init_from)
    eval_data = getattr(args, "eval_data", None)
    if eval_data:
        kind, _, paths = eval_data.partition(":")
        if eval_data != "synthetic":
            if kind not in ("criteo", "avazu") or not paths:
                raise BadFlag(
                    "--eval-data", f"expected 'synthetic', 'criteo:PATH' or 'avazu:PATH', got {eval_data!r}"
                )
            if kind != args.data.partition(":")[0]:
                raise BadFlag(
                    "--eval-data",
                    f"{kind}: data is not in the format of --data {args.data.partition(':')[0]}",
                )
            for path in (p for p in paths.split(",") if p):
                _readable_file("--eval-data", path)
        elif args.data != "synthetic":
            raise BadFlag("--eval-data", "synthetic held-out samples need --data synthetic")
    elif getattr(args, "eval_every", 0):
        raise BadFlag("--eval-every", "needs --eval-data")
    lookahead = getattr(args, "lookahead", None)
    if lookahead is not None and lookahead > args.max_lookahead:
        raise BadFlag("--lookahead", f"{lookahead} is over --max-lookahead {args.max_lookahead}")
