"""What every service's gRPC server has in common: options, health, Control and graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import signal
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bagpipe import rpc, security, tls
from bagpipe.control.registry import Registry
from bagpipe.health_service import HealthService
from bagpipe.metrics_http import Health, MetricsServer
from bagpipe.v1 import control_pb2, control_pb2_grpc
from bagpipe.wire import decode_message, serialized

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 30
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
RPC_TIMEOUT_S = 60.0
# each server's bound on calls in progress; more are refused RESOURCE_EXHAUSTED. A job's own calls to one
# server are a few per trainer (streams, prefetches, write-backs, a migration's chunks) plus the health
# watchers (at most health_service.MAX_WATCHERS)
MAX_CONCURRENT_RPCS = 1024
# each stream's receive window, fixed (gRPC's BDP probing off): what a server buffers of a request it has
# not read, at most. Probing grew the windows of 16 refused 256 MB calls to 36-111 MB in all; fixed at
# 1 MiB they cost 5 MB, and 1 MiB a round trip is still 1 GB/s at a millisecond's round trip. A stranger's
# open health watch holds one such window for as long as it stays open (its request is never read): the
# watchers' cap bounds them to health_service.MAX_WATCHERS MiB
STREAM_WINDOW_BYTES = 1 << 20
# each server's bound on open connections; a connection past it is closed as it is accepted (the client
# sees UNAVAILABLE). A job opens a few to each server per process (trainers, peers, the controller, the
# launcher); an idle one costs the server 7-14 KB (bench/health_watches.py), so 2,048 of them 30 MB at most
MAX_CONNECTIONS = 2048
# a connection with no call in progress for this long is closed (GOAWAY; a job's client reconnects at its
# next call), so that idle connections, a stranger's or a finished client's, do not hold the places above
MAX_CONNECTION_IDLE_MS = 60_000
# a connection with calls in progress (a health watch, a stream of batches) is pinged after this long
# without traffic, and closed when the ping is not answered within KEEPALIVE_TIMEOUT_MS: a peer that
# vanished without closing (a pod's node lost) gives back its connection and watch. Pings are allowed
# whether or not data has flowed since the last one (a watch is silent until the status changes)
KEEPALIVE_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000
# a client channel's streams with the servers' fixed window: what it reads ahead of a stream it does not
# read is one window. The oracle's streams of batches: with BDP probing a processor ran about 6 MB (265
# batches of 96 samples) ahead of an oracle whose own buffer was full
FIXED_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES)]
GRACE_S = 2.0


class ControlServicer(control_pb2_grpc.ControlServicer):
    """Status counters from a callable; Shutdown sets ``stop``."""

    def __init__(self, service: str, counters: Callable[[], dict[str, float]]) -> None:
        self.service = service
        self.address = ""
        self._counters = counters
        self.stop = asyncio.Event()

    async def Status(
        self, request: control_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.StatusResponse:  # noqa: N802
        return control_pb2.StatusResponse(
            service=self.service, address=self.address, counters=self._counters()
        )

    async def Shutdown(
        self, request: control_pb2.ShutdownRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ShutdownResponse:  # noqa: N802
        logger.info("%s: shutdown requested (%s)", self.service, request.reason or "no reason given")
        self.stop.set()
        return control_pb2.ShutdownResponse()


def add_servicer(
    servicer: Any, server: grpc.aio.Server, module: Any, service: str, raw_requests: Sequence[str] = ()
) -> None:
    """What the generated ``add_<Service>Servicer_to_server`` does, with two differences for the hot
    messages: replies may be bytes already serialised (``wire.encode_message``), which go out as they
    are, and the requests of the methods named in ``raw_requests`` are read by ``wire.decode_message``
    (tensors as views of the received bytes). ``module`` is the service's generated ``*_pb2``."""
    descriptor = module.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for m in descriptor.methods:
        decode = (
            functools.partial(decode_message, descriptor=m.input_type)
            if m.name in raw_requests
            else getattr(module, m.input_type.name).FromString
        )
        make = (
            grpc.unary_stream_rpc_method_handler
            if m.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[m.name] = make(
            getattr(servicer, m.name), request_deserializer=decode, response_serializer=serialized
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))
    server.add_registered_method_handlers(descriptor.full_name, handlers)


async def create_server(
    address: str,
    service: str,
    register: Callable[[grpc.aio.Server], None],
    counters: Callable[[], dict[str, float]] = dict,
    caps: dict[str, int] | None = None,
) -> tuple[grpc.aio.Server, int, ControlServicer, HealthService]:
    """Builds and starts an aio server on ``address`` (port 0 picks one); returns the bound port.
    ``caps``: the largest request each method takes, in bytes (``security.ServerGuard``); the server's
    message limit is the largest of them."""
    guard = security.ServerGuard(caps=caps)
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", guard.largest_cap),
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
            ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
            ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.max_pings_without_data", 0),
        ],
        interceptors=[guard],
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )
    register(server)
    health_servicer = HealthService()
    guard.open_health = health_servicer.unread
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    control = ControlServicer(service, counters)
    control_pb2_grpc.add_ControlServicer_to_server(control, server)
    credentials = tls.server_credentials()
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"{service}: cannot listen on {address}")
    await server.start()
    host = address.rsplit(":", 1)[0]
    control.address = f"{'127.0.0.1' if host in ('[::]', '0.0.0.0', '') else host}:{port}"
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(f"bagpipe.v1.{service}", health_pb2.HealthCheckResponse.SERVING)
    return server, port, control, health_servicer


async def stop_gracefully(server: grpc.aio.Server, health_servicer: HealthService) -> None:
    health_servicer.enter_graceful_shutdown()
    await server.stop(GRACE_S)


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set ``stop``: the service stops gracefully and exits 0, as on Control.Shutdown (a
    pod stopping). Services call it before they register in Redis, so that a signal sent as soon as they
    are visible finds the handler, not the default (exit -15, still registered).

    The handlers are the process's (``signal.signal``), not the event loop's: closing a loop puts back
    the default action of the signals it handled, so a SIGTERM arriving between the end of the loop and
    the end of ``run_service`` (a launcher stopping every process just after asking the services to shut
    down) killed a service that was stopping cleanly. This handler outlives the loop and then does
    nothing: the service is already on its way out."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int, frame: object) -> None:
        with contextlib.suppress(RuntimeError):  # (the loop is closed: stopping already)
            loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def redis_lost(error: BaseException) -> str | None:
    """One line naming Redis when ``error`` (or what caused it) is a lost Redis connection, else None."""
    import redis

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, redis.RedisError):
            return f"Redis does not answer ({type(seen).__name__}: {seen}); the job's coordination is lost"
        seen = seen.__cause__ or seen.__context__
    return None


def run_service(body: Callable[[], object], name: str) -> None:
    """Runs a service's main body; a lost Redis ends it with one line naming Redis, not a traceback.
    Once the body has returned, SIGTERM is ignored: the service stopped cleanly and is only finishing its
    exit (threads joined, modules torn down), and a launcher stopping every process still alive must not
    turn that into a failure while stopping (see ``stop_on_signals``). A process that then does not exit
    is still killed."""
    try:
        body()
    except Exception as e:
        lost = redis_lost(e)
        if lost is None:
            raise
        logging.getLogger(name).error("%s", lost)
        raise SystemExit(f"{name}: {lost}") from None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # what is left is never collected again but by the interpreter's own passes on the way out, which
        # walked every object of the modules (numpy, numba, gRPC, torch): 0.9 s of a service's exit here.
        # Frozen, those passes skip them; atexit handlers and the logging's flush still run
        gc.freeze()


def advertised(address: str, host: str | None) -> str:
    """``address`` with its host replaced by ``host`` (the one peers can reach), when given."""
    return f"{host}:{address.rsplit(':', 1)[1]}" if host else address


def start_metrics(
    address: str,
    service: str,
    member: str,
    registry: Registry,
    health: Health | None = None,
    advertise_host: str | None = None,
) -> MetricsServer:
    """Starts the service's /metrics, /healthz, /readyz endpoint and registers it in Redis."""
    metrics_server = MetricsServer(address, service, health)
    registry.register_metrics(service, member, advertised(metrics_server.address, advertise_host))
    return metrics_server


def retrying(service: str, *methods: str) -> list[tuple[str, Any]]:
    """Channel options under which gRPC itself retries ``methods`` of ``service`` (``OracleCacher``) when
    the server is unavailable: the rule of ``rpc.call_with_retry`` (``rpc.RETRIES`` attempts, backoff from
    0.1 s doubling), for calls that need nothing more (no shard map to route by)."""
    policy = {
        "maxAttempts": rpc.RETRIES,
        "initialBackoff": "0.1s",
        "maxBackoff": f"{0.1 * 2 ** (rpc.RETRIES - 1):g}s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    names = [{"service": f"bagpipe.v1.{service}", "method": m} for m in methods]
    config = {"methodConfig": [{"name": names, "retryPolicy": policy}]}
    return [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]


def channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking client channel with Bagpipe's message limits, whose calls carry the job's secret."""
    credentials = tls.channel_credentials()
    if credentials is not None:
        return security.secure(
            grpc.secure_channel(
                address, credentials[0], options=CHANNEL_OPTIONS + credentials[1] + list(options)
            )
        )
    return security.secure(grpc.insecure_channel(address, options=CHANNEL_OPTIONS + list(options)))


def aio_channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """The same, for asyncio."""
    credentials = tls.channel_credentials()
    if credentials is not None:
        return grpc.aio.secure_channel(
            address,
            credentials[0],
            options=CHANNEL_OPTIONS + credentials[1] + list(options),
            interceptors=security.aio_interceptors(),
        )
    return grpc.aio.insecure_channel(
        address, options=CHANNEL_OPTIONS + list(options), interceptors=security.aio_interceptors()
    )


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
