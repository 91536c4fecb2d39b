"""Stopping ``bagpipe run`` as ``timeout``, systemd, a container runtime (SIGTERM) or a shell's Ctrl-C
(SIGINT) do: every service stops, every complete checkpoint stays, one line says how to go on, and the
exit status is the signal's (143, 130), with no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bagpipe.core import snapshots

from tests.integration.conftest import TINY, TINY_MODEL
from tests.integration.test_recovery import _trained


def _left(run_dir: Path) -> list[str]:
    """Command lines of live processes that belong to the run (they name its directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(run_dir) in command and state != "Z":
            found.append(command)
    return found


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_run_stops_every_service_and_says_how_to_resume(
    tmp_path: Path, sig: int, status: int
) -> None:
    run_dir = tmp_path / "stopped"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bagpipe.cli",
            "run",
            *TINY,
            *TINY_MODEL["dlrm"],
            "--no-report",
            "--iterations",
            "400",
            "--checkpoint-every",
            "5",
            "--run-dir",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        deadline = time.monotonic() + 120
        while _trained(run_dir) < 12 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    latest = snapshots.latest(run_dir / "checkpoints")
    assert latest and latest >= 10
    line = err.strip().splitlines()[-1]
    assert line == (
        f"bagpipe run stopped by {signal.Signals(sig).name}: every service stopped; checkpoints kept in "
        f"{run_dir / 'checkpoints'} (latest: batch {latest}); go on with: bagpipe run --resume {run_dir}"
    ), err
    assert not _left(run_dir), _left(run_dir)
    for n in snapshots.complete(run_dir / "checkpoints"):
        snapshots.files_of(run_dir / "checkpoints", n)  # every complete one whole (BrokenChain otherwise)
