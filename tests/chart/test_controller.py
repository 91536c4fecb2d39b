"""The chart's recovery controller: its Deployment's flags (parsed by the controller's own parser), its
least-privilege RBAC, what controller.enabled / release / prometheusUrl change, the liveness probes of
every workload (the trainers' against a real metrics endpoint), and the trainers' Job letting a member
that rejoins a new generation (exit 75) go uncounted."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from bagpipe.control.generation import EXIT_RESTART
from bagpipe.core.snapshots import EXIT_CHECKPOINT_FAILED

from tests.chart.test_chart import (
    BIN,
    CHART,
    NAMESPACE,
    by_kind,
    check_consistency,
    helm,
    kubelet_env,
    parse_container,
    pod_specs,
    render,
    render_notes,
    run,
    workloads,
)

SCALE_TARGETS = [
    "statefulset/bagpipe-embedding-server",
    "statefulset/bagpipe-oracle-cacher",
    "deployment/bagpipe-data-processor",
]
POD_RULE = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "delete"]}


def validated(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    """The release rendered with ``args``, after kubernetes-validate --strict passed it."""
    out = run(helm(), "template", "bagpipe", str(CHART), "--namespace", NAMESPACE, *args)
    assert out.returncode == 0, out.stderr
    manifests = tmp_path / "manifests.yaml"
    manifests.write_text(out.stdout)
    check = run(str(BIN / "kubernetes-validate"), "--strict", "-k", "1.32.0", "--quiet", str(manifests))
    assert check.returncode == 0 and "ERROR" not in check.stdout.upper(), check.stdout + check.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def controller(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = workloads(docs)["bagpipe-controller"]["spec"]["template"]["spec"]["containers"]
    return dict(container)


def parsed(docs: list[dict[str, Any]]) -> Any:
    """The controller's config from its rendered args, by its own parser."""
    container = controller(docs)
    return parse_container(container, kubelet_env(container, docs, POD_IP="10.1.2.3"))[0]


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_the_controller_runs_with_exactly_its_flags_and_validates_strictly(tmp_path: Path) -> None:
    docs = validated(tmp_path)
    load = workloads(docs)["bagpipe-controller"]
    assert load["kind"] == "Deployment" and load["spec"]["replicas"] == 1
    assert load["spec"]["strategy"] == {"type": "Recreate"}, "never two controllers at once"
    container = controller(docs)
    assert container["command"] == ["python", "-m", "bagpipe.controller"]
    assert container["args"] == [
        "--trainers", "2",
        "--checkpoint-dir", "/bagpipe/checkpoints/bagpipe",
        "--start-batch", "latest",
        "--failure-timeout", "60",
        "--max-restarts", "3",
        "--kill", "kubernetes",
        "--namespace", NAMESPACE,
        *[a for target in SCALE_TARGETS for a in ("--release", target)],
        "--redis", "redis://bagpipe-redis:6379/0",
        "--job", "bagpipe",
        "--log-level", "INFO",
        "--metrics-address", "0.0.0.0:9400",
        "--advertise-host", "$(POD_IP)",
    ]  # fmt: skip
    cfg = parsed(docs)
    assert (cfg.trainers, cfg.kill, cfg.namespace) == (2, "kubernetes", NAMESPACE)
    assert (cfg.failure_timeout, cfg.max_restarts, cfg.prometheus_url) == (60.0, 3, None)
    assert list(cfg.release) == SCALE_TARGETS
    # reads the checkpoints only: the run's volume, read only
    assert {"name": "run", "mountPath": "/bagpipe", "readOnly": True} in container["volumeMounts"]
    # the job's secret and Redis password like every member, and POD_NAME (what it deletes) for them all
    check_consistency(docs)
    for owner, pod in pod_specs(docs).items():
        for c in pod["containers"]:
            if c["name"] not in {"redis", "check-model", "probe"}:
                (env,) = [e for e in c["env"] if e["name"] == "POD_NAME"]
                assert env["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, owner
    # scaled with the job and its alerts' threshold
    docs = render(
        "--set", "trainer.replicaCount=4",
        "--set", "dataProcessor.replicaCount=3",
        "--set", "prometheus.rules.heartbeatStaleSeconds=90",
        "--set", "controller.maxRestarts=0",
        "--set", "training.checkpointEvery=0",
    )  # fmt: skip
    cfg = parsed(docs)
    assert (cfg.trainers, cfg.failure_timeout, cfg.max_restarts) == (4, 90.0, 0)
    assert cfg.checkpoint_dir is None
    assert not [m for m in controller(docs)["volumeMounts"] if m["name"] == "run"]


def role_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return list(by_kind(docs, "Role")["bagpipe-controller"]["rules"])


def test_rbac_is_least_privilege_for_its_own_account() -> None:
    docs = render()
    assert role_rules(docs) == [
        POD_RULE,
        {
            "apiGroups": ["apps"],
            "resources": ["statefulsets/scale"],
            "resourceNames": ["bagpipe-embedding-server", "bagpipe-oracle-cacher"],
            "verbs": ["get", "patch"],
        },
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["bagpipe-data-processor"],
            "verbs": ["get", "patch"],
        },
    ]
    # the scale rules name exactly the --release targets, each a workload of that kind in the release
    named = {
        f"{rule['resources'][0].split('s/')[0]}/{name}"
        for rule in role_rules(docs)[1:]
        for name in rule["resourceNames"]
    }
    assert named == set(flag_values(controller(docs)["args"], "--release")) == set(SCALE_TARGETS)
    loads = workloads(docs)
    assert all(loads[t.split("/")[1]]["kind"].lower() == t.split("/")[0] for t in SCALE_TARGETS)
    binding = by_kind(docs, "RoleBinding")["bagpipe-controller"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "bagpipe-controller",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "bagpipe-controller", "namespace": NAMESPACE}
    ]
    pod = pod_specs(docs)["bagpipe-controller"]
    assert pod["serviceAccountName"] == "bagpipe-controller" and pod["automountServiceAccountToken"] is True
    assert "bagpipe-controller" in by_kind(docs, "ServiceAccount")
    # Redis is never released: it keeps the job's record of its end (the controller reads it; the drain
    # hook of a server scaled to zero reads there that nothing is to be moved)
    external = render("-f", str(CHART / "ci" / "external-redis.yaml"))
    assert flag_values(controller(external)["args"], "--release") == SCALE_TARGETS
    assert role_rules(external)[1]["resourceNames"] == ["bagpipe-embedding-server", "bagpipe-oracle-cacher"]


def test_disabled_renders_no_controller_and_no_rbac(tmp_path: Path) -> None:
    docs = validated(tmp_path, "--set", "controller.enabled=false")
    assert not [
        d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "controller"
    ]
    assert not [d for d in docs if "controller" in d["metadata"]["name"]]
    for kind in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        assert not by_kind(docs, kind), kind
    assert set(by_kind(docs, "ServiceAccount")) == {"bagpipe"}
    assert not [p for p in pod_specs(docs).values() if p.get("automountServiceAccountToken")]
    check_consistency(docs)
    text = render_notes(tmp_path, "--set", "controller.enabled=false")
    assert "Recovery:" not in text and "--filter" not in text


def test_release_off_omits_release_and_the_scale_rules(tmp_path: Path) -> None:
    docs = validated(tmp_path, "--set", "controller.release=false")
    assert "--release" not in controller(docs)["args"]
    assert parsed(docs).release == ()
    assert role_rules(docs) == [POD_RULE]
    text = render_notes(tmp_path, "--set", "controller.release=false")
    assert "Recovery: Deployment bagpipe-controller" in text and "to zero" not in text
    assert "helm test bagpipe -n ml\n" in text + "\n"


@pytest.mark.parametrize("url", [None, "http://prometheus-operated.monitoring:9090"])
def test_prometheus_url_is_passed_or_the_controller_scrapes(url: str | None, tmp_path: Path) -> None:
    docs = render(*(["--set", f"controller.prometheusUrl={url}"] if url else []))
    args = controller(docs)["args"]
    assert flag_values(args, "--prometheus-url") == ([url] if url else [])
    assert parsed(docs).prometheus_url == url
    text = render_notes(tmp_path, *(["--set", f"controller.prometheusUrl={url}"] if url else []))
    assert (f"through Prometheus at {url}" if url else "scraping their /metrics itself") in text


def test_notes_say_what_the_controller_does_and_where_the_model_stays(tmp_path: Path) -> None:
    text = render_notes(tmp_path)
    assert "Recovery: Deployment bagpipe-controller watches every member's liveness" in text
    assert "a stuck member's pod is deleted" in text and "at most 3 times" in text
    assert "scales the embedding servers, the oracle cacher and the data processors to zero" in text
    assert "Redis and the controller stay until helm uninstall" in text
    assert "The model and checkpoints stay on PersistentVolumeClaim bagpipe-run" in text
    # the servers are gone after the job: helm test runs only the model check
    assert "helm test bagpipe -n ml --filter name=bagpipe-test-model" in text
    assert "bagpipe-test-model" in by_kind(render(), "Pod")


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("stale", [60, 90])
def test_every_workload_has_a_liveness_probe_and_the_trainers_fails_on_a_stale_heartbeat(stale: int) -> None:
    docs = render("--set", f"prometheus.rules.heartbeatStaleSeconds={stale}")
    for name, pod in pod_specs(docs).items():
        for c in pod["containers"]:
            if name == "bagpipe-redis":  # (its port: a probe that authenticates could restart it for nothing)
                assert c["livenessProbe"]["tcpSocket"] == {"port": "redis"}
            elif pod.get("restartPolicy") != "Never" or name == "bagpipe-trainer":  # (not helm test's pods)
                probe = c["livenessProbe"]["httpGet"]
                assert urlparse(probe["path"]).path == "/healthz" and probe["port"] == "metrics", name
    (trainer,) = workloads(docs)["bagpipe-trainer"]["spec"]["template"]["spec"]["containers"]
    probe = trainer["livenessProbe"]
    assert probe["httpGet"]["path"] == f"/healthz?max_silence={stale}"
    # killed only after the threshold and as long again (the alert's `for`): the controller acts first
    assert (probe["failureThreshold"] - 1) * probe["periodSeconds"] >= stale
    assert probe["failureThreshold"] == {60: 4, 90: 6}[stale]
    # the probe's path on a real trainer metrics endpoint: healthy, then hung
    from bagpipe.metrics_http import MetricsServer
    from bagpipe.trainer import metrics

    saved = metrics.HEARTBEAT._value.get()
    server = MetricsServer("127.0.0.1:0", "trainer")
    try:
        url = f"http://{server.address}{probe['httpGet']['path']}"
        metrics.HEARTBEAT.set(time.time() - 2)
        assert _get(url) == 200
        metrics.HEARTBEAT.set(time.time() - stale - 5)
        assert _get(url) == 503
    finally:
        server.stop()
        metrics.HEARTBEAT.set(saved)


def test_the_trainers_job_ignores_a_rejoining_trainers_exit() -> None:
    (job,) = by_kind(render(), "Job").values()
    assert job["spec"]["podFailurePolicy"]["rules"] == [
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [EXIT_CHECKPOINT_FAILED]},
        },
        {
            "action": "Ignore",
            "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [EXIT_RESTART]},
        },
    ]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never", "podFailurePolicy needs it"


def test_the_controllers_metrics_are_scraped_and_open_only_there() -> None:
    docs = render()
    monitor = by_kind(docs, "ServiceMonitor")["bagpipe-controller"]
    service = by_kind(docs, "Service")["bagpipe-controller"]
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]
    off = render("--set", "controller.metrics.enabled=false")
    assert "bagpipe-controller" not in by_kind(off, "ServiceMonitor")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ("controller:\n  maxRestarts: -1\n", "controller.maxRestarts: Must be greater than or equal to 0"),
        (
            "controller:\n  prometheusUrl: prometheus:9090\n",
            "controller.prometheusUrl: Does not match pattern",
        ),
        ("controller:\n  release: [x]\n", "controller.release: Invalid type. Expected: boolean"),
        (
            "controller:\n  failureTimeout: 5\n",
            "controller: Additional property failureTimeout is not allowed",
        ),
        ("controller:\n  probes: {readiness: {periodSeconds: 1}}\n", "Additional property readiness"),
    ],
)
def test_schema_rejects_bad_controller_values(values: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(values)
    out = run(helm(), "template", "bagpipe", str(CHART), "-f", str(path))
    assert out.returncode != 0 and message in out.stderr, out.stderr
