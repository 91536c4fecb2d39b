"""A trainer that has trained its last batch still belongs to its job until the controller ends it: a member
failing in the job's last moments starts a generation this trainer must join (its pod must not have
completed), and only its own generation's end lets it exit 0. On a real Redis."""

from __future__ import annotations

import threading
from pathlib import Path

from bagpipe.control.generation import DONE, Generation, Membership, Watch, current
from bagpipe.control.registry import Registry
from bagpipe.local.redis_server import RedisServer
from bagpipe.trainer.__main__ import _job_done


def test_a_finished_trainer_follows_the_next_generation_and_exits_only_at_its_own_end(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    try:
        registry = Registry(server.url, "job")
        membership = Membership(registry, "trainer", "0")
        membership.announce()
        first = Generation.new(1, 0, "the job starts")
        registry.begin_generation(first.record())
        registry.set_generation_state(first.id, "training")
        trained = current(registry)
        assert trained is not None
        registry.put_json("stats:0", {"iterations": 10})  # (this trainer is done; trainer 1 is not yet)
        changed = threading.Event()
        why: list[str] = []
        watch = Watch(membership, trained, lambda said: (why.append(said), changed.set()))
        watch.start()
        assert not _job_done(registry, trained)
        second = Generation.new(2, 0, "trainer-1 was restarted (a new process)")
        registry.begin_generation(second.record())  # (trainer 1 failed before its end)
        assert changed.wait(5), "the finished trainer did not make way for the next generation"
        assert why == ["generation 1 is over (now 2)"]
        assert not _job_done(registry, trained) and registry.get_json("stats:0") is None
        registry.set_generation_state(second.id, DONE)
        assert not _job_done(registry, trained)  # (another generation's end: this process is not its trainer)
        assert _job_done(registry, current(registry))
        watch.stop()
    finally:
        server.stop()
