"""Schemas and the csv/tsv/parquet reader: what a schema may say, what is inferred, and a bad value named
by file, line (or row) and column."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bagpipe.core.data import DataFormatError
from bagpipe.core.schema import Schema, SchemaError, built_in, schema_of
from bagpipe.data_processor.config import SourceConfig
from bagpipe.data_processor.files import AVAZU_TABLE_ROWS, CRITEO_NUM_DENSE, fnv1a64
from bagpipe.local.run_config import RunConfig
from bagpipe.trainer.evaluation import load_held_out

SCHEMA = {
    "columns": [
        {"name": "y", "role": "label"},
        {"name": "x", "role": "dense", "transform": "none"},
        {"name": "n", "role": "dense"},
        {"name": "a", "role": "categorical", "rows": 10, "hashing": "none"},
        {"name": "b", "role": "categorical", "rows": 7},
        {"name": "c", "role": "categorical", "rows": 5, "hashing": "mod"},
    ]
}


def write(tmp_path: Path, text: str, spec: dict = SCHEMA, name: str = "d.csv") -> SourceConfig:
    (tmp_path / name).write_text(text)
    (tmp_path / "s.yaml").write_text(json.dumps(spec))  # (JSON is YAML)
    return SourceConfig(f"csv:{tmp_path / name}", (10, 7, 5), schema=str(tmp_path / "s.yaml"))


def test_values_become_samples_as_the_schema_says(tmp_path: Path) -> None:
    source = write(tmp_path, "y,x,n,a,b,c\n1,2.5,3,4,red,12\n0,-1,,9,,-3\n")
    ((_, samples),) = source.open().batches(2)
    assert samples.labels.tolist() == [1.0, 0.0]
    np.testing.assert_allclose(samples.dense, [[2.5, np.log1p(3)], [-1.0, 0.0]], rtol=1e-6)  # (missing: 0)
    assert samples.sparse.tolist() == [[4, fnv1a64(b"red") % 7, 12 % 5], [9, 0, -3 % 5]]  # (missing: row 0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("2,1,1,1,x,1", "d.csv:3: field y: '2' is not 0 or 1"),
        ("1,abc,1,1,x,1", "d.csv:3: field x: 'abc' is not a number"),
        ("1,1,1,10,x,1", "d.csv:3: field a: '10' is not a row of its table's [0, 10)"),
        ("1,1,1,1,x,1.5", "d.csv:3: field c: '1.5' is not an integer"),
        ("1,inf,1,1,x,1", "d.csv:3: field x: 'inf' is not finite"),
        ("1,1,1,1,x", "field fields: '1,1,1,1,x' has 5 fields, expected 6"),
    ],
)
def test_a_bad_value_names_file_line_and_column(tmp_path: Path, line: str, message: str) -> None:
    source = write(tmp_path, f"y,x,n,a,b,c\n1,1,1,1,x,1\n{line}\n1,1,1,1,x,1\n")
    with pytest.raises(DataFormatError, match=message.replace("[", r"\[").replace(")", r"\)")):
        list(source.open().batches(1))
    skipping = SourceConfig(source.data, source.table_rows, skip_bad_rows=True, schema=source.schema).open()
    assert len(list(skipping.batches(1))) == 2 and skipping.bad_rows == 1


def test_parquet_rows_are_named_from_one_and_row_groups_split_batches(tmp_path: Path) -> None:
    table = pa.table({"y": [1, 0, 1, 1, 0], "x": [0.5] * 5, "n": [1, 2, 3, 4, 5], "a": [1, 2, 3, 4, 5],
                      "b": list("vwxyz"), "c": [7] * 5})  # fmt: skip
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    (tmp_path / "s.json").write_text(json.dumps({**SCHEMA, "format": "parquet"}))
    source = SourceConfig(f"parquet:{tmp_path / 'd.parquet'}", (10, 7, 5), schema=str(tmp_path / "s.json"))
    mine = list(source.open().batches(2, start=1, stride=2))  # (batches 1: rows 2-3; 2 rows left over)
    assert [n for n, _ in mine] == [1] and mine[0][1].sparse[:, 0].tolist() == [3, 4]
    pq.write_table(table.set_column(0, "y", pa.array([1, 0, 3, 1, 0])), tmp_path / "d.parquet")
    with pytest.raises(DataFormatError, match=r"d.parquet:3: field y: '3' is not 0 or 1"):
        list(source.open().batches(5))


def test_a_schema_is_checked_as_it_is_read(tmp_path: Path) -> None:
    bad = [
        ({"columns": [{"name": "y", "role": "label"}]}, "needs at least one categorical column"),
        ({"columns": [{"name": "y", "role": "lbl"}]}, r"columns\[0\] \(y\): role: 'lbl' is not one of"),
        ({"columns": [{"name": "y", "role": "label"}, {"name": "y", "role": "dense"}]}, "y named twice"),
        (
            {"columns": [{"name": "a", "role": "categorical", "rows": 0}, {"name": "y", "role": "label"}]},
            "rows:",
        ),
        ({"columns": [], "colour": 1}, "unknown key"),
    ]
    for spec, message in bad:
        (tmp_path / "s.json").write_text(json.dumps(spec))
        with pytest.raises(SchemaError, match=message):
            Schema.load(str(tmp_path / "s.json"))
    (tmp_path / "s.yaml").write_text("columns: [unclosed\n")
    with pytest.raises(SchemaError, match=r"s.yaml: not valid YAML"):
        Schema.load(str(tmp_path / "s.yaml"))


def test_a_schema_is_inferred_from_the_header_with_table_rows(tmp_path: Path) -> None:
    (tmp_path / "d.tsv").write_text("click\tprice\tcity\tshop\n1\t2.5\tparis\t3\n0\t1.0\tlyon\t4\n")
    inferred = schema_of(f"tsv:{tmp_path / 'd.tsv'}")
    assert (inferred.label.name, [c.name for c in inferred.dense]) == ("click", ["price"])
    assert [(c.name, c.hashing) for c in inferred.categorical] == [("city", "hash"), ("shop", "mod")]
    config = RunConfig(data=f"tsv:{tmp_path / 'd.tsv'}", table_rows=(11, 13), batch_size=2, trainers=1)
    assert config.table_rows == (11, 13)
    with pytest.raises(ValueError, match="table_rows: .* gives no rows for city, shop"):
        RunConfig(data=f"tsv:{tmp_path / 'd.tsv'}")


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_an_inferred_dense_column_of_counts_gets_log1p_and_one_with_a_negative_value_none(
    tmp_path: Path, kind: str
) -> None:
    """Counts such as Criteo's (``17668.0``) enter the model raw only where a value says they are not counts:
    diverging at once is what raw counts do."""
    columns = {
        "label": [0, 1, 0, 1],
        "clicks": [17668.0, None, 0.0, 3.0],
        "delta": [1.5, 2.0, -0.5, 0.0],
        "empty": [None, None, None, 2.0],
        "shop": ["a", "b", "a", "c"],
        "slot": [-1, 3, 2, 5],
    }
    path = tmp_path / f"d.{kind}"
    if kind == "csv":
        rows = zip(*columns.values(), strict=True)
        lines = [",".join(columns), *(",".join("" if v is None else str(v) for v in row) for row in rows)]
        path.write_text("\n".join(lines) + "\n")
    else:
        pq.write_table(pa.table(columns), path, row_group_size=2)  # (the negative one in the second group)
    inferred = schema_of(f"{kind}:{path}")
    assert [(c.name, c.transform) for c in inferred.dense] == [
        ("clicks", "log1p"),
        ("delta", "none"),
        ("empty", "log1p"),
    ]
    assert inferred.describe() == (
        "label: label; dense (log1p): clicks, empty; dense (none): delta; categorical (hash): shop; "
        "categorical (mod): slot"
    )


def test_held_out_data_without_a_schema_is_laid_out_as_the_training_data_was_inferred(tmp_path: Path) -> None:
    """The held-out file's own values would infer ``none`` for a column the training file's infer
    ``log1p`` for: the model would be evaluated on inputs of another scale than it trained on."""
    (tmp_path / "train.csv").write_text("label,clicks,shop\n1,3.0,a\n0,0.0,b\n")
    (tmp_path / "held.csv").write_text("label,clicks,shop\n1,-2.0,a\n0,3.0,b\n")
    assert schema_of(f"csv:{tmp_path / 'held.csv'}").dense[0].transform == "none"
    held, train = f"csv:{tmp_path / 'held.csv'}", f"csv:{tmp_path / 'train.csv'}"
    samples = load_held_out(held, (5,), 0, 0, 2, like=train)
    assert samples.dense[:, 0].tolist() == pytest.approx([0.0, np.log1p(3.0)])


def test_the_built_in_layouts_are_the_formats() -> None:
    criteo, avazu = built_in("criteo"), built_in("avazu")
    assert (criteo.num_dense, criteo.num_tables) == (CRITEO_NUM_DENSE, 26)
    assert (avazu.num_dense, avazu.num_tables, avazu.table_rows) == (1, 22, AVAZU_TABLE_ROWS)
    assert schema_of("synthetic") == criteo and schema_of("avazu:x.csv") == avazu
    with pytest.raises(ValueError, match="schema: applies to csv:, tsv: and parquet: data, not criteo"):
        RunConfig(data="criteo:x.tsv", schema="avazu")
