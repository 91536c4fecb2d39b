"""The chart runs a job from start to end: checkpoints on by default and an automatic resume from the
newest complete one (parsed by the services' own parsers against a real checkpoint directory), a checkpoint
that cannot be written fails the Job instead of being retried, alerts quiet on healthy series and firing
on failed ones (``promtool test rules``), NOTES true to what was rendered, and the chart as a subchart."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from bagpipe.core import snapshots
from bagpipe.local.prometheus import find_binary

from tests.chart.test_chart import (
    CHART,
    bagpipe_containers,
    by_kind,
    helm,
    kubelet_env,
    parse_container,
    render,
    render_notes,
    run,
)


def _complete_checkpoint(directory: Path, n: int, previous: int) -> None:
    keys = np.arange(3, dtype=np.int64)
    rows = np.zeros((3, 16), dtype=np.float32)
    name, _ = snapshots.write_rows(directory, n, 0, keys, rows, rows[:, :0])
    (snapshots.path_of(directory, n) / snapshots.DENSE).write_bytes(b"dense")
    snapshots.mark_complete(directory, n, {"previous": previous, "full": False, "row_files": [name]})


def test_checkpoints_are_on_by_default_and_only_the_controller_chooses_where_the_job_begins(
    tmp_path: Path,
) -> None:
    """``training.resumeBatch`` reaches the controller alone (``--start-batch``), read once when the job has
    no generation yet; trainers and servers are started with ``--resume-batch latest`` (what a restarted
    server loads before the generation's roll-back), so no process start depends on a checkpoint pruning
    may remove. The oracle needs no volume: it plans from each generation's start."""
    docs = render()
    containers = {name.split("/")[-1]: c for name, c in bagpipe_containers(docs).items()}
    trainer, server, oracle = (containers[c] for c in ("trainer", "embedding-server", "oracle-cacher"))
    directory = "/bagpipe/checkpoints/bagpipe"
    for container in (trainer, server):
        args = container["args"]
        assert args[args.index("--checkpoint-dir") + 1] == directory
        assert args[args.index("--resume-batch") + 1] == "latest"
    assert trainer["args"][trainer["args"].index("--keep-checkpoints") + 1] == "3"
    assert "--start-batch" not in oracle["args"] and "--checkpoint-dir" not in oracle["args"]
    assert oracle["args"][oracle["args"].index("--checkpoint-every") + 1] == "50"
    assert "run" not in {m["name"] for m in oracle["volumeMounts"]}
    for value, expected in (("latest", "latest"), ("50", 50)):
        chosen = render("--set", f"training.resumeBatch={value}")
        (control,) = [c for n, c in bagpipe_containers(chosen).items() if n.endswith("/controller")]
        env = kubelet_env(control, chosen, POD_IP="10.1.2.3")
        assert parse_container(control, env)[0].start_batch == expected
    # a restarted server's own parser, on the volume as it finds it: the newest complete one
    local = tmp_path / "checkpoints"
    _complete_checkpoint(local, 50, 0)
    _complete_checkpoint(local, 100, 50)
    (snapshots.path_of(local, 150)).mkdir()  # (one being written when the pods stopped: not complete)
    for container in (trainer, server):
        env = kubelet_env(container, docs, POD_IP="10.1.2.3", POD_INDEX="0")
        moved = {**container, "args": [str(local) if a == directory else a for a in container["args"]]}
        assert parse_container(moved, env)[0].resume_batch == 100, container["name"]
    # and a first install, with nothing on the volume yet, starts at 0
    env = kubelet_env(trainer, docs, POD_IP="10.1.2.3", POD_INDEX="0")
    empty = {**trainer, "args": [str(tmp_path / "none") if a == directory else a for a in trainer["args"]]}
    assert parse_container(empty, env)[0].resume_batch == 0


def test_a_checkpoint_that_cannot_be_written_fails_the_job() -> None:
    (job,) = by_kind(render(), "Job").values()
    (rule,) = [r for r in job["spec"]["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert rule["onExitCodes"] == {
        "containerName": "trainer",
        "operator": "In",
        "values": [snapshots.EXIT_CHECKPOINT_FAILED],
    }


def test_a_stale_threshold_below_twice_the_scrape_interval_is_refused() -> None:
    out = run(helm(), "template", "bagpipe", str(CHART), "--set", "prometheus.rules.heartbeatStaleSeconds=20")
    assert out.returncode != 0
    assert "heartbeatStaleSeconds=20 is below twice the scrape interval (trainer.metrics.interval=15s)" in (
        out.stderr
    )


# every 15 s (the ServiceMonitor's interval) Prometheus scrapes trainer t0 (healthy: its heartbeat a few
# seconds old at each scrape), t1 (stuck from 5 minutes on: answers, heartbeat frozen), t2 (done at 5 min:
# its heartbeat stops but it reports finished) and embedding server s1 (gone from 5 minutes on)
_SERIES = [
    ("bagpipe_trainer_heartbeat_timestamp_seconds", "trainer", "t0", "-4+15x80"),
    ("bagpipe_trainer_heartbeat_timestamp_seconds", "trainer", "t1", "-4+15x20 296x60"),
    ("bagpipe_trainer_heartbeat_timestamp_seconds", "trainer", "t2", "-4+15x20 296x60"),
    ("bagpipe_trainer_finished", "trainer", "t0", "0x80"),
    ("bagpipe_trainer_finished", "trainer", "t1", "0x80"),
    ("bagpipe_trainer_finished", "trainer", "t2", "0x20 1x60"),
    ("bagpipe_trainer_alive_timestamp_seconds", "trainer", "t0", "0+15x80"),
    ("bagpipe_trainer_alive_timestamp_seconds", "trainer", "t1", "0+15x80"),
    ("bagpipe_trainer_alive_timestamp_seconds", "trainer", "t2", "0+15x80"),
    ("bagpipe_embedding_server_alive_timestamp_seconds", "embedding-server", "s0", "0+15x80"),
    ("bagpipe_embedding_server_alive_timestamp_seconds", "embedding-server", "s1", "0+15x20 _x60"),
    ("up", "trainer", "t0", "1x80"),
    ("up", "trainer", "t1", "1x80"),
    ("up", "trainer", "t2", "1x80"),
    ("up", "embedding-server", "s0", "1x80"),
    ("up", "embedding-server", "s1", "1x20 0x60"),
]


def _alerts(rule: dict[str, Any], name: str, jobs: dict[str, str]) -> list[dict[str, Any]]:
    (spec,) = [r for g in rule["spec"]["groups"] for r in g["rules"] if r.get("alert") == name]
    out = []
    for job, instance in jobs.items():
        labels = {"severity": "critical", "job": f"bagpipe-{job}", "instance": instance}
        summary = spec["annotations"]["summary"].replace("{{ $labels.instance }}", instance)
        summary = summary.replace("{{ $labels.job }}", f"bagpipe-{job}")
        out.append(
            {
                "exp_labels": labels,
                "exp_annotations": {"summary": summary, "description": spec["annotations"]["description"]},
            }
        )
    return out


def test_alerts_are_quiet_on_healthy_series_and_fire_on_failed_ones(tmp_path: Path) -> None:
    (rule,) = by_kind(render(), "PrometheusRule").values()
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    series = [
        {"series": f'{name}{{job="bagpipe-{job}", instance="{instance}"}}', "values": values}
        for name, job, instance, values in _SERIES
    ]
    cases = []
    for minutes in (2, 5, 6):  # healthy throughout, at the moment of the failures, and within `for`
        for alert in ("BagpipeTrainerStuck", "BagpipeServiceGone"):
            cases.append({"eval_time": f"{minutes}m", "alertname": alert, "exp_alerts": []})
    for minutes in (8, 19):  # past the threshold and its `for`: exactly the failed members
        cases.append(
            {
                "eval_time": f"{minutes}m",
                "alertname": "BagpipeTrainerStuck",
                "exp_alerts": _alerts(rule, "BagpipeTrainerStuck", {"trainer": "t1"}),
            }
        )
        cases.append(
            {
                "eval_time": f"{minutes}m",
                "alertname": "BagpipeServiceGone",
                "exp_alerts": _alerts(rule, "BagpipeServiceGone", {"embedding-server": "s1"}),
            }
        )
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "alert_rule_test": cases}],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    out = run(find_binary("promtool"), "test", "rules", str(tmp_path / "tests.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("args", "says", "never"),
    [
        (("no-crds",), "this cluster serves no monitoring.coreos.com/v1 API", "ServiceMonitors bagpipe-"),
        (
            (),
            'ServiceMonitors bagpipe-<component> select the services\' "metrics" port; alerts are in '
            "PrometheusRule bagpipe.",
            "no ServiceMonitor",
        ),
        (
            ("--set", "prometheus.serviceMonitor.enabled=false", "--set", "prometheus.rules.enabled=true"),
            "alerts are in PrometheusRule bagpipe; no ServiceMonitor was rendered",
            "ServiceMonitors bagpipe-",
        ),
        (
            ("--set", "prometheus.serviceMonitor.enabled=false", "--set", "prometheus.rules.enabled=false"),
            "prometheus.serviceMonitor.enabled and prometheus.rules.enabled are false",
            "PrometheusRule bagpipe",
        ),
    ],
    ids=["auto-without-operator", "auto-with-operator", "rules-only", "off"],
)
def test_notes_say_what_monitoring_was_rendered(
    tmp_path: Path, args: tuple[str, ...], says: str, never: str
) -> None:
    crds = args != ("no-crds",)
    args = args if crds else ()
    text = render_notes(tmp_path, *args, crds=crds)
    assert says in text and never not in text
    assert "Checkpoints: every 50 batches in /bagpipe/checkpoints/bagpipe" in text
    assert "the newest complete checkpoint there" in text
    docs = render(*args, crds=crds)
    rendered = {d["kind"] for d in docs}
    assert ("ServiceMonitor" in rendered) == ("ServiceMonitors bagpipe-" in text)
    assert ("PrometheusRule" in rendered) == ("alerts are in PrometheusRule" in text)


def test_the_chart_works_as_a_subchart_with_global_values(tmp_path: Path) -> None:
    parent = tmp_path / "platform"
    shutil.copytree(CHART, parent / "charts" / "bagpipe")
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    (parent / "Chart.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v2",
                "name": "platform",
                "version": "0.1.0",
                "dependencies": [
                    {"name": "bagpipe", "version": version, "repository": "file://charts/bagpipe"}
                ],
            }
        )
    )
    (parent / "values.yaml").write_text(
        yaml.safe_dump({"global": {"imageRegistry": "registry.example.com"}, "bagpipe": {"training": {}}})
    )
    out = run(helm(), "template", "team", str(parent), "--set", "bagpipe.trainer.replicaCount=4")
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    assert job["spec"]["completions"] == 4
    lint = run(helm(), "lint", str(parent), "--strict")
    assert lint.returncode == 0, lint.stdout + lint.stderr
