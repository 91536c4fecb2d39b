"""The failure detector's rules on a scripted sequence of observations (a clock the test moves)."""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest
from bagpipe.control.detector import FINISHED, PROGRESS, Detector, Observation, ScrapeSource
from bagpipe.local.redis_server import free_port
from bagpipe.metrics_http import MetricsServer
from prometheus_client.parser import text_string_to_metric_families


class Script:
    """Observations the test sets between polls."""

    def __init__(self) -> None:
        self.now: dict[str, Observation] = {}

    def observe(self) -> dict[str, Observation]:
        return dict(self.now)

    def close(self) -> None:
        pass


def detector(members: list[str]) -> tuple[Detector, Script, list[float]]:
    script, clock = Script(), [0.0]
    d = Detector(script, timeout=10.0, clock=lambda: clock[0])  # type: ignore[arg-type]
    d.expect(members)
    return d, script, clock


def test_a_member_that_stops_answering_is_gone_after_the_timeout() -> None:
    d, script, clock = detector(["trainer/0", "embedding_server/0"])
    script.now = {"trainer/0": Observation(True, 1.0), "embedding_server/0": Observation(True)}
    assert d.poll() == []
    script.now["embedding_server/0"] = Observation(False)
    clock[0] = 9.0
    assert d.poll() == []
    clock[0] = 10.5
    [failure] = d.poll()
    assert (failure.member, failure.kind) == ("embedding_server/0", "gone")


def test_a_trainer_without_progress_is_stuck_but_peers_of_a_silent_member_are_not_blamed() -> None:
    d, script, clock = detector(["trainer/0", "trainer/1", "embedding_server/0"])
    script.now = {
        "trainer/0": Observation(True, 5.0),
        "trainer/1": Observation(True, 5.0),
        "embedding_server/0": Observation(True),
    }
    d.poll()
    script.now["embedding_server/0"] = Observation(False)  # frozen: the trainers wait for it
    clock[0] = 10.2
    [failure] = d.poll()
    assert failure.member == "embedding_server/0"  # not the trainers, stuck just as long
    script.now["embedding_server/0"] = Observation(True)
    clock[0] = 10.4
    stuck = d.poll()
    assert {f.member for f in stuck} == {"trainer/0", "trainer/1"} and {f.kind for f in stuck} == {"stuck"}


def test_trainers_that_have_not_started_or_have_finished_are_not_stuck() -> None:
    d, script, clock = detector(["trainer/0", "trainer/1"])
    script.now = {"trainer/0": Observation(True, 0.0), "trainer/1": Observation(True, 3.0, finished=True)}
    d.poll()
    clock[0] = 60.0
    assert d.poll() == []
    script.now["trainer/0"] = Observation(True, 61.0)
    assert d.poll() == []
    clock[0] = 72.0
    assert [f.member for f in d.poll()] == ["trainer/0"]


def test_scrape_source_reads_liveness_and_progress_from_real_metrics_endpoints() -> None:
    server = MetricsServer("127.0.0.1:0", "trainer")
    dead = f"127.0.0.1:{free_port()}"
    try:
        source = ScrapeSource(lambda: {"trainer/0": server.address, "trainer/1": dead})
        seen = source.observe()
        assert seen["trainer/0"].reachable and seen["trainer/0"].progress is not None
        assert not seen["trainer/1"].reachable
        source.close()
    finally:
        server.stop()


def test_a_scrape_that_names_series_gets_only_those_and_the_detector_asks_for_its_two() -> None:
    server = MetricsServer("127.0.0.1:0", "trainer")
    try:
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=10) as r:
            whole = {f.name for f in text_string_to_metric_families(r.read().decode())}
        assert {PROGRESS, FINISHED, "bagpipe_trainer_alive_timestamp_seconds"} <= whole and len(whole) > 10
        query = urllib.parse.urlencode(
            [("name[]", PROGRESS), ("name[]", "bagpipe_trainer_alive_timestamp_seconds")]
        )
        with urllib.request.urlopen(f"http://{server.address}/metrics?{query}", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            named = {f.name for f in text_string_to_metric_families(r.read().decode())}
        assert named == {PROGRESS, "bagpipe_trainer_alive_timestamp_seconds"}
        # a name no series has: an empty exposition, not an error
        with urllib.request.urlopen(
            f"http://{server.address}/metrics?name[]=no_such_series", timeout=10
        ) as r:
            assert r.status == 200 and not list(text_string_to_metric_families(r.read().decode()))

        seen: list[str] = []
        handler = server._server.RequestHandlerClass
        original = handler.do_GET

        def record(self: Any) -> None:
            seen.append(self.path)
            original(self)

        handler.do_GET = record  # type: ignore[method-assign]
        source = ScrapeSource(lambda: {"trainer/0": server.address})
        try:
            assert source.observe()["trainer/0"].progress is not None
        finally:
            source.close()
        assert len(seen) == 1 and urllib.parse.parse_qs(seen[0].partition("?")[2])["name[]"] == [
            PROGRESS,
            FINISHED,
        ]
    finally:
        server.stop()


def _healthz(address: str, query: str = "") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}/healthz{query}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize(
    ("age", "finished", "query", "status"),
    [
        (5.0, 0.0, "?max_silence=60", 200),  # a healthy trainer
        (100.0, 0.0, "?max_silence=60", 503),  # hung inside a live process
        (100.0, 0.0, "", 200),  # (no max_silence: only whether the process answers)
        (100.0, 0.0, "?max_silence=120", 200),
        (None, 0.0, "?max_silence=60", 200),  # not trained yet: no heartbeat to be stale
        (100.0, 1.0, "?max_silence=60", 200),  # finished: its heartbeat has stopped
        (5.0, 0.0, "?max_silence=soon", 400),
        (5.0, 0.0, "?max_silence=-1", 400),
    ],
)
def test_healthz_max_silence_fails_on_a_stale_trainer_heartbeat(
    age: float | None, finished: float, query: str, status: int
) -> None:
    from bagpipe.trainer import metrics

    saved = metrics.HEARTBEAT._value.get(), metrics.FINISHED._value.get()
    metrics.HEARTBEAT.set(0.0 if age is None else time.time() - age)
    metrics.FINISHED.set(finished)
    server = MetricsServer("127.0.0.1:0", "trainer")
    try:
        code, body = _healthz(server.address, query)
        assert code == status, body
        if status == 503:
            assert body.startswith("no progress for 10") and "max_silence=60 s" in body
    finally:
        server.stop()
        metrics.HEARTBEAT.set(saved[0])
        metrics.FINISHED.set(saved[1])
