"""Command-line configuration of the controller."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bagpipe.config_args import (
    Coordination,
    add_coordination_args,
    coordination_of,
    non_negative_int,
    parse_config,
    positive_float,
    positive_int,
)
from bagpipe.control.detector import DEFAULT_TIMEOUT_S

KILLERS = ("local", "kubernetes", "none")
RELEASE_KINDS = ("statefulset", "deployment")


@dataclass(frozen=True)
class ControllerConfig:
    """What the controller watches and how it acts."""

    trainers: int
    data_processors: int
    coordination: Coordination = Coordination()
    checkpoint_dir: str | None = None
    prometheus_url: str | None = None
    failure_timeout: float = DEFAULT_TIMEOUT_S
    max_restarts: int = 3
    kill: str = "local"
    namespace: str | None = None
    release: tuple[str, ...] = ()
    formation_timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.kill not in KILLERS:
            raise ValueError(f"kill: expected one of {', '.join(KILLERS)}, got {self.kill!r}")
        for target in self.release:
            kind, _, name = target.partition("/")
            if kind not in RELEASE_KINDS or not name:
                raise ValueError(f"release: expected statefulset/NAME or deployment/NAME, got {target!r}")
        if self.release and self.kill != "kubernetes":
            raise ValueError("release: scales workloads through the Kubernetes API (needs --kill kubernetes)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bagpipe.controller",
        description="Detects failed members of a Bagpipe job from their metrics and recovers the job in "
        "place, through Redis.",
    )
    add_coordination_args(p)
    p.add_argument("--trainers", type=positive_int, required=True, help="the job's trainers")
    p.add_argument("--data-processors", type=positive_int, required=True, help="the job's data processors")
    p.add_argument(
        "--checkpoint-dir", default=None, help="the recovery checkpoints (a generation starts at the newest)"
    )
    p.add_argument(
        "--prometheus-url",
        default=None,
        help="read liveness and progress from this Prometheus's HTTP API (default: scrape every member's "
        "/metrics)",
    )
    p.add_argument(
        "--failure-timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a member may not answer, or a trainer not progress, before it is failed (default "
        f"{DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--max-restarts", type=non_negative_int, default=3, help="recoveries before giving up (default 3)"
    )
    p.add_argument(
        "--kill",
        choices=KILLERS,
        default="local",
        help="how a stuck member is ended so that it is restarted: SIGKILL by pid on this host (local), "
        "deleting its pod (kubernetes), or not at all (default local)",
    )
    p.add_argument("--namespace", default=None, help="(kubernetes) default: the pod's own namespace")
    p.add_argument(
        "--release",
        action="append",
        default=[],
        metavar="KIND/NAME",
        help="a workload scaled to zero once the job finished (statefulset/NAME or deployment/NAME; "
        "repeatable; needs --kill kubernetes)",
    )
    p.add_argument(
        "--formation-timeout",
        type=positive_float,
        default=300.0,
        help="seconds a generation may take to roll back and form before the job fails (default 300)",
    )
    return p


def _config(a: argparse.Namespace) -> ControllerConfig:
    return ControllerConfig(
        trainers=a.trainers,
        data_processors=a.data_processors,
        coordination=coordination_of(a),
        checkpoint_dir=a.checkpoint_dir,
        prometheus_url=a.prometheus_url,
        failure_timeout=a.failure_timeout,
        max_restarts=a.max_restarts,
        kill=a.kill,
        namespace=a.namespace,
        release=tuple(a.release),
        formation_timeout=a.formation_timeout,
    )


def parse(argv: list[str] | None = None) -> ControllerConfig:
    return parse_config(build_parser(), argv, _config)


def argv(c: ControllerConfig) -> list[str]:
    out = [*c.coordination.argv(), "--trainers", str(c.trainers), "--data-processors", str(c.data_processors)]
    if c.checkpoint_dir:
        out += ["--checkpoint-dir", c.checkpoint_dir]
    if c.prometheus_url:
        out += ["--prometheus-url", c.prometheus_url]
    out += ["--failure-timeout", f"{c.failure_timeout:g}", "--max-restarts", str(c.max_restarts)]
    out += ["--kill", c.kill, "--formation-timeout", f"{c.formation_timeout:g}"]
    if c.namespace:
        out += ["--namespace", c.namespace]
    for target in c.release:
        out += ["--release", target]
    return out
