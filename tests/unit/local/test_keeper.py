"""What ``bagpipe run`` does as the job's kubelet: Redis started again when it exits, and killed then
started again when it stops answering (its liveness probe); the same command line, so the same port."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from bagpipe.control.registry import Registry
from bagpipe.local.keeper import ComponentFailure, Keeper, Process, Silence, keep_alive
from bagpipe.local.redis_server import RedisServer


def test_a_killed_redis_is_started_again_and_a_frozen_one_killed_first(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    job = Keeper(tmp_path)  # (no process of its own: Redis alone)
    try:
        url, first = server.url, server.proc.pid
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        keep_alive(job, server, Silence(10.0), timeout=1.0)
        assert server.restarts == 1 and server.proc.pid != first and server.url == url
        assert Registry(url, "keeper").ping()

        frozen = server.proc.pid
        server.proc.send_signal(signal.SIGSTOP)
        silent = Silence(10.0)
        silent.seconds = 0.5  # (probes failed for half a second)
        keep_alive(job, server, silent, timeout=1.0)
        assert server.proc.pid == frozen  # not yet: silent for less than the timeout
        silent.seconds = 2.0
        keep_alive(job, server, silent, timeout=1.0)
        assert server.restarts == 2 and server.proc.pid != frozen and silent.seconds == 0.0
        assert Registry(url, "keeper").ping()
    finally:
        server.stop()


def test_silence_counts_failed_probes_not_the_time_the_keeper_itself_was_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job frozen in turns (SIGSTOP to its process group, Redis and the keeper with it) wakes with its
    pending Redis call timed out: the freeze's minutes are not Redis's silence. A Redis that hangs makes
    every probe wait its socket timeout, and those add up."""
    from bagpipe.local import keeper

    now = [1000.0]
    monkeypatch.setattr(keeper.time, "monotonic", lambda: now[0])
    silence = Silence(probe_timeout=10.0)
    now[0] += 600.0  # (stopped mid-probe for ten minutes)
    silence.failed()
    assert silence.seconds == 11.0
    now[0] += 0.01
    silence.answered()  # (thawed with it, Redis answers the next probe)
    assert silence.seconds == 0.0
    for _ in range(5):  # a hung Redis: each probe waits out its timeout
        now[0] += 10.0
        silence.failed()
    assert silence.seconds == 50.0
    silence.answered()
    for _ in range(30):  # one that refuses at once, looked at every 0.1 s: the time between looks counts
        now[0] += 0.1
        silence.failed()
    assert silence.seconds == pytest.approx(3.0)


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
            keep_alive(job, server, Silence(10.0), timeout=1.0)
        assert failure.value.exit_code == code and job.processes[0].restarts == 0
    finally:
        server.stop()


def test_a_recoverys_restarts_do_not_count_and_the_crash_loop_bound_follows_max_restarts(
    tmp_path: Path,
) -> None:
    """Exit 75 is how every recovery starts a process again: never a failure, however many. Failures count
    up to --max-restarts plus the crash-loop bound, not a fixed 20 that capped --max-restarts in secret."""
    from bagpipe.local import keeper

    server = RedisServer(tmp_path)
    job = Keeper(tmp_path)

    def process(name: str, code: int) -> Process:
        command = [sys.executable, "-c", f"raise SystemExit({code})"]
        p = Process(name, subprocess.Popen(command), tmp_path / f"{name}.log", command)
        job.processes[:] = [p]
        return p

    try:
        rejoining = process("trainer-0", 75)
        for _ in range(3 * keeper.CRASH_LOOP_RESTARTS):
            rejoining.proc.wait()
            keep_alive(job, server, Silence(10.0), timeout=1.0, max_restarts=3)
        assert rejoining.failures == 0 and rejoining.restarts == 3 * keeper.CRASH_LOOP_RESTARTS

        crashing = process("embedding-server-0", 1)
        allowed = 30 + keeper.CRASH_LOOP_RESTARTS  # (--max-restarts 30)
        for _ in range(allowed):
            crashing.proc.wait()
            keep_alive(job, server, Silence(10.0), timeout=1.0, max_restarts=30)
        crashing.proc.wait()
        with pytest.raises(ComponentFailure, match=f"after {allowed} restarts"):
            keep_alive(job, server, Silence(10.0), timeout=1.0, max_restarts=30)
    finally:
        server.stop()
