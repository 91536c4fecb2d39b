"""Held-out metrics: exact ROC AUC (ties count one half) and logloss, against direct computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from bagpipe.core.evaluation import logloss, roc_auc


def pairwise_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (pos.size * neg.size))


@pytest.mark.parametrize("seed", range(5))
def test_auc_equals_the_pairwise_definition_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    scores = np.round(rng.normal(size=300), 1)  # many ties
    labels = (rng.random(300) < 0.3).astype(np.float32)
    assert roc_auc(scores, labels) == pytest.approx(pairwise_auc(scores, labels), abs=1e-12)


def test_auc_extremes_and_undefined() -> None:
    assert roc_auc(np.array([0.1, 0.2, 0.9]), np.array([0, 0, 1])) == 1.0
    assert roc_auc(np.array([0.9, 0.2, 0.1]), np.array([0, 0, 1])) == 0.0
    assert roc_auc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5
    assert math.isnan(roc_auc(np.array([0.1, 0.2]), np.array([1, 1])))


def test_logloss_equals_torch_bce_and_survives_large_logits() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=30, size=1000).astype(np.float32)
    labels = (rng.random(1000) < 0.5).astype(np.float32)
    expected = torch.nn.functional.binary_cross_entropy_with_logits(
        torch.from_numpy(logits).double(), torch.from_numpy(labels).double()
    )
    assert logloss(logits, labels) == pytest.approx(float(expected), rel=1e-12)
    with pytest.raises(ValueError, match="logits and labels"):
        logloss(logits[:3], labels[:4])
