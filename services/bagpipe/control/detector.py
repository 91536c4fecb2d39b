"""Failure detection from the services' Prometheus metrics.

Every service answers ``/metrics`` with ``bagpipe_<service>_alive_timestamp_seconds`` (the time of the
scrape: a frozen or dead process cannot answer), and trainers report progress with
``bagpipe_trainer_heartbeat_timestamp_seconds`` (the end of their last iteration or checkpoint) and
``bagpipe_trainer_finished``. The detector reads them from a Prometheus server's HTTP API when one is
configured (``up`` and the same series), otherwise by scraping every member's ``/metrics`` itself, and
declares a member failed when it is

* **gone**: it has not answered for ``timeout`` seconds (killed, frozen, partitioned), or
* **stuck**: a trainer that has started training made no progress for ``timeout`` seconds while every
  member answers (a hang inside a live process; while some member does not answer, it is the one blamed,
  since training is synchronous and everyone else waits for it).

The chart's PrometheusRule alerts use the same series and threshold (``deploy/helm``).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
PROGRESS = "bagpipe_trainer_heartbeat_timestamp_seconds"
FINISHED = "bagpipe_trainer_finished"


@dataclass(frozen=True)
class Observation:
    """One look at a member: did it answer, its progress mark (trainers), has it finished."""

    reachable: bool
    progress: float | None = None
    finished: bool = False


@dataclass(frozen=True)
class Failure:
    member: str  # "<service>/<member>", e.g. "trainer/1"
    kind: str  # "gone" or "stuck"
    silent_seconds: float  # since it last answered (gone) or progressed (stuck)

    def __str__(self) -> str:
        what = "has not answered" if self.kind == "gone" else "has made no progress"
        return f"{self.member} {what} for {self.silent_seconds:.1f} s"


# the two series the detector reads: a service renders only these (``metrics_http``), not every series it has
_ONLY = urllib.parse.urlencode([("name[]", PROGRESS), ("name[]", FINISHED)])


class ScrapeSource:
    """Scrapes every member's ``/metrics`` itself (no Prometheus server), in parallel, with a timeout:
    only the series it reads."""

    def __init__(self, endpoints: Callable[[], dict[str, str]], timeout: float = 1.0) -> None:
        self._endpoints = endpoints
        self._timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="detector")

    def _one(self, address: str) -> Observation:
        try:
            with urllib.request.urlopen(f"http://{address}/metrics?{_ONLY}", timeout=self._timeout) as r:
                text = r.read().decode()
        except OSError:
            return Observation(False)
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name in (PROGRESS, FINISHED):
                for sample in family.samples:
                    values[sample.name] = sample.value
        return Observation(True, values.get(PROGRESS), values.get(FINISHED, 0.0) >= 1)

    def observe(self) -> dict[str, Observation]:
        endpoints = self._endpoints()
        names = sorted(endpoints)
        return dict(zip(names, self._pool.map(self._one, [endpoints[n] for n in names]), strict=True))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PrometheusSource:
    """Reads ``up`` and the trainers' progress series from a Prometheus server's HTTP API. Targets carry
    the labels ``service`` and ``member`` (the local launcher's and the chart's scrape configs set them)."""

    def __init__(self, url: str, timeout: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self._timeout = timeout

    def _query(self, expr: str) -> list[tuple[str, float]]:
        query = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}", timeout=self._timeout) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise ValueError(f"prometheus query {expr!r}: {body}")
        out = []
        for series in body["data"]["result"]:
            labels = series["metric"]
            if "service" in labels and "member" in labels:
                out.append((f"{labels['service']}/{labels['member']}", float(series["value"][1])))
        return out

    def observe(self) -> dict[str, Observation]:
        try:
            up = dict(self._query("up"))
            progress = dict(self._query(PROGRESS))
            finished = dict(self._query(FINISHED))
        except (OSError, ValueError) as e:
            # no answer from Prometheus is no evidence about the members: report nothing this round
            logger.warning("failure detector: prometheus at %s: %s", self.url, e)
            return {}
        return {
            member: Observation(value >= 1, progress.get(member), finished.get(member, 0.0) >= 1)
            for member, value in up.items()
        }

    def close(self) -> None:
        pass


class Detector:
    """Tracks the members it is told to expect and reports those gone or stuck for ``timeout`` seconds."""

    def __init__(
        self,
        source: ScrapeSource | PrometheusSource,
        timeout: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout}")
        self.source = source
        self.timeout = timeout
        self._clock = clock
        self._seen: dict[str, float] = {}  # member -> last time it answered (or was first expected)
        self._mark: dict[str, tuple[float | None, float]] = {}  # trainer -> (progress mark, since when)
        self._reachable: dict[str, bool] = {}
        self._finished: set[str] = set()

    def expect(self, members: Iterable[str]) -> None:
        """Starts watching ``members`` (``service/member``), as if they had just answered."""
        now = self._clock()
        for m in members:
            self._seen.setdefault(m, now)
            self._mark.setdefault(m, (None, now))

    def retire(self, members: Iterable[str]) -> None:
        """Stops watching ``members``: they left on purpose (an embedding server drained by a scale-down)."""
        for m in members:
            for table in (self._seen, self._mark, self._reachable):
                table.pop(m, None)  # type: ignore[attr-defined]
            self._finished.discard(m)

    def poll(self) -> list[Failure]:
        """One look at every member; the failures, gone ones first (empty: all is well)."""
        observed = self.source.observe()
        now = self._clock()
        for member, obs in observed.items():
            if member not in self._seen:
                continue
            self._reachable[member] = obs.reachable
            if not obs.reachable:
                continue
            self._seen[member] = now
            if obs.finished:
                self._finished.add(member)
            mark, _ = self._mark[member]
            if obs.progress is not None and obs.progress != mark:
                self._mark[member] = (obs.progress, now)
        # (a trainer that finished may exit: a Job's pod does)
        gone = [
            Failure(m, "gone", now - t)
            for m, t in self._seen.items()
            if now - t > self.timeout and m not in self._finished
        ]
        if gone:
            return sorted(gone, key=lambda f: -f.silent_seconds)
        if not all(self._reachable.get(m, True) for m in self._seen):
            return []  # someone does not answer: wait for it to be declared gone rather than blame its peers
        stuck = []
        for member, (mark, since) in self._mark.items():
            started = mark is not None and mark > 0
            if (
                member.startswith("trainer/")
                and started
                and member not in self._finished
                and now - since > self.timeout
            ):
                stuck.append(Failure(member, "stuck", now - since))
        return sorted(stuck, key=lambda f: -f.silent_seconds)

    def close(self) -> None:
        self.source.close()
