"""Evaluation of the current model on held-out data (``--eval-data``, ``--eval-every``).

Each trainer scores a contiguous share of the held-out samples with its dense model and the newest
rows, read from the embedding servers: an evaluation runs at a point where they hold every row's newest
value (the end of training, or a flush the oracle plans after the batch, as for a checkpoint, while
every trainer waits). The trainers then exchange their logits, so each computes the same exact logloss
and ROC AUC over all held-out samples (core/evaluation.py).

Held-out sources: a file source (``criteo:PATH``, ``avazu:PATH``) read whole in order with the training
data's table sizes, or ``synthetic``: samples of the training generator from batch numbers training
never reaches (2^40 on), so unseen samples of the same distribution.
"""

from __future__ import annotations

import csv
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bagpipe.core.data import Samples
from bagpipe.core.evaluation import EVAL_FIELDS, logloss, roc_auc
from bagpipe.core.model import batch_logits
from bagpipe.core.row_store import RowStore

logger = logging.getLogger(__name__)

HELD_OUT_FIRST_BATCH = 1 << 40  # synthetic held-out samples come from batch numbers this far on
DEFAULT_SYNTHETIC_SAMPLES = 16384
SCORE_CHUNK = 8192  # samples scored per forward pass (bounds the memory of one lookup)


@dataclass(frozen=True)
class EvalResult:
    batch: int  # evaluated after training this many batches
    samples: int
    logloss: float
    auc: float
    seconds: float

    def as_dict(self) -> dict[str, float]:
        return {
            "batches": self.batch,
            "samples": self.samples,
            "logloss": self.logloss,
            "auc": self.auc,
            "seconds": self.seconds,
        }


def append_eval(path: Path, result: EvalResult) -> None:
    """One evaluation as a CSV row of ``path`` (a header first in a new file)."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=EVAL_FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(result.as_dict())


def load_held_out(
    data: str,
    table_rows: tuple[int, ...],
    seed: int,
    limit: int,
    batch_size: int,
    schema: str | None = None,
    like: str | None = None,
) -> Samples:
    """All held-out samples of ``data`` (at most ``limit``; 0: the whole file, or
    DEFAULT_SYNTHETIC_SAMPLES for synthetic data), laid out as the training data: ``schema``, or without
    one the layout inferred from the training data ``like`` (its own values could infer other transforms
    from the held-out file)."""
    from bagpipe.core.schema import TABLE_KINDS, schema_of
    from bagpipe.data_processor.config import SourceConfig

    tables = data.partition(":")[0] in TABLE_KINDS
    inferred = schema_of(like).with_table_rows(table_rows) if tables and not schema and like else None
    config = SourceConfig(data=data, table_rows=table_rows, seed=seed, schema=schema if tables else None)
    source = config.open(inferred)
    parts: list[Samples] = []
    if data == "synthetic":
        want = limit or DEFAULT_SYNTHETIC_SAMPLES
        number = HELD_OUT_FIRST_BATCH
        while sum(len(p) for p in parts) < want:
            parts.append(source.batch(number, min(batch_size, want - sum(len(p) for p in parts))))  # type: ignore[union-attr]
            number += 1
    else:
        for count, (_, sample) in enumerate(source.batches(1), start=1):  # type: ignore[union-attr]
            parts.append(sample)
            if limit and count >= limit:
                break
    if not parts:
        raise ValueError(f"--eval-data {data}: no samples")
    return Samples(
        dense=np.concatenate([p.dense for p in parts]),
        sparse=np.concatenate([p.sparse for p in parts]),
        labels=np.concatenate([p.labels for p in parts]),
    )


class HeldOut:
    """This trainer's share of the held-out samples, and the evaluation over all trainers' shares."""

    def __init__(self, samples: Samples, offsets: np.ndarray, rank: int, world_size: int) -> None:
        n = len(samples)
        lo, hi = n * rank // world_size, n * (rank + 1) // world_size
        self.total = n
        self.dense = samples.dense[lo:hi]
        self.keys = samples.sparse[lo:hi] + offsets[:-1][None, :]
        self.labels = samples.labels[lo:hi]
        self.world_size = world_size
        self.results: list[EvalResult] = []

    def evaluate(
        self, model: torch.nn.Module, store: RowStore, device: torch.device, batch: int
    ) -> EvalResult:
        """Scores this share with ``model`` and the servers' rows; every trainer must call it together."""
        t0 = time.perf_counter()
        logits = np.empty(self.labels.size, dtype=np.float32)
        with torch.no_grad():
            for lo in range(0, self.labels.size, SCORE_CHUNK):
                keys = self.keys[lo : lo + SCORE_CHUNK]
                unique, inverse = np.unique(keys, return_inverse=True)
                rows, _ = store.lookup(unique)
                rows_t = torch.from_numpy(rows).to(device)
                index = torch.from_numpy(inverse.reshape(keys.shape).astype(np.int64, copy=False)).to(device)
                dense = torch.from_numpy(self.dense[lo : lo + SCORE_CHUNK]).to(device)
                # (as in training: DLRM reads the rows by index, the other models gather them first)
                scores = batch_logits(model, dense, rows_t, index)
                logits[lo : lo + keys.shape[0]] = scores.float().cpu().numpy()
        if self.world_size > 1:
            shares: list[Any] = [None] * self.world_size
            dist.all_gather_object(shares, (logits, self.labels))
            all_logits = np.concatenate([s[0] for s in shares])
            all_labels = np.concatenate([s[1] for s in shares])
        else:
            all_logits, all_labels = logits, self.labels
        result = EvalResult(
            batch=batch,
            samples=int(all_labels.size),
            logloss=logloss(all_logits, all_labels),
            auc=roc_auc(all_logits, all_labels),
            seconds=time.perf_counter() - t0,
        )
        self.results.append(result)
        logger.info(
            "evaluation after %d batches: logloss %.5f, AUC %.5f (%d samples, %.2f s)",
            batch,
            result.logloss,
            result.auc,
            result.samples,
            result.seconds,
        )
        return result
