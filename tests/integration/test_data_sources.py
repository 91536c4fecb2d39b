"""Avazu CSV and shuffled Criteo runs, read by two data processors that split the file, train the model
single-process synchronous training computes on the same batches."""

from __future__ import annotations

from pathlib import Path

from bagpipe.core import checkpoint
from bagpipe.core.model import ModelConfig
from bagpipe.core.optim import OptimizerConfig
from bagpipe.data_processor.files import (
    AVAZU_HEADER,
    AvazuConfig,
    AvazuCSVSource,
    CriteoConfig,
    CriteoTSVSource,
)

from tests.integration.conftest import adam_eps, flags
from tests.integration.test_equivalence import MODEL, assert_same_model
from tests.integration.test_evaluation import ROWS, criteo_tsv
from tests.reference import train_reference

AVAZU_ROWS = (24, 7, 7, 50, 60, 26, 70, 40, 36, 200, 300, 80, 5, 4, 90, 8, 9, 45, 4, 30, 40, 30)


def avazu_csv(path: Path, samples: int) -> None:
    lines = [AVAZU_HEADER.decode()]
    for i in range(samples):
        site, app, device = (
            f"{(i * 2654435761) % 97:08x}",
            f"{(i * 40503) % 61:08x}",
            f"{(i * 7919) % 211:08x}",
        )
        lines.append(
            ",".join(
                [
                    str(10**18 + i),
                    str((i * 7 + i // 3) % 3 % 2),
                    f"141021{i % 24:02d}",
                    "1005",
                    str(i % 3),
                    site,
                    "f3845767",
                    "28905ebd",
                    app,
                    "7801e8d9",
                    "07d7df22",
                    device,
                    f"{(i * 31) % 283:08x}",
                    f"{i % 17:x}",
                    "1",
                    str(i % 4),
                    str(15000 + i % 40),
                    "320",
                    "50",
                    str(1700 + i % 23),
                    "0",
                    "35",
                    str(-1 + i % 5),
                    str(79 + i % 9),
                ]
            )
        )
    path.write_text("\n".join(lines) + "\n")


def test_avazu_run_with_two_processors_matches_synchronous_training(run_job, tmp_path: Path) -> None:
    data, batch = tmp_path / "train.csv", 32
    avazu_csv(data, 12 * batch + 5)  # (a partial last batch is dropped)
    summary, paths = run_job(
        "avazu",
        *flags(
            data=f"avazu:{data}",
            table_rows=",".join(map(str, AVAZU_ROWS)),
            iterations=0,
            trainers=2,
            embedding_servers=2,
            data_processors=2,
            lookahead=4,
            batch_size=batch,
            optimizer="adam",
            lr="0.01",
            **adam_eps("adam"),
        ),
    )
    assert summary["iterations"] == 12
    # every kind's CPU since it started, summed over its processes (the bench measures spans with it)
    at_end = summary["cpu_seconds_at_end"]
    assert set(at_end) == {"trainer", "embedding-server", "data-processor", "oracle-cacher", "controller"}
    assert all(at_end[k] > 0 for k in at_end)
    initial = checkpoint.load(paths["initial"])
    assert len(initial["embeddings"]) == 22 and initial["dense"]["bottom_mlp.0.weight"].shape[1] == 1
    batches = [s for _, s in AvazuCSVSource(AvazuConfig((str(data),), AVAZU_ROWS)).batches(batch)]
    model = ModelConfig(num_dense=1, num_tables=22, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1))
    assert_same_model(
        paths["final"],
        train_reference(initial, batches, model, OptimizerConfig("adam", 0.01, **adam_eps("adam"))),
    )


def test_a_shuffled_run_with_two_processors_matches_synchronous_training(run_job, tmp_path: Path) -> None:
    data, batch = tmp_path / "day.tsv", 32
    criteo_tsv(data, 10 * batch, salt=3)
    summary, paths = run_job(
        "shuffled",
        *flags(
            data=f"criteo:{data}",
            table_rows=",".join(map(str, ROWS)),
            iterations=0,
            trainers=2,
            embedding_servers=1,
            data_processors=2,
            lookahead=4,
            batch_size=batch,
            optimizer="adagrad",
            lr="0.1",
            shuffle_seed=11,
            shuffle_buffer=100,
        ),
    )
    assert summary["iterations"] == 10
    config = CriteoConfig((str(data),), ROWS, shuffle_seed=11, shuffle_buffer=100)
    batches = [s for _, s in CriteoTSVSource(config).batches(batch)]
    plain = [s for _, s in CriteoTSVSource(CriteoConfig((str(data),), ROWS)).batches(batch)]
    assert any((a.sparse != b.sparse).any() for a, b in zip(batches, plain, strict=True)), "the order changed"
    expected = train_reference(
        checkpoint.load(paths["initial"]), batches, MODEL, OptimizerConfig("adagrad", 0.1)
    )
    assert_same_model(paths["final"], expected)
