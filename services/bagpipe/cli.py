"""The ``bagpipe`` command."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType

from bagpipe import flags, tls
from bagpipe.config_args import add_cache_args, positive_float, positive_int
from bagpipe.core.optim_config import OPTIMIZERS
from bagpipe.data_processor.config import add_source_args
from bagpipe.local.run_config import RunConfig
from bagpipe.local.validate import BadFlag


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bagpipe",
        description="Bagpipe: lookahead-cached recommendation model training",
        epilog="services (the container image's entry point; `bagpipe SERVICE --help` lists each one's "
        "flags): " + ", ".join(SERVICES),
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train one job with every service as a local process")
    flags.add_grouped(r, RunConfig, RunConfig.GROUPS)
    tls.add_tls_args(r)  # the run's processes inherit the files (every gRPC call then uses mutual TLS)

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
    g.add_argument(
        "--oracles",
        type=int,
        default=1,
        help="oracle shards: each plans its keys (the embedding servers' bucket map over K shards) with its "
        "part of --cache-rows, timed alone (default 1)",
    )
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

    e = sub.add_parser(
        "export",
        help="write a trained model (an interchange checkpoint) in another framework's format: the state "
        "dict of TorchRec's DLRM, and OUT.json, the sizes to build it with (docs/models.md)",
    )
    e.add_argument("--to", required=True, choices=["torchrec"], help="the format (torchrec: its DLRM)")
    e.add_argument("checkpoint", metavar="CHECKPOINT", help="an interchange checkpoint (--save-final)")
    e.add_argument("out", metavar="OUT", help="the state dict goes here, its build description to OUT.json")
    return p


def parse_run(argv: list[str]) -> RunConfig:
    """``bagpipe run ARGV``'s config. A flag that does not parse exits with the usage; a value a rule
    refuses exits with one line naming the flag (``bagpipe run: --batch-size: ...``)."""
    return run_config(build_parser().parse_args(["run", *argv]))


def run_config(args: argparse.Namespace) -> RunConfig:
    try:
        return flags.config_of(RunConfig, args)
    except flags.ConfigError as e:
        raise BadFlag(e.flag or e.field, e.why) from None


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
    if args.command == "run":  # (the Python API's run, with the flags as its RunConfig)
        from bagpipe.api import run
        from bagpipe.local.summary import format_summary

        config = run_config(args)
        try:
            summary = run(config)
        except flags.ConfigError as e:
            raise BadFlag(e.flag or e.field, e.why) from None
        except RuntimeError as e:
            print(f"bagpipe run failed: {e}", file=sys.stderr)
            raise SystemExit(1) from None
        except KeyboardInterrupt as e:  # (a shell's Ctrl-C, timeout, systemd, a container runtime)
            print(_stopped_line(e), file=sys.stderr)
            raise SystemExit(128 + (e.signum if isinstance(e, Stopped) else signal.SIGINT)) from None
        print(format_summary(summary.figures))
    elif args.command == "scale":
        scale(args)
    elif args.command == "plan-stats":
        from bagpipe.oracle_cacher.plan_stats import main as plan_stats_main

        if args.iterations < 1:
            raise SystemExit(f"--iterations: must be >= 1, got {args.iterations}")
        plan_stats_main(args)
    elif args.command == "export":
        from bagpipe.export import export

        try:
            print(export(args.checkpoint, args.out, args.to))
        except (OSError, ValueError) as e:
            print(f"bagpipe export: {e}", file=sys.stderr)
            raise SystemExit(1) from None


if __name__ == "__main__":
    main()
