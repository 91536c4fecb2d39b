"""A real file, tried as a new user would: DeepCTR's 200-row Criteo sample (tests/data/README.md), a CSV
whose integer features are written as ``260.0``, run with ``bagpipe run`` and no schema.

The inferred schema takes its float columns for counts (``log1p``) and the job trains; a model that
diverges (the same columns taken as they are, or a huge learning rate) fails the job at once with one line
naming the cause and what to change, and is never restarted: a restart would replay the same batches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from bagpipe.cli import parse_run
from bagpipe.core.schema import schema_of
from bagpipe.local.launcher import run

SAMPLE = Path(__file__).parents[1] / "data" / "criteo_sample.txt"
DENSE = [f"I{i}" for i in range(1, 14) if i != 2]  # (I2 holds integers, -1 among them: a table)


def _argv(run_dir: Path, *extra: str) -> list[str]:
    return [
        "--data",
        f"csv:{SAMPLE}",
        "--iterations",
        "5",
        "--batch-size",
        "20",
        "--embedding-dim",
        "8",
        "--bottom-mlp",
        "16,8",
        "--top-mlp",
        "16,1",
        "--data-processors",
        "1",
        "--quiet",
        "--log-level",
        "WARNING",
        "--no-report",
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def test_the_sample_trains_with_its_counts_taken_as_log1p(tmp_path: Path, capsys) -> None:
    table_rows = ",".join(["1000"] * 27)  # (C1..C26, and I2)
    summary = run(parse_run(_argv(tmp_path / "run", "--table-rows", table_rows)))
    assert summary["iterations"] == 5
    said = capsys.readouterr().err
    assert f"schema inferred from {SAMPLE}: label: label; dense (log1p): {', '.join(DENSE)};" in said
    written = json.loads((tmp_path / "run" / "schema.json").read_text())
    assert {c["name"]: c.get("transform") for c in written["columns"] if c["role"] == "dense"} == {
        name: "log1p" for name in DENSE
    }


@pytest.mark.parametrize(
    "how, cause",
    [
        (
            "raw",  # the run: counts such as 17668.0 enter the model as they are
            # (what a trainer meets first, the write-back of a row grown huge or the loss turned nan, is
            # down to timing; either is the model diverging)
            r"(batch \d+: )?the model diverged: (an embedding server refused a row written back: rows: "
            r"key \d+: value \S+ \(must be at most 1e\+06 in absolute value \(--max-abs-value\)\)"
            r"|the loss is nan); "
            r"lower --lr \(now 0\.1\), or give the dense columns taken as they are \(I1, I3, I4, I5, I6, I7, "
            r"I8, I9 and 4 more\) transform: log1p in a --schema",
        ),
        ("lr", r"batch \d+: the model diverged: the loss is nan; lower --lr \(now 1e\+10\)"),
    ],
    ids=["raw-counts", "huge-lr"],
)
def test_a_diverged_model_fails_the_job_at_once_with_one_line_and_no_restart(
    tmp_path: Path, how: str, cause: str
) -> None:
    table_rows = ",".join(["1000"] * 27)
    if how == "raw":  # (the schema inferred before log1p: every dense column as it is)
        layout = schema_of(f"csv:{SAMPLE}").to_dict()
        for column in layout["columns"]:
            if column["role"] == "dense":
                column["transform"] = "none"
        (tmp_path / "raw.json").write_text(json.dumps(layout))
        extra = ["--schema", str(tmp_path / "raw.json"), "--table-rows", table_rows]
    else:
        extra = ["--table-rows", table_rows, "--lr", "1e10"]
    with pytest.raises(RuntimeError) as err:
        run(parse_run(_argv(tmp_path / "run", *extra)))
    message = str(err.value)  # (the cause, what to change and who met it, in one line)
    assert re.fullmatch(
        rf"training: {cause} \(met by trainer-[01]; not retried: a restart would meet it again\)", message
    ), message
    controller = (tmp_path / "run" / "logs" / "controller.log").read_text()
    assert "generation 2" not in controller and "recovering" not in controller
    for rank in (0, 1):  # (a trainer started again after the job failed says so: it never trains again)
        assert "joins generation 2" not in (tmp_path / "run" / "logs" / f"trainer-{rank}.log").read_text()
