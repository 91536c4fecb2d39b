"""Bad data is reported as bad data: the data processor's one line (file, line, field, value), never a
trainer's traceback. A file whose first lines do not parse stops ``bagpipe run`` before any process starts;
a bad line deep in a file fails the job at once (a restart would read it again), naming that line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from bagpipe.cli import parse_run
from bagpipe.local.launcher import run

TABLE_ROWS = ",".join(["1000"] * 26)


def _criteo(path: Path, lines: int, bad_at: int) -> Path:
    rng = random.Random(0)
    out = []
    for i in range(lines):
        dense = [str(rng.randint(0, 50)) for _ in range(13)]
        if i == bad_at:
            dense[2] = "260.0"  # (a real sample's integer as some tools write it)
        cats = [f"{rng.getrandbits(32):08x}" for _ in range(26)]
        out.append("\t".join([str(rng.randint(0, 1)), *dense, *cats]))
    path.write_text("\n".join(out) + "\n")
    return path


def _argv(path: Path, run_dir: Path, iterations: int) -> list[str]:
    return [
        "run",
        "--data",
        f"criteo:{path}",
        "--table-rows",
        TABLE_ROWS,
        "--batch-size",
        "64",
        "--iterations",
        str(iterations),
        "--embedding-dim",
        "8",
        "--bottom-mlp",
        "16,8",
        "--top-mlp",
        "16,1",
        "--data-processors",
        "1",
        "--no-report",
        "--run-dir",
        str(run_dir),
    ]


def test_a_file_whose_first_lines_do_not_parse_is_refused_before_anything_starts(tmp_path: Path) -> None:
    path = _criteo(tmp_path / "head.tsv", 200, bad_at=5)
    with pytest.raises(SystemExit, match=rf"--data: bad data: {path}:6: field I3: '260.0' is not an integer"):
        run(parse_run(_argv(path, tmp_path / "run", 2)[1:]))
    assert not (tmp_path / "run").exists()  # (nothing started, nothing written)


def test_a_bad_line_deep_in_a_file_fails_the_job_naming_it(tmp_path: Path) -> None:
    # past the first chunk the start-up check reads (4 MiB: about 20,000 of these lines)
    path = _criteo(tmp_path / "late.tsv", 30_000, bad_at=25_000)
    with pytest.raises(RuntimeError) as err:
        run(parse_run(_argv(path, tmp_path / "run", 460)[1:]))
    message = str(err.value)
    assert message.startswith(f"bad data: {path}:25001: field I3: '260.0' is not an integer (read by ")
    assert "Traceback" not in message and "rank" not in message
