"""The metrics endpoint under idle and slow connections: bounded, and a scrape still answered at once."""

from __future__ import annotations

import socket
import time
import urllib.request

from bagpipe import metrics_http
from bagpipe.metrics_http import MetricsServer


def _get(address: str, path: str) -> tuple[int, float]:
    t0 = time.monotonic()
    with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
        r.read()
        return r.status, time.monotonic() - t0


def test_idle_connections_neither_delay_a_scrape_nor_stay_open() -> None:
    server = MetricsServer("127.0.0.1:0", "test_idle")
    idle: list[socket.socket] = []
    try:
        for _ in range(200):  # connected, sending nothing (or a request line and no more)
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            idle.append(s)
        for path in ("/metrics", "/healthz"):
            status, seconds = _get(server.address, path)
            assert status == 200 and seconds < 1.0, (path, seconds)
        # each idle connection is closed once it has sent no whole request for the timeout (or at once,
        # past the bound): none is held open
        deadline = time.monotonic() + metrics_http.REQUEST_TIMEOUT_S + 5
        for s in idle:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            while s.recv(1024):  # (a 408 answer, or nothing, then the close)
                pass
        assert time.monotonic() < deadline
        status, seconds = _get(server.address, "/metrics")
        assert status == 200 and seconds < 1.0
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_connections_past_the_bound_are_closed_at_once(monkeypatch) -> None:
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 4)
    server = MetricsServer("127.0.0.1:0", "test_bound")
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(4)]
    try:
        time.sleep(0.2)  # (the four are accepted and wait for a request)
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        t0 = time.monotonic()
        assert extra.recv(1024) == b""  # closed without an answer
        assert time.monotonic() - t0 < metrics_http.REQUEST_TIMEOUT_S
        extra.close()
        for s in held:
            s.close()
        time.sleep(metrics_http.REQUEST_TIMEOUT_S + 0.3)  # (their threads end: the slots are free again)
        status, _ = _get(server.address, "/healthz")
        assert status == 200
    finally:
        for s in held:
            s.close()
        server.stop()


def test_clients_that_trickle_bytes_lose_their_slot_at_the_deadline(monkeypatch) -> None:
    """A byte every half second never trips the per-read timeout; the whole-request deadline still frees
    the slot, so a probe gets through while every slot is being held that way."""
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 4)
    server = MetricsServer("127.0.0.1:0", "test_trickle")
    slow = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(4)]
    request = b"GET /metrics HTTP/1.1\r\nX-Padding: " + b"x" * 200
    cut: set[int] = set()
    try:
        for i in range(int(4 * metrics_http.REQUEST_DEADLINE_S / 0.5)):
            for n, s in enumerate(slow):
                if n not in cut:
                    try:
                        s.sendall(request[i : i + 1])
                    except OSError:
                        cut.add(n)
            if len(cut) == len(slow):
                break
            time.sleep(0.5)
        assert len(cut) == len(slow), "a trickling client kept its connection past the deadline"
        status, _ = _get(server.address, "/healthz")
        assert status == 200
    finally:
        for s in slow:
            s.close()
        server.stop()
