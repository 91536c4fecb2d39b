"""The embedding servers of ``bagpipe run`` at idle CPU priority (``cpu_priority``): every thread of theirs
in ``SCHED_IDLE``, those that gRPC starts once it serves too, and nothing else's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bagpipe import cpu_priority
from bagpipe.local.keeper import children_matching

from tests.integration.conftest import BackgroundRun, flags
from tests.integration.test_recovery import _trained

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


def _policies(pid: int) -> dict[int, str]:
    """Each live thread of ``pid``: idle or normal."""
    out: dict[int, str] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:  # (the process ended meanwhile: the test's counts then fail)
        return out
    for task in tasks:
        try:
            out[int(task.name)] = cpu_priority.policy_of(int(task.name))
        except ProcessLookupError:  # (a thread that ended meanwhile)
            continue
    return out


@pytest.mark.parametrize(("extra", "servers"), [([], "idle"), (["--system", "no-cache"], "normal")])
def test_the_servers_of_a_run_train_at_their_priority(
    run_job, tmp_path: Path, extra: list[str], servers: str
) -> None:
    name = f"priority-{servers}"
    job = BackgroundRun(run_job, name, *flags(iterations=400, trainers=2, embedding_servers=2), *extra)
    deadline = time.monotonic() + 120
    while _trained(tmp_path / name) < 20 and job.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.alive(), "the run ended before it could be looked at"
    seen = {pid: _policies(pid) for pid in children_matching("bagpipe.embedding_server")}
    trainers = {pid: _policies(pid) for pid in children_matching("bagpipe.trainer")}
    summary, _ = job.result()
    assert summary["iterations"] == 400
    assert len(seen) == 2 and len(trainers) == 2
    for pid, threads in seen.items():
        # the event loop and gRPC's own threads (started once the server was) at the servers' priority; the
        # metrics endpoint's thread (and a scrape's, while one is answered) at normal priority, so that the
        # failure detector's scrapes are answered at once
        policies = list(threads.values())
        if servers == "idle":
            assert policies.count("idle") > 3 and 1 <= policies.count("normal") <= 2, (pid, threads)
        else:
            assert len(threads) > 3 and set(policies) == {"normal"}, (pid, threads)
    for pid, threads in trainers.items():
        assert set(threads.values()) == {"normal"}, (pid, threads)


def test_idle_reaches_every_thread_and_those_started_later() -> None:
    script = (
        "import threading\n"
        "from bagpipe import cpu_priority\n"
        "done = threading.Event()\n"
        "t = threading.Thread(target=done.wait); t.start()\n"
        "said = cpu_priority.apply('idle')\n"
        "late = []\n"
        "u = threading.Thread(target=lambda: late.append(cpu_priority.policy_of(0))); u.start(); u.join()\n"
        "print(said); print(cpu_priority.policy_of(0), cpu_priority.policy_of(t.native_id), late[0])\n"
        "done.set(); t.join()\n"
        "print(cpu_priority.apply('normal'), cpu_priority.policy_of(0))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    said, policies, normal = out.splitlines()
    assert said.startswith("CPU priority idle: SCHED_IDLE on 2 threads")
    assert policies == "idle idle idle"  # this thread, one started before, one started after
    # (normal leaves a process as it is: it does not take back idle, which needs no privilege to give)
    assert normal == "CPU priority normal idle"


def test_an_unknown_priority_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu priority: one of normal, idle, got 'low'"):
        cpu_priority.apply("low")
