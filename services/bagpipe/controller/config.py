"""The controller's configuration: each field its flag (``bagpipe.flags``)."""

from __future__ import annotations

from dataclasses import dataclass

from bagpipe.config_args import (
    Coordination,
    batch_or_latest,
    command_line,
    non_negative_int,
    oracles_field,
    positive_float,
    positive_int,
)
from bagpipe.control.detector import DEFAULT_TIMEOUT_S
from bagpipe.flags import flag


def oracle_process(shard: int, oracles: int) -> str:
    """The oracle's process (and log) name: ``oracle-cacher`` for a job's one oracle, ``oracle-cacher-I``
    for shard I of several."""
    return "oracle-cacher" if oracles == 1 else f"oracle-cacher-{shard}"


KILLERS = ("local", "kubernetes", "none")
RELEASE_KINDS = ("statefulset", "deployment")


@dataclass(frozen=True)
class ControllerConfig:
    """What the controller watches and how it acts."""

    trainers: int = flag("the job's trainers", parse=positive_int)
    oracles: int = oracles_field()
    coordination: Coordination = Coordination()
    checkpoint_dir: str | None = flag(
        "the recovery checkpoints (a generation starts at the newest)", default=None
    )
    start_batch: int | str = flag(
        "where the job's first generation begins: a complete checkpoint of --checkpoint-dir (with its chain "
        "there), 0 for the start, or latest, the newest complete one (the start when there is none). Read "
        "only while the job has no generation yet; every recovery begins at the newest",
        default="latest",
        parse=batch_or_latest,
        metavar="BATCH|latest",
    )
    prometheus_url: str | None = flag(
        "read liveness and progress from this Prometheus's HTTP API (default: scrape every member's "
        "/metrics)",
        default=None,
    )
    failure_timeout: float = flag(
        "seconds a member may not answer, or a trainer not progress, before it is failed",
        default=DEFAULT_TIMEOUT_S,
        parse=positive_float,
        show=lambda v: f"{v:g}",
    )
    max_restarts: int = flag("recoveries before giving up", default=3, parse=non_negative_int)
    kill: str = flag(
        "how a stuck member is ended so that it is restarted: SIGKILL by pid on this host (local), deleting "
        "its pod (kubernetes), or not at all",
        default="local",
        choices=KILLERS,
    )
    namespace: str | None = flag("(kubernetes) default: the pod's own namespace", default=None)
    release: tuple[str, ...] = flag(
        "a workload scaled to zero once the job finished (statefulset/NAME or deployment/NAME; repeatable; "
        "needs --kill kubernetes)",
        default=(),
        metavar="KIND/NAME",
    )
    formation_timeout: float = flag(
        "seconds a generation may take to roll back and form before the job fails",
        default=300.0,
        parse=positive_float,
        show=lambda v: f"{v:g}",
    )

    def __post_init__(self) -> None:
        if self.kill not in KILLERS:
            raise ValueError(f"kill: expected one of {', '.join(KILLERS)}, got {self.kill!r}")
        for target in self.release:
            kind, _, name = target.partition("/")
            if kind not in RELEASE_KINDS or not name:
                raise ValueError(f"release: expected statefulset/NAME or deployment/NAME, got {target!r}")
        if self.release and self.kill != "kubernetes":
            raise ValueError("release: scales workloads through the Kubernetes API (needs --kill kubernetes)")


# the controller's command line: ``python -m`` parses it, ``bagpipe run`` and the chart write it
build_parser, parse, argv = command_line(ControllerConfig, "python -m bagpipe.controller")
