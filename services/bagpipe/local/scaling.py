"""``bagpipe scale embedding-servers N --run RUN_DIR``: changes the number of embedding servers of a running
``bagpipe run``, which starts or drains servers the way Kubernetes does (see embedding_server/resharder.py).

The request and its outcome are files in the run directory, so the command works from any shell:
``scale-request.json`` (written by ``bagpipe scale``) and ``scale-status.json`` (written by the launcher).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bagpipe import serving
from bagpipe.control.registry import Registry
from bagpipe.v1 import control_pb2, control_pb2_grpc

logger = logging.getLogger(__name__)

REQUEST = "scale-request.json"
STATUS = "scale-status.json"
LAUNCHER = "launcher.json"


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def launcher_running(run_dir: Path) -> bool:
    info = _read_json(run_dir / LAUNCHER)
    if not info:
        return False
    try:
        os.kill(int(info["pid"]), 0)
    except (OSError, KeyError, ValueError):
        return False
    return True


def request_scale(run_dir: Path, servers: int) -> str:
    """Asks the run's launcher for ``servers`` embedding servers; returns the request's id."""
    if servers < 1:
        raise ValueError(f"embedding servers: must be >= 1, got {servers}")
    if not launcher_running(run_dir):
        raise FileNotFoundError(f"--run: no running `bagpipe run` in {run_dir} (no live {LAUNCHER})")
    request_id = uuid.uuid4().hex[:8]
    _write_json(run_dir / REQUEST, {"id": request_id, "embedding_servers": servers, "time": time.time()})
    return request_id


def wait_scaled(run_dir: Path, request_id: str, timeout: float = 600.0) -> dict[str, Any]:
    """The status of request ``request_id`` once it is done or failed (TimeoutError otherwise)."""
    deadline = time.monotonic() + timeout
    while True:
        status = _read_json(run_dir / STATUS)
        if (
            status
            and status.get("id") == request_id
            and status.get("state") in ("done", "failed", "rejected")
        ):
            return status
        if not launcher_running(run_dir):
            raise RuntimeError(f"the run in {run_dir} ended before scaling was done")
        if time.monotonic() > deadline:
            raise TimeoutError(f"scaling not done after {timeout:g} s; see {run_dir / STATUS}")
        time.sleep(0.1)


def shut_down(address: str, reason: str) -> None:
    try:
        with serving.channel(address) as ch:
            control_pb2_grpc.ControlStub(ch).Shutdown(control_pb2.ShutdownRequest(reason=reason), timeout=5)
    except grpc.RpcError:
        pass


class Scaler:
    """The launcher's side: picks up requests and carries them out over the watch loop's polls.

    Up: the new servers start and register; the coordinator moves their share of the buckets to them.
    Down: the highest shards are marked leaving; once the coordinator has moved their buckets away, they
    are shut down and retired (the failure detector stops watching them, ``retire`` waits for their exit).
    """

    def __init__(self, run_dir: Path, servers: int) -> None:
        self.run_dir = run_dir
        self.servers = servers  # the target, once a request is taken
        self.request: dict[str, Any] | None = None
        self.records: list[dict[str, Any]] = []  # completed re-shardings of earlier generations
        self._seen: str | None = None
        self._retiring: list[int] = []
        self._started = 0.0
        done = _read_json(run_dir / STATUS)
        if done:
            self._seen = done.get("id")
        _write_json(run_dir / LAUNCHER, {"pid": os.getpid(), "time": time.time()})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            (self.run_dir / LAUNCHER).unlink()

    def _status(self, state: str, **extra: Any) -> None:
        assert self.request is not None
        _write_json(self.run_dir / STATUS, {**self.request, "state": state, **extra})

    def poll(
        self,
        registry: Registry,
        current: int,
        spawn: Callable[[int], None],
        retire: Callable[[int], None],
        allowed: str | None,
    ) -> None:
        """One step. ``current``: servers running now; ``spawn(shard)`` starts one, ``retire(shard)`` forgets
        a stopped one; ``allowed``: why scaling is not possible in this run, or None."""
        if self.request is None:
            request = _read_json(self.run_dir / REQUEST)
            if not request or request.get("id") == self._seen:
                return
            self._seen = request["id"]
            self.request = request
            target = int(request["embedding_servers"])
            if allowed is not None or target < 1:
                self._status("rejected", error=allowed or f"embedding servers: must be >= 1, got {target}")
                self.request = None
                return
            self._started = time.time()
            self.servers = target
            logger.info("scaling embedding servers %d -> %d", current, target)
            if target > current:
                for shard in range(current, target):
                    spawn(shard)
            else:
                self._retiring = list(range(target, current))
                for shard in self._retiring:
                    registry.set_leaving(shard)
            self._status("running", started_at=self._started)
        shard_map, members = registry.embedding_servers()
        assert shard_map is not None
        if shard_map.owners != list(range(self.servers)):
            return
        mine = [r for r in registry.reshards() if r["started_at"] >= self._started]
        if shard_map.version > 1 and not (mine and mine[-1]["to_version"] == shard_map.version):
            return  # the map is in Redis, the servers are still switching
        if mine and mine[-1]["state"] == "failed":
            return  # the coordinator stops its server: recovery takes over, and the coordinator tries again
        for shard in self._retiring:  # drained: stop them (they unregister) and stop watching them
            if shard in members:
                shut_down(members[shard], "drained by bagpipe scale")
            retire(shard)
            registry.set_leaving(shard, False)
        self._status(
            "done",
            embedding_servers=self.servers,
            shard_map_version=shard_map.version,
            reshards=mine,
            seconds=time.time() - self._started,
        )
        logger.info("scaled to %d embedding servers (shard map version %d)", self.servers, shard_map.version)
        self.request = None
        self._retiring = []
