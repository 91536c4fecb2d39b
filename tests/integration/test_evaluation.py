"""Held-out evaluation during and after training equals a direct computation with the model of that
moment: plain PyTorch on full tables from the synchronous reference, scored on the whole file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from bagpipe.core import checkpoint
from bagpipe.core.model import build_model
from bagpipe.core.optim import OptimizerConfig
from bagpipe.data_processor.files import CriteoConfig, CriteoTSVSource

from tests.integration.conftest import flags
from tests.integration.test_equivalence import MODEL
from tests.reference import train_reference

ROWS = [5, 7, 50, 40, 3, 4, 30, 6, 3, 20, 9, 45, 8, 4, 11, 35, 4, 6, 5, 4, 33, 4, 4, 12, 4, 9]


def criteo_tsv(path: Path, samples: int, salt: int) -> None:
    lines = []
    for i in range(samples):
        ints = ["" if (i + salt) % 7 == 0 else str((i * 13 + k * salt) % 50) for k in range(13)]
        cats = [
            format((i * 2654435761 + k * 97 + salt) % (1 << 32) % (3 + (i % 5) * 40), "x") for k in range(26)
        ]
        lines.append("\t".join([str((i * 7 + salt) % 3 % 2), *ints, *cats]))
    path.write_text("\n".join(lines) + "\n")


# logits computed in other batch shapes (each trainer scores its share in chunks) may differ in the last
# float32 bits; a positive/negative pair closer than this may rank either way (equal samples tie exactly)
LOGIT_TOLERANCE = 1e-5


def direct_metrics(model_ckpt: dict, held_out: Path) -> tuple[float, tuple[float, float]]:
    """Logloss (torch's BCE) of a checkpoint on every held-out sample, and the bounds of its AUC (the
    pairwise definition, ties half) when pairs within ``LOGIT_TOLERANCE`` may rank either way."""
    samples = [
        s for _, s in CriteoTSVSource(CriteoConfig(paths=(str(held_out),), table_rows=tuple(ROWS))).batches(1)
    ]
    dense = torch.from_numpy(np.concatenate([s.dense for s in samples]))
    sparse = np.concatenate([s.sparse for s in samples])
    labels = np.concatenate([s.labels for s in samples])
    model = build_model(MODEL)
    model.load_state_dict(model_ckpt["dense"])
    rows = torch.stack(
        [model_ckpt["embeddings"][str(t)][torch.from_numpy(sparse[:, t])] for t in range(26)], dim=1
    )
    with torch.no_grad():
        logits = model(dense, rows).double()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels).double())
    pos, neg = logits[labels == 1], logits[labels == 0]
    gap = pos[:, None] - neg[None, :]
    sure = int((gap > LOGIT_TOLERANCE).sum())
    close = int((gap.abs() <= LOGIT_TOLERANCE).sum())
    pairs = pos.numel() * neg.numel()
    assert close < 0.02 * pairs, "too many near ties for the AUC to be a check"
    return float(loss), (sure / pairs, (sure + close) / pairs)


def test_held_out_logloss_and_auc_equal_a_direct_computation(run_job, tmp_path: Path) -> None:
    train, held_out, batch = tmp_path / "train.tsv", tmp_path / "held_out.tsv", 32
    criteo_tsv(train, 10 * batch, salt=1)
    criteo_tsv(held_out, 157, salt=5)  # not a multiple of anything: every sample counts
    summary, paths = run_job(
        "eval",
        *flags(
            data=f"criteo:{train}",
            table_rows=",".join(map(str, ROWS)),
            iterations=0,
            trainers=2,
            embedding_servers=2,
            lookahead=4,
            batch_size=batch,
            optimizer="adagrad",
            lr="0.1",
            eval_data=f"criteo:{held_out}",
            eval_every=4,
        ),
        report=True,
    )
    evals = summary["evaluations"]
    assert [e["batches"] for e in evals] == [4, 8, 10] and all(e["samples"] == 157 for e in evals)
    # mid-training: rows cached by one trainer only (LRPP) must be part of the model evaluated
    assert summary["rows_private_per_iteration"] > 0
    batches = [
        s
        for _, s in CriteoTSVSource(CriteoConfig(paths=(str(train),), table_rows=tuple(ROWS))).batches(batch)
    ]
    initial = checkpoint.load(paths["initial"])
    for e in evals:
        at = train_reference(initial, batches[: e["batches"]], MODEL, OptimizerConfig("adagrad", 0.1))
        loss, (low, high) = direct_metrics(at, held_out)
        assert e["logloss"] == pytest.approx(loss, abs=1e-5), e
        assert low - 1e-12 <= e["auc"] <= high + 1e-12, (e, low, high)
    assert evals[-1]["auc"] != evals[0]["auc"], "the model changed between evaluations"
    # the final one is the final model's
    loss, (low, high) = direct_metrics(checkpoint.load(paths["final"]), held_out)
    assert evals[-1]["logloss"] == pytest.approx(loss) and low - 1e-12 <= evals[-1]["auc"] <= high + 1e-12
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "eval.png").exists() and "Held-out evaluation" in (run_dir / "report.html").read_text()
    scrape = (run_dir / "metrics" / "trainer-0.prom").read_text()
    assert f"bagpipe_trainer_eval_auc {evals[-1]['auc']}" in scrape
    assert json.loads((run_dir / "config.json").read_text())["eval_data"] == f"criteo:{held_out}"


def test_the_run_record_names_flags_code_and_packages(run_job) -> None:
    summary, _ = run_job(
        "record", "--iterations", "3", "--trainers", "1", "--embedding-servers", "1", report=True
    )
    run_dir = Path(summary["run_dir"])
    config = json.loads((run_dir / "config.json").read_text())
    record = config["_record"]
    assert config["model"] == "dlrm" and config["iterations"] == 3 and config["optimizer"] == "sgd"
    assert record["packages"]["torch"] and record["packages"]["grpcio"] and record["python"]
    assert record["git_revision"] is None or len(record["git_revision"]) == 40
    page = (run_dir / "report.html").read_text()
    assert page.index("<h2>Run</h2>") < page.index("Iteration breakdown")
    assert "--embedding-dim" in page and record["packages"]["numpy"] in page
