"""``bagpipe drain`` (the servers' preStop hook) once the job is done: the controller scales the servers to
zero, and no row is moved."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from bagpipe.control.generation import DONE, TRAINING, Generation
from bagpipe.control.registry import Registry
from bagpipe.embedding_server import drain
from bagpipe.local.redis_server import RedisServer


def test_a_done_job_is_not_drained(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    server = RedisServer(tmp_path)
    registry = Registry(server.url, "job")
    moved: list[int] = []
    monkeypatch.setattr(drain, "drain", lambda registry, shard, timeout: moved.append(shard))
    try:
        running = dataclasses.replace(Generation.new(3, 50, "test"), state=TRAINING)
        registry.begin_generation(running.record())
        drain.main(["--shard", "1", "--redis", server.url, "--job", "job"])
        assert moved == [1]  # a scale-down while training moves the shard's rows away
        registry.set_generation_state(running.id, DONE)
        drain.main(["--shard", "1", "--redis", server.url, "--job", "job"])
        assert moved == [1]
        assert (
            "the job is done (the model is saved): shard 1 stops without moving rows"
            in capsys.readouterr().out
        )
    finally:
        registry.close()
        server.stop()
