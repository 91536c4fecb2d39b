"""What a kubelet does for a local run: start each process with a fixed command line, start it again with
the same one when it exits with a failure, and keep Redis alive (its liveness probe). It decides nothing
about the job: failures and recovery are the controller's (``bagpipe.controller``). A process that
fails its checkpoint (exit 74) or that restarts too often fails the run, as the chart's Job would."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bagpipe.control.generation import EXIT_RESTART
from bagpipe.core import snapshots
from bagpipe.errors import EXIT_DATA_ERROR
from bagpipe.local.redis_server import RedisServer

logger = logging.getLogger(__name__)


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    failures: int = 0  # the restarts after an exit other than EXIT_RESTART (a recovery's own)


@dataclass
class Keeper:
    """The processes of one local run, each kept with the command line it started with (a kubelet's
    containers); their output goes to ``<run_dir>/logs/<name>.log``."""

    run_dir: Path
    processes: list[Process] = field(default_factory=list)

    def spawn(self, name: str, module: str, argv: list[str], prefix: list[str] | None = None) -> Process:
        log = self.run_dir / "logs" / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        command = [*(prefix or []), sys.executable, "-m", module, *argv]
        p = Process(name, _start(command, log, env), log, command, env)
        self.processes.append(p)
        return p

    def restart(self, p: Process) -> None:
        """``p`` again with the same command line, as a kubelet restarts a pod's container."""
        p.restarts += 1
        p.proc = _start(p.command, p.log, p.env)

    def failed(self) -> Process | None:
        for p in self.processes:
            code = p.proc.poll()
            if code not in (None, 0):
                return p
        return None

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds each live process has used so far."""
        used = {p.name: process_cpu_seconds(p.proc.pid) for p in self.processes}
        return {name: seconds for name, seconds in used.items() if seconds is not None}

    def stop_all(self) -> None:
        for p in self.processes:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in self.processes:
            try:
                p.proc.wait(10)
            except subprocess.TimeoutExpired:
                p.proc.kill()


def _start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:  # a restarted process goes on in the same log
        out.write(
            f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command[-2:])} ----\n".encode()
            if out.tell()
            else b""
        )
        out.flush()
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used so far (None once it has ended)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return float(times.user + times.system)


def children_matching(pattern: str, parent: int | None = None) -> list[int]:
    """PIDs of the processes whose parent is ``parent`` (default: this process) and whose command line
    contains ``pattern`` (``bagpipe.trainer --rank 1``, ``redis-server``): how an operator, a chaos test or
    the recovery benchmark finds one service of a run."""
    try:
        children = psutil.Process(os.getpid() if parent is None else parent).children()
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if pattern in " ".join(child.cmdline()):
                found.append(child.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ComponentFailure(Exception):
    """A process of the job died, froze or stopped making progress."""

    def __init__(self, component: str, kind: str, detail: str, log: Path | None = None) -> None:
        super().__init__(f"{component} {detail}" + (f"; last lines of {log}:\n{tail(log)}" if log else ""))
        self.component = component
        self.kind = kind  # "exited", "gone" or "stuck"
        self.detail = detail
        self.log = log
        self.exit_code: int | None = None  # (exited)
        self.detected_at = time.time()


# exits a new process would repeat (a checkpoint that cannot be written, bad input data): they fail the
# run, as the chart's podFailurePolicy fails the Job, instead of being restarted
FINAL_EXITS = (snapshots.EXIT_CHECKPOINT_FAILED, EXIT_DATA_ERROR)
# a process that fails this many times more than the controller's --max-restarts allows is in a crash loop
# the controller cannot see (it never joins a generation): the run gives up. Exits with EXIT_RESTART, a
# recovery's normal way to start a process again, do not count (the chart's podFailurePolicy ignores them)
CRASH_LOOP_RESTARTS = 20


class Silence:
    """How long Redis has not answered, as a liveness probe counts it: the time since the last answer, over
    the failed probes in a row, each stretch between two looks counted for at most ``probe_timeout``
    (+1 s). A stretch longer than that did not wait on Redis alone: this process was itself stopped (a job
    frozen in turns, ``SIGSTOP`` to its process group, Redis with it), and the time it did not run is no
    evidence that Redis hangs. A Redis that hangs makes each probe wait its timeout; one that refuses at
    once fails every look: both add up as before."""

    def __init__(self, probe_timeout: float) -> None:
        self.cap = probe_timeout + 1.0
        self.seconds = 0.0
        self._looked = time.monotonic()  # the last answer or failure

    def answered(self) -> None:
        self.seconds = 0.0
        self._looked = time.monotonic()

    def failed(self) -> None:
        now = time.monotonic()
        self.seconds += min(now - self._looked, self.cap)
        self._looked = now


def keep_alive(
    job: Keeper, redis_server: RedisServer, redis_silent: Silence, timeout: float, max_restarts: int = 0
) -> None:
    """What a kubelet does: starts again every process that exited with a failure, with the same command
    line, and Redis when it exited or did not answer for ``timeout`` seconds (its liveness probe). Raises
    ComponentFailure for a checkpoint that could not be written (exit 74, as the chart's podFailurePolicy
    fails the Job: a new process would fail the same way) and for a process that failed more than
    ``max_restarts`` (the controller's) + ``CRASH_LOOP_RESTARTS`` times."""
    if redis_server.proc.poll() is None and redis_silent.seconds > timeout:
        logger.warning("redis does not answer for %.1f s: killing it", redis_silent.seconds)
        redis_server.proc.kill()
        redis_server.proc.wait()
    if redis_server.proc.poll() is not None:
        logger.warning("redis exited with %s: starting it again", redis_server.proc.returncode)
        redis_silent.answered()
        redis_server.restart()
    for p in job.processes:
        code = p.proc.poll()
        if code is None or code == 0:
            continue
        if code in FINAL_EXITS or p.failures >= max_restarts + CRASH_LOOP_RESTARTS:
            failure = ComponentFailure(
                p.name,
                "exited",
                f"exited with {code}" + (f" after {p.restarts} restarts" if p.restarts else ""),
                p.log,
            )
            failure.exit_code = code
            raise failure
        logger.info("%s exited with %d: starting it again", p.name, code)
        if code != EXIT_RESTART:
            p.failures += 1
        job.restart(p)
