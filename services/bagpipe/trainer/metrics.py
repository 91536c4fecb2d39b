"""Prometheus metrics of the trainer (the one place their names are defined)."""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Counter, Gauge, Histogram

STAGES = (
    "data_wait",
    "prefetch_wait",
    "forward",
    "backward",
    "embedding_sync",
    "dense_sync",
    "optimizer",
    "write_back",
)

ITERATIONS = Counter("bagpipe_trainer_iterations_total", "Training iterations completed")
SAMPLES = Counter("bagpipe_trainer_samples_total", "Samples trained on by this trainer")
STAGE_SECONDS = Histogram(
    "bagpipe_trainer_stage_seconds",
    "Time of one stage of an iteration",
    ["stage"],
    buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
CACHE_HITS = Counter("bagpipe_trainer_cache_hits_total", "Batch rows found in the cache")
CACHE_MISSES = Counter("bagpipe_trainer_cache_misses_total", "Batch rows that had to be prefetched")
ROWS_PREFETCHED = Counter("bagpipe_trainer_rows_prefetched_total", "Rows fetched from embedding servers")
ROWS_COMPUTED = Counter(
    "bagpipe_trainer_rows_computed_total",
    "Prefetched rows used for the first time, computed here (initial values) instead of fetched",
)
ROWS_WRITTEN_BACK = Counter(
    "bagpipe_trainer_rows_written_back_total", "Rows written back to embedding servers"
)
LOSS = Gauge("bagpipe_trainer_loss", "Mean loss of the last global batch")
ITERATION_SECONDS = Histogram(
    "bagpipe_trainer_iteration_seconds",
    "Time of one whole iteration (the stages add up to it)",
    buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0),
)
CACHE_LOOKUPS = Counter(
    "bagpipe_trainer_cache_lookups_total", "Rows this trainer's samples read (hits + misses)"
)
BYTES = Counter(
    "bagpipe_trainer_embedding_bytes_total",
    "Embedding bytes exchanged with the embedding servers",
    ["direction"],
)
FINISHED = Gauge("bagpipe_trainer_finished", "1 once this trainer has trained its last batch")
HEARTBEAT = Gauge("bagpipe_trainer_heartbeat_timestamp_seconds", "Unix time of the last finished iteration")
ROWS_SYNCED = Counter(
    "bagpipe_trainer_rows_synced_total",
    "Cache rows synchronised with other trainers (all-reduced or handed over), by path",
    ["path"],
)
CACHE_OCCUPANCY = Gauge(
    "bagpipe_trainer_cache_occupancy_rows", "Rows in the logical cache during the last batch"
)
CACHE_CAPACITY = Gauge("bagpipe_trainer_cache_capacity_rows", "Rows the trainer's cache tensors hold")
LOOKAHEAD = Gauge("bagpipe_trainer_lookahead_batches", "Lookahead L the oracle used for the last batch")
CHECKPOINT_SECONDS = Histogram(
    "bagpipe_trainer_checkpoint_seconds",
    "Time training paused for one consistent checkpoint",
    buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
)
CHECKPOINTS = Counter("bagpipe_trainer_checkpoints_total", "Consistent checkpoints this trainer took part in")
LAST_CHECKPOINT = Gauge("bagpipe_trainer_last_checkpoint_batch", "First batch after the newest checkpoint")
FIRST_BATCH = Gauge("bagpipe_trainer_first_batch", "The batch this trainer process began at (> 0: resumed)")
EVAL_LOGLOSS = Gauge(
    "bagpipe_trainer_eval_logloss", "Logloss of the model on the held-out data, last evaluation"
)
EVAL_AUC = Gauge("bagpipe_trainer_eval_auc", "ROC AUC of the model on the held-out data, last evaluation")
EVAL_BATCH = Gauge("bagpipe_trainer_eval_batches", "Batches trained before the last evaluation")
EVAL_SECONDS = Histogram(
    "bagpipe_trainer_eval_seconds",
    "Time training paused for one evaluation",
    buckets=(0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0),
)
SHARD_MAP_VERSION = Gauge(
    "bagpipe_trainer_shard_map_version", "Shard-map version this trainer's transfers use"
)
SHARD_MAP_REFUSALS = Counter(
    "bagpipe_trainer_shard_map_refusals_total",
    "Transfers a server refused for their shard-map version while re-sharding (routed again and retried)",
)


@contextmanager
def heartbeat_while(what: str, every: float = 0.25, at_most: float | None = None) -> Iterator[None]:
    """Keeps ``HEARTBEAT`` going through a long step between two batches (a checkpoint, an evaluation, the
    final export): the failure detector must not take it for a hang. Each part of such a step has a deadline
    of its own (RPCs, the re-sharding lock, the collectives' timeout), so a real hang inside it still ends.
    A step with no deadline of its own beats for ``at_most`` seconds: past that, a hang is found as one."""
    stop = threading.Event()
    until = None if at_most is None else time.monotonic() + at_most

    def beat() -> None:
        while not stop.wait(every) and (until is None or time.monotonic() < until):
            HEARTBEAT.set(time.time())

    beater = threading.Thread(target=beat, name=f"heartbeat-{what}", daemon=True)
    beater.start()
    try:
        yield
    finally:
        stop.set()
        beater.join()
