"""Files that survive a power loss whole or not at all: the checkpoints' and the final model's writes.

A rename is durable only once its directory is fsynced, and a new directory only once its parent is: a
checkpoint whose ``<n>/`` was never fsynced into the checkpoint directory can vanish with its manifest
after a crash, and later chains then fail. Removal goes the other way: the file that makes a directory
count (a checkpoint's manifest) goes first, durably, then the rest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """``mkdir -p``, with each directory it creates fsynced into its parent."""
    missing = []
    at = path
    while not at.is_dir():
        missing.append(at)
        at = at.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # (another process made it: theirs to fsync)
            directory.mkdir()
        fsync_dir(directory.parent)


def write_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """Writes ``target`` through a temporary file that is fsynced, renamed into place, and its directory
    fsynced (and any directory made for it): after a crash the file is whole or absent. On error (a full
    disk) the temporary file is removed and ``target``, if it existed, is untouched."""
    make_dirs(target.parent)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and e.filename is None:  # (ENOSPC from a write names no file)
            raise OSError(e.errno, e.strerror, str(target)) from e
        raise
    fsync_dir(target.parent)


def remove_tree(path: Path, first: str) -> None:
    """Removes directory ``path``: its file ``first`` (what makes it count) durably first, then the rest,
    then the directory's entry in its parent, durably too."""
    try:
        (path / first).unlink()
    except FileNotFoundError:
        pass
    else:
        fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        fsync_dir(path.parent)
