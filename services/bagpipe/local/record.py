"""The run record: what ran (every flag, the code's git revision, package versions, the machine), kept in
``config.json`` of the run directory beside the flags ``--resume`` reads back, and shown at the top of
the report; and the held-out evaluations of a run (``metrics/eval.csv``, written by trainer 0).
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bagpipe.core import snapshots
from bagpipe.core.evaluation import EVAL_FIELDS

TUPLE_FLAGS = ("table_rows", "bottom_mlp", "top_mlp", "deep_mlp")
RECORD_KEY = "_record"  # config.json's key for everything that is not a flag
PACKAGES = ("torch", "numpy", "grpcio", "protobuf", "redis", "prometheus-client", "matplotlib", "tqdm")


def _git(*argv: str) -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", *argv], cwd=here, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def run_record() -> dict[str, Any]:
    """Where and with what code this run ran."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_revision": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "python": sys.version.split()[0],
        "packages": versions,
        "host": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv),
    }


def flags_of(config: dict[str, Any]) -> dict[str, Any]:
    """The flags of a config.json (without the record)."""
    return {k: v for k, v in config.items() if k != RECORD_KEY}


def read_evals(path: Path) -> list[dict[str, float]]:
    """The evaluations of a run, one per batch count (a replayed one, after a recovery, as it ran last)."""
    if not path.exists():
        return []
    by_batch: dict[int, dict[str, float]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            entry = {k: float(row[k]) for k in EVAL_FIELDS}
            entry["batches"] = int(entry["batches"])
            entry["samples"] = int(entry["samples"])
            by_batch[int(entry["batches"])] = entry
    return [by_batch[b] for b in sorted(by_batch)]


def resumed_args(args: argparse.Namespace) -> argparse.Namespace:
    """``--resume RUN_DIR``: the stopped run's own flags (from its config.json), to go on where it stopped."""
    config = Path(args.resume) / "config.json"
    if not config.is_file():
        raise SystemExit(f"--resume: {config} not found (not a run directory of `bagpipe run`?)")
    saved = flags_of(json.loads(config.read_text()))
    # (sizes JSON gave back as lists are the tuples the flags parse to)
    saved = {k: tuple(v) if k in TUPLE_FLAGS and isinstance(v, list) else v for k, v in saved.items()}
    # (how this invocation shows and reports the run stays its own: --resume, --quiet, --no-report)
    own = {"resume": args.resume, "quiet": args.quiet, "no_report": args.no_report}
    merged = argparse.Namespace(**{**vars(args), **saved, **own})
    checkpoints = (
        Path(merged.checkpoint_dir) if merged.checkpoint_dir else Path(merged.run_dir) / "checkpoints"
    )
    if not snapshots.complete(checkpoints):
        print(f"--resume: no complete checkpoint in {checkpoints}: the run starts over", file=sys.stderr)
    return merged
