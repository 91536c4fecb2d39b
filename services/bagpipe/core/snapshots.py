"""The recovery checkpoint directory: consistent, incremental checkpoints of a running job.

A checkpoint is named by the first batch after it (``next_batch``) and lives in
``<directory>/<next_batch:09d>/``:

* ``rows-<shard>.npz`` — one per embedding server: the global keys, rows and optimizer state it changed
  since the previous checkpoint (incremental, like Check-N-Run); or, in a *full* checkpoint,
  ``base-<shard>.npz``: every row of the shard that is no longer its initial value. Before the servers
  write them the trainers have written every cached row to the servers, so together they hold the whole
  model.
* ``dense.pt`` — the dense model and its optimizer state (trainer rank 0).
* ``COMPLETE`` — a JSON manifest, written last and atomically: a checkpoint without it does not exist.
  It names the checkpoint it follows (``previous``, 0 for the run's initial rows) and whether it is full.

The embedding rows of checkpoint ``n`` are its *chain* applied in order: the newest full checkpoint at or
before ``n`` (or the run's initial rows), then every incremental one after it up to ``n``, each found
through ``previous``. Every ``full_every``-th checkpoint is full, so a restore reads a bounded number of
files however long the run; a link that is missing is refused (``BrokenChain``), never skipped. ``prune``
keeps the newest ``keep`` complete checkpoints and the links they stand on. Every file is fsynced before
the manifest names it, and every directory made or removed is fsynced into its parent (``durable``).
Files hold global keys, so they restore onto any number of servers. Nothing here
opens a socket; the services call it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bagpipe.core import durable

logger = logging.getLogger(__name__)

MANIFEST = "COMPLETE"
DENSE = "dense.pt"
DEFAULT_KEEP = 3  # complete checkpoints kept (and the links they stand on)
DEFAULT_FULL_EVERY = 8  # every this many checkpoints one is full: a chain is at most this many links
# the exit status of a trainer whose checkpoint could not be written (EX_IOERR, a full disk): not retried,
# since a replay would fail the same way (the launcher gives up; the chart's Job fails by its
# podFailurePolicy), and the complete checkpoints before it are intact to resume from
EXIT_CHECKPOINT_FAILED = 74
# why a checkpoint cannot be written that a replay would meet again: a full disk or quota, a read-only
# volume. Anything else (EIO or ESTALE on a network volume, EMFILE, a timeout) may pass, and is recovered
# from like any other failure
FINAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
_CHUNK_ROWS = 1 << 16  # rows a full snapshot writes at a time (no copy of the whole shard)


class BrokenChain(ValueError):
    """A checkpoint cannot be restored: a link of its chain, or a file a manifest lists, is missing."""


def final(error: BaseException) -> bool:
    """Whether ``error``, met writing a checkpoint, would fail a replay the same way (``FINAL_ERRNOS``)."""
    return isinstance(error, OSError) and error.errno in FINAL_ERRNOS


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


def _remove(path: Path) -> None:
    """Removes a checkpoint's directory, its manifest first and durably: half removed, it is no checkpoint
    at all, whenever the power goes."""
    durable.remove_tree(path, MANIFEST)


def discard_after(directory: str | os.PathLike[str], next_batch: int) -> list[int]:
    """Removes every checkpoint after ``next_batch`` (a run rolled back to it writes them anew) and any
    incomplete one; returns what was removed."""
    removed = []
    for n, path in _numbered(directory):
        if n > next_batch or not (path / MANIFEST).is_file():
            _remove(path)
            removed.append(n)
    return removed


def discard(directory: str | os.PathLike[str], next_batch: int) -> None:
    """Removes checkpoint ``next_batch`` whatever it holds (one that could not be completed)."""
    _remove(path_of(directory, next_batch))


def row_file(shard: int, full: bool) -> str:
    return f"{'base' if full else 'rows'}-{shard}.npz"


def _write_npy(
    archive: zipfile.ZipFile, name: str, dtype: np.dtype[Any], shape: tuple[int, ...], parts: Any
) -> None:
    """One array of an ``.npz``, written a part at a time (``np.load`` reads it like ``np.savez``'s)."""
    with archive.open(f"{name}.npy", "w", force_zip64=True) as out:
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_2_0(out, header)
        for part in parts:
            out.write(np.ascontiguousarray(part, dtype=dtype).tobytes())


def write_rows(
    directory: str | os.PathLike[str],
    next_batch: int,
    shard: int,
    keys: np.ndarray,
    rows: np.ndarray,
    state: np.ndarray,
    full: bool = False,
) -> tuple[str, int]:
    """One server's rows (changed since the previous checkpoint, or with ``full`` every row not initial);
    returns the file name (relative to the checkpoint) and its size. ``rows`` and ``state`` may be any
    object whose slices give arrays (``gathered``): a full snapshot is written a chunk at a time."""
    name = row_file(shard, full)
    target = path_of(directory, next_batch) / name
    n = int(keys.size)

    def chunks(values: Any) -> Iterator[np.ndarray]:
        for start in range(0, n, _CHUNK_ROWS):
            yield values[start : start + _CHUNK_ROWS]

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            _write_npy(archive, "keys", np.dtype(np.int64), (n,), [keys])
            _write_npy(archive, "rows", np.dtype(np.float32), (n, rows.shape[1]), chunks(rows))
            _write_npy(archive, "state", np.dtype(np.float32), (n, state.shape[1]), chunks(state))

    durable.write_atomically(target, write)
    return name, target.stat().st_size


class Gathered:
    """Rows ``index`` of ``columns`` (a view of a table), gathered only as they are sliced."""

    def __init__(self, columns: np.ndarray, index: np.ndarray) -> None:
        self.columns = columns
        self.index = index
        self.shape = (index.size, columns.shape[1])

    def __getitem__(self, part: slice) -> np.ndarray:
        return self.columns[self.index[part]]


def write_dense(directory: str | os.PathLike[str], next_batch: int, content: dict[str, Any]) -> None:
    import torch  # (trainers only; the embedding servers never load it)

    durable.write_atomically(path_of(directory, next_batch) / DENSE, lambda tmp: torch.save(content, tmp))


def read_dense(directory: str | os.PathLike[str], next_batch: int) -> dict[str, Any]:
    from bagpipe.core import checkpoint

    path = path_of(directory, next_batch) / DENSE
    content = checkpoint.load_plain(path)
    if not isinstance(content.get("dense"), dict):
        raise ValueError(f"{path}: no 'dense' dictionary")
    return content


def mark_complete(directory: str | os.PathLike[str], next_batch: int, manifest: dict[str, Any]) -> None:
    """Makes the checkpoint count: every file it lists must already be in place (and is, durably: each was
    fsynced as it was written). ``manifest`` names the checkpoint it follows (``previous``) and whether it is
    ``full``."""
    where = path_of(directory, next_batch)
    previous = int(manifest.get("previous", 0))
    if not 0 <= previous < next_batch:
        raise ValueError(f"checkpoint {next_batch}: previous must be in [0, {next_batch}), got {previous}")
    for name in [DENSE, *manifest.get("row_files", [])]:
        if not (where / name).is_file():
            raise FileNotFoundError(f"checkpoint {next_batch}: {name} is missing, cannot mark it complete")
    durable.write_atomically(
        where / MANIFEST,
        lambda tmp: tmp.write_text(json.dumps({"next_batch": next_batch, **manifest}, indent=1)),
    )


def manifest(directory: str | os.PathLike[str], next_batch: int) -> dict[str, Any]:
    return dict(json.loads((path_of(directory, next_batch) / MANIFEST).read_text()))


def chain(directory: str | os.PathLike[str], upto: int) -> list[int]:
    """The checkpoints whose row files make up checkpoint ``upto``, in the order they apply: the newest full
    one at or before it (none: the run's initial rows), then each incremental one after it. BrokenChain
    when a link is missing or incomplete."""
    links: list[int] = []
    n = upto
    while n:
        if not (path_of(directory, n) / MANIFEST).is_file():
            what = "it" if n == upto else f"checkpoint {n}, a link of its chain,"
            raise BrokenChain(
                f"{directory}: cannot restore checkpoint {upto}: {what} is missing or incomplete"
            )
        m = manifest(directory, n)
        links.append(n)
        if m.get("full"):
            break
        previous = int(m.get("previous", 0))
        if not 0 <= previous < n:
            raise BrokenChain(f"{path_of(directory, n) / MANIFEST}: previous {previous} is not before {n}")
        n = previous
    return links[::-1]


def files_of(directory: str | os.PathLike[str], upto: int) -> list[Path]:
    """Every row file a restore of checkpoint ``upto`` reads, in order (BrokenChain if one is missing)."""
    out = []
    for n in chain(directory, upto):
        for name in manifest(directory, n).get("row_files", []):
            path = path_of(directory, n) / name
            if not path.is_file():
                raise BrokenChain(f"{path}: listed by checkpoint {n}'s manifest but missing")
            out.append(path)
    return out


def full_due(directory: str | os.PathLike[str], previous: int, full_every: int) -> bool:
    """Whether the checkpoint after ``previous`` must be full: its chain would otherwise read more than
    ``full_every`` files a server (the run's initial rows cost none)."""
    if not previous:
        return full_every <= 1
    links = chain(directory, previous)
    return len(links) + 1 > full_every


def row_deltas(
    directory: str | os.PathLike[str], upto: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """(next_batch, keys, rows, state) of every row file of checkpoint ``upto``'s chain, in the order they
    must be applied, each file in parts of at most ``_CHUNK_ROWS`` rows (a full snapshot holds a whole
    shard: a server with a row tier restores within its budget). The whole chain is checked before the
    first file is read; ValueError names a file whose arrays do not line up or end early."""
    for path in files_of(directory, upto):
        yield from _parts(path, int(path.parent.name))


def _parts(path: Path, next_batch: int) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.open(f"{name}.npy") for name in ("keys", "rows", "state")}
        try:
            headers = {}
            for name, member in members.items():
                version = np.lib.format.read_magic(member)
                read_header = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, fortran, dtype = read_header(member)
                if fortran:
                    raise ValueError(f"{path}: {name} is stored in Fortran order")
                headers[name] = (shape, dtype)
            (keys, _), (rows, _), (state, _) = headers["keys"], headers["rows"], headers["state"]
            lined_up = len(keys) == 1 and len(rows) == len(state) == 2 and keys[0] == rows[0] == state[0]
            if not lined_up:
                raise ValueError(f"{path}: keys {keys}, rows {rows} and state {state} do not line up")
            for start in range(0, keys[0], _CHUNK_ROWS):
                count = min(_CHUNK_ROWS, keys[0] - start)
                part = [
                    _read_rows(path, name, members[name], dtype, shape[1:], start, count)
                    for name, (shape, dtype) in headers.items()
                ]
                yield next_batch, part[0], part[1], part[2]
        finally:
            for member in members.values():
                member.close()


def _read_rows(
    path: Path,
    name: str,
    member: Any,
    dtype: np.dtype[Any],
    row_shape: tuple[int, ...],
    start: int,
    count: int,
) -> np.ndarray:
    """Rows ``start`` .. ``start + count`` of array ``name``, read from its stream (at row ``start``)."""
    width = int(np.prod(row_shape, dtype=np.int64))
    size = count * width * dtype.itemsize
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = member.readinto(view[got:])
        if not n:
            rows = start + got // max(1, width * dtype.itemsize)
            raise ValueError(f"{path}: {name} ends after {rows} of its rows")
        got += n
    return np.frombuffer(data, dtype=dtype).reshape((count, *row_shape))


def prune(directory: str | os.PathLike[str], keep: int) -> list[int]:
    """Removes every checkpoint older than the newest ``keep`` complete ones, except the links their chains
    stand on (and incomplete ones left behind before the newest); returns what was removed."""
    if keep < 1:
        raise ValueError(f"keep: must be >= 1, got {keep}")
    done = complete(directory)
    if not done:
        return []
    kept = done[-keep:]
    needed: set[int] = set()
    for n in kept:
        try:
            needed.update(chain(directory, n))
        except BrokenChain:
            needed.add(n)  # (restoring it fails anyway, with its own error; its files are not ours to judge)
    removed = []
    for n, path in _numbered(directory):
        if n < kept[-1] and n not in needed:
            _remove(path)
            removed.append(n)
    return removed
