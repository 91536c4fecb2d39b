"""The controller: failure detection and in-place recovery of one job, the same locally and in a cluster.

It owns the job's generations (control/generation.py). Each ``step`` reads the generation in force from
Redis and moves it on:

* none yet: the first generation, from the newest complete checkpoint (a job started again resumes);
* ``rolling_back`` -> ``forming`` once every embedding server that holds buckets and the oracle acked it
  with their current incarnation;
* ``forming`` -> ``training`` once every trainer acked it;
* ``training``: the job is done once every trainer stored its statistics (the serving tiers are then
  released); otherwise a member that was restarted (its incarnation is not the one that acked), or that the
  failure detector (control/detector.py: Prometheus's HTTP API, or the members' /metrics) declares gone
  or stuck, is a failure. A stuck or silent member is ended (``--kill``: SIGKILL by pid, or its pod
  deleted) so that its keeper starts it again, and the next generation begins from the newest complete
  checkpoint: the embedding servers and the oracle roll back in place, the trainers rejoin. A failure a
  member reports is one too (the oracle: a processor's broken stream, or its bad data; a trainer: a failure
  the same batches would meet again, trainer/faults.py); bad data and a trainer's such failure fail the job
  at once.

The kinds of failure the controller does not handle: two members failing in one generation are one
failure (the second is part of the same recovery); a lost checkpoint volume loses the job's checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

import redis
from prometheus_client import Counter, Gauge

from bagpipe.config_args import checkpoint_refusal
from bagpipe.control.detector import Detector, PrometheusSource, ScrapeSource
from bagpipe.control.generation import (
    DONE,
    FAILED,
    FORMING,
    ROLLING_BACK,
    TRAINING,
    Generation,
    current,
)
from bagpipe.control.locks import CHECKPOINT_LOCK_OWNER, RESHARD_LOCK
from bagpipe.control.registry import Registry
from bagpipe.controller.config import ControllerConfig, oracle_process
from bagpipe.core import snapshots
from bagpipe.core.shard_map import ShardMap
from bagpipe.errors import BAD_DATA, TRAINING_FAULT

logger = logging.getLogger(__name__)

GENERATION = Gauge("bagpipe_controller_generation", "The number of the job's generation in force")
FAILURES = Counter("bagpipe_controller_failures", "Failures the controller handled", ["kind"])
RECOVERY_SECONDS = Gauge(
    "bagpipe_controller_recovery_seconds", "From the last failure's detection to training again"
)


class Actuator(Protocol):
    def kill(self, member: str, where: dict[str, Any]) -> str: ...

    def release(self, targets: list[str]) -> list[str]: ...


class LocalActuator:
    """Ends a stuck process by pid (SIGKILL: a frozen one ignores SIGTERM) when it runs on this host; its
    keeper (``bagpipe run``) starts it again. Releases nothing: ``bagpipe run`` stops its services."""

    def kill(self, member: str, where: dict[str, Any]) -> str:
        if where.get("host") != socket.gethostname() or not where.get("pid"):
            return f"{member} runs on {where.get('host', 'an unknown host')}: not ended from here"
        try:
            os.kill(int(where["pid"]), signal.SIGKILL)
        except ProcessLookupError:
            return f"{member} (pid {where['pid']}) had already ended"
        return f"killed {member} (pid {where['pid']})"

    def release(self, targets: list[str]) -> list[str]:
        return []


class NoActuator(LocalActuator):
    def kill(self, member: str, where: dict[str, Any]) -> str:
        return f"{member} left as it is (--kill none)"


def process_name(member: str, oracles: int = 1) -> str:
    """``trainer/1`` (a member) -> ``trainer-1`` (the process ``bagpipe run`` calls so, and its log), in a
    job of ``oracles`` oracle shards."""
    service, index = member.split("/", 1)
    if service == "oracle_cacher":
        return oracle_process(int(index), oracles) if index.isdigit() else f"oracle-cacher-{index}"
    return f"{service.replace('_', '-')}-{index}"


class Controller:
    def __init__(
        self,
        config: ControllerConfig,
        registry: Registry,
        actuator: Actuator,
        source: ScrapeSource | PrometheusSource | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` dates the records (wall time); ``monotonic`` times the failure detector."""
        self.config = config
        self.registry = registry
        self.actuator = actuator
        self.source = source or (
            PrometheusSource(config.prometheus_url)
            if config.prometheus_url
            else ScrapeSource(registry.metrics_endpoints)
        )
        self._clock = clock
        self._monotonic = monotonic
        self.generation: Generation | None = None
        self.number = 0  # the last generation made (kept here too: Redis may lose it)
        self.since = clock()  # when the generation in force entered its state
        self.detector: Detector | None = None
        self.watched: set[str] = set()
        self.trained = False  # some generation trained a batch (a failure before is a setup error)
        self.recovering: int | None = None  # the failure record whose recovery is not timed yet
        self.released = False
        self.shard_map: ShardMap | None = None  # the last one seen in Redis
        self.records: list[dict[str, Any]] = []  # the failures handled so far (Redis may lose its list)

    # ---- what the job holds
    def _start_batch(self) -> int:
        directory = self.config.checkpoint_dir
        return (snapshots.latest(directory) or 0) if directory else 0

    def _first_start(self) -> int | str:
        """The first generation's start (``--start-batch``), or why it cannot be: a checkpoint that is not
        complete, or whose chain is broken, is refused with what is there."""
        if self.config.start_batch == "latest":
            return self._start_batch()
        start = int(self.config.start_batch)
        refused = checkpoint_refusal(f"--start-batch {start}", start, self.config.checkpoint_dir)
        return start if refused is None else refused

    def _serving(self) -> set[str] | None:
        """The members that must ack a generation: the embedding servers holding buckets, every oracle
        shard (None before the first server published the shard map: who holds buckets is not known yet)."""
        shard_map = self.registry.shard_map()
        if shard_map is None:
            return None
        self.shard_map = shard_map
        oracles = {f"oracle_cacher/{shard}" for shard in range(self.config.oracles)}
        return {f"embedding_server/{s}" for s in shard_map.owners} | oracles

    def _name(self, member: str) -> str:
        return process_name(member, self.config.oracles)

    def _trainers(self) -> set[str]:
        return {f"trainer/{r}" for r in range(self.config.trainers)}

    # ---- one look
    def step(self) -> None:
        generation = current(self.registry)
        now = self._clock()
        if generation is None:
            if self.generation is not None and self.generation.state not in (DONE, FAILED):
                self._restore_shard_map()
                self._failed("redis", "exited", "lost the job's state (restarted empty)")
            elif self.generation is None:
                first = self._first_start()
                if isinstance(first, str):  # (the job fails with why: every member sees it, none retries)
                    self.number += 1
                    failed = dataclasses.replace(Generation.new(self.number, 0, first), state=FAILED)
                    self.registry.begin_generation(failed.record())
                    logger.error("the job cannot start: %s", first)
                else:  # (--start-batch latest: read as the generation begins)
                    self._begin("the job starts", None if self.config.start_batch == "latest" else first)
            return
        if (
            self.generation is None
            or generation.id != self.generation.id
            or generation.state != (self.generation.state)
        ):
            if self.generation is None or generation.id != self.generation.id:
                logger.info("following generation %d (%s)", generation.number, generation.state)
            self.generation, self.since = generation, now
            self.number = max(self.number, generation.number)
            GENERATION.set(generation.number)
        if generation.state == DONE:
            self._release()
            return
        if generation.state == FAILED:
            return
        if generation.state in (ROLLING_BACK, FORMING):
            self._form(generation, now)
        else:
            self._train(generation)

    def _form(self, generation: Generation, now: float) -> None:
        need = self._serving() if generation.state == ROLLING_BACK else self._trainers()
        acks, incarnations = self.registry.acks(generation.id), self.registry.incarnations()
        if need is None:
            missing = ["embedding_server/0"]
        else:
            missing = sorted(m for m in need if not acks.get(m) or acks[m] != incarnations.get(m))
        if not missing:
            state = FORMING if generation.state == ROLLING_BACK else TRAINING
            self.registry.set_generation_state(generation.id, state)
            logger.info(
                "generation %d %s after %.1f s",
                generation.number,
                "rolled back; trainers join" if state == FORMING else "formed: training",
                now - self.since,
            )
            if state == TRAINING:
                self._watch_training()
            return
        if now - self.since > self.config.formation_timeout:
            self._failed(
                self._name(missing[0]),
                "gone",
                f"did not join generation {generation.number} within {self.config.formation_timeout:g} s "
                "(--formation-timeout)",
                member=missing[0],
            )

    def _watch_training(self) -> None:
        # (a new detector each generation, over the one source: Detector.close would close that)
        self.detector = Detector(self.source, self.config.failure_timeout, clock=self._monotonic)
        self.watched = set()

    def _train(self, generation: Generation) -> None:
        if self.detector is None:  # (a controller started again mid-generation)
            self._watch_training()
        assert self.detector is not None
        progress = self.registry.progress()
        if progress:
            self.trained = True
            if self.recovering is not None and len(progress) == self.config.trainers:
                self._timed_recovery()
        if all(self.registry.get_json(f"stats:{r}") is not None for r in range(self.config.trainers)):
            self.registry.set_generation_state(generation.id, DONE)
            logger.info("job done after generation %d", generation.number)
            return
        reports = self.registry.reports(generation.id)
        if reports:  # (a processor's stream broke, or its data is bad: the oracle says which; a trainer's
            # deterministic failure: that trainer)
            # (those that fail again first: retrying another member's failure would only meet them again)
            final = sorted(m for m, why in reports.items() if why.startswith((BAD_DATA, TRAINING_FAULT)))
            member = (final or sorted(reports))[0]
            reason = reports[member]
            if member.startswith("data_processor/"):
                # a Deployment's pod comes back under another name: the oracle must not wait for this one
                # (one still alive finds its registration gone and starts again, under its own name)
                self.registry.forget_member(member)
            if reason.startswith(BAD_DATA):
                self._failed(self._name(member), "data", reason, member=member, retry=False)
            elif reason.startswith(TRAINING_FAULT):
                self._failed(self._name(member), "training", reason, member=member, retry=False)
            else:
                self._failed(self._name(member), "failed", reason, member=member)
            return
        acks, incarnations = self.registry.acks(generation.id), self.registry.incarnations()
        # A member started again is a failure if it held some of the generation's state. Not so a data
        # processor (it holds none: the oracle reports it if a stream it read broke), nor an embedding
        # server holding no buckets (drained by a scale-down, then started again by a scale-up within one
        # generation: it joins empty, and rows move to it).
        holders = self._serving() or set()
        restarted = [
            m
            for m, i in acks.items()
            if incarnations.get(m) != i
            and not m.startswith("data_processor/")
            and (m in holders or not m.startswith("embedding_server/"))
        ]
        if restarted:
            member = sorted(restarted)[0]
            self._failed(
                self._name(member),
                "exited",
                "was restarted (a new process)",
                member=member,
            )
            return
        endpoints = {m: a for m, a in self.registry.metrics_endpoints().items() if m != "controller/0"}
        gone = self.watched - set(endpoints)
        if gone:  # (an embedding server drained by a scale-down unregisters)
            self.detector.retire(gone)
            self.watched -= gone
        joined = set(endpoints) - self.watched
        if joined:
            self.detector.expect(joined)
            self.watched |= joined
        found = self.detector.poll()
        if found:
            worst = found[0]
            what = "did not answer" if worst.kind == "gone" else "made no progress"
            detail = f"{what} for {worst.silent_seconds:.1f} s (--failure-timeout {self.detector.timeout:g})"
            where = self.registry.whereabouts(worst.member)
            if worst.member.startswith("data_processor/"):
                # a Deployment's pod comes back under another name: the oracle must not wait for this one
                self.registry.forget_member(worst.member)
            try:
                done = self.actuator.kill(worst.member, where)
            except Exception as e:  # (the API server refused: recovery goes on; the member may come back)
                done = f"could not be ended: {e}"
            logger.warning("%s %s: %s", worst.member, detail, done)
            self._failed(self._name(worst.member), worst.kind, detail, member=worst.member)

    # ---- acting
    def _begin(self, reason: str, start: int | None = None) -> Generation:
        """Begins the next generation from ``start``, or from the newest complete checkpoint: read while
        the generation in force is watched, so that its rank 0, which prunes only while its generation is
        in force (``Registry.checkpoint_sealed``), can never prune the one read (a newer one completed
        meanwhile makes the controller read again)."""
        self.number += 1

        def record() -> dict[str, str]:
            return Generation.new(
                self.number, self._start_batch() if start is None else start, reason
            ).record()

        generation = Generation.of(self.registry.begin_generation(record))
        assert generation is not None
        # a trainer of the last generation may have died holding the checkpoint's re-sharding lock: no
        # trainer holds it now, and a migration must not wait out its ttl
        if self.registry.break_lock(RESHARD_LOCK, CHECKPOINT_LOCK_OWNER):
            logger.info("released the re-sharding lock a trainer of the last generation held")
        self.generation, self.since = generation, self._clock()
        GENERATION.set(generation.number)
        self.detector = None
        logger.info("generation %d from batch %d: %s", generation.number, generation.start_batch, reason)
        return generation

    def _failed(
        self, component: str, kind: str, detail: str, member: str | None = None, retry: bool = True
    ) -> None:
        """Records a failure and begins the next generation, or fails the job: a failure before any batch
        was trained (a setup error), bad data or a trainer's deterministic failure (``retry=False``: the
        same line or batches would fail again), or one restart too many."""
        assert self.generation is not None
        failed = self.generation
        FAILURES.labels(kind).inc()
        progress = {} if component == "redis" else self.registry.progress()
        record: dict[str, Any] = {
            "generation": failed.number,
            "component": component,
            "member": member or component,
            "kind": kind,
            "detail": detail,
            "detected_at": time.time(),
            "start_batch": failed.start_batch,
            "last_batch": max(progress.values()) if progress else failed.start_batch - 1,
            "generation_seconds": self._clock() - self.since,
        }
        earlier = len(self._failures())
        self.records.append(record)
        index = self.registry.add_failure(record)
        # (Redis lost is never a setup error: the progress that would show it went with it)
        never_trained = component != "redis" and not self.trained and not progress
        if not retry or never_trained or earlier + 1 > self.config.max_restarts:
            why = (
                "before training began (a setup error is not retried)"
                if never_trained
                else f"after {self.config.max_restarts} restarts (--max-restarts)"
            )
            reason = f"{component} failed {why}: {component} {detail}"
            if detail.startswith(BAD_DATA):  # (the line to fix, first; not retried: it fails again)
                reason = f"{detail} (read by {component}; fix the input, or skip such rows: --skip-bad-rows)"
            elif detail.startswith(TRAINING_FAULT):  # (the cause and what to change, first)
                reason = f"{detail} (met by {component}; not retried: a restart would meet it again)"
            logger.error("%s", reason)
            if not self.registry.set_generation_state(failed.id, FAILED, reason):
                # (its record is gone with Redis: the job's end must still be written for all to read)
                ended = Generation(failed.id, failed.number, failed.start_batch, FAILED, reason)
                self.registry.begin_generation(ended.record())
            return
        logger.warning("%s %s: recovering", component, detail)
        generation = self._begin(f"{component} {detail}")
        record["resumed_at_batch"] = generation.start_batch
        self.registry.update_failure(index, record)
        self.recovering = index

    def _failures(self) -> list[dict[str, Any]]:
        """The failures handled so far, in Redis again where it lost them (a Redis started again, empty)
        or taken from it (a controller started again)."""
        records = self.registry.failures()
        if len(records) > len(self.records):
            self.records = records
        for record in self.records[len(records) :]:
            self.registry.add_failure(record)
        return self.records

    def _restore_shard_map(self) -> None:
        """Puts the last shard map seen back into a Redis that lost it. A server started again publishes the
        map of its ``--initial-shards``, which after a scale-down names shards that no longer run (the next
        generation would wait for their acks), and after a scale-up leaves the new servers out; the
        generation that follows takes every server back to the checkpoint under the map restored."""
        if self.shard_map is None:
            return
        self.registry.restore_shard_map(self.shard_map)
        logger.info(
            "restored shard map version %d (shards %s) into Redis",
            self.shard_map.version,
            self.shard_map.owners,
        )

    def _timed_recovery(self) -> None:
        assert self.recovering is not None
        records = self._failures()
        if self.recovering < len(records):
            record = records[self.recovering]
            record["recovered_seconds"] = time.time() - record["detected_at"]
            RECOVERY_SECONDS.set(record["recovered_seconds"])
            self.registry.update_failure(self.recovering, record)
            logger.info(
                "training again %.1f s after %s was found failed",
                record["recovered_seconds"],
                record["component"],
            )
        self.recovering = None

    def _release(self) -> None:
        if self.released:
            return
        self.released = True
        try:
            for said in self.actuator.release(list(self.config.release)):
                logger.info("%s", said)
        except Exception as e:  # (not retried: the workloads stay up until helm uninstall)
            logger.error("the serving tiers could not be released: %s", e)

    def run(self, stopped: Callable[[], bool], interval: float = 0.2) -> None:
        while not stopped():
            try:
                self.step()
            except redis.RedisError as e:  # (Redis restarting: the next look finds what it lost)
                logger.warning("Redis: %s", e)
            time.sleep(interval)

    def close(self) -> None:
        self.source.close()
