"""Prometheus metrics of the oracle cacher (the one place their names are defined)."""

from prometheus_client import Counter, Gauge, Histogram

BATCHES_RECEIVED = Counter(
    "bagpipe_oracle_cacher_batches_received_total", "Batches received from data processors"
)
BATCHES_PLANNED = Counter("bagpipe_oracle_cacher_batches_planned_total", "Batches planned")
PLANS_DISPATCHED = Counter("bagpipe_oracle_cacher_plans_dispatched_total", "Plans sent to trainers")
PLAN_SECONDS = Histogram("bagpipe_oracle_cacher_plan_seconds", "Time to plan one batch")
PLAN_BYTES = Counter(
    "bagpipe_oracle_cacher_plan_bytes",
    "Bytes of the plans made, over all trainers: the batch's rows, each trainer's samples and plan",
)
ITERATIONS_TARGET = Gauge(
    "bagpipe_oracle_cacher_iterations_target", "Batches this run trains (--iterations; 0: the whole input)"
)
LOOKAHEAD = Gauge("bagpipe_oracle_cacher_lookahead_batches", "Lookahead L in use")
OCCUPANCY = Gauge("bagpipe_oracle_cacher_cache_occupancy_rows", "Rows resident in the (logical) cache")
QUEUE_DEPTH = Gauge(
    "bagpipe_oracle_cacher_queue_depth_plans", "Plans made and not yet sent to a trainer", ["rank"]
)
READY_PLANS = Gauge(
    "bagpipe_oracle_cacher_dispatchable_plans", "Planned batches whose write-back dependencies are met"
)
PEAK_OCCUPANCY = Gauge(
    "bagpipe_oracle_cacher_cache_peak_occupancy_rows", "Most rows resident in the logical cache so far"
)
SLOT_HIGH_WATER = Gauge(
    "bagpipe_oracle_cacher_cache_slots_rows", "Cache slots a trainer needs (live plus waiting for reuse)"
)
ROWS_SYNCED = Counter(
    "bagpipe_oracle_cacher_rows_synced_total",
    "Rows planned for synchronisation between trainers, by path",
    ["path"],
)
EARLY_REUSES = Counter(
    "bagpipe_oracle_cacher_early_slot_reuses_total",
    "Times the capacity forced a freed slot to be reused early",
)
