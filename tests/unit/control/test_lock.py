"""The re-sharding lock a checkpoint holds (``Registry.locked``), on a real redis-server: renewed while a
slow block runs, so no one else takes it meanwhile; reported when it lapsed anyway."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from bagpipe.control.registry import LockLost, Registry
from bagpipe.local.redis_server import RedisServer


@pytest.fixture
def registry(tmp_path: Path):  # type: ignore[no-untyped-def]
    server = RedisServer(tmp_path)
    registry = Registry(server.url, "lock-test")
    try:
        yield registry
    finally:
        registry.close()
        server.stop()


def test_a_slow_holder_keeps_the_lock_past_its_ttl(registry: Registry) -> None:
    """A block five times the lock's ttl long (a slow snapshot): a switch trying all along never gets it."""
    taken = []
    done = threading.Event()

    def switch() -> None:
        other = Registry(registry.url, registry.job)
        while not done.is_set():
            taken.append(other.try_lock("reshard", "switch", 0.3))
            time.sleep(0.02)
        other.close()

    contender = threading.Thread(target=switch)
    with registry.locked("reshard", "checkpoint", ttl=0.3):
        contender.start()
        time.sleep(1.5)
        done.set()
        contender.join()
    assert len(taken) > 20 and not any(taken)
    assert registry.try_lock("reshard", "switch", 0.3)  # (released at the block's end)


def test_a_lock_that_lapsed_while_held_is_reported(registry: Registry) -> None:
    lapsed = pytest.raises(LockLost, match="lock reshard: lapsed while checkpoint held it")
    with lapsed, registry.locked("reshard", "checkpoint", ttl=0.3):
        registry._redis.delete(registry._key("lock", "reshard"))  # (expired: Redis was out of reach)
        assert registry.try_lock("reshard", "switch", 5)
        time.sleep(0.3)
    assert registry._redis.get(registry._key("lock", "reshard")) == "switch"  # (not the other's to free)
