"""Mutual TLS for a job's gRPC connections: which PEM files, and the credentials made from them.

Every process reads the same three files (its certificate, its key and the job's CA), from
``--tls-cert/--tls-key/--tls-ca`` or the ``BAGPIPE_TLS_*`` variables, which the flags set so that child
processes and every channel of the process see them. Servers require a client certificate signed by the
job's CA; clients check the servers' certificates for one name (``--tls-server-name``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import grpc

TLS_ENV = {"cert": "BAGPIPE_TLS_CERT", "key": "BAGPIPE_TLS_KEY", "ca": "BAGPIPE_TLS_CA"}
TLS_SERVER_NAME_ENV = "BAGPIPE_TLS_SERVER_NAME"
DEFAULT_TLS_SERVER_NAME = "bagpipe"


def tls_files() -> dict[str, str] | None:
    """Mutual TLS: this process's certificate and key and the job's CA (PEM paths), or None (plaintext).
    Set by ``--tls-cert/--tls-key/--tls-ca`` (``add_coordination_args``) or the BAGPIPE_TLS_* variables,
    all three or none."""
    files = {k: os.environ.get(v, "") for k, v in TLS_ENV.items()}
    if not any(files.values()):
        return None
    missing = [f"--tls-{k}" for k, v in files.items() if not v]
    if missing:
        raise ValueError(
            f"{', '.join(missing)}: mutual TLS needs --tls-cert, --tls-key and --tls-ca together"
        )
    return files


def _pem(files: dict[str, str]) -> dict[str, bytes]:
    out = {}
    for kind, path in files.items():
        try:
            out[kind] = open(path, "rb").read()  # noqa: SIM115 (small file, read at once)
        except OSError as e:
            raise ValueError(f"--tls-{kind}: {path}: {e.strerror}") from None
    return out


def server_credentials() -> grpc.ServerCredentials | None:
    """Servers present their certificate and require one signed by the job's CA from every client."""
    files = tls_files()
    if files is None:
        return None
    pem = _pem(files)
    return grpc.ssl_server_credentials(
        [(pem["key"], pem["cert"])], root_certificates=pem["ca"], require_client_auth=True
    )


def channel_credentials() -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]] | None:
    """Clients present their certificate, trust only the job's CA, and check the servers' certificates for
    the name ``BAGPIPE_TLS_SERVER_NAME`` (default ``bagpipe``; pods are reached by IP, which certificates
    rarely name)."""
    files = tls_files()
    if files is None:
        return None
    pem = _pem(files)
    name = os.environ.get(TLS_SERVER_NAME_ENV) or DEFAULT_TLS_SERVER_NAME
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pem["ca"], private_key=pem["key"], certificate_chain=pem["cert"]
    )
    return credentials, [("grpc.ssl_target_name_override", name)]


class EnvFlag(argparse.Action):
    """A flag whose value also goes into an environment variable, so that every channel and server of the
    process (and its children) sees it."""

    def __init__(self, *args: Any, env: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env = env

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        os.environ[self.env] = str(values)
        setattr(namespace, self.dest, values)


def add_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mutual TLS (all three, or none: plaintext)")
    for kind, what in (
        ("cert", "this process's certificate"),
        ("key", "its private key"),
        ("ca", "the job's CA certificate, which signed every service's"),
    ):
        g.add_argument(
            f"--tls-{kind}",
            action=EnvFlag,
            env=TLS_ENV[kind],
            default=None,
            metavar="PEM",
            help=f"{what} (PEM; or ${TLS_ENV[kind]})",
        )
    g.add_argument(
        "--tls-server-name",
        action=EnvFlag,
        env=TLS_SERVER_NAME_ENV,
        default=None,
        help=f"the name in servers' certificates (default {DEFAULT_TLS_SERVER_NAME})",
    )
