"""The chart's NetworkPolicies, as the real helm renders them, judged by who they let reach each pod's
metrics port (/metrics, /healthz, /readyz): this release's pods and the namespaces that values name, no one
else unless asked for in so many words."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.test_chart import CHART, NAMESPACE, by_kind, container_ports, helm, render, run, workloads

MONITORING = "monitoring"
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
GRAFANA = {"app.kubernetes.io/name": "grafana"}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector's verdict on ``labels`` ({} selects everything)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        if {
            "In": value is not None and value in e.get("values", []),
            "NotIn": value is None or value not in e.get("values", []),
            "Exists": value is not None,
            "DoesNotExist": value is None,
        }[e["operator"]] is False:
            return False
    return True


def admits(policy: dict[str, Any], port: int, labels: dict[str, str], namespace: str) -> bool:
    """Whether ``policy`` (in the release's namespace) lets a pod with ``labels`` in ``namespace`` open a TCP
    connection to ``port`` of a pod it selects (as Kubernetes reads its ingress rules)."""
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports")
        if ports and not any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports):
            continue
        if "from" not in rule:  # a rule with no peers admits everyone
            return True
        for peer in rule["from"]:
            if "ipBlock" in peer:  # (pods are not matched by address here)
                continue
            if "namespaceSelector" in peer:
                in_namespace = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
            else:
                in_namespace = namespace == NAMESPACE
            if in_namespace and selects(peer.get("podSelector", {}), labels):
                return True
    return False


def metrics_gate(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """For every workload with a metrics port: a function telling whether a pod (labels, namespace) may
    reach that port under the policies that select the workload's pods."""
    policies = by_kind(docs, "NetworkPolicy").values()
    gates = {}
    for name, load in workloads(docs).items():
        template = load["spec"]["template"]
        ports = [container_ports(c).get("metrics") for c in template["spec"]["containers"]]
        if not any(ports):
            continue
        (port,) = [p for p in ports if p]
        selecting = [p for p in policies if selects(p["spec"]["podSelector"], template["metadata"]["labels"])]
        assert selecting, f"{name}: no NetworkPolicy selects its pods"

        def gate(
            labels: dict[str, str], namespace: str, port: int = port, selecting: Any = selecting
        ) -> bool:
            return any(admits(p, port, labels, namespace) for p in selecting)

        gates[name] = gate
    return gates


def member_labels(docs: list[dict[str, Any]]) -> dict[str, str]:
    """A pod of this release (the controller's, which scrapes the members itself without Prometheus)."""
    return dict(workloads(docs)["bagpipe-controller"]["spec"]["template"]["metadata"]["labels"])


def render_values(tmp_path: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return render("-f", str(path))


def test_by_default_the_metrics_port_admits_the_release_and_the_monitoring_namespace_only() -> None:
    docs = render()
    gates = metrics_gate(docs)
    assert set(gates) == {
        f"bagpipe-{c}"
        for c in ("data-processor", "oracle-cacher", "trainer", "embedding-server", "controller")
    }
    member = member_labels(docs)
    other_release = {**member, "app.kubernetes.io/instance": "another"}
    for name, gate in gates.items():
        assert gate(member, NAMESPACE), name
        assert gate(PROMETHEUS, MONITORING) and gate(GRAFANA, MONITORING), name
        assert not gate(other_release, NAMESPACE), name
        assert not gate({}, NAMESPACE), name
        assert not gate(PROMETHEUS, "default"), name
        assert not gate(member, "default"), f"{name}: the release's labels, but another namespace"
    # no rule of any policy is open to all (no peers) or to every namespace
    for policy in by_kind(docs, "NetworkPolicy").values():
        for rule in policy["spec"]["ingress"]:
            assert rule.get("from"), policy["metadata"]["name"]
            assert {"namespaceSelector": {}} not in rule["from"], policy["metadata"]["name"]


def test_the_named_namespaces_match_by_their_name_label() -> None:
    """kubernetes.io/metadata.name: the label Kubernetes sets on every namespace, which no one can forge."""
    docs = render("--set", "networkPolicy.metrics.namespaces={monitoring,observability}")
    policy = by_kind(docs, "NetworkPolicy")["bagpipe-trainer"]
    (metrics_rule,) = [
        r for r in policy["spec"]["ingress"] if r["ports"] == [{"port": 9400, "protocol": "TCP"}]
    ]
    assert metrics_rule["from"][1] == {
        "namespaceSelector": {
            "matchExpressions": [
                {
                    "key": "kubernetes.io/metadata.name",
                    "operator": "In",
                    "values": ["monitoring", "observability"],
                }
            ]
        }
    }
    for gate in metrics_gate(docs).values():
        assert gate(PROMETHEUS, "observability") and gate(PROMETHEUS, MONITORING)
        assert not gate(PROMETHEUS, "default")


def test_no_namespaces_means_none(tmp_path: Path) -> None:
    docs = render_values(tmp_path, {"networkPolicy": {"metrics": {"namespaces": []}}})
    member = member_labels(docs)
    for name, gate in metrics_gate(docs).items():
        assert gate(member, NAMESPACE), name
        assert not gate(PROMETHEUS, MONITORING), name
        assert not gate(PROMETHEUS, "default"), name


def test_pod_labels_narrow_the_namespaces_to_the_scrapers() -> None:
    docs = render("--set", "networkPolicy.metrics.podLabels.app\\.kubernetes\\.io/name=prometheus")
    member = member_labels(docs)
    for name, gate in metrics_gate(docs).items():
        assert gate(PROMETHEUS, MONITORING), name
        assert not gate(GRAFANA, MONITORING), name
        assert not gate(PROMETHEUS, "default"), name
        assert gate(member, NAMESPACE), name


def test_every_namespace_only_when_asked_for() -> None:
    docs = render(
        "--set",
        "networkPolicy.metrics.allNamespaces=true",
        "--set",
        "networkPolicy.metrics.podLabels.app\\.kubernetes\\.io/name=prometheus",
    )
    for name, gate in metrics_gate(docs).items():
        assert gate(PROMETHEUS, "default") and gate(PROMETHEUS, MONITORING), name
        assert not gate(GRAFANA, "default"), name
    for gate in metrics_gate(render("--set", "networkPolicy.metrics.allNamespaces=true")).values():
        assert gate(GRAFANA, "default") and gate({}, "anywhere")


def test_extra_peers_are_added_as_they_are(tmp_path: Path) -> None:
    """(an ipBlock: a Prometheus outside the cluster, or the nodes where the CNI holds kubelet probes to
    policies)"""
    peer = {"ipBlock": {"cidr": "10.0.0.0/24"}}
    docs = render_values(tmp_path, {"networkPolicy": {"metrics": {"namespaces": [], "extraFrom": [peer]}}})
    for name, policy in by_kind(docs, "NetworkPolicy").items():
        rules = [r for r in policy["spec"]["ingress"] if {"port": 9400, "protocol": "TCP"} in r["ports"]]
        if name == "bagpipe-redis":
            assert not rules, "Redis has no metrics port"
            continue
        (rule,) = rules
        assert rule["from"][-1] == peer and len(rule["from"]) == 2, name


def test_the_service_ports_still_admit_the_release_alone() -> None:
    """The scrapers reach the metrics port, not gRPC, rendezvous or Redis."""
    docs = render("--set", "networkPolicy.metrics.allNamespaces=true")
    member = member_labels(docs)
    policies = by_kind(docs, "NetworkPolicy")
    for name, port in (
        ("bagpipe-embedding-server", 50051),
        ("bagpipe-trainer", 29500),
        ("bagpipe-trainer", 40000),
        ("bagpipe-redis", 6379),
    ):
        assert admits(policies[name], port, member, NAMESPACE), (name, port)
        assert not admits(policies[name], port, PROMETHEUS, MONITORING), (name, port)
        assert not admits(policies[name], port, {**member, "app.kubernetes.io/instance": "x"}, NAMESPACE)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            "networkPolicy:\n  metricsFrom: [{namespaceSelector: {}}]\n",
            "networkPolicy: Additional property metricsFrom is not allowed",
        ),
        (
            "networkPolicy:\n  metrics: {namespaces: [Monitoring]}\n",
            "networkPolicy.metrics.namespaces.0: Does not match pattern",
        ),
        (
            "networkPolicy:\n  metrics: {allNamespaces: 'yes'}\n",
            "networkPolicy.metrics.allNamespaces: Invalid type",
        ),
    ],
)
def test_schema_rejects_bad_network_policy_values(values: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(values)
    out = run(helm(), "template", "bagpipe", str(CHART), "-f", str(path))
    assert out.returncode != 0 and message in out.stderr, out.stderr
