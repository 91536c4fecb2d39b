"""Redis keys of one job: membership, progress, heartbeats, the shard map and run statistics.

Everything is under ``bagpipe:<job>:``. Services register their address once they listen, so
ports can be ephemeral; clients wait for the members they need.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import redis

from bagpipe import security, tls
from bagpipe.core.shard_map import ShardMap

logger = logging.getLogger(__name__)

# a Redis call that waits longer has failed (redis-py raises TimeoutError)
SOCKET_TIMEOUT_S = 10.0


class LockLost(RuntimeError):
    """A lock expired while its holder's block ran: someone else may have taken it meanwhile."""


def _text(value: str | bytes) -> str:
    """The client decodes replies (``decode_responses=True``); the stubs also allow bytes."""
    return value.decode() if isinstance(value, bytes) else value


def connection_options(url: str) -> dict[str, Any]:
    """The client's options for the job's Redis at ``url``; what the URL's query names wins over them.

    The password comes from the environment (a URL on a command line shows in /proc). A ``rediss://`` URL
    in a job with mutual TLS (``bagpipe.tls.tls_files()``) is dialled with the job's certificate and key, and
    the server must present a certificate of the job's CA: the chart's Redis demands the same of its
    clients. Hostnames are not checked, since pods dial Redis by its Service's DNS name, which the job's one
    shared certificate need not name (it names ``tls.serverName`` for the gRPC servers, dialled by IP);
    being signed by the job's own CA is what vouches for it. An external Redis whose certificate comes from
    another CA takes its own as ``?ssl_ca_certs=PATH`` (and ``&ssl_check_hostname=true``) in the URL.
    Without the job's files, a ``rediss://`` URL gets redis-py's defaults: the system's CAs, hostnames
    checked.
    """
    options: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "password": security.redis_password(),
    }
    files = tls.tls_files()
    if files is not None and urlsplit(url).scheme == "rediss":
        options.update(
            ssl_certfile=files["cert"],
            ssl_keyfile=files["key"],
            ssl_ca_certs=files["ca"],
            ssl_cert_reqs="required",
            ssl_check_hostname=False,
        )
    return options


class Registry:
    """Thin, typed access to a job's coordination state in Redis.

    ``fence`` (a trainer's: the id of the generation it trains in) fences what the trainer writes of its
    training (progress, statistics, evaluations): a write lands only while that generation is the one in
    force, in one Redis script with the check, so that a trainer of a generation that is over, not yet
    ended, cannot write into the next one (the controller decides the job's end from the statistics)."""

    def __init__(self, url: str, job: str, fence: str | None = None) -> None:
        self.url = url
        self.job = job
        self.fence = fence
        self._redis = redis.Redis.from_url(url, **connection_options(url))

    def _key(self, *parts: str) -> str:
        return ":".join(("bagpipe", self.job, *parts))

    def _hash(self, key: str) -> dict[str, str]:
        return {_text(k): _text(v) for k, v in self._redis.hgetall(key).items()}

    def ping(self) -> bool:
        return bool(self._redis.ping())

    # membership
    def register(self, service: str, member: str, address: str) -> None:
        self._redis.hset(self._key("members", service), member, address)

    def unregister(self, service: str, member: str) -> None:
        self._redis.hdel(self._key("members", service), member)

    def members(self, service: str) -> dict[str, str]:
        return self._hash(self._key("members", service))

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
        """Where ``service``'s ``member`` serves /metrics (the local Prometheus and the launcher read it)."""
        self._redis.hset(self._key("metrics"), f"{service}/{member}", address)

    def unregister_metrics(self, service: str, member: str) -> None:
        self._redis.hdel(self._key("metrics"), f"{service}/{member}")

    def metrics_endpoints(self) -> dict[str, str]:
        """``service/member`` -> ``host:port`` of every registered /metrics endpoint."""
        return self._hash(self._key("metrics"))

    # shard map
    def publish_shard_map(self, shard_map: ShardMap) -> ShardMap:
        """Stores ``shard_map`` unless one exists; returns the one in force (first writer wins)."""
        self._redis.set(self._key("shard_map"), shard_map.to_json(), nx=True)
        current = self.shard_map()
        assert current is not None
        return current

    def shard_map(self) -> ShardMap | None:
        text = self._redis.get(self._key("shard_map"))
        return ShardMap.from_json(_text(text)) if text else None

    def replace_shard_map(self, new: ShardMap) -> None:
        """Makes ``new`` the map in force, if the one in force is the version before it (else ValueError)."""
        key = self._key("shard_map")
        with self._redis.pipeline() as pipe:
            pipe.watch(key)
            text = pipe.get(key)
            current = ShardMap.from_json(_text(text)).version if text else 0
            if current != new.version - 1:
                raise ValueError(f"shard map version {new.version} cannot follow version {current} in Redis")
            pipe.multi()
            pipe.set(key, new.to_json())
            pipe.execute()  # WatchError if another writer came first

    def restore_shard_map(self, shard_map: ShardMap) -> None:
        """Makes ``shard_map`` the map in force whatever Redis holds (the controller's, after Redis lost it:
        a server started again may have published its initial map meanwhile)."""
        self._redis.set(self._key("shard_map"), shard_map.to_json())

    def embedding_servers(self) -> tuple[ShardMap | None, dict[int, str]]:
        """The shard map in force and every registered embedding server's address, by shard."""
        return self.shard_map(), {int(k): v for k, v in self.members("embedding_server").items()}

    # re-sharding
    def set_leaving(self, shard: int, leaving: bool = True) -> None:
        """Marks embedding server ``shard`` to be drained (its buckets move away) or not."""
        if leaving:
            self._redis.sadd(self._key("leaving"), str(shard))
        else:
            self._redis.srem(self._key("leaving"), str(shard))

    def leaving(self) -> set[int]:
        return {int(s) for s in self._redis.smembers(self._key("leaving"))}

    def try_lock(self, name: str, owner: str, ttl: float) -> bool:
        """Takes lock ``name`` for ``ttl`` seconds unless someone else holds it (it expires if they die)."""
        return bool(self._redis.set(self._key("lock", name), owner, nx=True, px=int(ttl * 1000)))

    def unlock(self, name: str, owner: str) -> None:
        """Releases lock ``name`` if ``owner`` still holds it."""
        self._redis.eval(
            "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0",
            1,
            self._key("lock", name),
            owner,
        )

    def break_lock(self, name: str, owner_prefix: str) -> bool:
        """Releases lock ``name`` if its holder's name starts with ``owner_prefix`` (a holder known dead)."""
        return bool(
            self._redis.eval(
                "local v = redis.call('get', KEYS[1]) "
                "if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then "
                "return redis.call('del', KEYS[1]) end return 0",
                1,
                self._key("lock", name),
                owner_prefix,
            )
        )

    def renew_lock(self, name: str, owner: str, ttl: float) -> bool:
        """Extends lock ``name`` to ``ttl`` seconds from now if ``owner`` still holds it."""
        return bool(
            self._redis.eval(
                "if redis.call('get', KEYS[1]) == ARGV[1] then "
                "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0",
                1,
                self._key("lock", name),
                owner,
                int(ttl * 1000),
            )
        )

    @contextmanager
    def locked(self, name: str, owner: str, ttl: float = 120.0, timeout: float = 300.0) -> Iterator[None]:
        """Holds lock ``name`` for the block, waiting up to ``timeout`` seconds for it. A thread renews it
        every third of ``ttl`` while the block runs, so a slow block keeps it (and a dead holder's expires);
        LockLost at the block's end if it lapsed meanwhile (Redis unreachable for ``ttl``)."""
        deadline = time.monotonic() + timeout
        while not self.try_lock(name, owner, ttl):
            if time.monotonic() > deadline:
                raise TimeoutError(f"lock {name}: held by someone else for {timeout:g} s")
            time.sleep(0.01)
        stop, lost = threading.Event(), threading.Event()

        def renew() -> None:
            while not stop.wait(ttl / 3):
                try:
                    if not self.renew_lock(name, owner, ttl):
                        lost.set()
                        return
                except redis.RedisError as e:  # (the next try may reach it before the ttl runs out)
                    logger.warning("lock %s: could not renew: %s", name, e)

        renewer = threading.Thread(target=renew, name=f"lock-{name}", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()
            self.unlock(name, owner)
        if lost.is_set():
            raise LockLost(f"lock {name}: lapsed while {owner} held it (not renewed within {ttl:g} s)")

    def add_reshard(self, record: dict[str, Any]) -> None:
        self._redis.rpush(self._key("reshards"), json.dumps(record))

    def reshards(self) -> list[dict[str, Any]]:
        """Every completed or failed re-sharding of the job, oldest first."""
        return [json.loads(r) for r in self._redis.lrange(self._key("reshards"), 0, -1)]

    # generations (control/generation.py): the controller writes them, every member follows
    def generation_record(self) -> dict[str, str]:
        return self._hash(self._key("generation"))

    def begin_generation(self, record: dict[str, str] | Callable[[], dict[str, str]]) -> dict[str, str]:
        """Makes ``record`` the generation in force and forgets the trainers' progress and statistics of the
        last one (the new one starts over from its checkpoint); returns the record written.

        ``record`` may be a function (the controller's, which reads the newest checkpoint): it is called
        while the generation in force is watched, and called again if that generation recorded a sealed
        checkpoint (``checkpoint_sealed``) before the new record was written. So a start read before rank 0
        completed a newer checkpoint is never written once rank 0 may prune it."""
        key = self._key("generation")
        with self._redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    content = record if isinstance(record, dict) else record()
                    # (a finished trainer's statistics: it trains again)
                    stats = list(self._redis.scan_iter(self._key("stats", "*")))
                    pipe.multi()
                    pipe.delete(key, self._key("progress"), self._key("heartbeat"), *stats)
                    pipe.hset(key, mapping=dict(content))  # type: ignore[arg-type]
                    pipe.execute()
                    return content
                except redis.WatchError:
                    logger.info("rank 0 sealed a checkpoint meanwhile: the start is read again")

    def checkpoint_sealed(self, generation: str, next_batch: int) -> bool:
        """Records that generation ``generation``'s rank 0 completed checkpoint ``next_batch``, if that
        generation is still in force; returns whether it is (only then may rank 0 prune: a generation
        begun after this reads ``next_batch`` or a newer one as the newest, see ``begin_generation``)."""
        return bool(
            self._redis.eval(
                "if redis.call('hget', KEYS[1], 'id') == ARGV[1] then "
                "redis.call('hset', KEYS[1], 'checkpoint', ARGV[2]) return 1 end return 0",
                1,
                self._key("generation"),
                generation,
                str(next_batch),
            )
        )

    def set_generation_state(self, generation: str, state: str, reason: str = "") -> bool:
        """Moves generation ``generation`` to ``state``, if it is still the one in force."""
        return bool(
            self._redis.eval(
                "if redis.call('hget', KEYS[1], 'id') == ARGV[1] then "
                "redis.call('hset', KEYS[1], 'state', ARGV[2], 'reason', ARGV[3]) return 1 end return 0",
                1,
                self._key("generation"),
                generation,
                state,
                reason,
            )
        )

    def announce(self, member: str, incarnation: str, where: dict[str, Any]) -> None:
        """``member`` (``service/name``) is now process ``incarnation``, at ``where`` (host, pid, pod)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(self._key("incarnations"), member, incarnation)
        pipe.hset(self._key("whereabouts"), member, json.dumps(where))
        pipe.execute()

    def forget_member(self, member: str) -> None:
        """Drops ``member`` (a pod replaced under another name) from everything the controller watches."""
        service, name = member.split("/", 1)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hdel(self._key("incarnations"), member)
        pipe.hdel(self._key("whereabouts"), member)
        pipe.hdel(self._key("metrics"), member)
        pipe.hdel(self._key("members", service), name)
        pipe.execute()

    def incarnations(self) -> dict[str, str]:
        return self._hash(self._key("incarnations"))

    def incarnation_of(self, member: str) -> str | None:
        value = self._redis.hget(self._key("incarnations"), member)
        return _text(value) if value is not None else None

    def whereabouts(self, member: str) -> dict[str, Any]:
        value = self._redis.hget(self._key("whereabouts"), member)
        return json.loads(_text(value)) if value else {}

    def _hset_for_a_day(self, key: str, field: str, value: str, only_new: bool = False) -> None:
        """A field of a per-generation hash, which expires a day after its last write (generations come
        and go; nothing cleans their keys up otherwise)."""
        pipe = self._redis.pipeline(transaction=False)
        (pipe.hsetnx if only_new else pipe.hset)(key, field, value)
        pipe.expire(key, 86400)
        pipe.execute()

    def ack(self, generation: str, member: str, incarnation: str) -> None:
        """``member`` holds generation ``generation``'s starting state (rolled back, rewound)."""
        self._hset_for_a_day(self._key("acks", generation), member, incarnation)

    def acks(self, generation: str) -> dict[str, str]:
        return self._hash(self._key("acks", generation))

    def report(self, generation: str, member: str, reason: str) -> None:
        """Another member saw ``member`` fail in generation ``generation`` (the oracle: a processor's
        stream); the first reason stays."""
        self._hset_for_a_day(self._key("reports", generation), member, reason, only_new=True)

    def reports(self, generation: str) -> dict[str, str]:
        return self._hash(self._key("reports", generation))

    def add_failure(self, record: dict[str, Any]) -> int:
        """Appends a failure the controller handled; returns its index."""
        return int(self._redis.rpush(self._key("failures"), json.dumps(record))) - 1

    def update_failure(self, index: int, record: dict[str, Any]) -> None:
        self._redis.lset(self._key("failures"), index, json.dumps(record))

    def failures(self) -> list[dict[str, Any]]:
        return [json.loads(r) for r in self._redis.lrange(self._key("failures"), 0, -1)]

    # progress and liveness
    def _fenced(self, script: str, keys: list[str], args: list[Any]) -> bool:
        """Runs ``script`` (KEYS and ARGV from 2) if the generation in force is ``fence`` (or there is no
        fence); whether it ran."""
        check = "if redis.call('hget', KEYS[1], 'id') ~= ARGV[1] then return 0 end " if self.fence else ""
        return bool(
            self._redis.eval(
                f"{check}{script} return 1",
                len(keys) + 1,
                self._key("generation"),
                *keys,
                self.fence or "",
                *args,
            )
        )

    def set_progress(self, rank: int, batch: int) -> bool:
        """Trainer ``rank`` trained and wrote back ``batch``; False if fenced off (its generation is over)."""
        return self._fenced(
            "redis.call('hset', KEYS[2], ARGV[2], ARGV[3]) redis.call('hset', KEYS[3], ARGV[2], ARGV[4])",
            [self._key("progress"), self._key("heartbeat")],
            [str(rank), str(batch), repr(time.time())],
        )

    def progress(self) -> dict[int, int]:
        return {int(k): int(v) for k, v in self._redis.hgetall(self._key("progress")).items()}

    def put_json(self, name: str, value: Any) -> bool:
        """Stores ``value`` under ``name``; False if fenced off (``fence``: a generation that is over)."""
        return self._fenced("redis.call('set', KEYS[2], ARGV[2])", [self._key(name)], [json.dumps(value)])

    def get_json(self, name: str) -> Any:
        text = self._redis.get(self._key(name))
        return json.loads(text) if text else None

    def close(self) -> None:
        self._redis.close()
