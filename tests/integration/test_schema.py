"""The user's own data schema: a Parquet (and CSV) file of 5 dense and 7 categorical columns, neither
Criteo's nor Avazu's layout, trains the model single-process synchronous training computes on the same
samples, which the reference here builds from the generating arrays (not through bagpipe's reader)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bagpipe.core import checkpoint
from bagpipe.core.model import ModelConfig
from bagpipe.core.optim import OptimizerConfig
from bagpipe.data_processor.files import fnv1a64

from tests.integration.conftest import flags
from tests.integration.test_equivalence import assert_same_model
from tests.reference import train_reference

DENSE = 5
# (name, rows, hashing): ids that are rows, strings hashed, a large id taken modulo its table
CATEGORICAL = [
    ("user", 40, "none"),
    ("item", 60, "none"),
    ("hour", 24, "none"),
    ("device", 7, "none"),
    ("country", 30, "hash"),
    ("query", 50, "hash"),
    ("campaign", 90, "mod"),
]
TABLE_ROWS = tuple(rows for _, rows, _ in CATEGORICAL)


def make_data(samples: int, seed: int = 7) -> dict[str, list]:
    """Columns of a click log with a learnable label; dense values in log-normal counts."""
    rng = np.random.default_rng(seed)
    columns: dict[str, list] = {}
    user = rng.zipf(1.3, samples) % 40
    item = rng.integers(0, 60, samples)
    columns["clicked"] = [int(v) for v in ((user % 3 == 0) ^ (item % 5 == 0)) | (rng.random(samples) < 0.1)]
    for j in range(DENSE):
        columns[f"f{j}"] = list(np.floor(rng.lognormal(j * 0.5, 1.0, samples)))
    columns["user"], columns["item"] = [int(v) for v in user], [int(v) for v in item]
    columns["hour"] = [int(v) for v in rng.integers(0, 24, samples)]
    columns["device"] = [int(v) for v in rng.integers(0, 7, samples)]
    columns["country"] = [f"c{int(v)}" for v in rng.zipf(1.5, samples) % 200]
    columns["query"] = [f"q-{int(v)}" for v in rng.integers(0, 1000, samples)]
    columns["campaign"] = [int(v) for v in rng.integers(10**6, 10**9, samples)]
    columns["session"] = [f"s{i}" for i in range(samples)]  # (ignored)
    return columns


def schema(kind: str) -> dict:
    return {
        "format": kind,
        "columns": [
            {"name": "clicked", "role": "label"},
            *({"name": f"f{j}", "role": "dense"} for j in range(DENSE)),
            *(
                {"name": name, "role": "categorical", "rows": rows, "hashing": h}
                for name, rows, h in CATEGORICAL
            ),
            {"name": "session", "role": "ignore"},
        ],
    }


def reference_batches(columns: dict[str, list], batch: int) -> list[SimpleNamespace]:
    """The samples as the schema defines them, computed here one value at a time."""
    n = len(columns["clicked"]) // batch * batch
    dense = np.array([[np.log1p(max(columns[f"f{j}"][i], 0.0)) for j in range(DENSE)] for i in range(n)])
    sparse = np.zeros((n, len(CATEGORICAL)), dtype=np.int64)
    for t, (name, rows, hashing) in enumerate(CATEGORICAL):
        for i in range(n):
            value = columns[name][i]
            sparse[i, t] = fnv1a64(str(value).encode()) % rows if hashing == "hash" else value % rows
    labels = np.array(columns["clicked"][:n], dtype=np.float32)
    return [
        SimpleNamespace(
            dense=dense[b : b + batch].astype(np.float32),
            sparse=sparse[b : b + batch],
            labels=labels[b : b + batch],
        )
        for b in range(0, n, batch)
    ]


@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_a_schema_of_its_own_trains_as_synchronous_training(run_job, tmp_path: Path, kind: str) -> None:
    batch, iterations = 64, 14
    columns = make_data(batch * iterations + 11)  # (a partial last batch is dropped)
    data = tmp_path / f"clicks.{kind}"
    if kind == "parquet":
        pq.write_table(pa.table(columns), data, row_group_size=200)  # (row groups across batches)
    else:
        with data.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(list(columns))
            w.writerows(zip(*columns.values(), strict=True))
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema(kind)))
    summary, paths = run_job(
        kind,
        *flags(
            data=f"{kind}:{data}",
            schema=schema_file,
            iterations=0,
            trainers=2,
            data_processors=2,
            lookahead=4,
            batch_size=batch,
            optimizer="adagrad",
            lr="0.05",
        ),
    )
    assert summary["iterations"] == iterations
    initial = checkpoint.load(paths["initial"])
    assert len(initial["embeddings"]) == len(CATEGORICAL)
    assert initial["dense"]["bottom_mlp.0.weight"].shape[1] == DENSE
    model = ModelConfig(
        num_dense=DENSE, num_tables=len(CATEGORICAL), embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1)
    )
    expected = train_reference(
        initial, reference_batches(columns, batch), model, OptimizerConfig("adagrad", 0.05)
    )
    assert_same_model(paths["final"], expected)
