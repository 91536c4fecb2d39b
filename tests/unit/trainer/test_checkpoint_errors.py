"""Rank 0's sealing of a checkpoint: which errors fail the job for good (exit 74) and which are recovered
from as any failure is."""

from __future__ import annotations

import dataclasses
import errno
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from bagpipe.config_args import Coordination
from bagpipe.control.registry import Registry
from bagpipe.core import snapshots
from bagpipe.core.model import ModelConfig
from bagpipe.core.optim import OptimizerConfig, dense_optimizer
from bagpipe.local.redis_server import RedisServer
from bagpipe.trainer.checkpointing import CheckpointFailed, DenseModel, Sealer
from bagpipe.trainer.config import TrainerConfig


class Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FailingServers:
    """The embedding servers' client as rank 0 uses it to seal, every snapshot meeting ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def snapshot(self, directory: str, next_batch: int, full: bool = False) -> list[tuple[str, int, int]]:
        raise self.error


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield Registry(server.url, "job")
    server.stop()


def sealer(directory: Path, registry: Registry, servers: Any, generation: str = "", **config: Any) -> Sealer:
    """Rank 0's sealer, in generation ``generation`` (none: it never prunes), of a one-trainer job with a
    small model, checkpointing into ``directory``."""
    cfg = TrainerConfig(
        0,
        1,
        "env://",
        ModelConfig(),
        OptimizerConfig(),
        (5,) * 26,
        0,
        None,
        None,
        None,
        "cpu",
        Coordination(),
    )
    cfg = dataclasses.replace(cfg, checkpoint_dir=str(directory), **config)
    model = torch.nn.Linear(2, 1)
    dense = DenseModel(
        model, dense_optimizer(cfg.optimizer, list(model.parameters()), torch.device("cpu")), cfg.optimizer
    )
    return Sealer(str(directory), cfg, servers, dense, registry, generation, cfg.resume_batch)


def seal(tmp_path: Path, registry: Registry, error: BaseException) -> Any:
    """``Sealer.seal`` of checkpoint 10 whose servers' snapshots meet ``error``."""
    (tmp_path / "000000010").mkdir(parents=True)
    return sealer(tmp_path, registry, FailingServers(error)).seal(10)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device", "/bagpipe/checkpoints/x/000000010/dense.pt"),
        OSError(errno.EDQUOT, "Disk quota exceeded", "/bagpipe/checkpoints/x/000000010/dense.pt"),
        Refused(grpc.StatusCode.FAILED_PRECONDITION, "directory: cannot write the snapshot: [Errno 30] ..."),
    ],
)
def test_a_full_or_read_only_volume_fails_the_job_naming_the_directory(
    tmp_path: Path, registry: Registry, error: Any
) -> None:
    with pytest.raises(CheckpointFailed, match=f"checkpoint 10 could not be written to {tmp_path}"):
        seal(tmp_path, registry, error)
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
def test_any_other_error_is_recovered_from_as_a_failure(
    tmp_path: Path, registry: Registry, error: Any
) -> None:
    with pytest.raises(type(error)):
        seal(tmp_path, registry, error)
