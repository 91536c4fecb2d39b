"""Every service's HTTP endpoint: Prometheus ``/metrics``, liveness ``/healthz`` and readiness ``/readyz``.

A small threaded ``http.server`` beside the service's gRPC server (the trainer has only this one).
``/healthz`` answers 200 while the process is responsive and its health callable reports no failure;
``/healthz?max_silence=SECONDS`` also answers 503 when this process's trainer heartbeat
(``bagpipe_trainer_heartbeat_timestamp_seconds``, once it has one) is older than that, unless it has
finished: a trainer hung inside a live process still answers HTTP, so a liveness probe needs this to see it;
``/readyz`` answers 200 once the service has said it is ready (listening, registered).
``/metrics?name[]=A&name[]=B`` serves only the series named (as Prometheus's own client does): the
failure detector reads two series a second from every service, and rendering and parsing the whole
exposition each time cost the services and the launcher more CPU than the rest of its work.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Gauge, generate_latest

from bagpipe import cpu_priority

logger = logging.getLogger(__name__)

Health = Callable[[], str | None]  # None when healthy, else what is wrong

STOP_POLL_S = 0.05  # how often the serving thread looks for a stop request
# a connection that sends nothing for this long is closed (its thread ends): idle clients cannot pile up
REQUEST_TIMEOUT_S = 1.0
# and one whose whole request and answer take longer than this, however steadily it trickles bytes: a
# client sending a byte a second would otherwise hold its slot for ever, and once every slot is held the
# kubelet's probe and the controller's scrape are refused and the member is taken for dead. A scrape,
# a probe or a health check takes milliseconds
REQUEST_DEADLINE_S = 2.0
# connections served at once (a thread each, most of them idle for at most REQUEST_TIMEOUT_S); more are
# closed as they come. Far above what Prometheus, probes and the controller open (one or two each), so that
# a few hundred idle connections still leave room for a scrape
MAX_CONNECTIONS = 512
# connections the kernel queues before they are accepted: at the default 5, a burst of connections made
# a scrape wait for the client's SYN retransmission (1 s)
LISTEN_BACKLOG = 1024


class _BoundedServer(ThreadingHTTPServer):
    """A thread a connection, at most ``MAX_CONNECTIONS`` at once, each closed after ``REQUEST_TIMEOUT_S``
    of silence or ``REQUEST_DEADLINE_S`` in all (a reaper thread shuts late connections down)."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._deadlines: dict[socket.socket, float] = {}
        self._deadlines_lock = threading.Lock()
        self._closing = threading.Event()
        super().__init__(*args, **kwargs)
        threading.Thread(target=self._reap, name="metrics-http-deadline", daemon=True).start()

    def _reap(self) -> None:
        while not self._closing.wait(REQUEST_DEADLINE_S / 8):
            now = time.monotonic()
            with self._deadlines_lock:
                late = [request for request, deadline in self._deadlines.items() if deadline < now]
            for request in late:  # (its thread's read or write then fails, and the thread ends)
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)

    def server_close(self) -> None:
        self._closing.set()
        super().server_close()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._deadlines_lock:
            self._deadlines[request] = time.monotonic() + REQUEST_DEADLINE_S
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._deadlines_lock:
                self._deadlines.pop(request, None)
            self._slots.release()


_ALIVE: dict[str, Gauge] = {}

HEARTBEAT = "bagpipe_trainer_heartbeat_timestamp_seconds"
FINISHED = "bagpipe_trainer_finished"


def heartbeat_silence(max_silence: float) -> str | None:
    """What is wrong when this process's trainer heartbeat is over ``max_silence`` seconds old; None when it
    is not, or the process has no heartbeat (not a trainer, or one that has not trained yet: 0), or it has
    finished (its heartbeat stops then)."""
    values = {
        s.name: s.value
        for f in REGISTRY.restricted_registry([HEARTBEAT, FINISHED]).collect()
        for s in f.samples
    }
    beat = values.get(HEARTBEAT, 0.0)
    if beat <= 0 or values.get(FINISHED, 0.0) >= 1:
        return None
    silence = time.time() - beat
    if silence <= max_silence:
        return None
    return f"no progress for {silence:.1f} s (heartbeat older than max_silence={max_silence:g} s)"


def _max_silence(query: str) -> float | None:
    """``max_silence`` from a query string (None: absent); ValueError when it is not a number >= 0."""
    given = urllib.parse.parse_qs(query).get("max_silence")
    if not given:
        return None
    value = float(given[-1])
    if not value >= 0:  # (also NaN)
        raise ValueError(given[-1])
    return value


def _alive_gauge(service: str) -> Gauge:
    """``bagpipe_<service>_alive_timestamp_seconds``: the time of the scrape itself (once per process)."""
    if service not in _ALIVE:
        gauge = Gauge(
            f"bagpipe_{service}_alive_timestamp_seconds",
            "Unix time at which this process answered the scrape",
        )
        gauge.set_function(time.time)
        _ALIVE[service] = gauge
    return _ALIVE[service]


class MetricsServer:
    """Serves the process's default Prometheus registry on ``address`` (``host:port``, port 0: any)."""

    def __init__(self, address: str, service: str, health: Health | None = None) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"metrics address: expected host:port, got {address!r}")
        self.service = service
        self.ready = threading.Event()
        # liveness for the failure detector: a frozen process cannot answer, so this only ever shows "now"
        _alive_gauge(service)
        self._health = health or (lambda: None)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S  # (the socket's: reading the request, and writing the answer)

            def do_GET(self) -> None:  # noqa: N802
                path, _, query = self.path.partition("?")
                if path == "/metrics":
                    names = urllib.parse.parse_qs(query).get("name[]")
                    registry = REGISTRY.restricted_registry(names) if names else REGISTRY
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    try:
                        max_silence = _max_silence(query)
                    except ValueError:
                        self._send(400, b"max_silence: expected seconds, a number >= 0\n")
                        return
                    problem = owner._health()
                    if problem is None and max_silence is not None:
                        problem = heartbeat_silence(max_silence)
                    self._send(503 if problem else 200, (problem or "ok").encode() + b"\n")
                elif path == "/readyz":
                    ready = owner.ready.is_set()
                    self._send(200 if ready else 503, b"ready\n" if ready else b"starting\n")
                else:
                    self._send(404, b"not found: try /metrics, /healthz or /readyz\n")

            def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                logger.debug("%s: %s", owner.service, format % args)

        bind = "" if host in ("0.0.0.0", "[::]") else host.strip("[]")
        self._server = _BoundedServer((bind, int(port)), Handler)
        self.port = int(self._server.server_address[1])
        self.address = f"{'127.0.0.1' if bind == '' else bind}:{self.port}"
        # (stop waits for the loop to see the request: every 50 ms, not the default 0.5 s)
        serve_forever = functools.partial(self._server.serve_forever, poll_interval=STOP_POLL_S)

        def serve() -> None:
            said = cpu_priority.normal_for_this_thread()  # (its request threads inherit it)
            if said is not None:
                logger.info("%s: /metrics and /healthz at %s", service, said)
            serve_forever()

        self._thread = threading.Thread(target=serve, name="metrics-http", daemon=True)
        self._thread.start()
        logger.info("%s: metrics on http://%s/metrics", service, self.address)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
