"""Redis keys of one job: membership, progress, heartbeats, the shard map and run statistics.

Everything is under ``bagpipe:<job>:``. Services register their address once they listen, so
ports can be ephemeral; clients wait for the members they need.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis

from bagpipe.core.shard_map import ShardMap

logger = logging.getLogger(__name__)


class Registry:
    """Thin, typed access to a job's coordination state in Redis."""

    def __init__(self, url: str, job: str) -> None:
        self.url = url
        self.job = job
        self._redis = redis.Redis.from_url(url, decode_responses=True, socket_timeout=10)

    def _key(self, *parts: str) -> str:
        return ":".join(("bagpipe", self.job, *parts))

    def ping(self) -> bool:
        return bool(self._redis.ping())

    # membership
    def register(self, service: str, member: str, address: str) -> None:
        self._redis.hset(self._key("members", service), member, address)

    def unregister(self, service: str, member: str) -> None:
        self._redis.hdel(self._key("members", service), member)

    def members(self, service: str) -> dict[str, str]:
        return dict(self._redis.hgetall(self._key("members", service)))

    def wait_for_members(self, service: str, count: int, timeout: float = 120.0) -> dict[str, str]:
        """Blocks until ``count`` members of ``service`` are registered; raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.members(service)
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service}: {len(found)} of {count} members registered after {timeout}s")
            time.sleep(0.05)

    def register_metrics(self, service: str, member: str, address: str) -> None:
        """Where ``service``'s ``member`` serves /metrics (the local Prometheus and the launcher scrape it)."""
        self._redis.hset(self._key("metrics"), f"{service}/{member}", address)

    def metrics_endpoints(self) -> dict[str, str]:
        """``service/member`` -> ``host:port`` of every registered /metrics endpoint."""
        return dict(self._redis.hgetall(self._key("metrics")))

    # shard map
    def publish_shard_map(self, shard_map: ShardMap) -> ShardMap:
        """Stores ``shard_map`` unless one exists; returns the one in force (first writer wins)."""
        self._redis.set(self._key("shard_map"), shard_map.to_json(), nx=True)
        current = self.shard_map()
        assert current is not None
        return current

    def shard_map(self) -> ShardMap | None:
        text = self._redis.get(self._key("shard_map"))
        return ShardMap.from_json(text) if text else None

    # progress and liveness
    def set_progress(self, rank: int, batch: int) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(self._key("progress"), str(rank), batch)
        pipe.hset(self._key("heartbeat"), str(rank), time.time())
        pipe.execute()

    def progress(self) -> dict[int, int]:
        return {int(k): int(v) for k, v in self._redis.hgetall(self._key("progress")).items()}

    def put_json(self, name: str, value: Any) -> None:
        self._redis.set(self._key(name), json.dumps(value))

    def get_json(self, name: str) -> Any:
        text = self._redis.get(self._key(name))
        return json.loads(text) if text else None

    def close(self) -> None:
        self._redis.close()
