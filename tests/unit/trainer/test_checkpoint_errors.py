"""Rank 0's sealing of a checkpoint: which errors fail the job for good (exit 74) and which are recovered
from as any failure is."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from bagpipe.core import snapshots
from bagpipe.trainer.worker import CheckpointFailed, Trainer


class Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def seal(tmp_path: Path, error: BaseException) -> Any:
    """``Trainer._seal_checkpoint`` of checkpoint 10 on a trainer whose writing meets ``error``."""
    (tmp_path / "000000010").mkdir(parents=True)

    def write(*_: Any) -> Any:
        raise error

    trainer = SimpleNamespace(
        _last_checkpoint=0,
        _write_checkpoint=write,
        config=SimpleNamespace(checkpoint_full_every=8, keep_checkpoints=3),
    )
    return Trainer._seal_checkpoint(trainer, str(tmp_path), 10)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device", "/bagpipe/checkpoints/x/000000010/dense.pt"),
        OSError(errno.EDQUOT, "Disk quota exceeded", "/bagpipe/checkpoints/x/000000010/dense.pt"),
        Refused(grpc.StatusCode.FAILED_PRECONDITION, "directory: cannot write the snapshot: [Errno 30] ..."),
    ],
)
def test_a_full_or_read_only_volume_fails_the_job_naming_the_directory(tmp_path: Path, error: Any) -> None:
    with pytest.raises(CheckpointFailed, match=f"checkpoint 10 could not be written to {tmp_path}"):
        seal(tmp_path, error)
    assert not snapshots.path_of(tmp_path, 10).exists(), "the incomplete checkpoint is removed"


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.EIO, "Input/output error", "/bagpipe/checkpoints/x/000000010/dense.pt"),
        OSError(errno.ESTALE, "Stale file handle", "/bagpipe/checkpoints/x/000000010/dense.pt"),
        TimeoutError("the re-sharding lock: not within 300 s"),
        Refused(grpc.StatusCode.UNAVAILABLE, "snapshot: cannot write the snapshot (may pass): [Errno 5] ..."),
        Refused(grpc.StatusCode.UNAVAILABLE, "connection refused"),
    ],
)
def test_any_other_error_is_recovered_from_as_a_failure(tmp_path: Path, error: Any) -> None:
    with pytest.raises(type(error)):
        seal(tmp_path, error)
