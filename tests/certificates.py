"""Test certificates made with openssl: a CA and one certificate it signed (what a job's services share)."""

from __future__ import annotations

import subprocess
from pathlib import Path

# default file names (cert-manager's Secret uses tls.crt, tls.key and ca.crt)
PEM_NAMES = {"cert": "cert.pem", "key": "key.pem", "ca": "ca.pem"}


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def certificates(directory: Path, name: str, names: dict[str, str] = PEM_NAMES) -> dict[str, str]:
    """A new CA in ``directory`` and a certificate it signed for DNS ``name``; the files' paths by kind."""
    directory.mkdir(parents=True)
    cert, key, ca = names["cert"], names["key"], names["ca"]
    days = ("-days", "2")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", *days, "-subj", f"/CN={name}-ca",
             "-keyout", "ca.key", "-out", ca, cwd=directory)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
             "-keyout", key, "-out", "req.csr", cwd=directory)  # fmt: skip
    (directory / "ext.cnf").write_text(f"subjectAltName=DNS:{name}\n")
    _openssl("x509", "-req", "-in", "req.csr", "-CA", ca, "-CAkey", "ca.key", "-CAcreateserial", *days,
             "-extfile", "ext.cnf", "-out", cert, cwd=directory)  # fmt: skip
    return {kind: str(directory / file) for kind, file in names.items()}
