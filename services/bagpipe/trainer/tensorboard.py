"""``--tensorboard DIR``: trainer 0's training curves as TensorBoard event files, through
``torch.utils.tensorboard``'s ``SummaryWriter``, the step being the global batch.

Written: the loss, each stage's seconds and the iteration's, the cache hit rate, rows per iteration
(used, fetched, written back, synchronised), L, bytes, the held-out evaluations, checkpoints, and each
generation the job starts (a recovery rolls the job back: its first batch purges the events of the
batches it replays, so the curves show the run as it counted). The report and Grafana stay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TensorBoardLog:
    """Trainer 0's event files in ``directory``; ``first_batch`` > 0: a generation resumed there."""

    def __init__(self, directory: str, first_batch: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # (tensorboard is an optional dependency of torch)
            raise RuntimeError(
                f"--tensorboard {directory}: needs the tensorboard package (pip install "
                f"'bagpipe[tensorboard]', or tensorboard): {e}"
            ) from None
        Path(directory).mkdir(parents=True, exist_ok=True)
        # (purge_step: events of batches at or after first_batch, which this generation replays, are hidden)
        self._writer = SummaryWriter(log_dir=directory, purge_step=first_batch or None, flush_secs=10)

    def generation(self, number: int, start_batch: int) -> None:
        """Generation ``number`` of the job starts at ``start_batch`` (1: the first; each further one is a
        recovery)."""
        self._writer.add_scalar("recovery/generation", number, start_batch)
        if number > 1:
            self._writer.add_text(
                "recovery/events",
                f"generation {number} resumed from the checkpoint of batch {start_batch}",
                start_batch,
            )

    def iteration(self, batch: int, row: dict[str, Any], hit_rate: float) -> None:
        """One trained batch: the iteration log's ``row`` (see ``TrainerStats.record``)."""
        w = self._writer
        w.add_scalar("train/loss", row["loss"], batch)
        w.add_scalar("train/samples", row["samples"], batch)
        w.add_scalar("time/iteration_seconds", row["iteration_seconds"], batch)
        for key, value in row.items():
            if key.endswith("_seconds") and key != "iteration_seconds":
                w.add_scalar(f"time/{key}", value, batch)
            elif key.startswith("rows_"):
                w.add_scalar(f"rows/{key[5:]}", value, batch)
        w.add_scalar("cache/hit_rate", hit_rate, batch)
        w.add_scalar("cache/occupancy_rows", row["cache_occupancy_rows"], batch)
        w.add_scalar("cache/lookahead", row["lookahead"], batch)
        w.add_scalar("network/bytes_sent", row["bytes_sent"], batch)
        w.add_scalar("network/bytes_received", row["bytes_received"], batch)

    def evaluation(self, result: dict[str, float]) -> None:
        step = int(result["batches"])
        self._writer.add_scalar("eval/logloss", result["logloss"], step)
        self._writer.add_scalar("eval/auc", result["auc"], step)
        self._writer.flush()

    def checkpoint(self, next_batch: int, seconds: float) -> None:
        self._writer.add_scalar("checkpoint/seconds", seconds, next_batch)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
