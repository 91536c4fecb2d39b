"""Live re-sharding with real embedding-server processes, Redis and gRPC: rows written while buckets
move are neither lost nor applied twice, and every read sees the last write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from bagpipe.control.generation import Generation
from bagpipe.control.registry import Registry
from bagpipe.core import checkpoint
from bagpipe.core.data import table_offsets
from bagpipe.core.embedding_init import init_rows
from bagpipe.embedding_server.client import EmbeddingClient
from bagpipe.embedding_server.resharder import drain
from bagpipe.local.keeper import children_matching
from bagpipe.local.redis_server import RedisServer
from bagpipe.local.scaling import request_scale, wait_scaled

from tests.integration.conftest import BackgroundRun, exact_flags, flags
from tests.integration.test_equivalence import assert_same_model, assert_synchronous
from tests.integration.test_recovery import _trained

TABLES = tuple(100 + 20 * t for t in range(26))  # 9100 rows
DIM = 4
SEED = 5
WIDTH = DIM  # adagrad: one accumulator per element


class Servers:
    """Embedding-server processes of one job (shard 0 coordinates re-sharding)."""

    def __init__(self, workdir: Path, redis_url: str, job: str, rate: float, lookup_threads: int = 0) -> None:
        self.workdir, self.redis_url, self.job, self.rate = workdir, redis_url, job, rate
        self.lookup_threads = lookup_threads
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, shard: int, initial: int = 2) -> None:
        log = open(self.workdir / f"server-{shard}.log", "ab")  # noqa: SIM115
        self.procs[shard] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bagpipe.embedding_server",
                *flags(
                    shard=shard,
                    initial_shards=initial,
                    table_rows=",".join(map(str, TABLES)),
                    embedding_dim=DIM,
                    optimizer="adagrad",
                    seed=SEED,
                    redis=self.redis_url,
                    job=self.job,
                    log_level="INFO",
                    migration_rows_per_second=repr(self.rate),
                    lookup_threads=self.lookup_threads,
                ),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    def stop(self, shard: int) -> None:
        proc = self.procs.pop(shard)
        proc.terminate()
        proc.wait(20)

    def close(self) -> None:
        for shard in list(self.procs):
            self.stop(shard)


def _wait(what: str, predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _read_in_parts(client: EmbeddingClient, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``client.lookup_parts``, assembled; every position must be answered exactly once."""
    rows = np.full((keys.size, DIM), np.nan, dtype=np.float32)
    state = np.full((keys.size, WIDTH), np.nan, dtype=np.float32)
    answered = np.zeros(keys.size, dtype=np.int64)
    for positions, part_rows, part_state in client.lookup_parts(keys):
        assert part_rows.shape == (positions.size, DIM) and part_state.shape == (positions.size, WIDTH)
        rows[positions], state[positions] = part_rows, part_state
        np.add.at(answered, positions, 1)
    assert (answered == 1).all(), f"positions answered {answered.min()}..{answered.max()} times"
    return rows, state


class Writer(threading.Thread):
    """Writes random rows back continuously and reads each write back at once; remembers the last value
    of every key (what the servers must hold at the end)."""

    def __init__(self, client: EmbeddingClient, num_keys: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.client, self.num_keys = client, num_keys
        self.rng = np.random.default_rng(seed)
        self.expected: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.writes = 0

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                keys = self.rng.choice(self.num_keys, size=200, replace=False).astype(np.int64)
                rows = self.rng.standard_normal((keys.size, DIM)).astype(np.float32)
                state = self.rng.random((keys.size, WIDTH)).astype(np.float32)
                self.client.write_back(keys, rows, state)
                got_rows, got_state = self._read(keys)
                if not (np.array_equal(got_rows, rows) and np.array_equal(got_state, state)):
                    raise AssertionError(f"write {self.writes}: a read after the write does not see it")
                for k, r, s in zip(keys.tolist(), rows, state, strict=True):
                    self.expected[k] = (r, s)
                self.writes += 1
        except BaseException as e:
            self.error = e

    def _read(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """In turn: as the trainers' prefetch reads (in parts, as the servers answer); ``lookup``; and two
        ``lookup_async`` in flight at once, the second of the keys reversed, read in the other order."""
        if self.writes % 3 == 0:
            return _read_in_parts(self.client, keys)
        if self.writes % 3 == 1:
            return self.client.lookup(keys)
        first, second = self.client.lookup_async(keys), self.client.lookup_async(keys[::-1].copy())
        back_rows, back_state = second.result()
        rows, state = first.result()
        if not (np.array_equal(back_rows, rows[::-1]) and np.array_equal(back_state, state[::-1])):
            raise AssertionError(f"write {self.writes}: two lookups in flight read different rows")
        return rows, state


@pytest.fixture(params=[0, 2], ids=["on-the-loop", "lookup-threads-2"])
def cluster(tmp_path: Path, request: pytest.FixtureRequest):
    """Servers that work on rows on their event loop, or on two threads (lookups copied, write-backs
    stored, off the loop, while the migration's steps run on it)."""
    redis_server = RedisServer(tmp_path)
    job = "reshard-test"
    servers = Servers(tmp_path, redis_server.url, job, rate=3000.0, lookup_threads=request.param)
    registry = Registry(redis_server.url, job)
    # (the controller's part: servers serve a generation once they hold its state; these start at batch 0)
    registry.begin_generation(Generation.new(1, 0, "the test starts").record())
    try:
        yield servers, registry
    finally:
        servers.close()
        registry.close()
        redis_server.stop()


def _settled(registry: Registry, shards: list[int]) -> bool:
    shard_map, _ = registry.embedding_servers()
    records = registry.reshards()
    return (
        shard_map is not None
        and shard_map.owners == shards
        and (shard_map.version == 1 or (records and records[-1]["to_version"] == shard_map.version))
    )


def test_writes_during_migrations_are_neither_lost_nor_duplicated(cluster) -> None:
    servers, registry = cluster
    num_keys = int(table_offsets(TABLES)[-1])
    for shard in (0, 1):
        servers.start(shard)
    _wait("two servers", lambda: len(registry.members("embedding_server")) == 2)
    shard_map, addresses = registry.embedding_servers()
    assert shard_map is not None and shard_map.owners == [0, 1]
    client = EmbeddingClient(shard_map, addresses, DIM, WIDTH, resolver=registry.embedding_servers)
    writer = Writer(client, num_keys, seed=1)
    writer.start()
    try:
        _wait("writes before scaling", lambda: writer.writes >= 5)
        servers.start(2)  # scale up: shard 2 joins, the coordinator moves a third of the buckets to it
        _wait("2 -> 3", lambda: _settled(registry, [0, 1, 2]) or writer.error is not None)
        writes_before_down = writer.writes
        # scale down to one: drain 2 and 1 (as the preStop hook does), then stop them
        for shard in (2, 1):
            drain(registry, shard, timeout=60)
            servers.stop(shard)
        _wait("-> 1", lambda: _settled(registry, [0]) or writer.error is not None)
        _wait(
            "writes after scaling",
            lambda: writer.writes >= writes_before_down + 5 or writer.error is not None,
        )
    finally:
        writer.stop.set()
        writer.join(30)
    assert writer.error is None, writer.error
    records = registry.reshards()
    assert [r["state"] for r in records] == ["done"] * 3
    assert [(r["from_shards"], r["to_shards"]) for r in records] == [
        ([0, 1], [0, 1, 2]),
        ([0, 1, 2], [0, 1]),
        ([0, 1], [0]),
    ]
    assert all(r["rows_moved"] > 0 and r["bytes_moved"] > 0 for r in records)
    # writes landed on every source during the copies: some rows were sent again at the switch
    assert sum(r["rows_resent"] for r in records) > 0
    # every key holds its last write, or its initial value if never written
    keys = np.arange(num_keys, dtype=np.int64)
    rows, state = client.lookup(keys)
    want_rows = init_rows(keys, table_offsets(TABLES), DIM, SEED)
    want_state = np.zeros((num_keys, WIDTH), dtype=np.float32)
    for k, (r, s) in writer.expected.items():
        want_rows[k], want_state[k] = r, s
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(state, want_state)
    assert client.shard_map.owners == [0] and client.refusals > 0
    client.close()


# ---- `bagpipe scale` on a running `bagpipe run`


def _scaled(run_dir: Path, servers: int, timeout: float = 120.0) -> dict:
    status = wait_scaled(run_dir, request_scale(run_dir, servers), timeout)
    assert status["state"] == "done", status
    return status


def _when_trained(run_dir: Path, batches: int, job: BackgroundRun) -> None:
    _wait(f"{batches} batches trained", lambda: _trained(run_dir) >= batches or not job.alive(), 120)
    assert job.alive(), "the run ended too early"


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_scaling_up_and_down_mid_training_keeps_the_model_exact(
    run_job, tmp_path: Path, optimizer: str
) -> None:
    """S=2 -> 3 -> 1 while training ends with the final checkpoint of a run at a fixed S=2, and that is the
    synchronous model."""
    iterations, batch = 600, 64  # (both re-shardings must end well before training does)
    _, fixed = run_job("fixed", *exact_flags(iterations, batch, optimizer))
    job = BackgroundRun(
        run_job, "scaled", *exact_flags(iterations, batch, optimizer, migration_rows_per_second=10000)
    )
    run_dir = tmp_path / "scaled"
    try:
        _when_trained(run_dir, 10, job)
        up = _scaled(run_dir, 3)
        _when_trained(run_dir, _trained(run_dir) + 3, job)
        down = _scaled(run_dir, 1)
        finished_at = _trained(run_dir)
    finally:
        summary, paths = job.result()
    print(f"scaled to 3 and back to 1 by batch {finished_at} of {iterations}: {summary['resharding']}")
    assert finished_at < iterations, "the migrations did not happen while training"
    assert [(r["from_shards"], r["to_shards"]) for r in up["reshards"]] == [([0, 1], [0, 1, 2])]
    assert [(r["from_shards"], r["to_shards"]) for r in down["reshards"]] == [([0, 1, 2], [0])]
    resharding = summary["resharding"]
    assert resharding["rows_moved"] > 0 and resharding["iterations_during"] > 0, resharding
    assert summary["embedding_servers"] == 1 and summary["iterations"] == iterations
    assert summary["rows_private_per_iteration"] > 0 and summary["rows_handed_over"] > 0
    assert_same_model(paths["final"], checkpoint.load(fixed["final"]), tolerance=0.0)
    assert_synchronous(paths, iterations, batch, optimizer)


def test_a_server_failing_mid_migration_rolls_back_and_stays_exact(run_job, tmp_path: Path) -> None:
    """The joining server dies while rows move to it: it is started again, the migration is done again, and
    the run ends with the three servers asked for and the synchronous model."""
    iterations, batch = 400, 64
    extra = ("--migration-rows-per-second", "2000", "--failure-timeout", "3", "--log-level", "INFO")
    job = BackgroundRun(run_job, "interrupted", *exact_flags(iterations, batch, "adagrad"), *extra)
    run_dir = tmp_path / "interrupted"
    log = run_dir / "logs" / "embedding-server-2.log"
    try:
        _when_trained(run_dir, 8, job)
        request = request_scale(run_dir, 3)
        _wait("rows moving", lambda: log.is_file() and b"migration to version 2" in log.read_bytes())
        pids = children_matching("bagpipe.embedding_server --shard 2")
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
        status = wait_scaled(run_dir, request, 120)
    finally:
        summary, paths = job.result()
    # the one killed starts again and the coordinator moves the rows again to the three servers asked for.
    # Killed before the switch (rows were still moving, slowly), it held nothing of the generation: its
    # restart is no failure and nothing rolls back; after the switch it would have been one
    assert status["state"] == "done" and status["embedding_servers"] == 3, status
    blamed = [f["component"] for f in summary["recovery"]["failures"]]
    assert blamed in ([], ["embedding-server-2"]), summary["recovery"]
    assert summary["embedding_servers"] == 3 and summary["iterations"] == iterations
    assert_synchronous(paths, iterations, batch, "adagrad")


def test_redis_lost_after_a_scale_down_recovers_with_the_servers_left(run_job, tmp_path: Path) -> None:
    """S=2 -> 1, then Redis is killed: the servers start again and publish the map of their --initial-shards
    (two), the controller puts the last map back, and the job forms again with the one server and ends with
    the synchronous model."""
    iterations, batch = 300, 64
    extra = ("--failure-timeout", "5", "--log-level", "INFO")
    job = BackgroundRun(
        run_job, "down", *exact_flags(iterations, batch, "adagrad", migration_rows_per_second=10000), *extra
    )
    run_dir = tmp_path / "down"
    try:
        _when_trained(run_dir, 8, job)
        _scaled(run_dir, 1)
        _when_trained(run_dir, _trained(run_dir) + 3, job)
        [redis_pid] = children_matching("redis-server")
        os.kill(redis_pid, signal.SIGKILL)
        killed_at = _trained(run_dir)
    finally:
        summary, paths = job.result()
    assert killed_at < iterations, "Redis was killed after training ended"
    assert [f["component"] for f in summary["recovery"]["failures"]] == ["redis"], summary["recovery"]
    assert summary["embedding_servers"] == 1 and summary["iterations"] == iterations
    assert_synchronous(paths, iterations, batch, "adagrad")
