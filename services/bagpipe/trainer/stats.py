"""What a trainer reports: stage times, per-iteration counts, Prometheus metrics, the iteration log and
the end-of-run statistics. Nothing here changes training; the training step hands it one record per
batch."""

from __future__ import annotations

import csv
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bagpipe.core.plans import TrainerBatch
from bagpipe.core.row_store import RowStore
from bagpipe.trainer import metrics
from bagpipe.trainer.tensorboard import TensorBoardLog


class IterationLog:
    """One CSV row per iteration (the run report's source): stage times, loss, cache and sync figures."""

    def __init__(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # appended to: a restarted trainer goes on in the same file (replayed batches show up again)
        self._header = not Path(path).is_file() or Path(path).stat().st_size == 0
        self._file = open(path, "a", newline="")  # noqa: SIM115 (closed by close())
        self._writer: csv.DictWriter[str] | None = None

    def write(self, row: dict[str, Any]) -> None:
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=list(row))
            if self._header:
                self._writer.writeheader()
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class StageTimer:
    """Seconds per stage of one iteration (metrics.STAGES); ``mark`` closes the stage that just ran."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.seconds = dict.fromkeys(metrics.STAGES, 0.0)
        # a CUDA stage ends when its kernels do, not when they are queued: without this, the GPU's time
        # would fall on whichever later stage waits first (or, with one trainer, on none)
        self._device = device if device is not None and device.type == "cuda" else None
        self.started = self._last = time.perf_counter()

    def mark(self, stage: str) -> None:
        if self._device is not None:
            torch.cuda.synchronize(self._device)
        now = time.perf_counter()
        self.seconds[stage] += now - self._last
        self._last = now

    def total(self) -> float:
        return self._last - self.started


class TrainerStats:
    """Counts over the run, the metrics and the iteration log, fed one ``record`` per trained batch."""

    def __init__(
        self, rank: int, first_batch: int, iteration_log: str | None, tensorboard: str | None = None
    ) -> None:
        self.rank = rank
        self.first_batch = first_batch
        self.stage_seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.losses: list[float] = []
        self.lookaheads: list[tuple[int, int]] = []  # (batch, L of its plan)
        self.peak_occupancy = 0
        self.checkpoints: list[dict[str, float]] = []
        self.log = IterationLog(iteration_log) if iteration_log else None
        self.tensorboard = TensorBoardLog(tensorboard, first_batch) if tensorboard else None
        self._bytes_seen = (0, 0)
        self._refusals_seen = 0
        metrics.FIRST_BATCH.set(first_batch)

    def record(
        self, plan: TrainerBatch, timer: StageTimer, loss: float, cache_capacity: int, store: RowStore
    ) -> None:
        """Adds trained batch ``plan.batch``: its stage times, rows, loss and the store's traffic."""
        share = plan.share
        iteration = timer.total()
        for stage, seconds in timer.seconds.items():
            self.stage_seconds[stage] += seconds
            metrics.STAGE_SECONDS.labels(stage).observe(seconds)
        metrics.ITERATION_SECONDS.observe(iteration)

        used = int(share.slots.size)
        missed = (
            # (a table over the slots' range: 0.04 against 0.5 ms for the default sort at 9,000 slots)
            int(np.isin(share.slots, share.prefetch_slots, assume_unique=True, kind="table").sum())
            if share.prefetch_slots.size
            else 0
        )
        fetched, written = int(share.prefetch_keys.size), int(share.writeback_keys.size)
        crit_rows = int(share.critical.slots.size + share.critical.handover_slots.size)
        bg_rows = int(share.background.slots.size + share.background.handover_slots.size)
        private = int(share.private_rows.size)
        counts = self.counts
        counts["iterations"] += 1
        counts["samples"] += int(plan.labels.size)
        counts["global_samples"] += plan.global_batch_size
        counts["rows"] += used
        counts["unique_rows"] += plan.unique_rows
        counts["misses"] += missed
        counts["prefetched"] += fetched
        counts["written_back"] += written
        counts["critical_rows"] += crit_rows
        counts["background_rows"] += bg_rows
        counts["private_rows"] += private
        counts["handed_over"] += int(
            share.critical.handover_slots.size + share.background.handover_slots.size
        )
        self.lookaheads.append((plan.batch, plan.lookahead))
        self.peak_occupancy = max(self.peak_occupancy, plan.occupancy)
        self.losses.append(loss)

        metrics.ITERATIONS.inc()
        metrics.SAMPLES.inc(int(plan.labels.size))
        metrics.CACHE_LOOKUPS.inc(used)
        metrics.CACHE_HITS.inc(used - missed)
        metrics.CACHE_MISSES.inc(missed)
        metrics.ROWS_PREFETCHED.inc(fetched)
        metrics.ROWS_WRITTEN_BACK.inc(written)
        metrics.ROWS_SYNCED.labels("critical").inc(crit_rows)
        metrics.ROWS_SYNCED.labels("background").inc(bg_rows)
        metrics.CACHE_OCCUPANCY.set(plan.occupancy)
        metrics.CACHE_CAPACITY.set(cache_capacity)
        metrics.LOOKAHEAD.set(plan.lookahead)
        metrics.LOSS.set(loss)
        sent, received = store.bytes_sent, store.bytes_received
        metrics.SHARD_MAP_VERSION.set(store.shard_map_version)
        metrics.SHARD_MAP_REFUSALS.inc(store.refusals - self._refusals_seen)
        self._refusals_seen = store.refusals
        metrics.BYTES.labels("sent").inc(sent - self._bytes_seen[0])
        metrics.BYTES.labels("received").inc(received - self._bytes_seen[1])
        self._bytes_seen = (sent, received)
        now = time.time()
        metrics.HEARTBEAT.set(now)
        if self.log is not None or self.tensorboard is not None:
            self._log(
                plan.batch,
                {
                    "batch": plan.batch,
                    "time": now,
                    "iteration_seconds": iteration,
                    **{f"{stage}_seconds": sec for stage, sec in timer.seconds.items()},
                    "loss": loss,
                    "samples": int(plan.labels.size),
                    "rows_used": used,
                    "rows_missed": missed,
                    "rows_prefetched": fetched,
                    "rows_written_back": written,
                    "rows_synced_critical": crit_rows,
                    "rows_synced_background": bg_rows,
                    "rows_private": private,
                    "lookahead": plan.lookahead,
                    "cache_occupancy_rows": plan.occupancy,
                    "bytes_sent": sent,
                    "bytes_received": received,
                },
                1.0 - missed / max(1, used),
            )

    def _log(self, batch: int, row: dict[str, Any], hit_rate: float) -> None:
        if self.log is not None:
            self.log.write(row)
        if self.tensorboard is not None:
            self.tensorboard.iteration(batch, row, hit_rate)

    def record_checkpoint(self, next_batch: int, seconds: float, written: dict[str, float]) -> None:
        self.checkpoints.append({"next_batch": float(next_batch), "seconds": seconds, **written})
        metrics.CHECKPOINT_SECONDS.observe(seconds)
        metrics.CHECKPOINTS.inc()
        metrics.LAST_CHECKPOINT.set(next_batch)
        metrics.HEARTBEAT.set(time.time())  # a checkpoint is progress too
        if self.tensorboard is not None:
            self.tensorboard.checkpoint(next_batch, seconds)

    def _lookahead_stats(self) -> dict[str, float]:
        """L over the plans whose window did not reach the end of the data (the tail's shrinks anyway)."""
        final = self.lookaheads[-1][0] if self.lookaheads else 0
        inner = [w for b, w in self.lookaheads if b + w <= final] or [w for _, w in self.lookaheads] or [0]
        return {"min": min(inner), "max": max(inner), "mean": sum(inner) / len(inner)}

    def summary(
        self, elapsed: float, transfers: dict[str, int], cache_capacity: int, store: RowStore
    ) -> dict[str, Any]:
        """The run's statistics (``bagpipe run`` reports and the benchmarks read these)."""
        it = max(1, self.counts["iterations"])
        counts = self.counts
        return {
            "rank": self.rank,
            "first_batch": self.first_batch,
            "checkpoints": self.checkpoints,
            "iterations": counts["iterations"],
            "seconds": elapsed,
            "samples_per_second": counts["global_samples"] / elapsed if elapsed > 0 else 0.0,
            "stage_seconds_per_iteration": {s: self.stage_seconds[s] / it for s in metrics.STAGES},
            "unique_rows_per_iteration": counts["unique_rows"] / it,
            "rows_per_iteration": counts["rows"] / it,
            "rows_prefetched_per_iteration": counts["prefetched"] / it,
            "rows_written_back_per_iteration": counts["written_back"] / it,
            "rows_private_per_iteration": counts["private_rows"] / it,
            "rows_synced_critical_per_iteration": counts["critical_rows"] / it,
            "rows_synced_background_per_iteration": counts["background_rows"] / it,
            "rows_handed_over": counts["handed_over"],
            "lookup_calls": transfers["lookup_calls"],
            "write_back_calls": transfers["write_back_calls"],
            "cache_hit_rate": 1.0 - counts["misses"] / max(1, counts["rows"]),
            "cache_capacity_rows": cache_capacity,
            "cache_peak_occupancy_rows": self.peak_occupancy,
            "lookahead": self._lookahead_stats(),
            "bytes_sent": store.bytes_sent,
            "bytes_received": store.bytes_received,
            "rows_initial": store.initial_rows,
            "rows_first": transfers["first_rows"],
            "losses": self.losses,
        }

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
