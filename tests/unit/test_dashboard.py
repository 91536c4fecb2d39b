"""The Grafana dashboard queries only metrics the code defines, and every query is valid PromQL."""

from __future__ import annotations

import json
import re
import subprocess

from bagpipe.local.prometheus import find_binary

from tests.dashboard_exprs import DASHBOARD, dashboard_exprs, defined_metric_names, names_in


def test_every_dashboard_metric_is_defined_in_the_code() -> None:
    defined = defined_metric_names()
    used = set().union(*(names_in(e) for e in dashboard_exprs()))
    assert used, "the dashboard must query Bagpipe metrics"
    assert not used - defined, f"the dashboard uses metrics no service defines: {sorted(used - defined)}"
    for needed in (
        "bagpipe_trainer_stage_seconds_sum",
        "bagpipe_embedding_server_request_seconds_bucket",
        "bagpipe_oracle_cacher_queue_depth_plans",
        "bagpipe_trainer_heartbeat_timestamp_seconds",
        "bagpipe_trainer_rows_synced_total",
        "bagpipe_trainer_cache_hits_total",
    ):
        assert needed in used, f"the dashboard should show {needed}"


def test_every_dashboard_expr_passes_promtool(tmp_path) -> None:
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr_{i}", "expr": e} for i, e in enumerate(dashboard_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    out = subprocess.run(
        [find_binary("promtool"), "check", "rules", str(path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_has_the_iteration_breakdown_per_trainer() -> None:
    dash = json.loads(DASHBOARD.read_text())
    breakdown = [p for p in dash["panels"] if "Iteration breakdown" in p.get("title", "")]
    assert len(breakdown) == 1 and breakdown[0]["repeat"] == "rank"
    assert breakdown[0]["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"


def test_dashboard_selects_a_namespace_release_and_rank_in_every_query() -> None:
    """Concurrent runs do not mix: every query is scoped to the chosen namespace and release, trainer
    queries also to the chosen ranks (labels the ServiceMonitors add; not IP:port)."""
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "release", "rank"} <= set(variables)
    assert all(variables[v]["allValue"] == ".*" for v in ("namespace", "release", "rank"))
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            for selector in re.findall(r"(bagpipe_[a-z_0-9]+)(\{[^}]*\})?", target["expr"]):
                name, labels = selector
                assert 'namespace=~"$namespace"' in labels and 'release=~"$release"' in labels, (
                    name,
                    panel["title"],
                )
            assert "instance" not in target["expr"] and "instance" not in target.get("legendFormat", "")
    titles = {p["title"] for p in dash["panels"]}
    assert {
        "Progress",
        "Time to finish",
        "Stage share of the iteration (%)",
        "Held-out logloss and AUC",
    } <= titles
    shares = next(p for p in dash["panels"] if p["title"] == "Stage share of the iteration (%)")
    assert shares["fieldConfig"]["defaults"]["unit"] == "percent"
    progress = next(p for p in dash["panels"] if p["title"] == "Progress")
    assert "bagpipe_oracle_cacher_iterations_target" in progress["targets"][0]["expr"]


def test_metric_names_follow_the_convention() -> None:
    """bagpipe_<service>_<what>_<unit>, each service's metrics in its own module, low-cardinality labels."""
    import importlib

    from prometheus_client.metrics import MetricWrapperBase

    from tests.dashboard_exprs import METRIC_MODULES

    for service in METRIC_MODULES:
        module = importlib.import_module(f"bagpipe.{service}.metrics")
        found = [m for m in vars(module).values() if isinstance(m, MetricWrapperBase)]
        assert found, service
        for metric in found:
            assert metric._name.startswith(f"bagpipe_{service}_"), metric._name
            assert set(metric._labelnames) <= {"stage", "path", "direction", "op", "rank"}, metric._labelnames
