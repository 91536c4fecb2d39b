"""The trainer's parts on their own: the row stores, the synchroniser's updates, the pipeline's transfer
groups and errors, the stats' stage timer (no processes, no network: world size 1)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from bagpipe import cli
from bagpipe.config_args import Coordination
from bagpipe.core.model import ModelConfig
from bagpipe.core.optim import OptimizerConfig, apply_rows
from bagpipe.core.plans import SyncStep, TrainerPlan
from bagpipe.core.row_store import RowStore
from bagpipe.embedding_server.client import EmbeddingClient
from bagpipe.local import configs
from bagpipe.trainer import metrics
from bagpipe.trainer.cache import EmbeddingCache
from bagpipe.trainer.config import TrainerConfig
from bagpipe.trainer.pipeline import Pipeline
from bagpipe.trainer.shared_table import SharedTable
from bagpipe.trainer.stats import StageTimer
from bagpipe.trainer.sync import Synchronizer, backend_for, gather_rows
from bagpipe.trainer.worker import trainer_device
from prometheus_client import REGISTRY

CPU = torch.device("cpu")


def _ints(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def _step(slots: np.ndarray, local: np.ndarray) -> SyncStep:
    empty = _ints()
    return SyncStep(slots, local, empty, empty, empty)


def _config(rank: int = 0, world: int = 1, k: int = 4) -> TrainerConfig:
    return TrainerConfig(
        rank,
        world,
        "env://",
        ModelConfig(),
        OptimizerConfig(),
        tuple([5] * 26),
        0,
        None,
        None,
        None,
        "cpu",
        Coordination(),
        transfer_batches=k,
    )


def test_both_row_stores_are_row_stores(tmp_path: Path) -> None:
    table = SharedTable(str(tmp_path / "t"), 10, 3, 3, create=True)
    stores: list[RowStore] = [table]
    keys = np.array([7, 2], dtype=np.int64)
    stores[0].write_back(keys, np.ones((2, 3), np.float32) * [[1], [2]], np.full((2, 3), 5, np.float32))
    rows, state = SharedTable(str(tmp_path / "t"), 10, 3, 3, create=False).lookup(keys)
    assert rows.tolist() == [[1] * 3, [2] * 3] and (state == 5).all()
    ((positions, part_rows, part_state),) = table.lookup_parts(keys)
    assert positions.tolist() == [0, 1] and np.array_equal(part_rows, rows) and (part_state == 5).all()
    for name in ("lookup", "lookup_parts", "write_back", "close"):
        assert callable(getattr(EmbeddingClient, name)) and callable(getattr(SharedTable, name))
    table.unlink()


def test_gather_rows_puts_this_trainers_gradients_in_sync_order() -> None:
    grad = torch.arange(12, dtype=torch.float32).view(4, 3)
    out = gather_rows(grad, _ints(2, -1, 0))
    assert out.tolist() == [[6, 7, 8], [0, 0, 0], [0, 1, 2]]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_update_applies_private_and_critical_rows_like_the_optimizer(optimizer: str) -> None:
    opt = OptimizerConfig(optimizer, 0.1)
    cache = EmbeddingCache(2, opt.state_width(2), CPU, capacity=8)
    cache.insert(cache.index(_ints(*range(8))), torch.randn(8, 2), torch.rand(8, opt.state_width(2)))
    weights, state = cache.weights.clone(), cache.state.clone()
    sync = Synchronizer(cache, opt, 1, Pipeline(_config(), cache, None, [], 0), lambda batch: batch + 1)  # type: ignore[arg-type]
    # the batch uses slots 5, 1, 6: 5 and 6 are private (rows 0 and 2), 1 is critical (row 1)
    share = TrainerPlan(
        3,
        _ints(5, 1, 6),
        _ints(),
        np.array([], np.int64),
        _ints(),
        _ints(0, 2),
        _step(_ints(1), _ints(1)),
        _step(_ints(), _ints()),
        np.array([], np.int64),
        _ints(),
        np.zeros(0, bool),
        0,
    )
    row_grad = torch.randn(3, 2)
    sync.synced = 2  # (batch 2's background synchronisation is done: batch 3's critical one may start)
    critical = sync.critical(3, share, row_grad)  # (world size 1: nothing to reduce)
    sync.update(3, share, cache.index(share.slots), row_grad, critical)
    apply_rows(opt, weights, state, torch.tensor([5, 6]), row_grad[[0, 2]], 4)
    apply_rows(opt, weights, state, torch.tensor([1]), row_grad[[1]], 4)
    assert torch.equal(cache.weights, weights) and torch.equal(cache.state, state)


def test_transfer_groups_cover_every_batch_and_interleave_across_trainers() -> None:
    k = 4
    for world in (1, 2, 4):
        ends = []
        for rank in range(world):
            p = Pipeline(_config(rank, world, k), EmbeddingCache(2, 0, CPU), None, [], 0)  # type: ignore[arg-type]
            for phase in (p._prefetch_phase, p._write_phase):
                group_ends = [p._group_end(b, phase) for b in range(40)]
                assert all(b <= e < b + k for b, e in enumerate(group_ends))
                assert all(group_ends[e] == e for e in group_ends if e < 40)  # an end ends its own group
            ends.append(p._group_end(0, p._prefetch_phase))
        assert world == 1 or len(set(ends)) > 1  # the trainers' groups do not all end together


def test_a_failed_thread_wakes_every_waiter_with_its_error() -> None:
    p = Pipeline(_config(), EmbeddingCache(2, 0, CPU), None, [], 0)  # type: ignore[arg-type]
    caught: list[BaseException] = []

    def wait() -> None:
        try:
            p.wait(lambda: False, starving=True)
        except RuntimeError as e:
            caught.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    p.fail(ValueError("plan 4: slots"))
    waiter.join(10)
    assert not waiter.is_alive() and isinstance(caught[0].__cause__, ValueError)
    assert not p.starving


def test_stage_timer_adds_up_to_the_iteration() -> None:
    timer = StageTimer()
    for stage in metrics.STAGES:
        timer.mark(stage)
    timer.mark("embedding_sync")  # a stage may run twice in one iteration
    assert set(timer.seconds) == set(metrics.STAGES)
    assert sum(timer.seconds.values()) == pytest.approx(timer.total())


def test_cache_growth_keeps_rows_and_waits_for_holders() -> None:
    cache = EmbeddingCache(3, 3, CPU, capacity=4)
    cache.insert(torch.arange(4), torch.arange(12.0).view(4, 3), -torch.arange(12.0).view(4, 3))
    held, release = threading.Event(), threading.Event()

    def reader() -> None:  # a holder of shared() (the training thread reading rows)
        with cache.lock.shared():
            held.set()
            release.wait(10)

    thread = threading.Thread(target=reader)
    thread.start()
    held.wait(10)
    grower = threading.Thread(target=cache.ensure_capacity, args=(6,))
    grower.start()
    grower.join(0.2)
    assert grower.is_alive() and cache.capacity == 4  # the tensors are swapped only once holders leave
    release.set()
    thread.join(10)
    grower.join(10)
    assert cache.capacity == 8
    assert torch.equal(cache.weights[:4], torch.arange(12.0).view(4, 3))
    assert torch.equal(cache.state[:4], -torch.arange(12.0).view(4, 3))
    assert not cache.weights[4:].any() and not cache.state[4:].any()
    fixed = EmbeddingCache(3, 3, CPU, capacity=4, fixed=True)
    with pytest.raises(ValueError, match="--cache-rows"):
        fixed.ensure_capacity(5)


def test_device_and_backend_follow_the_gpus_this_host_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device``: rank r on GPU r mod the GPUs seen; the local launcher puts trainers that would share a
    GPU on gloo (NCCL refuses two ranks on one device), and leaves NCCL to trainers with a GPU each."""

    # the launcher looks for GPU device files before it imports torch to count GPUs: a host without them
    # has no CUDA device for torch either
    assert configs.gpu_nodes() or not torch.cuda.is_available()

    def host(gpus: int) -> None:
        monkeypatch.setattr(configs, "gpu_nodes", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)

    def launcher_backend(*flags: str) -> str:
        return configs.dist_backend(cli.parse_run([*flags, "--batch-size", "2520"]))  # (divides by 1-10)

    host(0)
    assert trainer_device("auto", 3) == CPU and trainer_device("cpu", 3) == CPU
    with pytest.raises(RuntimeError, match="--device cuda: torch sees no CUDA device"):
        trainer_device("cuda", 0)
    assert launcher_backend("--trainers", "4") == "auto" and backend_for("auto", CPU) == "gloo"
    host(2)
    assert trainer_device("cpu", 3) == CPU
    assert [trainer_device("auto", r) for r in range(3)] == [torch.device("cuda", i) for i in (0, 1, 0)]
    assert launcher_backend("--trainers", "2") == "auto"
    assert launcher_backend("--trainers", "3") == "gloo"
    assert launcher_backend("--trainers", "3", "--device", "cpu") == "auto"
    assert backend_for("auto", torch.device("cuda", 1)) == "nccl"
    assert backend_for("gloo", torch.device("cuda", 1)) == "gloo"


def _heartbeat() -> float:
    value = REGISTRY.get_sample_value("bagpipe_trainer_heartbeat_timestamp_seconds")
    assert value is not None
    return value


def test_the_heartbeat_goes_on_through_a_step_and_for_at_most_its_bound() -> None:
    """A step with no deadline of its own (the wait for the oracle's first plan) beats for ``at_most``
    seconds only: past that, a hang inside it stops the heartbeat and the failure detector finds it."""
    metrics.HEARTBEAT.set(0.0)
    with metrics.heartbeat_while("a long step", every=0.01):
        threading.Event().wait(0.2)
        assert _heartbeat() > 0
    metrics.HEARTBEAT.set(0.0)
    with metrics.heartbeat_while("a hang", every=0.01, at_most=0.05):
        threading.Event().wait(0.3)  # (the bound passed long ago: no beat since)
        last = _heartbeat()
        threading.Event().wait(0.1)
        assert 0 < last == _heartbeat()
