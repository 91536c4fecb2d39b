"""``python -m bagpipe.trainer``: train until the oracle's last plan, then exit once the controller says
the job is done."""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import threading

import redis

from bagpipe import allocator, security, serving
from bagpipe.control.generation import (
    DONE,
    EXIT_RESTART,
    POLL_S,
    Generation,
    Membership,
    Restart,
    Watch,
    current,
    join,
)
from bagpipe.control.registry import Registry
from bagpipe.core import snapshots
from bagpipe.core.snapshots import EXIT_CHECKPOINT_FAILED
from bagpipe.trainer import faults, metrics
from bagpipe.trainer.checkpointing import CheckpointFailed
from bagpipe.trainer.config import TrainerConfig, parse
from bagpipe.trainer.worker import Trainer

logger = logging.getLogger("bagpipe.trainer")


# how long a trainer whose training failed waits for the controller's next generation before it exits
# with the error: a peer's failure (a killed trainer, a server gone) reaches every trainer as an error of its
# own, and the controller must see the restart of the one that failed first, not theirs
FOLLOW_PEERS_S = 30.0


def generation_url(dist_init: str, generation: str) -> str:
    """A file store is never reused: each generation meets in a file of its own."""
    return f"{dist_init}-{generation}" if dist_init.startswith("file://") else dist_init


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    serving.configure_logging(cfg.coordination.log_level)
    # (a Redis that cannot be reached, even at start: one line naming it, and the restart policy retries)
    serving.run_service(lambda: _run(cfg), "bagpipe.trainer")


def _run(cfg: TrainerConfig) -> None:
    allocator.keep_freed_buffers()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints every thread's stack to the log
    registry = Registry(cfg.coordination.redis_url, cfg.coordination.job)
    membership = Membership(registry, "trainer", str(cfg.rank))
    membership.announce()
    trainer: Trainer | None = None
    http = serving.start_metrics(
        cfg.coordination.metrics_address,
        "trainer",
        str(cfg.rank),
        registry,
        lambda: repr(trainer.pipeline.error) if trainer and trainer.pipeline.error is not None else None,
        cfg.coordination.advertise_host,
    )
    # SIGTERM while training: stop, release everything and exit 0 (a stopped pod, or the launcher)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with metrics.heartbeat_while("waiting for a generation"):
            generation = join(membership, cfg.rank)
    except Restart as e:  # (Redis lost this member's registration: it comes back as a new process)
        logger.warning("rank %d: %s: starting again", cfg.rank, e.why)
        http.stop()
        raise SystemExit(EXIT_RESTART) from None
    logger.info(
        "rank %d joins generation %d from batch %d", cfg.rank, generation.number, generation.start_batch
    )
    security.set_generation(generation.id)  # (the servers refuse this process's calls once it is over)
    cfg = dataclasses.replace(
        cfg,
        resume_batch=generation.start_batch,
        dist_init=generation_url(cfg.dist_init, generation.id),
    )
    if cfg.rank == 0 and cfg.checkpoint_dir:  # (what a failed generation began after its start goes)
        snapshots.discard_after(cfg.checkpoint_dir, generation.start_batch)
    ended = threading.Event()

    def make_way(why: str) -> None:
        logger.warning("rank %d: %s: starting again to join the next one", cfg.rank, why)
        ended.set()
        os._exit(EXIT_RESTART)  # (at once: this process may be blocked in a collective with a dead peer)

    watch = Watch(membership, generation, make_way)
    watch.start()
    # (local work, with no deadline of its own: a large model takes a while, a hang is still found)
    with metrics.heartbeat_while("building the model", at_most=cfg.collective_timeout):
        trainer = Trainer(cfg, generation.id)
    if trainer.stats.tensorboard is not None:
        trainer.stats.tensorboard.generation(generation.number, generation.start_batch)
    trainer.on_ready = http.ready.set
    try:
        stats = trainer.run()
        logger.info(
            "rank %d done: %d iterations, %.1f samples/s",
            cfg.rank,
            stats["iterations"],
            stats["samples_per_second"],
        )
    except BaseException as e:
        fault = faults.deterministic(e, cfg) if isinstance(e, Exception) else None
        if fault is not None:  # (the same batches would meet it again: the controller fails the job at once)
            logger.error("rank %d: %s; reported to the controller", cfg.rank, fault)
            faults.report(registry, generation, cfg.rank, fault)
        elif isinstance(e, Exception) and not isinstance(e, CheckpointFailed):
            logger.warning("rank %d: training failed (%s); waiting for the controller", cfg.rank, e)
        if isinstance(e, Exception) and not isinstance(e, CheckpointFailed):
            ended.wait(FOLLOW_PEERS_S)  # (make_way ends the process if a new generation comes)
        watch.stop()
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
    trainer.close()  # (the watch goes on: a failure elsewhere before the job's end makes it train again)
    # The job ends when the controller says so (every trainer stored its statistics). Until then a failure
    # elsewhere may still start a new generation, which this process must join (the watch makes way, exit
    # 75); once it is done the process exits 0, so that a Job's pod completes and frees its CPUs or GPUs.
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    logger.info("rank %d: training done; waiting for the job's end", cfg.rank)
    with metrics.heartbeat_while("waiting for the job's end"):
        while not stopped.wait(POLL_S) and not _job_done(registry, generation):
            pass
    watch.stop()
    if cfg.serve_after_done and not stopped.is_set():
        logger.info("rank %d: the job is done; serving metrics until stopped (SIGTERM)", cfg.rank)
        while not stopped.wait(1.0):  # (a timed wait: the signal handler runs between two)
            pass
    http.stop()


def _job_done(registry: Registry, generation: Generation) -> bool:
    try:
        now = current(registry)
    except redis.RedisError:  # (Redis restarting: the watch makes way if it comes back empty)
        return False
    return now is not None and now.id == generation.id and now.state == DONE


if __name__ == "__main__":
    main(sys.argv[1:])
