"""The controller's state machine on a real Redis: generations formed, failures found (a restarted member,
a member the detector declares stuck), the job's end and giving up.

The members are this test acting through the same Registry calls the services make; the detector's input
is a scripted observation source (what Prometheus or the members' /metrics would say), and the actuator
records what it was asked to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bagpipe.config_args import Coordination
from bagpipe.control.detector import Observation
from bagpipe.control.generation import (
    DONE,
    FAILED,
    FORMING,
    ROLLING_BACK,
    TRAINING,
    Membership,
    current,
)
from bagpipe.control.registry import Registry
from bagpipe.controller.config import ControllerConfig, parse
from bagpipe.controller.controller import Controller
from bagpipe.core import snapshots
from bagpipe.core.shard_map import ShardMap
from bagpipe.errors import BAD_DATA, TRAINING_FAULT
from bagpipe.local.redis_server import RedisServer


class Script:
    """The detector's input: every member answers, trainers at the progress marks set here."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.silent: set[str] = set()
        self.members: list[str] = []

    def observe(self) -> dict[str, Observation]:
        return {m: Observation(m not in self.silent, self.marks.get(m), False) for m in self.members}

    def close(self) -> None:
        pass


class Recorder:
    def __init__(self) -> None:
        self.killed: list[tuple[str, dict[str, Any]]] = []
        self.released: list[list[str]] = []

    def kill(self, member: str, where: dict[str, Any]) -> str:
        self.killed.append((member, where))
        return f"killed {member}"

    def release(self, targets: list[str]) -> list[str]:
        self.released.append(targets)
        return targets


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def redis_url(tmp_path: Path):
    server = RedisServer(tmp_path)
    yield server.url
    server.stop()


def _job(redis_url: str, tmp_path: Path, **config: Any):
    registry = Registry(redis_url, "job")
    registry.publish_shard_map(ShardMap.create(64, 2))
    cfg = ControllerConfig(
        trainers=2,
        coordination=Coordination(redis_url, "job"),
        checkpoint_dir=str(tmp_path / "checkpoints"),
        **config,
    )
    script, actuator, clock = Script(), Recorder(), Clock()
    controller = Controller(cfg, registry, actuator, script, clock, monotonic=clock)
    members = {
        m: Membership(registry, *m.split("/"))
        for m in ("embedding_server/0", "embedding_server/1", "oracle_cacher/0", "trainer/0", "trainer/1")
    }
    for m in members.values():
        m.announce()
        registry.register_metrics(*m.name.split("/"), "127.0.0.1:1")
    script.members = list(members)
    return registry, controller, members, script, actuator, clock


def _checkpoint(directory: Path, batch: int) -> None:
    snapshots.path_of(directory, batch).mkdir(parents=True, exist_ok=True)
    snapshots.write_dense(directory, batch, {"dense": {}})
    snapshots.mark_complete(directory, batch, {"previous": 0, "full": True, "row_files": []})


def _form(registry: Registry, controller: Controller, members: dict[str, Membership]) -> None:
    controller.step()
    generation = current(registry)
    assert generation is not None and generation.state == ROLLING_BACK
    for name in ("embedding_server/0", "embedding_server/1"):
        registry.ack(generation.id, name, members[name].incarnation)
    controller.step()
    assert current(registry).state == ROLLING_BACK  # (the oracle has not acked)
    registry.ack(generation.id, "oracle_cacher/0", members["oracle_cacher/0"].incarnation)
    controller.step()
    assert current(registry).state == FORMING
    for r in (0, 1):
        registry.ack(generation.id, f"trainer/{r}", members[f"trainer/{r}"].incarnation)
    controller.step()
    assert current(registry).state == TRAINING


def test_a_generation_forms_from_the_newest_checkpoint_and_the_job_ends(redis_url, tmp_path: Path) -> None:
    _checkpoint(tmp_path / "checkpoints", 10)
    _checkpoint(tmp_path / "checkpoints", 20)
    registry, controller, members, _, actuator, _ = _job(
        redis_url, tmp_path, kill="kubernetes", release=("statefulset/servers",)
    )
    _form(registry, controller, members)
    generation = current(registry)
    assert (generation.number, generation.start_batch) == (1, 20)
    registry.set_progress(0, 21)
    for r in (0, 1):
        registry.put_json(f"stats:{r}", {"iterations": 5})
    controller.step()
    controller.step()
    assert current(registry).state == DONE
    assert actuator.released == [["statefulset/servers"]]  # once
    assert registry.failures() == []


def test_a_restarted_server_starts_the_next_generation_from_the_newest_checkpoint(
    redis_url, tmp_path: Path
) -> None:
    registry, controller, members, _, actuator, _ = _job(redis_url, tmp_path)
    _form(registry, controller, members)
    registry.set_progress(0, 12)
    registry.set_progress(1, 12)
    controller.step()
    _checkpoint(tmp_path / "checkpoints", 10)
    again = Membership(registry, "embedding_server", "1")  # the same member, a new process
    again.announce()
    controller.step()
    generation = current(registry)
    assert (generation.number, generation.start_batch, generation.state) == (2, 10, ROLLING_BACK)
    [failure] = registry.failures()
    assert failure["component"] == "embedding-server-1" and failure["kind"] == "exited", failure
    assert failure["resumed_at_batch"] == 10 and failure["last_batch"] == 12
    assert actuator.killed == []  # (it ended by itself)
    assert registry.progress() == {}  # the new generation starts over
    # the old incarnation's ack does not count for the new one
    members["embedding_server/1"] = again
    _form(registry, controller, members)
    registry.set_progress(0, 10)
    registry.set_progress(1, 10)
    controller.step()
    assert "recovered_seconds" in registry.failures()[0]


def test_a_stuck_trainer_is_ended_and_replaced(redis_url, tmp_path: Path) -> None:
    registry, controller, members, script, actuator, clock = _job(redis_url, tmp_path, failure_timeout=0.2)
    _form(registry, controller, members)
    registry.set_progress(0, 3)
    script.marks = {"trainer/0": 5.0, "trainer/1": 5.0}
    controller.step()
    clock.now += 0.3  # (past the timeout, on the detector's clock too)
    script.marks["trainer/0"] = 6.0  # trainer 1 makes no progress
    controller.step()
    assert [m for m, _ in actuator.killed] == ["trainer/1"]
    assert actuator.killed[0][1]["pid"] > 0  # where the member said it runs
    [failure] = registry.failures()
    assert (failure["component"], failure["kind"]) == ("trainer-1", "stuck")
    assert current(registry).number == 2


def test_a_failure_before_training_or_past_max_restarts_fails_the_job(redis_url, tmp_path: Path) -> None:
    registry, controller, members, _, _, _ = _job(redis_url, tmp_path, max_restarts=1)
    _form(registry, controller, members)
    Membership(registry, "trainer", "0").announce()
    controller.step()
    generation = current(registry)
    assert generation.state == FAILED
    assert generation.reason.startswith("trainer-0 failed before training began"), generation.reason

    registry, controller, members, _, _, _ = _job(redis_url, tmp_path / "b", max_restarts=1)
    registry._redis.flushdb()
    registry.publish_shard_map(ShardMap.create(64, 2))
    for m in members.values():
        m.announce()
    for _ in range(2):
        _form(registry, controller, members)
        registry.set_progress(0, 4)
        controller.step()
        members["trainer/1"] = Membership(registry, "trainer", "1")
        members["trainer/1"].announce()
        controller.step()
    generation = current(registry)
    assert generation.state == FAILED
    assert "trainer-1 failed after 1 restarts (--max-restarts)" in generation.reason


def test_redis_losing_the_job_is_a_failure_of_redis(redis_url, tmp_path: Path) -> None:
    registry, controller, members, _, _, _ = _job(redis_url, tmp_path)
    _form(registry, controller, members)
    registry.set_progress(0, 4)
    controller.step()
    registry._redis.flushdb()  # (what a restarted Redis holds: nothing)
    controller.step()
    [failure] = registry.failures()
    assert failure["component"] == "redis" and failure["kind"] == "exited"
    generation = current(registry)
    assert generation.number == 2 and generation.state == ROLLING_BACK
    assert members["trainer/0"].lost() is not None  # every member finds out and starts again


def test_the_command_line_round_trips_and_bad_values_name_the_flag(capsys) -> None:
    cfg = ControllerConfig(
        trainers=3,
        checkpoint_dir="/run/checkpoints",
        prometheus_url="http://prometheus:9090",
        kill="kubernetes",
        release=("statefulset/a", "deployment/b"),
    )
    from bagpipe.controller.config import argv

    assert parse(argv(cfg)) == cfg
    with pytest.raises(SystemExit):
        parse([*argv(cfg), "--release", "pod/x"])
    assert "--release: expected statefulset/NAME or deployment/NAME, got 'pod/x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--trainers", "1", "--release", "statefulset/a"])
    assert "needs --kill kubernetes" in capsys.readouterr().err
    assert json.dumps(argv(cfg))


def test_a_processor_the_oracle_reports_is_blamed_and_its_restart_alone_is_not(
    redis_url, tmp_path: Path
) -> None:
    """A data processor holds no state: started again it is no failure by itself; a stream of it that broke
    (or bad data in it) is, reported by the oracle with the processor's own message."""
    registry, controller, members, _, _, _ = _job(redis_url, tmp_path)
    processor = Membership(registry, "data_processor", "0")
    processor.announce()
    _form(registry, controller, members)
    generation = current(registry)
    registry.ack(generation.id, processor.name, processor.incarnation)  # (it follows every generation)
    registry.set_progress(0, 4)
    Membership(registry, "data_processor", "0").announce()  # started again
    controller.step()
    assert registry.failures() == [] and current(registry).id == generation.id
    registry.report(generation.id, "data_processor/0", "data.tsv:7: field I3: '2.5' is not an integer")
    controller.step()
    [failure] = registry.failures()
    assert (failure["component"], failure["kind"]) == ("data-processor-0", "failed")
    assert failure["detail"] == "data.tsv:7: field I3: '2.5' is not an integer"
    assert current(registry).number == 2
    # forgotten: a Deployment's replacement comes back under another name, and the oracle must not wait for
    # this one (were it alive, it would find its registration gone and start again)
    assert "data_processor/0" not in registry.incarnations()
    assert processor.lost() is not None


def test_bad_data_fails_the_job_at_once_naming_the_line(redis_url, tmp_path: Path) -> None:
    """Bad data the oracle reports is not retried, even after training began: a restart would read the same
    line again. The job's reason starts with the processor's own line."""
    registry, controller, members, _, _, _ = _job(redis_url, tmp_path, max_restarts=5)
    _form(registry, controller, members)
    generation = current(registry)
    registry.set_progress(0, 4)
    controller.step()
    line = "data.tsv:7: field I3: '2.5' is not an integer"
    # (another processor's broken stream, reported too, and first by name: the bad data still wins)
    registry.report(generation.id, "data_processor/0", "UNAVAILABLE: connection reset")
    registry.report(generation.id, "data_processor/1", BAD_DATA + line)
    controller.step()
    [failure] = registry.failures()
    assert (failure["component"], failure["kind"]) == ("data-processor-1", "data")
    ended = current(registry)
    assert ended is not None and ended.id == generation.id and ended.state == FAILED
    assert ended.reason.startswith(f"bad data: {line} (read by data-processor-1;")
    assert "--skip-bad-rows" in ended.reason


def test_a_trainers_deterministic_failure_fails_the_job_at_once_with_its_cause(
    redis_url, tmp_path: Path
) -> None:
    """A trainer that met a failure the same batches would meet again (a diverged model) reports it: the
    job fails at once, with restarts left and after training began, and the trainer is not ended."""
    registry, controller, members, _, actuator, _ = _job(redis_url, tmp_path, max_restarts=5)
    _form(registry, controller, members)
    generation = current(registry)
    registry.set_progress(0, 4)
    controller.step()
    cause = "batch 5: the model diverged: the loss is nan; lower --lr (now 10)"
    # (the peer it left waiting in a collective, reported too, and first by name: the cause still wins)
    registry.report(generation.id, "oracle_cacher/0", "UNAVAILABLE: connection reset")
    registry.report(generation.id, "trainer/1", TRAINING_FAULT + cause)
    controller.step()
    [failure] = registry.failures()
    assert (failure["component"], failure["kind"]) == ("trainer-1", "training")
    ended = current(registry)
    assert ended is not None and ended.id == generation.id and ended.state == FAILED
    assert ended.reason == (
        f"training: {cause} (met by trainer-1; not retried: a restart would meet it again)"
    )
    assert actuator.killed == []


def test_redis_lost_at_once_is_no_setup_error_and_giving_up_is_written_anew(
    redis_url, tmp_path: Path
) -> None:
    """Redis lost before the controller saw any progress (a short run): still a recovery, not a setup error;
    and a job that gives up while Redis holds no generation writes its end anew (else nobody reads it)."""
    registry, controller, members, _, _, _ = _job(redis_url, tmp_path, max_restarts=1)
    _form(registry, controller, members)
    registry._redis.flushdb()
    controller.step()
    assert current(registry).number == 2 and current(registry).state == ROLLING_BACK
    registry._redis.flushdb()  # (lost again: past --max-restarts)
    controller.step()
    generation = current(registry)
    assert generation is not None and generation.state == FAILED
    assert "redis failed after 1 restarts (--max-restarts)" in generation.reason


@pytest.mark.parametrize(("chosen", "start"), [("latest", 15), (10, 10), (0, 0)])
def test_the_first_generation_begins_at_the_chosen_checkpoint(
    redis_url, tmp_path: Path, chosen: Any, start: int
) -> None:
    """``--start-batch``: the first generation only; a later one (a recovery) begins at the newest."""
    for batch in (5, 10, 15):
        _checkpoint(tmp_path / "checkpoints", batch)
    registry, controller, _, _, _, _ = _job(redis_url, tmp_path, start_batch=chosen)
    controller.step()
    generation = current(registry)
    assert generation is not None and (generation.number, generation.start_batch) == (1, start)


@pytest.mark.parametrize("chosen", [7, 20])
def test_a_chosen_checkpoint_that_is_not_there_fails_the_job_naming_what_is(
    redis_url, tmp_path: Path, chosen: int
) -> None:
    for batch in (5, 10):
        _checkpoint(tmp_path / "checkpoints", batch)
    registry, controller, _, _, _, _ = _job(redis_url, tmp_path, start_batch=chosen)
    controller.step()
    generation = current(registry)
    assert generation is not None and generation.state == FAILED
    where = tmp_path / "checkpoints"
    assert (
        generation.reason
        == f"--start-batch {chosen}: no complete checkpoint {chosen} in {where} (complete: 5, 10)"
    )


def test_a_trainer_of_a_generation_that_is_over_cannot_end_the_next_one(redis_url, tmp_path: Path) -> None:
    """A trainer's writes of progress and statistics are fenced by its generation: one of a generation the
    controller has ended, not ended yet itself, writes nothing into the next (whose end the controller
    decides from the statistics)."""
    registry, controller, members, _, _, _ = _job(redis_url, tmp_path)
    _form(registry, controller, members)
    first = current(registry)
    late = Registry(redis_url, "job", fence=first.id)  # (a trainer of the first generation)
    assert late.set_progress(0, 4)
    controller.step()
    Membership(registry, "embedding_server", "1").announce()  # a failure: the next generation begins
    controller.step()
    assert current(registry).number == 2
    assert not late.set_progress(0, 5)
    assert [late.put_json(f"stats:{r}", {"iterations": 5}) for r in (0, 1)] == [False, False]
    assert registry.progress() == {} and registry.get_json("stats:0") is None
    controller.step()
    assert current(registry).state == ROLLING_BACK  # (not done)
    ours = Registry(redis_url, "job", fence=current(registry).id)
    assert ours.put_json("stats:0", {"iterations": 5}) and registry.get_json("stats:0") == {"iterations": 5}


def test_a_server_drained_and_started_again_within_a_generation_is_no_failure(
    redis_url, tmp_path: Path
) -> None:
    """A scale-down then a scale-up in one generation: the server that left held no buckets when it came
    back as a new process, so it lost nothing of the generation; once it holds buckets, a restart is a
    failure again."""
    registry, controller, members, _, _, _ = _job(redis_url, tmp_path)
    _form(registry, controller, members)
    registry.set_progress(0, 4)
    drained = registry.shard_map().rebalance([0])
    registry.replace_shard_map(drained)  # (the coordinator moved shard 1's buckets away)
    back = Membership(registry, "embedding_server", "1")  # (stopped, then started again by a scale-up)
    back.announce()
    controller.step()
    assert registry.failures() == [] and current(registry).number == 1
    registry.replace_shard_map(drained.rebalance([0, 1]))  # (rows move to it)
    registry.ack(current(registry).id, back.name, back.incarnation)  # (it joined the generation empty)
    controller.step()
    assert registry.failures() == []
    Membership(registry, "embedding_server", "1").announce()  # now it held rows
    controller.step()
    [failure] = registry.failures()
    assert failure["component"] == "embedding-server-1" and current(registry).number == 2


def test_failure_records_survive_a_redis_started_again_empty(redis_url, tmp_path: Path) -> None:
    registry, controller, members, _, _, _ = _job(redis_url, tmp_path)
    _form(registry, controller, members)
    registry.set_progress(0, 4)
    controller.step()
    Membership(registry, "trainer", "1").announce()
    controller.step()
    assert [f["component"] for f in registry.failures()] == ["trainer-1"]
    registry._redis.flushdb()
    controller.step()
    records = registry.failures()
    assert [(f["component"], f["generation"]) for f in records] == [("trainer-1", 1), ("redis", 2)]
    assert records[0]["resumed_at_batch"] == 0
    # a controller started again takes the list from Redis
    again = Controller(controller.config, registry, Recorder(), Script())
    assert again._failures() == records


def test_redis_lost_after_a_scale_down_forms_again_under_the_last_shard_map(
    redis_url, tmp_path: Path
) -> None:
    """A server started again after Redis lost the job publishes the map of its --initial-shards, which names
    a shard drained since: the controller puts the last map it saw back, and the generation forms without
    waiting for the shard that is gone."""
    registry, controller, members, _, _, _ = _job(redis_url, tmp_path)
    _form(registry, controller, members)
    registry.set_progress(0, 4)
    drained = registry.shard_map().rebalance([0])
    registry.replace_shard_map(drained)  # (a scale-down to one server)
    controller.step()
    registry._redis.flushdb()  # Redis restarted empty
    for m in ("embedding_server/0", "oracle_cacher/0"):  # (started again as new processes)
        members[m] = Membership(registry, *m.split("/"))
        members[m].announce()
    registry.publish_shard_map(ShardMap.create(64, 2))  # (server 0's --initial-shards 2, first)
    controller.step()
    assert registry.shard_map().to_json() == drained.to_json()
    generation = current(registry)
    assert generation.number == 2 and generation.state == ROLLING_BACK
    for m in ("embedding_server/0", "oracle_cacher/0"):
        registry.ack(generation.id, m, members[m].incarnation)
    controller.step()
    assert current(registry).state == FORMING
