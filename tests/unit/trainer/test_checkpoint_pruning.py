"""Rank 0's pruning of old checkpoints against the controller's choice of where the next generation starts.

With ``--keep-checkpoints 1`` a full checkpoint leaves nothing before it, so a trainer 0 of a generation
that is over (it has not noticed yet) must not prune the checkpoint the controller chose for the next one:
neither once the next generation began, nor when the controller read the newest checkpoint just before
this trainer completed a newer one. The controller and Redis are real; rank 0's sealer writes real
checkpoint files (its embedding servers' snapshots are written here as a server writes them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bagpipe.control.generation import Membership, current
from bagpipe.control.registry import Registry
from bagpipe.controller.controller import Controller
from bagpipe.core import snapshots
from bagpipe.trainer.checkpointing import Sealer

from tests.unit.controller.test_controller import _form, _job, redis_url  # noqa: F401
from tests.unit.trainer.test_checkpoint_errors import sealer


class SnapshottingServers:
    """Two embedding servers' snapshots, as ``EmbeddingClient.snapshot`` has them written: each server's
    rows into the checkpoint's directory."""

    def snapshot(self, directory: str, next_batch: int, full: bool = False) -> list[tuple[str, int, int]]:
        out = []
        for shard in (0, 1):
            keys = np.array([shard, shard + 2], dtype=np.int64)
            rows = np.full((2, 4), float(next_batch), dtype=np.float32)
            name, size = snapshots.write_rows(directory, next_batch, shard, keys, rows, rows[:, :0], full)
            out.append((name, 2, size))
        return out


def rank_0(tmp_path: Path, registry: Registry) -> Sealer:
    """Rank 0 of the generation in force, in the controller's checkpoint directory: every checkpoint full,
    only one kept."""
    generation = current(registry)
    assert generation is not None
    return sealer(
        tmp_path / "checkpoints",
        registry,
        SnapshottingServers(),
        generation.id,
        keep_checkpoints=1,
        checkpoint_full_every=1,
    )


def training(redis_url: str, tmp_path: Path) -> tuple[Registry, Controller, Sealer]:  # noqa: F811
    """Generation 1 training from batch 0, its rank 0 having sealed checkpoint 10."""
    registry, controller, members, *_ = _job(redis_url, tmp_path)
    _form(registry, controller, members)
    registry.set_progress(0, 12)
    registry.set_progress(1, 12)
    controller.step()
    trainer_0 = rank_0(tmp_path, registry)
    trainer_0.seal(10)
    assert snapshots.complete(tmp_path / "checkpoints") == [10]
    return registry, controller, trainer_0


def server_restarts(registry: Registry, controller: Controller) -> None:
    """Embedding server 1 starts again: the controller begins generation 2."""
    Membership(registry, "embedding_server", "1").announce()
    controller.step()
    assert current(registry).number == 2


def assert_restorable(directory: Path, start: int) -> None:
    """What the servers and the trainers of a generation from ``start`` read is all there."""
    assert start in snapshots.complete(directory), (start, snapshots.complete(directory))
    assert snapshots.files_of(directory, start)  # (BrokenChain if a link is gone)
    snapshots.read_dense(directory, start)


def test_a_late_rank_0_does_not_prune_the_start_of_the_generation_that_replaced_it(
    redis_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    registry, controller, trainer_0 = training(redis_url, tmp_path)
    server_restarts(registry, controller)
    assert current(registry).start_batch == 10
    trainer_0.seal(20)  # generation 1's rank 0, before its watch made it exit
    assert_restorable(tmp_path / "checkpoints", current(registry).start_batch)


def test_a_checkpoint_completed_while_the_controller_chooses_the_start_is_not_lost(
    redis_url: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The controller reads the newest checkpoint (10); rank 0 then completes 20 and prunes, before the
    controller writes generation 2's record."""
    registry, controller, trainer_0 = training(redis_url, tmp_path)
    read = controller._start_batch
    sealed: list[int] = []

    def read_then_seal() -> int:
        newest = read()
        if not sealed:
            sealed.append(newest)
            trainer_0.seal(20)
        return newest

    monkeypatch.setattr(controller, "_start_batch", read_then_seal)
    server_restarts(registry, controller)
    assert sealed == [10]
    assert current(registry).start_batch == 20  # (read again: 10 may be gone)
    assert_restorable(tmp_path / "checkpoints", 20)


def test_rank_0_of_the_generation_in_force_keeps_only_the_newest(redis_url: str, tmp_path: Path) -> None:  # noqa: F811
    _, _, trainer_0 = training(redis_url, tmp_path)
    trainer_0.seal(20)
    trainer_0.seal(30)
    assert snapshots.complete(tmp_path / "checkpoints") == [30]
