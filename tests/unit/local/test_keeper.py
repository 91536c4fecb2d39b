"""What ``bagpipe run`` does as the job's kubelet: Redis started again when it exits, and killed then
started again when it stops answering (its liveness probe); the same command line, so the same port."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bagpipe.control.registry import Registry
from bagpipe.local.keeper import ComponentFailure, Keeper, Process, keep_alive
from bagpipe.local.redis_server import RedisServer


def test_a_killed_redis_is_started_again_and_a_frozen_one_killed_first(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    job = Keeper(tmp_path)  # (no process of its own: Redis alone)
    try:
        url, first = server.url, server.proc.pid
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        keep_alive(job, server, [0.0], timeout=1.0)
        assert server.restarts == 1 and server.proc.pid != first and server.url == url
        assert Registry(url, "keeper").ping()

        frozen = server.proc.pid
        server.proc.send_signal(signal.SIGSTOP)
        silent = [time.monotonic()]  # (the keeper saw it stop answering now)
        keep_alive(job, server, silent, timeout=1.0)
        assert server.proc.pid == frozen  # not yet: silent for less than the timeout
        silent[0] -= 2.0
        keep_alive(job, server, silent, timeout=1.0)
        assert server.restarts == 2 and server.proc.pid != frozen and silent == [0.0]
        assert Registry(url, "keeper").ping()
    finally:
        server.stop()


@pytest.mark.parametrize("code", [65, 74])
def test_an_exit_a_restart_would_repeat_fails_the_run_at_once(code: int, tmp_path: Path) -> None:
    """Bad input data (65) and a checkpoint that cannot be written (74) are not restarted."""
    server = RedisServer(tmp_path)
    job = Keeper(tmp_path)
    log = tmp_path / "p.log"
    proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    proc.wait()
    job.processes.append(Process("data-processor-0", proc, log))
    try:
        with pytest.raises(ComponentFailure) as failure:
            keep_alive(job, server, [0.0], timeout=1.0)
        assert failure.value.exit_code == code and job.processes[0].restarts == 0
    finally:
        server.stop()
