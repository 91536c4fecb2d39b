"""Held-out metrics of a click model: logloss and ROC AUC, exact (no binning, ties averaged).

``roc_auc`` is the Mann-Whitney statistic: the probability that a random positive scores above a
random negative, ties counting one half — what ``sklearn.metrics.roc_auc_score`` and torchmetrics'
exact ``BinaryAUROC`` compute. ``logloss`` is the mean binary cross-entropy of the logits, in float64.
"""

from __future__ import annotations

import numpy as np

# the columns of a run's metrics/eval.csv (trainer 0 writes it, the launcher reads it)
EVAL_FIELDS = ("batches", "samples", "logloss", "auc", "seconds")


def logloss(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of ``logits`` against 0/1 ``labels`` (numerically stable form)."""
    x = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or not x.size:
        raise ValueError(f"logits and labels: need two equal non-empty vectors, got {x.shape} and {y.shape}")
    return float(np.mean(np.maximum(x, 0.0) - x * y + np.log1p(np.exp(-np.abs(x)))))


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve; NaN when the labels hold only one class (it is undefined then)."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels) > 0.5
    if s.shape != y.shape or s.ndim != 1:
        raise ValueError(f"scores and labels: need two equal vectors, got {s.shape} and {y.shape}")
    positives = int(y.sum())
    negatives = y.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_scores = s[order]
    # average 1-based rank of each run of equal scores
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], s.size]
    run_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = np.repeat(run_rank, ends - starts)
    rank_sum = float(ranks[y].sum())
    return (rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives)
