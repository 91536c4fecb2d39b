"""The ``bagpipe`` command."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType

from bagpipe import tls
from bagpipe.config_args import (
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_TRANSFER_BATCHES,
    add_cache_args,
    add_checkpoint_chain_args,
    add_eval_args,
    add_model_args,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from bagpipe.control.detector import DEFAULT_TIMEOUT_S
from bagpipe.core.optim_config import OPTIMIZERS
from bagpipe.cpu_priority import PRIORITIES
from bagpipe.data_processor.config import add_source_args

# rows per second each embedding server sends while re-sharding a local run: there the services share the
# trainers' cores; at the quick profile's size this keeps iterations during a migration as fast as the
# others (bench/resharding.py), where no limit makes them about 1.6x slower on 2 cores
DEFAULT_MIGRATION_RATE = 50_000.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bagpipe",
        description="Bagpipe: lookahead-cached recommendation model training",
        epilog="services (the container image's entry point; `bagpipe SERVICE --help` lists each one's "
        "flags): " + ", ".join(SERVICES),
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train one job with every service as a local process")
    add_source_args(r)
    add_model_args(r, dense=True)
    add_eval_args(r)
    g = r.add_argument_group("job")
    g.add_argument("--batch-size", type=int, default=2048, help="global batch size (default 2048)")
    g.add_argument(
        "--iterations", type=int, default=300, help="global batches to train (0: the whole data; default 300)"
    )
    g.add_argument("--trainers", type=int, default=2, help="number of trainers (default 2)")
    g.add_argument("--embedding-servers", type=int, default=2, help="number of embedding servers (default 2)")
    g.add_argument("--data-processors", type=int, default=1, help="number of data processors (default 1)")
    g.add_argument("--device", default="auto", help="trainer device: auto, cpu or cuda (default auto)")
    g.add_argument(
        "--transfer-batches",
        type=positive_int,
        default=DEFAULT_TRANSFER_BATCHES,
        help="trainers fetch and write back up to this many batches' rows in one call per shard "
        f"(default {DEFAULT_TRANSFER_BATCHES})",
    )
    g.add_argument("--save-initial", default=None, help="write the initial interchange checkpoint here")
    g.add_argument("--save-final", default=None, help="write the final interchange checkpoint here")
    g.add_argument("--run-dir", default=None, help="where logs and the summary go (default runs/<time>)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument(
        "--no-report",
        action="store_true",
        help="no report.html and plots at the end (scripted runs: the tests, the benchmarks); the summary, "
        "metrics and checkpoints are written as always",
    )
    g.add_argument("--log-level", default="INFO", help="services' logging level (default INFO)")
    add_cache_args(r)
    g = r.add_argument_group("failures and recovery")
    g.add_argument(
        "--checkpoint-every",
        type=non_negative_int,
        default=DEFAULT_CHECKPOINT_EVERY,
        help="a consistent, incremental checkpoint after every this many batches, from which the job "
        f"recovers exactly (default {DEFAULT_CHECKPOINT_EVERY}; 0: none)",
    )
    g.add_argument(
        "--checkpoint-dir", default=None, help="where checkpoints go (default RUN_DIR/checkpoints)"
    )
    g.add_argument(
        "--failure-timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        help="a service that does not answer its /metrics, or a trainer that makes no progress, for "
        f"this many seconds has failed (default {DEFAULT_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=3,
        help="recoveries from failures before the run gives up (default 3)",
    )
    add_checkpoint_chain_args(r)
    g.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="go on with a stopped or crashed run from its last checkpoint, with its own flags",
    )
    tls.add_tls_args(r)  # the run's processes inherit the files (every gRPC call then uses mutual TLS)
    g = r.add_argument_group("scaling")
    g.add_argument(
        "--migration-rows-per-second",
        type=non_negative_float,
        default=DEFAULT_MIGRATION_RATE,
        help="re-sharding (bagpipe scale) sends at most this many rows per second from each embedding "
        f"server, so that training keeps its share of the cores and the network (default "
        f"{DEFAULT_MIGRATION_RATE:g}; 0: no limit)",
    )
    g.add_argument(
        "--lookup-threads",
        type=non_negative_int,
        default=0,
        help="threads per embedding server that work on rows off its event loop: lookups' rows copied "
        "into their replies, several at once, and write-backs stored, one at a time (default 0: on the "
        "event loop, best where the servers have no cores to spare, as on one machine)",
    )
    g.add_argument(
        "--embedding-server-priority",
        choices=["auto", *PRIORITIES],
        default="auto",
        help="CPU priority of the embedding servers, which share this machine's cores with the trainers: "
        "idle runs them only on cores the trainers leave idle (Linux SCHED_IDLE), where a prefetching "
        "trainer, which needs their answers batches later, loses nothing to them; normal, as every other "
        "process; auto (default): idle, but normal with --system no-cache, whose trainers wait for every "
        "fetch",
    )
    g = r.add_argument_group("benchmarking")
    g.add_argument(
        "--system",
        choices=["bagpipe", "no-cache", "ideal"],
        default="bagpipe",
        help="bagpipe (default); no-cache: L=1, every row fetched before and written back after each step "
        "on the critical path; ideal: embeddings in shared memory beside the trainers, no network transfers",
    )
    g.add_argument(
        "--embedding-server-netns",
        default=None,
        metavar="NAME",
        help="run the embedding servers in this network namespace (the benchmark's limited link)",
    )
    g.add_argument(
        "--netns-addresses",
        default="10.231.0.1,10.231.0.2",
        metavar="HOST_IP,NETNS_IP",
        help="the link's address on this side and inside the namespace (default 10.231.0.1,10.231.0.2)",
    )
    g = r.add_argument_group("monitoring")
    g.add_argument(
        "--prometheus",
        action="store_true",
        help="also start a real Prometheus server scraping every service (binary: make tools)",
    )
    g.add_argument("--prometheus-port", type=int, default=0, help="its port (default: any free port)")
    g.add_argument(
        "--prometheus-linger",
        type=float,
        default=0.0,
        help="seconds Prometheus stays up after training, for queries (default 0)",
    )

    c = sub.add_parser(
        "scale",
        help="change the number of embedding servers of a running `bagpipe run`: rows and optimizer "
        "state move "
        "to the new servers, or off the removed ones, while training goes on",
    )
    c.add_argument("tier", choices=["embedding-servers"], help="what to scale")
    c.add_argument("count", type=positive_int, help="the number of embedding servers wanted")
    c.add_argument("--run", required=True, metavar="RUN_DIR", help="the run directory of the running job")
    c.add_argument(
        "--timeout", type=positive_float, default=600.0, help="seconds to wait for it (default 600)"
    )
    c.add_argument("--no-wait", action="store_true", help="return once the request is made")

    s = sub.add_parser(
        "plan-stats",
        help="plan a data source for T logical trainers (no trainers run) and report rows and bytes per "
        "iteration for a replicated cache, LRPP and LRPP with delayed synchronisation",
    )
    add_source_args(s)
    g = s.add_argument_group("plan")
    g.add_argument("--batch-size", type=int, default=16384, help="global batch size (default 16384)")
    g.add_argument("--trainers", type=int, default=8, help="logical trainers (default 8)")
    g.add_argument("--iterations", type=int, default=60, help="batches measured (default 60)")
    g.add_argument(
        "--embedding-dim", type=int, default=16, help="embedding dimension, for bytes (default 16)"
    )
    g.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS, help="for the bytes of a row's state")
    g.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g.add_argument("--output", default=None, help="also write the JSON here")
    add_cache_args(s)
    s.set_defaults(lookahead=200, scale=1.0)  # the Kaggle cardinalities, as in paper §3.3
    return p


class Stopped(KeyboardInterrupt):
    """``bagpipe run`` was told to stop (SIGTERM or SIGINT): it unwinds like Ctrl-C, so the launcher stops
    the processes it started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate(signum: int, frame: FrameType | None) -> None:
    # (once: a second signal must not break off the stopping of the services)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Stopped(signum)


def _stopped_line(e: KeyboardInterrupt) -> str:
    """What a stopped run says: how it stopped, what it kept, how to go on."""
    from pathlib import Path

    from bagpipe.core import snapshots

    name = signal.Signals(e.signum).name if isinstance(e, Stopped) else "SIGINT"
    run_dir = getattr(e, "run_dir", None)
    if run_dir is None:
        return f"bagpipe run stopped by {name} before it started"
    checkpoints = getattr(e, "checkpoints", None) or Path(run_dir) / "checkpoints"
    latest = snapshots.latest(checkpoints)
    kept = f"checkpoints kept in {checkpoints} (latest: batch {latest})" if latest else "no checkpoint yet"
    return (
        f"bagpipe run stopped by {name}: every service stopped; {kept}; go on with: "
        f"bagpipe run --resume {run_dir}"
    )


def scale(args: argparse.Namespace) -> None:
    from pathlib import Path

    from bagpipe.local.scaling import request_scale, wait_scaled

    run_dir = Path(args.run)
    try:
        request_id = request_scale(run_dir, args.count)
        if args.no_wait:
            print(f"requested {args.count} embedding servers (request {request_id})")
            return
        status = wait_scaled(run_dir, request_id, args.timeout)
    except (FileNotFoundError, TimeoutError, RuntimeError, ValueError) as e:
        print(f"bagpipe scale: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if status["state"] != "done":
        print(f"bagpipe scale: {status['state']}: {status.get('error', '')}", file=sys.stderr)
        raise SystemExit(1)
    print(
        f"{status['embedding_servers']} embedding servers, shard map version "
        f"{status.get('shard_map_version', '?')}"
        f" ({status.get('seconds', 0.0):.1f} s)" + (f"; {status['note']}" if status.get("note") else "")
    )
    for r in status.get("reshards", []):
        print(
            f"  version {r['from_version']} -> {r['to_version']}: shards {r['from_shards']} -> "
            f"{r['to_shards']}, "
            f"{r['buckets_moved']} buckets, {r.get('rows_moved', 0):,} rows, "
            f"{r.get('bytes_moved', 0) / 2**20:.1f} MiB "
            f"in {r.get('seconds', 0.0):.2f} s (switch {1000 * r.get('switch_seconds', 0.0):.1f} ms)"
        )


# `bagpipe <service> [flags]`: the container image's one entry point (the chart picks the service); each
# takes the flags its `python -m` module takes
SERVICES = {
    "data-processor": "bagpipe.data_processor.__main__",
    "oracle-cacher": "bagpipe.oracle_cacher.__main__",
    "embedding-server": "bagpipe.embedding_server.__main__",
    "trainer": "bagpipe.trainer.__main__",
    "drain": "bagpipe.embedding_server.drain",
    "probe": "bagpipe.probe",
    "check-model": "bagpipe.check_model",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:
        import importlib

        code = importlib.import_module(SERVICES[argv[0]]).main(argv[1:])
        raise SystemExit(code or 0)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    if args.command == "run":
        from bagpipe.local.launcher import run
        from bagpipe.local.summary import format_summary

        try:
            summary = run(args)
        except RuntimeError as e:
            print(f"bagpipe run failed: {e}", file=sys.stderr)
            raise SystemExit(1) from None
        except KeyboardInterrupt as e:  # (a shell's Ctrl-C, timeout, systemd, a container runtime)
            print(_stopped_line(e), file=sys.stderr)
            raise SystemExit(128 + (e.signum if isinstance(e, Stopped) else signal.SIGINT)) from None
        print(format_summary(summary))
    elif args.command == "scale":
        scale(args)
    elif args.command == "plan-stats":
        from bagpipe.oracle_cacher.plan_stats import main as plan_stats_main

        if args.iterations < 1:
            raise SystemExit(f"--iterations: must be >= 1, got {args.iterations}")
        plan_stats_main(args)


if __name__ == "__main__":
    main()
