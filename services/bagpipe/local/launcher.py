"""``bagpipe run``: Redis, S embedding servers, N data processors, the oracle and T trainers as
local processes on loopback, a progress bar, and a summary at the end.

The launcher builds each process's command line and shows the run; what a kubelet does (keeping the
processes) is ``keeper.py``, Redis is ``redis_server.py``, and the summary ``summary.py``."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
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
from tqdm.auto import tqdm  # (a notebook widget in Jupyter, text elsewhere)

from bagpipe import security, serving
from bagpipe.config_args import table_rows_of
from bagpipe.control.generation import DONE, FAILED, current
from bagpipe.control.registry import SOCKET_TIMEOUT_S, Registry
from bagpipe.controller.config import argv as controller_argv
from bagpipe.controller.config import oracle_process
from bagpipe.core import snapshots
from bagpipe.core.schema import TABLE_KINDS, schema_of
from bagpipe.data_processor import config as data_processor_config
from bagpipe.embedding_server import config as embedding_server_config
from bagpipe.errors import EXIT_DATA_ERROR
from bagpipe.local import configs
from bagpipe.local.configs import checkpoint_every, rendezvous_url
from bagpipe.local.keeper import ComponentFailure, Keeper, Process, Silence, keep_alive, tail
from bagpipe.local.prometheus import PrometheusServer
from bagpipe.local.record import RECORD_KEY, read_evals, run_record
from bagpipe.local.redis_server import RedisServer, free_port
from bagpipe.local.run_config import RunConfig
from bagpipe.local.scaling import Scaler
from bagpipe.local.summary import (
    cpu_by_service,
    recovery_summary,
    resharding_summary,
    run_losses,
    summarize,
)
from bagpipe.local.validate import check_inputs
from bagpipe.oracle_cacher import config as oracle_config
from bagpipe.trainer import config as trainer_config
from bagpipe.v1 import control_pb2, control_pb2_grpc

logger = logging.getLogger(__name__)


@dataclass
class LocalJob(Keeper):
    """The keeper of one run, with what its processes' command lines are made of."""

    args: RunConfig = field(default_factory=RunConfig)
    checkpoints: Path | None = None  # where recovery checkpoints go
    spec: configs.GenerationSpec | None = None  # what the generation's processes share


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


def run(args: RunConfig, after_training: AfterTraining | None = None) -> dict[str, Any]:
    """See ``_run``; every RPC and the Redis connection of the run are authenticated."""
    with job_credentials():
        return _run(args, after_training)


def _run(args: RunConfig, after_training: AfterTraining | None = None) -> dict[str, Any]:
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
    resuming = args.resume is not None
    if resuming:
        args = args.resumed()
    check_inputs(args)  # before any process starts: one line naming the flag and file
    run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    checkpoints = args.checkpoints(run_dir)
    if resuming:
        if not snapshots.complete(checkpoints):
            print(f"--resume: no complete checkpoint in {checkpoints}: the run starts over", file=sys.stderr)
    else:
        if checkpoint_every(args) and snapshots.complete(checkpoints):
            raise SystemExit(
                f"--checkpoint-dir: {checkpoints} holds another run's checkpoints; resume it with "
                f"--resume {run_dir} or choose another directory"
            )
        record = {**args.to_json(), "run_dir": str(run_dir), RECORD_KEY: run_record()}
        (run_dir / "config.json").write_text(json.dumps(record, indent=1))
    _say_inferred_schema(args, run_dir)
    netns = args.embedding_server_netns
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
        cpu_used = cpu_by_service(cpu_from[1], cpu_at_end)
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
                f"last lines of {stopped_badly.log}:\n{tail(stopped_badly.log)}"
            )
        summary = summarize(stats, args, run_dir, embedding_servers=scaler.servers)
        summary["evaluations"] = read_evals(run_dir / "metrics" / "eval.csv")
        summary["recovery"] = recovery_summary(failures, stats, run_dir, checkpoint_every(args), checkpoints)
        summary["resharding"] = resharding_summary(scaler.records + reshards, run_dir)
        if failures or stats[0]["first_batch"]:  # the run's batches, not just the last generation's
            summary["iterations"] = stats[0]["first_batch"] + stats[0]["iterations"]
            summary["losses"] = run_losses(run_dir)
        measured = max(1, stats[0]["iterations"] - cpu_from[0])
        summary["cpu_seconds_per_iteration"] = {k: v / measured for k, v in cpu_used.items()}
        # (each kind's CPU since its processes started, as training ended: to measure a span of your own)
        summary["cpu_seconds_at_end"] = cpu_by_service({}, cpu_at_end)
        summary["report"] = str(run_dir / "report.html") if args.report else None
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if args.report:
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
    args: RunConfig,
    run_dir: Path,
    redis_server: RedisServer,
    job_name: str,
    checkpoints: Path,
    prometheus: PrometheusServer | None,
) -> LocalJob:
    """Spawns the controller and every service, each with the command line it keeps for the whole run:
    where to resume is the controller's business (each generation's start batch, in Redis)."""
    job = LocalJob(run_dir, args=args)
    job.checkpoints = checkpoints
    every = checkpoint_every(args)
    job.spec = configs.GenerationSpec(redis_server.url, job_name, every, checkpoints, run_dir)
    controller = configs.controller(args, job.spec, prometheus.url if prometheus is not None else None)
    job.spawn("controller", "bagpipe.controller", controller_argv(controller))
    for s in range(args.embedding_servers):
        spawn_embedding_server(job, s)
    for i in range(args.data_processors):
        job.spawn(
            f"data-processor-{i}",
            "bagpipe.data_processor",
            data_processor_config.argv(configs.data_processor(args, job.spec, i)),
        )
    for shard in range(args.oracles):  # (one oracle: "oracle-cacher"; shards: "oracle-cacher-I")
        cfg = configs.oracle(args, job.spec, shard)
        # a shard's index first, as a trainer's rank: "bagpipe.oracle_cacher --shard 1" finds its process
        first = ["--shard", str(shard)] if args.oracles > 1 else []
        job.spawn(
            oracle_process(shard, args.oracles),
            "bagpipe.oracle_cacher",
            first + oracle_config.argv(dataclasses.replace(cfg, shard=0)),
        )
    dist_init = rendezvous_url(run_dir)
    for r in range(args.trainers):
        job.spawn(
            f"trainer-{r}",
            "bagpipe.trainer",
            trainer_config.argv(configs.trainer(args, job.spec, r, dist_init)),
        )
    return job


def spawn_embedding_server(job: LocalJob, shard: int) -> Process:
    """Starts embedding server ``shard``: one of the job's first (they create the shard map for
    ``--embedding-servers`` of them), or one that joins a running job (``bagpipe scale``), empty until the
    coordinator moves its buckets to it. Either loads the newest complete checkpoint's rows of its buckets
    when started (again): one that holds no bucket yet, as a joining one, reads no checkpoint file
    (``embedding_server.__main__.build_store``). It serves once the controller's generation takes it in."""
    assert job.spec is not None
    netns = job.args.embedding_server_netns
    addresses = job.args.netns_addresses if netns else None
    cfg = configs.embedding_server(job.args, job.spec, shard, addresses)
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


def _say_inferred_schema(args: RunConfig, run_dir: Path) -> None:
    """Without ``--schema``, a csv:, tsv: or parquet: source's layout is inferred from its first file: said in
    one line, and written to RUN_DIR/schema.json, for a ``--schema`` of one's own to start from."""
    if args.schema or args.data.partition(":")[0] not in TABLE_KINDS:
        return
    layout = schema_of(args.data).with_table_rows(table_rows_of(args))
    written = run_dir / "schema.json"
    written.write_text(json.dumps(layout.to_dict(), indent=1))
    first = args.data.partition(":")[2].split(",")[0]
    print(
        f"schema inferred from {first}: {layout.describe()} (in {written}: edit it and give it as "
        "--schema to change it)",
        file=sys.stderr,
    )


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
    redis_silent = Silence(SOCKET_TIMEOUT_S)
    recorded = [args.embedding_servers]  # (the servers config.json names: the scaling target since)

    def spawn(shard: int) -> None:
        spawn_embedding_server(job, shard)

    def retire(shard: int) -> None:
        for p in [p for p in job.processes if p.name == f"embedding-server-{shard}"]:
            try:
                p.proc.wait(30)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
            job.processes.remove(p)
        registry.unregister_metrics("embedding_server", str(shard))

    cannot_scale = "--system ideal keeps the embeddings in shared memory" if args.system == "ideal" else None
    while True:
        try:
            keep_alive(job, redis_server, redis_silent, args.failure_timeout, args.max_restarts)
        except ComponentFailure as failure:
            if failure.exit_code == EXIT_DATA_ERROR:  # (its last line: "... bad data: FILE:LINE: field ...")
                last = tail(failure.log, 1) if failure.log else ""
                said = last.partition(": ")[2] or f"{failure.component} {failure.detail}"
                print(f"failure: {said}; giving up", file=sys.stderr)
                raise RuntimeError(f"{said} (read by {failure.component}; not retried)") from None
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
            _follow_scaling(job.run_dir, scaler.servers, recorded)
        except redis.RedisError as e:
            redis_silent.failed()
            logger.debug("redis: %s", e)
            time.sleep(0.1)
            continue
        redis_silent.answered()
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


def _follow_scaling(run_dir: Path, servers: int, recorded: list[int]) -> None:
    """Keeps config.json's ``embedding_servers`` (what ``--resume`` starts) at the scaling target;
    ``recorded``: the count written last."""
    if recorded[0] == servers:
        return
    recorded[0] = servers
    config = run_dir / "config.json"
    if config.is_file():
        saved = json.loads(config.read_text())
        saved["embedding_servers"] = servers
        config.write_text(json.dumps(saved, indent=1))
