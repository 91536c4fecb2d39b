"""Prometheus metrics of the data processor (the one place their names are defined)."""

from prometheus_client import Counter, Histogram

SAMPLES = Counter("bagpipe_data_processor_samples_total", "Samples put into batches")
BATCHES = Counter("bagpipe_data_processor_batches_total", "Batches streamed")
SHARED = Counter(
    "bagpipe_data_processor_shared_batches_total",
    "Batches streamed to an oracle shard from a build made for another shard's stream",
)
BAD_ROWS = Counter("bagpipe_data_processor_bad_rows_total", "Malformed input lines skipped")
BUILD_SECONDS = Histogram("bagpipe_data_processor_batch_build_seconds", "Time to read and build one batch")
MASK_SECONDS = Histogram(
    "bagpipe_data_processor_trainer_mask_seconds",
    "Time to work out which trainers use each key of one batch (LRPP)",
)
