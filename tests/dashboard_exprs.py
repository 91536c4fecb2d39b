"""The Grafana dashboard's PromQL, and the metric names the code defines (shared by two tests)."""

from __future__ import annotations

import importlib
import json
import re
import tempfile
from pathlib import Path

from prometheus_client import REGISTRY

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "dashboards" / "bagpipe.json"
METRIC_MODULES = ("trainer", "oracle_cacher", "embedding_server", "data_processor")
# Grafana's variables, replaced by what they stand for when a query runs
VARIABLES = {"$__rate_interval": "1m", "$namespace": ".*", "$release": ".*", "$rank": ".*"}


def dashboard_exprs(rate_interval: str = "1m") -> list[str]:
    """Every target expression of every panel, with Grafana's variables substituted."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in {**VARIABLES, "$__rate_interval": rate_interval}.items():
                expr = expr.replace(var, value)
            exprs.append(expr)
    return exprs


def defined_metric_names() -> set[str]:
    """Sample names of every metric the four services define (counters: _total; histograms: _bucket...)."""
    for module in METRIC_MODULES:
        importlib.import_module(f"bagpipe.{module}.metrics")
    names: set[str] = set()
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
        "summary": ("_sum", "_count", "_created"),
    }
    for family in REGISTRY.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    # (the row tier's, which a server with --row-memory collects from its shard at each scrape)
    from bagpipe.embedding_server.metrics import TierCollector
    from bagpipe.embedding_server.row_tier import RowTier

    with tempfile.TemporaryDirectory() as directory:
        tier = RowTier(4, 2, 2, Path(directory))
        for family in TierCollector(lambda: tier).collect():
            names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        tier.close()
    return names


def names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bbagpipe_[a-z0-9_]+", expr))
