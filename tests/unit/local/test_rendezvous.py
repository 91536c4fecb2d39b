"""The trainers' rendezvous URL from ``bagpipe run``'s run directory, and each generation's file."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest
from bagpipe.local.configs import rendezvous_url
from bagpipe.trainer.__main__ import generation_url


def test_a_relative_run_directory_gives_an_absolute_file_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = rendezvous_url(Path("runs/job"))
    parsed = urlparse(url)  # as torch's file rendezvous reads it
    assert parsed.scheme == "file" and parsed.netloc == ""
    store = Path(parsed.path)
    assert store.is_absolute() and store.parent == tmp_path / "runs" / "job" / "rendezvous"
    assert store.parent.is_dir()
    # the trainers meet in a file of their generation's: a store file is never reused
    first, second = generation_url(url, "a1b2"), generation_url(url, "c3d4")
    assert first == f"{url}-a1b2" and first != second
    assert urlparse(first).path.startswith(str(store))
    # a TCP store is made anew by rank 0 each time: the same address serves every generation
    assert generation_url("tcp://trainer-0.trainer:29500", "a1b2") == "tcp://trainer-0.trainer:29500"
