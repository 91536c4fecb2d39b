"""The recovery checkpoint directory: consistent, incremental checkpoints of a running job.

A checkpoint is named by the first batch after it (``next_batch``) and lives in
``<directory>/<next_batch:09d>/``:

* ``rows-<shard>.npz`` — one per embedding server: the global keys, rows and optimizer state it changed
  since the previous checkpoint (incremental, like Check-N-Run). Before the servers write them the
  trainers have written every cached row to the servers, so together they hold the whole model.
* ``dense.pt`` — the dense model and its optimizer state (trainer rank 0).
* ``COMPLETE`` — a JSON manifest, written last and atomically: a checkpoint without it does not exist.

The embedding rows of checkpoint ``n`` are the run's initial rows with the files of every complete
checkpoint up to ``n`` applied in order. Files hold global keys, so they restore onto any number of
servers. Nothing here opens a socket; the services call it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

MANIFEST = "COMPLETE"
DENSE = "dense.pt"


def path_of(directory: str | os.PathLike[str], next_batch: int) -> Path:
    return Path(directory) / f"{next_batch:09d}"


def _numbered(directory: str | os.PathLike[str]) -> Iterator[tuple[int, Path]]:
    root = Path(directory)
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and entry.name.isdigit():
            yield int(entry.name), entry


def complete(directory: str | os.PathLike[str]) -> list[int]:
    """``next_batch`` of every complete checkpoint, oldest first."""
    return [n for n, path in _numbered(directory) if (path / MANIFEST).is_file()]


def latest(directory: str | os.PathLike[str]) -> int | None:
    """The newest complete checkpoint's ``next_batch``, or None when there is none."""
    done = complete(directory)
    return done[-1] if done else None


def discard_after(directory: str | os.PathLike[str], next_batch: int) -> list[int]:
    """Removes every checkpoint after ``next_batch`` (a run rolled back to it writes them anew) and any
    incomplete one; returns what was removed."""
    removed = []
    for n, path in _numbered(directory):
        if n > next_batch or not (path / MANIFEST).is_file():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(n)
    return removed


def _atomic(target: Path, write: Callable[[Path], object]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    write(tmp)
    os.replace(tmp, target)


def write_rows(
    directory: str | os.PathLike[str],
    next_batch: int,
    shard: int,
    keys: np.ndarray,
    rows: np.ndarray,
    state: np.ndarray,
) -> tuple[str, int]:
    """One server's changed rows; returns the file name (relative to the checkpoint) and its size."""
    name = f"rows-{shard}.npz"
    target = path_of(directory, next_batch) / name

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # (np.savez would append .npz to a name without it)
            np.savez(f, keys=keys.astype(np.int64, copy=False), rows=rows, state=state)

    _atomic(target, write)
    return name, target.stat().st_size


def write_dense(directory: str | os.PathLike[str], next_batch: int, content: dict[str, Any]) -> None:
    from bagpipe.core import checkpoint  # (torch: trainers only; the embedding servers never load it)

    checkpoint.save(path_of(directory, next_batch) / DENSE, content)


def read_dense(directory: str | os.PathLike[str], next_batch: int) -> dict[str, Any]:
    from bagpipe.core import checkpoint

    path = path_of(directory, next_batch) / DENSE
    content = checkpoint.load_plain(path)
    if not isinstance(content.get("dense"), dict):
        raise ValueError(f"{path}: no 'dense' dictionary")
    return content


def mark_complete(directory: str | os.PathLike[str], next_batch: int, manifest: dict[str, Any]) -> None:
    """Makes the checkpoint count: every file it lists must already be in place."""
    where = path_of(directory, next_batch)
    for name in [DENSE, *manifest.get("row_files", [])]:
        if not (where / name).is_file():
            raise FileNotFoundError(f"checkpoint {next_batch}: {name} is missing, cannot mark it complete")
    _atomic(
        where / MANIFEST,
        lambda tmp: tmp.write_text(json.dumps({"next_batch": next_batch, **manifest}, indent=1)),
    )


def manifest(directory: str | os.PathLike[str], next_batch: int) -> dict[str, Any]:
    return dict(json.loads((path_of(directory, next_batch) / MANIFEST).read_text()))


def row_deltas(
    directory: str | os.PathLike[str], upto: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """(next_batch, keys, rows, state) of every row file of the complete checkpoints up to ``upto``, in
    the order they must be applied."""
    for n in complete(directory):
        if n > upto:
            break
        for name in manifest(directory, n).get("row_files", []):
            path = path_of(directory, n) / name
            with np.load(path) as data:
                keys, rows, state = data["keys"], data["rows"], data["state"]
            if keys.ndim != 1 or rows.shape[0] != keys.size or state.shape[0] != keys.size:
                raise ValueError(
                    f"{path}: keys {keys.shape}, rows {rows.shape} and state {state.shape} do not line up"
                )
            yield n, keys, rows, state
