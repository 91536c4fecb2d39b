"""The trainers' rendezvous URL from ``bagpipe run``'s run directory."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import pytest
from bagpipe.local.launcher import rendezvous_url


def test_a_relative_run_directory_gives_an_absolute_file_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = rendezvous_url(Path("runs/job"), 3)
    parsed = urlparse(url)  # as torch's file rendezvous reads it
    assert parsed.scheme == "file" and parsed.netloc == ""
    store = Path(parsed.path)
    assert store.is_absolute() and store.parent == tmp_path / "runs" / "job" / "rendezvous"
    assert store.parent.is_dir() and store.name.startswith("generation-3-")
    assert os.path.basename(rendezvous_url(Path("runs/job"), 3)) != store.name  # a new file every time
