"""``python -m bagpipe.trainer``: train until the oracle's last plan, then exit."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading

from bagpipe import allocator, serving
from bagpipe.core.snapshots import EXIT_CHECKPOINT_FAILED
from bagpipe.trainer.config import parse
from bagpipe.trainer.worker import CheckpointFailed, Trainer

logger = logging.getLogger("bagpipe.trainer")


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    serving.configure_logging(cfg.coordination.log_level)
    allocator.keep_freed_buffers()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints every thread's stack to the log
    trainer = Trainer(cfg)
    http = serving.start_metrics(
        cfg.coordination.metrics_address,
        "trainer",
        str(cfg.rank),
        trainer.registry,
        lambda: repr(trainer.pipeline.error) if trainer.pipeline.error is not None else None,
        cfg.coordination.advertise_host,
    )
    trainer.on_ready = http.ready.set
    # SIGTERM while training: stop, release everything and exit 0 (a stopped pod, or the launcher)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        stats = trainer.run()
        logger.info(
            "rank %d done: %d iterations, %.1f samples/s",
            cfg.rank,
            stats["iterations"],
            stats["samples_per_second"],
        )
    except BaseException as e:
        trainer.close()
        http.stop()
        if isinstance(e, CheckpointFailed):  # one line naming the directory; not to be retried
            logger.error("rank %d: %s", cfg.rank, e)
            print(f"trainer {cfg.rank}: {e}", file=sys.stderr)
            raise SystemExit(EXIT_CHECKPOINT_FAILED) from None
        lost = serving.redis_lost(e) if isinstance(e, Exception) else None
        if lost is not None:  # one line naming Redis, not a thread's traceback
            logger.error("rank %d: %s", cfg.rank, lost)
            raise SystemExit(f"trainer {cfg.rank}: {lost}") from None
        raise
    trainer.close()
    if not cfg.exit_when_done:
        # keep /metrics and /healthz up (Prometheus' last scrape, a StatefulSet that must not restart)
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        signal.signal(signal.SIGINT, lambda *_: done.set())
        logger.info("training done; serving metrics until stopped (SIGTERM)")
        while not done.wait(1.0):
            pass
    http.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
