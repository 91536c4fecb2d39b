"""The run record: what ran (every flag, the code's git revision, package versions, the machine), kept in
``config.json`` of the run directory beside the flags ``--resume`` reads back, and shown at the top of
the report; and the held-out evaluations of a run (``metrics/eval.csv``, written by trainer 0).
"""

from __future__ import annotations

import csv
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bagpipe.core.evaluation import EVAL_FIELDS

RECORD_KEY = "_record"  # config.json's key for everything that is not a flag
PACKAGES = ("torch", "numpy", "grpcio", "protobuf", "redis", "prometheus-client", "matplotlib", "tqdm")


def _git(*argv: str) -> str | None:
    """``git ARGV`` in the checkout this code runs from; None where it is no checkout (an installed
    package, even inside another project's repository)."""
    root = Path(__file__).resolve().parents[3]  # (services/bagpipe/local/record.py)
    if not (root / "services" / "bagpipe").is_dir() or not (root / "pyproject.toml").is_file():
        return None
    try:
        out = subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True, timeout=10, check=True)
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if Path(top.stdout.strip()).resolve() == root else None


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
