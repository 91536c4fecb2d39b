"""The checkpoint chain (core/snapshots.py) over real shard stores: what rank 0 and the servers write at
each checkpoint (``full_due``, ``take_changes`` or ``take_all``, ``write_rows``, ``mark_complete``), then a
restore into fresh stores, compared with the rows the stores held at that checkpoint."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from bagpipe.core import checkpoint, snapshots
from bagpipe.core.data import table_offsets
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server.shard_store import ShardStore

DIM = STATE = 3
OFFSETS = table_offsets([300, 200])


def _stores() -> list[ShardStore]:
    shard_map = ShardMap.create(int(OFFSETS[-1]), num_shards=2, num_buckets=8)
    return [ShardStore(shard_map, s, OFFSETS, dim=DIM, state_width=STATE, seed=3) for s in range(2)]


def _train(stores: list[ShardStore], rng: np.random.Generator) -> None:
    """Writes random values into a random tenth of the rows, as a few batches' write-backs would."""
    keys = rng.choice(int(OFFSETS[-1]), size=50, replace=False).astype(np.int64)
    for store in stores:
        mine = keys[store.shard_map.shard_of(keys) == store.shard]
        rows = rng.normal(size=(mine.size, DIM)).astype(np.float32)
        state = rng.random((mine.size, STATE)).astype(np.float32)
        store.write(mine, rows, state)


def _checkpoint(stores: list[ShardStore], directory: Path, n: int, previous: int, full_every: int) -> bool:
    """One checkpoint ``n`` after ``previous``, as trainer rank 0 and the servers write it."""
    full = snapshots.full_due(directory, previous, full_every)
    files = []
    for store in stores:
        keys, rows, state = store.take_all() if full else store.take_changes()
        files.append(snapshots.write_rows(directory, n, store.shard, keys, rows, state, full=full)[0])
    (snapshots.path_of(directory, n) / snapshots.DENSE).write_bytes(b"dense")
    snapshots.mark_complete(directory, n, {"previous": previous, "full": full, "row_files": files})
    return full


def _restored(directory: Path, n: int) -> np.ndarray:
    everything = np.arange(int(OFFSETS[-1]), dtype=np.int64)
    fresh = _stores()
    out = np.zeros((everything.size, DIM + STATE), dtype=np.float32)
    for store in fresh:
        store.restore(snapshots.row_deltas(directory, n))
        mine = store.shard_map.shard_of(everything) == store.shard
        out[mine] = store.gather(everything[mine])
    return out


def _held(stores: list[ShardStore]) -> np.ndarray:
    everything = np.arange(int(OFFSETS[-1]), dtype=np.int64)
    out = np.zeros((everything.size, DIM + STATE), dtype=np.float32)
    for store in stores:
        mine = store.shard_map.shard_of(everything) == store.shard
        out[mine] = store.gather(everything[mine])
    return out


def _run(directory: Path, checkpoints: int, full_every: int, keep: int | None = None) -> dict[int, Any]:
    """Trains and checkpoints ``checkpoints`` times (every 5 batches); the rows held at each checkpoint."""
    rng = np.random.default_rng(7)
    stores = _stores()
    held = {}
    previous = 0
    for c in range(1, checkpoints + 1):
        _train(stores, rng)
        _checkpoint(stores, directory, 5 * c, previous, full_every)
        held[5 * c] = _held(stores)
        previous = 5 * c
        if keep is not None:
            snapshots.prune(directory, keep)
    return held


def test_a_restore_after_40_checkpoints_reads_a_bounded_number_of_files_and_is_exact(tmp_path: Path) -> None:
    held = _run(tmp_path, 40, full_every=4)
    for n in (5, 15, 20, 105, 200):
        files = snapshots.files_of(tmp_path, n)
        assert len(files) <= 4 * 2, files  # (two servers, a chain of at most four links)
        assert np.array_equal(_restored(tmp_path, n), held[n]), n
    fulls = [n for n in snapshots.complete(tmp_path) if snapshots.manifest(tmp_path, n)["full"]]
    # four incremental links from the initial rows, then every fourth one full
    assert fulls == list(range(25, 201, 20))
    assert [p.name for p in snapshots.files_of(tmp_path, 185)] == ["base-0.npz", "base-1.npz"]


def test_every_checkpoint_full_and_none_full_restore_the_same_rows(tmp_path: Path) -> None:
    held_full = _run(tmp_path / "full", 6, full_every=1)
    held_incremental = _run(tmp_path / "incremental", 6, full_every=100)
    assert len(snapshots.files_of(tmp_path / "full", 30)) == 2
    assert len(snapshots.files_of(tmp_path / "incremental", 30)) == 12
    for n in held_full:
        assert np.array_equal(held_full[n], held_incremental[n])
        assert np.array_equal(_restored(tmp_path / "full", n), _restored(tmp_path / "incremental", n))


def test_pruning_keeps_the_last_k_and_the_links_they_stand_on(tmp_path: Path) -> None:
    held = _run(tmp_path, 13, full_every=4, keep=2)
    # full ones at 25, 45 and 65: the last two are 60, standing on 45, 50 and 55, and the full 65
    assert snapshots.complete(tmp_path) == [45, 50, 55, 60, 65]
    held = _run(tmp_path / "b", 15, full_every=4, keep=2)
    # the last two (70, 75) stand on the full 65
    assert snapshots.complete(tmp_path / "b") == [65, 70, 75]
    for n in (70, 75):
        assert np.array_equal(_restored(tmp_path / "b", n), held[n])
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [f"{n:09d}" for n in (65, 70, 75)]


def test_a_missing_link_or_row_file_is_refused_naming_it(tmp_path: Path) -> None:
    _run(tmp_path, 6, full_every=100)
    (snapshots.path_of(tmp_path, 15) / snapshots.MANIFEST).unlink()  # (a link half removed)
    with pytest.raises(snapshots.BrokenChain, match="checkpoint 15, a link of its chain"):
        list(snapshots.row_deltas(tmp_path, 30))
    assert snapshots.files_of(tmp_path, 10)  # (the chain before the gap stands)
    (snapshots.path_of(tmp_path, 10) / "rows-1.npz").unlink()
    with pytest.raises(snapshots.BrokenChain, match="rows-1.npz: listed by checkpoint 10"):
        snapshots.files_of(tmp_path, 10)
    with pytest.raises(snapshots.BrokenChain, match="cannot restore checkpoint 99: it is missing"):
        snapshots.files_of(tmp_path, 99)


def test_files_are_fsynced_before_the_manifest_names_them(tmp_path: Path, monkeypatch: Any) -> None:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    _run(tmp_path, 1, full_every=4)
    where = str(snapshots.path_of(tmp_path, 5))
    names = [Path(p).name for p in synced]
    # each file as its temporary name, then the directory after its rename; the manifest last
    assert names.index(".rows-0.npz.tmp") < names.index(".COMPLETE.tmp")
    assert names.index(".rows-1.npz.tmp") < names.index(".COMPLETE.tmp")
    assert synced[-1] == where and names[-2] == ".COMPLETE.tmp"
    # the new checkpoint's directory is fsynced into the checkpoint directory before any file of it is
    # named there (else a power loss can take the whole checkpoint, manifest included)
    assert synced.index(str(tmp_path)) < names.index(".rows-0.npz.tmp")


def test_a_removed_checkpoint_loses_its_manifest_durably_before_its_files(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Pruning, discarding: the manifest's removal reaches the disk before any file goes, so a power loss
    in between leaves no checkpoint that names missing files."""
    _run(tmp_path, 2, full_every=4)
    events: list[str] = []
    real_fsync, real_unlink, real_rmtree = os.fsync, Path.unlink, shutil.rmtree
    monkeypatch.setattr(
        os,
        "fsync",
        lambda fd: (events.append(f"fsync {os.readlink(f'/proc/self/fd/{fd}')}"), real_fsync(fd))[1],
    )
    monkeypatch.setattr(
        Path, "unlink", lambda self, *a, **k: (events.append(f"unlink {self}"), real_unlink(self, *a, **k))[1]
    )
    monkeypatch.setattr(
        shutil,
        "rmtree",
        lambda path, *a, **k: (events.append(f"rmtree {path}"), real_rmtree(path, *a, **k))[1],
    )
    where = snapshots.path_of(tmp_path, 10)
    snapshots.discard(tmp_path, 10)
    assert events == [
        f"unlink {where / 'COMPLETE'}",
        f"fsync {where}",
        f"rmtree {where}",
        f"fsync {tmp_path}",
    ]
    assert snapshots.complete(tmp_path) == [5]


def test_the_final_model_is_fsynced_with_its_new_directories(tmp_path: Path, monkeypatch: Any) -> None:
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1]
    )
    target = tmp_path / "model" / "run-1" / "final.pt"
    checkpoint.save(target, {"dense": {"w": torch.ones(2)}, "embeddings": {}})
    assert synced == [
        str(tmp_path),
        str(tmp_path / "model"),
        str(target.with_name(".final.pt.tmp")),
        str(target.parent),
    ]
    assert torch.equal(checkpoint.load_plain(target)["dense"]["w"], torch.ones(2))


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 256 KiB tmpfs (needs root, as CI has; skipped where mounting is not permitted)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_a_full_disk_names_the_directory_and_damages_nothing(small_disk: Path) -> None:
    held = _run(small_disk, 2, full_every=100)
    before = {p: p.read_bytes() for p in small_disk.rglob("*") if p.is_file()}
    big = np.zeros((20000, DIM), dtype=np.float32)  # (240 KB a column range: more than is left)
    keys = np.arange(20000, dtype=np.int64)
    with pytest.raises(OSError, match="No space left") as error:
        snapshots.write_rows(small_disk, 15, 0, keys, big, big)
    assert str(small_disk) in str(error.value)
    snapshots.discard(small_disk, 15)  # (what rank 0 does with a checkpoint it could not complete)
    after = {p: p.read_bytes() for p in small_disk.rglob("*") if p.is_file()}
    assert after == before and snapshots.complete(small_disk) == [5, 10]
    assert np.array_equal(_restored(small_disk, 10), held[10])


@pytest.mark.parametrize(
    ("error", "final"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (OSError(errno.EROFS, "Read-only file system"), True),
        (OSError(errno.EIO, "Input/output error"), False),
        (OSError(errno.ESTALE, "Stale file handle"), False),
        (OSError(errno.EMFILE, "Too many open files"), False),
        (TimeoutError("the re-sharding lock"), False),
    ],
)
def test_only_a_full_or_read_only_volume_is_a_final_checkpoint_error(error: OSError, final: bool) -> None:
    assert snapshots.final(error) is final


def test_row_files_are_read_in_parts_and_a_short_one_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full snapshot holds a whole shard: a restore reads it ``_CHUNK_ROWS`` rows at a time, so that a
    server with a row tier stays within its budget. The parts are the file's rows in order; files written
    by ``np.savez_compressed`` read the same; a file that ends early is refused, naming it."""
    monkeypatch.setattr(snapshots, "_CHUNK_ROWS", 7)
    rng = np.random.default_rng(4)
    keys = rng.permutation(1000)[:30].astype(np.int64)
    rows = rng.standard_normal((30, 3)).astype(np.float32)
    state = rng.random((30, 2)).astype(np.float32)
    name, _ = snapshots.write_rows(tmp_path, 10, 0, keys, rows, state, full=True)
    (snapshots.path_of(tmp_path, 10) / snapshots.MANIFEST).write_text(
        json.dumps({"next_batch": 10, "full": True, "row_files": [name]})
    )
    path = snapshots.path_of(tmp_path, 10) / name
    for writer in ("ours", "numpy"):
        if writer == "numpy":
            np.savez_compressed(path, keys=keys, rows=rows, state=state)
        parts = list(snapshots.row_deltas(tmp_path, 10))
        assert [p[1].size for p in parts] == [7, 7, 7, 7, 2] and {p[0] for p in parts} == {10}
        for got, want in zip((1, 2, 3), (keys, rows, state), strict=True):
            np.testing.assert_array_equal(np.concatenate([p[got] for p in parts]), want)
    snapshots.write_rows(tmp_path, 10, 0, keys, rows, state, full=True)
    data = path.read_bytes()
    with zipfile.ZipFile(path, "w") as archive, zipfile.ZipFile(io.BytesIO(data)) as whole:
        for member in whole.namelist():  # (state's last rows lost)
            content = whole.read(member)
            archive.writestr(member, content[:-40] if member == "state.npy" else content)
    with pytest.raises(ValueError, match=f"{path}: state ends after 25 of its rows"):
        list(snapshots.row_deltas(tmp_path, 10))
