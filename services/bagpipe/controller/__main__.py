"""``python -m bagpipe.controller``: detect failed members of a job and recover it in place, until stopped."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from bagpipe import serving
from bagpipe.control.registry import Registry
from bagpipe.controller.config import ControllerConfig, parse
from bagpipe.controller.controller import Actuator, Controller, LocalActuator, NoActuator

logger = logging.getLogger("bagpipe.controller")


def actuator_of(cfg: ControllerConfig) -> Actuator:
    if cfg.kill == "kubernetes":
        from bagpipe.controller.kubernetes import KubernetesActuator  # (the client loads only here)

        return KubernetesActuator(cfg.namespace)
    return LocalActuator() if cfg.kill == "local" else NoActuator()


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    serving.configure_logging(cfg.coordination.log_level)
    # (a Redis that cannot be reached, even at start: one line naming it, and the restart policy retries)
    serving.run_service(lambda: _run(cfg), "bagpipe.controller")


def _run(cfg: ControllerConfig) -> None:
    registry = Registry(cfg.coordination.redis_url, cfg.coordination.job)
    http = serving.start_metrics(
        cfg.coordination.metrics_address, "controller", "0", registry, None, cfg.coordination.advertise_host
    )
    controller = Controller(cfg, registry, actuator_of(cfg))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    http.ready.set()
    logger.info(
        "controller of job %s: %d trainers, %s, failure timeout %g s",
        cfg.coordination.job,
        cfg.trainers,
        f"prometheus at {cfg.prometheus_url}" if cfg.prometheus_url else "scraping the members' /metrics",
        cfg.failure_timeout,
    )
    try:
        controller.run(stop.is_set)
    finally:
        controller.close()
        http.stop()
        registry.close()


if __name__ == "__main__":
    main(sys.argv[1:])
