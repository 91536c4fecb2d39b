"""Every model with every optimizer trains exactly like single-process synchronous training.

The reference (tests/reference.py) uses stock ``nn.Embedding`` tables (a separate one-column table per
field for the first-order weights of W&D and DeepFM) and stock optimizers (``SparseAdam`` for the
tables under Adam); Bagpipe keeps a field's vector and first-order weight as one row, in caches and on
servers, with its optimizer state beside it. LRPP, delayed synchronisation and L=8 (rows change hands)
are on. Each (model, optimizer) pair runs in one of the two layouts, T=2/S=2 or T=3/S=1, and every
model and every optimizer runs in both.

"Float noise" is measured, not assumed: the reference is also trained on the same batches with the
samples of each batch in reverse order (the same mathematics, another summation order), and each
tensor may differ from the reference by at most 3x that spread, and never by more than 1e-4 where the
spread is below it. The spread is large in few places: Adagrad's first update of a row is lr·sign(g),
so a row whose first gradient nearly cancels (DCN's cross layers make some) moves by ±lr on noise.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from bagpipe.core import checkpoint
from bagpipe.core.model import ModelConfig
from bagpipe.core.optim import OptimizerConfig

from tests.integration.conftest import adam_eps, flags
from tests.integration.test_equivalence import TOLERANCE, synthetic_batches
from tests.reference import train_reference

SIZES = {
    "dlrm": {"bottom_mlp": (16, 8), "top_mlp": (16, 1)},
    "wdl": {"deep_mlp": (16, 8)},
    "deepfm": {"deep_mlp": (16, 8)},
    "dcn": {"deep_mlp": (16, 8), "cross_layers": 2},
}  # the sizes conftest.TINY_MODEL gives the runs
LR = {"sgd": 0.05, "adagrad": 0.05, "adam": 0.01}

# (model, optimizer, trainers, embedding servers); DLRM with SGD and Adagrad is in test_equivalence
MATRIX = [
    ("dlrm", "adam", 2, 2),
    ("dlrm", "adam", 3, 1),
    ("wdl", "sgd", 2, 2),
    ("wdl", "adagrad", 3, 1),
    ("wdl", "adam", 2, 2),
    ("deepfm", "sgd", 3, 1),
    ("deepfm", "adagrad", 2, 2),
    ("deepfm", "adam", 3, 1),
    ("dcn", "sgd", 2, 2),
    ("dcn", "adagrad", 3, 1),
    ("dcn", "adam", 3, 1),
]


@pytest.mark.parametrize(("model", "optimizer", "trainers", "servers"), MATRIX)
def test_model_and_optimizer_match_synchronous_training(
    run_job, model: str, optimizer: str, trainers: int, servers: int
) -> None:
    iterations, batch = 20, 32 * trainers
    summary, paths = run_job(
        f"{model}-{optimizer}-t{trainers}",
        *flags(
            model=model,
            optimizer=optimizer,
            lr=LR[optimizer],
            trainers=trainers,
            embedding_servers=servers,
            lookahead=8,
            iterations=iterations,
            batch_size=batch,
            **adam_eps(optimizer),
        ),
    )
    assert summary["iterations"] == iterations
    assert summary["rows_private_per_iteration"] > 0 and summary["rows_synced_background_per_iteration"] > 0
    assert summary["rows_handed_over"] > 0
    config = ModelConfig(embedding_dim=8, name=model, **SIZES[model])  # type: ignore[arg-type]
    initial, optim = (
        checkpoint.load(paths["initial"]),
        OptimizerConfig(optimizer, LR[optimizer], **adam_eps(optimizer)),
    )
    batches = synthetic_batches(iterations, batch)
    expected = train_reference(initial, batches, config, optim)
    reordered = [
        SimpleNamespace(**{k: getattr(b, k)[::-1].copy() for k in ("dense", "sparse", "labels")})
        for b in batches
    ]
    spread = checkpoint.max_abs_difference(train_reference(initial, reordered, config, optim), expected)
    diffs = checkpoint.max_abs_difference(checkpoint.load(paths["final"]), expected)
    over = {k: (d, spread[k]) for k, d in diffs.items() if d > max(TOLERANCE, 3 * spread[k])}
    assert not over, f"differ beyond float noise (difference, reference's own spread): {over}"
    loose = [k for k in diffs if spread[k] > TOLERANCE / 3]
    assert len(loose) <= 0.1 * len(diffs), f"the noise allowance covers too much to test anything: {loose}"
    moved = checkpoint.max_abs_difference(
        {k: initial[k] for k in expected if k in ("dense", "embeddings", "linear")},
        {k: expected[k] for k in expected if k in ("dense", "embeddings", "linear")},
    )
    assert max(moved.values()) > 100 * TOLERANCE, "training must move the model beyond the tolerance"
