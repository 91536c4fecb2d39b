"""Every service's /metrics, scraped live with a real HTTP client and the Prometheus text parser; a real
Prometheus server scraping a local run; the run report."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

from bagpipe.local.prometheus import PrometheusServer
from bagpipe.trainer.metrics import STAGES
from prometheus_client.parser import text_string_to_metric_families

from tests.dashboard_exprs import dashboard_exprs

ITERATIONS, BATCH, TRAINERS, SERVERS = 16, 64, 2, 2


def scrape(address: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)]"""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    assert name in samples, f"{name} missing"
    return sum(v for lab, v in samples[name] if all(lab.get(k) == x for k, x in labels.items()))


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def check_live_services(endpoints: dict[str, str], prometheus: PrometheusServer | None) -> dict[str, Any]:
    services = {name.split("/")[0] for name in endpoints}
    assert services == {"trainer", "oracle_cacher", "embedding_server", "data_processor"}
    assert len(endpoints) == TRAINERS + SERVERS + 1 + 1
    for address in endpoints.values():
        assert http_status(f"http://{address}/healthz") == 200
        assert http_status(f"http://{address}/readyz") == 200
        assert http_status(f"http://{address}/nope") == 404
    scraped = {name: scrape(address) for name, address in endpoints.items()}

    for rank in range(TRAINERS):
        t = scraped[f"trainer/{rank}"]
        assert total(t, "bagpipe_trainer_iterations_total") == ITERATIONS
        assert total(t, "bagpipe_trainer_samples_total") == ITERATIONS * BATCH / TRAINERS
        iteration = total(t, "bagpipe_trainer_iteration_seconds_sum")
        stages = sum(total(t, "bagpipe_trainer_stage_seconds_sum", stage=s) for s in STAGES)
        assert abs(stages - iteration) <= 0.01 * iteration, (
            f"stages {stages:.4f} s vs iterations {iteration:.4f} s"
        )
        for s in STAGES:
            assert total(t, "bagpipe_trainer_stage_seconds_count", stage=s) == ITERATIONS
        lookups = total(t, "bagpipe_trainer_cache_lookups_total")
        hits, misses = (
            total(t, "bagpipe_trainer_cache_hits_total"),
            total(t, "bagpipe_trainer_cache_misses_total"),
        )
        assert hits + misses == lookups > 0 and hits > 0 and misses > 0
        assert total(t, "bagpipe_trainer_rows_prefetched_total") > 0
        # a fresh run: the rows used for the first time are computed, and are among those prefetched
        assert (
            0
            < total(t, "bagpipe_trainer_rows_computed_total")
            <= total(t, "bagpipe_trainer_rows_prefetched_total")
        )
        assert total(t, "bagpipe_trainer_rows_written_back_total") > 0
        assert total(t, "bagpipe_trainer_embedding_bytes_total", direction="received") > 0
        assert total(t, "bagpipe_trainer_embedding_bytes_total", direction="sent") > 0
        assert total(t, "bagpipe_trainer_rows_synced_total", path="critical") > 0
        assert (
            0
            < total(t, "bagpipe_trainer_cache_occupancy_rows")
            <= total(t, "bagpipe_trainer_cache_capacity_rows")
        )
        assert 0.0 < total(t, "bagpipe_trainer_loss") < 2.0
        assert abs(time.time() - total(t, "bagpipe_trainer_heartbeat_timestamp_seconds")) < 300

    o = scraped["oracle_cacher/0"]
    assert total(o, "bagpipe_oracle_cacher_batches_planned_total") == ITERATIONS
    assert total(o, "bagpipe_oracle_cacher_plans_dispatched_total") == ITERATIONS * TRAINERS
    assert total(o, "bagpipe_oracle_cacher_plan_seconds_count") == ITERATIONS
    assert total(o, "bagpipe_oracle_cacher_lookahead_batches") >= 1
    assert {lab["rank"] for lab, _ in o["bagpipe_oracle_cacher_queue_depth_plans"]} == {"0", "1"}

    fetched = sum(
        total(scraped[f"trainer/{r}"], "bagpipe_trainer_rows_prefetched_total") for r in range(TRAINERS)
    )
    written = sum(
        total(scraped[f"trainer/{r}"], "bagpipe_trainer_rows_written_back_total") for r in range(TRAINERS)
    )
    served = [scraped[f"embedding_server/{s}"] for s in range(SERVERS)]
    assert sum(total(e, "bagpipe_embedding_server_rows_total", op="lookup") for e in served) >= fetched
    assert sum(total(e, "bagpipe_embedding_server_rows_total", op="write_back") for e in served) == written
    for e in served:
        assert total(e, "bagpipe_embedding_server_requests_total", op="lookup") > 0
        assert total(e, "bagpipe_embedding_server_request_seconds_count", op="lookup") > 0
        assert total(e, "bagpipe_embedding_server_bytes_total", op="lookup") > 0
        assert total(e, "bagpipe_embedding_server_rows_held") > 0

    d = scraped["data_processor/0"]
    assert total(d, "bagpipe_data_processor_samples_total") == ITERATIONS * BATCH
    assert total(d, "bagpipe_data_processor_bad_rows_total") == 0
    assert total(d, "bagpipe_data_processor_batch_build_seconds_count") == ITERATIONS

    assert prometheus is not None
    deadline = time.monotonic() + 30  # until Prometheus has scraped the trainers' final values, twice or more
    while True:
        result = prometheus.query("bagpipe_trainer_iterations_total")
        scrapes = prometheus.query("count_over_time(bagpipe_trainer_iterations_total[5m])")
        if (
            len(result) == TRAINERS
            and all(float(r["value"][1]) == ITERATIONS for r in result)
            and len(scrapes) == TRAINERS
            and all(float(r["value"][1]) >= 2 for r in scrapes)
        ):
            break
        assert time.monotonic() < deadline, f"Prometheus has {result}"
        time.sleep(0.5)
    assert {r["metric"]["job"] for r in result} == {"trainer"}
    for expr in dashboard_exprs(rate_interval="10s"):  # the dashboard's queries run on the real server
        prometheus.query(expr)
    assert prometheus.query("sum(rate(bagpipe_trainer_samples_total[5m]))")
    return scraped


def test_every_service_serves_metrics_that_add_up_and_prometheus_scrapes_them(run_job) -> None:
    seen: dict[str, Any] = {}
    summary, _ = run_job(
        "observed",
        "--trainers",
        str(TRAINERS),
        "--embedding-servers",
        str(SERVERS),
        "--lookahead",
        "4",
        "--iterations",
        str(ITERATIONS),
        "--prometheus",
        after_training=lambda endpoints, prom: seen.update(check_live_services(endpoints, prom)),
        report=True,
    )
    assert seen, "the checks ran while the services were up"
    run_dir = Path(summary["run_dir"])
    # the run directory holds the per-iteration metrics, the final scrapes and the report
    for rank in range(TRAINERS):
        lines = (run_dir / "metrics" / f"trainer-{rank}.csv").read_text().splitlines()
        assert len(lines) == ITERATIONS + 1 and lines[0].startswith("batch,time,iteration_seconds")
        assert (run_dir / "metrics" / f"trainer-{rank}.prom").stat().st_size > 0
    report = Path(summary["report"])
    page = report.read_text()
    for png in ("iteration_breakdown.png", "loss.png", "cache.png"):
        assert f'src="{png}"' in page
        assert (run_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "prometheus" / "prometheus.yml").exists()
