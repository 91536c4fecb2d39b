"""The Helm chart and the Dockerfiles: lint, schema, Kubernetes validation, alert rules, and that what
the chart tells each container agrees with what the services parse, listen on and dial."""

from __future__ import annotations

import base64
import contextlib
import copy
import importlib
import json
import os
import shutil
import signal
import socket
import string
import subprocess
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import Any
from unittest import mock
from urllib.parse import urlparse

import pytest
import torch
import yaml
from bagpipe import tls
from bagpipe.local.prometheus import find_binary
from bagpipe.local.redis_server import find_redis_server

from tests.certificates import certificates

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
BIN = Path(sysconfig.get_path("scripts"))
NAMESPACE = "ml"
# container name -> the module whose parser reads its args (the image's entry point)
PARSERS = {
    "data-processor": "bagpipe.data_processor.config",
    "oracle-cacher": "bagpipe.oracle_cacher.config",
    "trainer": "bagpipe.trainer.config",
    "embedding-server": "bagpipe.embedding_server.config",
    "controller": "bagpipe.controller.config",
}
# how each container starts: the one image's entry point, `bagpipe <service>`, but the controller's module
COMMANDS = {"controller": ["python", "-m", "bagpipe.controller"]}
AUTH_SECRET = "bagpipe-auth"  # the chart's Secret: the job's secret and the bundled Redis's password
JOB_SECRET_ENV, REDIS_PASSWORD_ENV = "BAGPIPE_JOB_SECRET", "BAGPIPE_REDIS_PASSWORD"
# mutual TLS: the variables the services read their PEM files' paths from, and cert-manager's Secret keys
TLS_ENV = {"cert": "BAGPIPE_TLS_CERT", "key": "BAGPIPE_TLS_KEY", "ca": "BAGPIPE_TLS_CA"}
TLS_SERVER_NAME_ENV = "BAGPIPE_TLS_SERVER_NAME"
TLS_KEYS = {"cert": "tls.crt", "key": "tls.key", "ca": "ca.crt"}
NOT_CLIENTS = {"redis", "check-model"}  # containers that call no Bagpipe service


def helm() -> str:
    for candidate in (
        os.environ.get("BAGPIPE_HELM"),
        shutil.which("helm"),
        str(REPO / ".tools" / "helm" / "helm"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError("no helm binary: run `make tools`")


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, cwd=REPO, env=env)


MONITORING_API = (
    "--api-versions",
    "monitoring.coreos.com/v1",
)  # a cluster with the Prometheus Operator's CRDs


def render(
    *args: str, chart: Path = CHART, env: dict[str, str] | None = None, crds: bool = True
) -> list[dict[str, Any]]:
    out = run(
        helm(),
        "template",
        "bagpipe",
        str(chart),
        "--namespace",
        NAMESPACE,
        *args,
        *(MONITORING_API if crds else ()),
        env=env,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: "default" if v is None else v.stem)
def test_helm_lint(values: Path | None) -> None:
    out = run(helm(), "lint", str(CHART), "--strict", *(["-f", str(values)] if values else []))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: "default" if v is None else v.stem)
def test_rendered_manifests_are_valid_kubernetes(values: Path | None, tmp_path: Path) -> None:
    args = ["-f", str(values)] if values else []
    out = run(helm(), "template", "bagpipe", str(CHART), "--namespace", NAMESPACE, *args)
    assert out.returncode == 0, out.stderr
    manifests = tmp_path / "manifests.yaml"
    manifests.write_text(out.stdout)
    check = run(str(BIN / "kubernetes-validate"), "--strict", "-k", "1.32.0", "--quiet", str(manifests))
    assert check.returncode == 0, check.stdout + check.stderr
    assert "ERROR" not in check.stdout.upper(), check.stdout


def test_prometheus_rule_passes_promtool(tmp_path: Path) -> None:
    (rule,) = by_kind(render(), "PrometheusRule").values()
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts == {
        "BagpipeTrainerStuck",
        "BagpipeServiceGone",
        "BagpipeOracleStarvingTrainers",
        "BagpipeIterationTimeRegressed",
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = run(find_binary("promtool"), "check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_one_dockerfile_passes_hadolint() -> None:
    files = sorted((REPO / "docker").rglob("Dockerfile*"))
    assert files == [REPO / "docker" / "Dockerfile"], "one image for every service"
    out = run(str(BIN / "hadolint"), *map(str, files))
    assert out.returncode == 0, out.stdout + out.stderr
    text = files[0].read_text()
    assert "USER 10001" in text, "must run as the non-root user"
    assert 'ENTRYPOINT ["bagpipe"]' in text, "the command picks the service: bagpipe <service>"


def test_a_change_of_the_code_rebuilds_only_the_package_layer_of_the_image() -> None:
    """The dependencies' virtual environment (about 1.9 GB) is a stage of its own that sees neither the code
    nor the README, and the image copies it before the package: a rebuild after a change of the code reuses
    that layer, so images of successive builds share it rather than each adding 2 GB to the disk."""
    stages: dict[str, list[str]] = {}
    name = ""
    for line in (REPO / "docker" / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["FROM"]:
            name = words[3] if len(words) > 3 and words[2].upper() == "AS" else "image"
            stages[name] = []
        elif name and words:
            stages[name].append(line)
    assert list(stages) == ["deps", "build", "image"], list(stages)
    copies = [line for line in stages["deps"] if line.startswith("COPY")]
    assert not any("services" in c or "README" in c for c in copies), copies
    final = [line.split()[1:] for line in stages["image"] if line.startswith("COPY")]
    venv = ["--from=deps", "/opt/bagpipe", "/opt/bagpipe"]
    assert final == [venv, ["--from=build", "/pkg", "/opt/bagpipe"]]
    assert any("--prefix /pkg" in line for line in stages["build"]), stages["build"]


def test_the_image_entry_point_runs_every_service_the_chart_names() -> None:
    """`bagpipe <service> --help` reaches the service's own parser (what the chart's commands run)."""
    from bagpipe.cli import SERVICES

    for container in bagpipe_containers(render()).values():
        command = container.get("command") or []
        if command[:1] == ["bagpipe"]:
            assert command[1] in SERVICES, command
    for service in SERVICES:
        out = run(str(BIN / "bagpipe"), service, "--help")
        assert out.returncode == 0 and "usage:" in out.stdout, (service, out.stderr[-500:])


def expand(arg: str, env: dict[str, str]) -> str:
    for name, value in env.items():
        arg = arg.replace(f"$({name})", value)
    assert "$(" not in arg, f"unexpanded variable in {arg!r}"
    return arg


def kubelet_env(container: dict[str, Any], docs: list[dict[str, Any]], **fields: str) -> dict[str, str]:
    """The container's environment as a kubelet sets it: literal values, keys of the rendered ConfigMaps
    and Secrets (``<name/key>`` for a Secret the user manages), and ``fields`` standing in for the fieldRef
    variables (the pod's IP and ordinal)."""
    maps = by_kind(docs, "ConfigMap")
    secrets = by_kind(docs, "Secret")
    env: dict[str, str] = {}
    for e in container.get("env", []):
        source = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] in maps, f"{e['name']}: no ConfigMap {ref['name']} in the release"
            env[e["name"]] = maps[ref["name"]]["data"][ref["key"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            if ref["name"] in secrets:
                env[e["name"]] = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
            else:
                env[e["name"]] = f"<{ref['name']}/{ref['key']}>"
        elif "fieldRef" in source and e["name"] in fields:
            env[e["name"]] = fields[e["name"]]
    return env


def mounted_files(
    pod: dict[str, Any], container: dict[str, Any], docs: list[dict[str, Any]], root: Path
) -> dict[str, str]:
    """The container's ConfigMap volumes as a kubelet mounts them: each ConfigMap's keys written as files into
    a directory under ``root``, by the mount path it stands for (the files the services read there)."""
    maps = by_kind(docs, "ConfigMap")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    found: dict[str, str] = {}
    for mount in container.get("volumeMounts", []):
        source = volumes[mount["name"]].get("configMap")
        if source is None:
            continue
        assert source["name"] in maps, f"{mount['name']}: no ConfigMap {source['name']} in the release"
        assert mount.get("readOnly") is True and "subPath" not in mount, f"{mount['name']}: read-only, whole"
        directory = root / container["name"] / mount["name"]
        directory.mkdir(parents=True, exist_ok=True)
        for key, text in maps[source["name"]]["data"].items():
            (directory / key).write_text(text)
        found[mount["mountPath"]] = str(directory)
    return found


def local_path(arg: str, files: dict[str, str]) -> str:
    """``arg`` with a path under a mounted ConfigMap's mount path pointing at its files here instead."""
    for mount, directory in files.items():
        if arg == mount or arg.startswith(f"{mount}/"):
            return directory + arg[len(mount) :]
    return arg


def parse_container(
    container: dict[str, Any], env: dict[str, str], files: dict[str, str] | None = None
) -> Any:
    """The container's args parsed by its service's own parser; ``files``: mount paths and where their files
    are here (``mounted_files``)."""
    module = importlib.import_module(PARSERS[container["name"]])
    argv = [local_path(expand(str(a), env), files or {}) for a in container["args"]]
    parsed = module.parse(argv)  # the service's own parser and config validation
    return parsed if isinstance(parsed, tuple) else (parsed, module.build_parser().parse_args(argv))


def run_drain_hook(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """Runs the container's preStop command as a kubelet does (no $(VAR) expansion, the container's
    environment) with a stand-in ``python`` that prints its argv, and returns that argv."""
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert not any("$(" in c for c in command), "hooks do not expand $(VAR); the shell must read the env"
    assert command[0] == "sh", "the image has sh on its PATH"
    with tempfile.TemporaryDirectory() as tmp:
        python = Path(tmp) / "bagpipe"
        python.write_text('#!/bin/sh\nfor a in "$@"; do printf \'%s\\0\' "$a"; done\n')
        python.chmod(0o755)
        out = subprocess.run(
            [shutil.which("sh") or "/bin/sh", *command[1:]],
            capture_output=True,
            text=True,
            env={**env, "PATH": tmp},
        )
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\0")[:-1]


def parse_drain(argv: list[str]) -> SimpleNamespace:
    """``bagpipe drain`` run on ``argv`` (its own parser), with Redis and the drain itself stubbed: what it
    would connect to and drain."""
    assert argv[:1] == ["drain"], argv
    module = importlib.import_module("bagpipe.embedding_server.drain")
    seen = SimpleNamespace()

    class Registry:
        def __init__(self, url: str, job: str) -> None:
            seen.redis, seen.job = url, job

        def generation_record(self) -> dict[str, str]:
            return {}  # (no generation: the job is not done, so the drain moves rows)

        def close(self) -> None:
            pass

    def drain(registry: Registry, shard: int, timeout: float) -> None:
        seen.shard, seen.timeout = shard, timeout

    with mock.patch.object(module, "Registry", Registry), mock.patch.object(module, "drain", drain):
        module.main(argv[1:])
    return seen


def workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {**by_kind(docs, "StatefulSet"), **by_kind(docs, "Deployment"), **by_kind(docs, "Job")}


def replicas(load: dict[str, Any]) -> int:
    """Pods of a workload: a Job's completions (one per trainer rank), else its replicas."""
    return load["spec"]["completions"] if load["kind"] == "Job" else load["spec"]["replicas"]


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The pod spec of every workload and of the helm test pod, by owner name."""
    pods = {name: load["spec"]["template"]["spec"] for name, load in workloads(docs).items()}
    return {**pods, **{name: pod["spec"] for name, pod in by_kind(docs, "Pod").items()}}


def bagpipe_containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every container that runs Bagpipe code and talks to the job, by owner name and container name: all
    but Redis's and the model check's (helm test's, which only reads the model file)."""
    return {
        f"{owner}/{c['name']}": c
        for owner, pod in pod_specs(docs).items()
        for c in [*pod.get("initContainers", []), *pod["containers"]]
        if c["name"] not in NOT_CLIENTS
    }


def secret_ref(container: dict[str, Any], name: str) -> dict[str, str] | None:
    """Where the container's env var ``name`` comes from, which must be a Secret; None without that var."""
    found = [e for e in container.get("env", []) if e["name"] == name]
    if not found:
        return None
    assert len(found) == 1, f"{name} set twice"
    assert set(found[0]) == {"name", "valueFrom"} and set(found[0]["valueFrom"]) == {"secretKeyRef"}, (
        f"{name} must come from a Secret, not a literal"
    )
    return found[0]["valueFrom"]["secretKeyRef"]


def tls_files(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, str]] | None:
    """Where the container's TLS files come from, as (Secret, key) by kind, following the paths in its
    BAGPIPE_TLS_* variables through its read-only mounts of the pod's Secret volumes; None without TLS."""
    env = {e["name"]: e for e in container.get("env", [])}
    if not {*TLS_ENV.values(), TLS_SERVER_NAME_ENV} & set(env):
        return None
    assert {*TLS_ENV.values(), TLS_SERVER_NAME_ENV} <= set(env), "all the TLS variables, or none"
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    found: dict[str, tuple[str, str]] = {}
    for kind, name in TLS_ENV.items():
        assert set(env[name]) == {"name", "value"}, f"{name}: a path, not a reference"
        path = PurePosixPath(env[name]["value"])
        (mount,) = [m for m in container.get("volumeMounts", []) if path.is_relative_to(m["mountPath"])]
        assert mount.get("readOnly") is True and "subPath" not in mount, f"{name}: a read-only, whole mount"
        secret = volumes[mount["name"]]["secret"]
        relative = str(path.relative_to(mount["mountPath"]))
        keys = {i["path"]: i["key"] for i in secret["items"]} if "items" in secret else {relative: relative}
        found[kind] = (secret["secretName"], keys[relative])
    return found


def secret_values(docs: list[dict[str, Any]]) -> set[str]:
    """The values in the release's Secrets, decoded and as rendered (base64)."""
    return {
        v
        for s in by_kind(docs, "Secret").values()
        for b64 in s.get("data", {}).values()
        for v in (b64, base64.b64decode(b64).decode())
    }


def assert_secrets_stay_in_secrets(docs: list[dict[str, Any]]) -> None:
    """No credential in any object but its Secret (args, commands, hooks, literal env, annotations), no
    password in a Redis URL, and no ``--requirepass`` but one the kubelet expands from a Secret's variable."""
    values = secret_values(docs)
    for doc in docs:
        if doc["kind"] != "Secret":
            text = json.dumps(doc)
            assert not [v for v in values if v in text], f"{doc['kind']} {doc['metadata']['name']}: a secret"
    for owner, pod in pod_specs(docs).items():
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            hook = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
            argv = [str(a) for a in (*c.get("command", []), *c.get("args", []), *hook)]
            for i, arg in enumerate(argv):
                if arg.startswith(("redis://", "rediss://")):
                    assert urlparse(arg).password is None, f"{owner}: a password in {arg}"
                if arg == "--requirepass":
                    var = argv[i + 1]
                    assert var.startswith("$(") and var.endswith(")"), f"{owner}: a literal Redis password"
                    assert secret_ref(c, var[2:-1]), f"{owner}: {var} must come from a Secret"


def check_consistency(docs: list[dict[str, Any]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:  # (the ConfigMaps' files the containers read, here)
        return check_consistency_with_files(docs, Path(tmp))


def check_consistency_with_files(docs: list[dict[str, Any]], root: Path) -> dict[str, Any]:
    services = by_kind(docs, "Service")
    loads = workloads(docs)
    configs: dict[str, Any] = {}
    for load in loads.values():
        pod = load["spec"]["template"]
        labels = pod["metadata"]["labels"]
        (container,) = pod["spec"]["containers"]
        if container["name"] == "redis":
            continue
        env_names = {e["name"]: e for e in container["env"]}
        assert env_names["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        fake_env = {"POD_IP": "10.1.2.3"}
        assert container["command"] == COMMANDS.get(container["name"], ["bagpipe", container["name"]])
        if load["kind"] == "StatefulSet":
            ref = env_names["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert ref == "metadata.labels['apps.kubernetes.io/pod-index']", (
                "rank/shard must come from the ordinal"
            )
            fake_env["POD_INDEX"] = str(load["spec"]["replicas"] - 1)
            headless = services[load["spec"]["serviceName"]]
            assert headless["spec"]["clusterIP"] == "None"
        if load["kind"] == "Job":  # the trainers: one pod per rank, DNS <job>-<rank>.<subdomain>
            ref = env_names["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert ref == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            spec = load["spec"]
            assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
            assert pod["spec"]["restartPolicy"] == "Never"
            fake_env["POD_INDEX"] = str(spec["completions"] - 1)
            assert services[pod["spec"]["subdomain"]]["spec"]["clusterIP"] == "None"
        env = kubelet_env(container, docs, **fake_env)
        cfg, args = parse_container(container, env, mounted_files(pod["spec"], container, docs, root))
        configs[container["name"]] = (cfg, args, load)
        ports = container_ports(container)
        assert urlparse(f"http://{args.metrics_address}").port == ports["metrics"]
        assert args.advertise_host == "10.1.2.3"
        if hasattr(args, "address"):
            assert urlparse(f"http://{args.address}").port == ports["grpc"]
            if tls_files(pod["spec"], container):  # kubelet's gRPC probes speak no TLS: /readyz instead
                for probe in ("startupProbe", "readinessProbe"):
                    assert container[probe]["httpGet"] == {"path": "/readyz", "port": "metrics"}, probe
            else:
                assert pod["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] == ports["grpc"]
        elif container["name"] == "trainer":  # HTTP readiness on its metrics port
            assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        liveness = container["livenessProbe"]["httpGet"]
        assert urlparse(liveness["path"]).path == "/healthz" and liveness["port"] == "metrics"
        redis = urlparse(args.redis)
        if redis.hostname in services:
            assert services[redis.hostname]["spec"]["ports"][0]["port"] == redis.port
        assert args.job == "bagpipe"
        # every Service selecting these pods targets ports they have
        for svc in services.values():
            if all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()):
                for p in svc["spec"]["ports"]:
                    assert p["targetPort"] in ports, (
                        f"{svc['metadata']['name']} targets a missing port {p['targetPort']}"
                    )
        sc = container["securityContext"]
        assert (
            sc["readOnlyRootFilesystem"]
            and not sc["allowPrivilegeEscalation"]
            and sc["capabilities"]["drop"] == ["ALL"]
        )
        assert pod["spec"]["securityContext"]["runAsNonRoot"]
        if container["name"] == "embedding-server":  # its preStop drain: this shard, this job's Redis
            drain = parse_drain(run_drain_hook(container, env))
            assert (drain.shard, drain.redis, drain.job) == (cfg.shard, args.redis, args.job)
            assert pod["spec"]["terminationGracePeriodSeconds"] > drain.timeout, "killed mid-drain"

    # every client and server of the job has its secret, and the bundled Redis's clients have its password
    redis_loads = [load for load in loads.values() if load["metadata"]["name"].endswith("-redis")]
    for name, container in bagpipe_containers(docs).items():
        assert (secret_ref(container, JOB_SECRET_ENV) or {}).get("key") == "jobSecret", name
        for redis_load in redis_loads:
            (server,) = redis_load["spec"]["template"]["spec"]["containers"]
            assert secret_ref(container, REDIS_PASSWORD_ENV) == secret_ref(server, "REDIS_PASSWORD"), name
    assert_secrets_stay_in_secrets(docs)
    # all of them speak TLS with the same files, or none does
    tls = {
        f"{owner}/{c['name']}": (tls_files(pod, c), kubelet_env(c, docs).get(TLS_SERVER_NAME_ENV))
        for owner, pod in pod_specs(docs).items()
        for c in [*pod.get("initContainers", []), *pod["containers"]]
        if c["name"] not in NOT_CLIENTS
    }
    assert len({json.dumps(v) for v in tls.values()}) == 1, tls
    if next(iter(tls.values()))[0]:
        for name, container in bagpipe_containers(docs).items():
            probes = [container.get(p, {}) for p in ("startupProbe", "readinessProbe", "livenessProbe")]
            assert not [p for p in probes if "grpc" in p], f"{name}: a gRPC probe, which cannot speak TLS"

    trainer_cfg, trainer_args, trainer_load = configs["trainer"]
    oracle_cfg, _, _ = configs["oracle-cacher"]
    emb_cfg, _, emb_load = configs["embedding-server"]
    dp_cfg, _, dp_load = configs["data-processor"]
    assert trainer_cfg.world_size == replicas(trainer_load) == oracle_cfg.trainers
    assert trainer_cfg.rank == replicas(trainer_load) - 1
    assert emb_cfg.initial_shards == emb_load["spec"]["replicas"], "the first shard map: one shard per server"
    assert emb_cfg.shard == emb_load["spec"]["replicas"] - 1
    assert oracle_cfg.data_processors == dp_load["spec"]["replicas"]
    assert dp_cfg.index is None, "data processors in a Deployment register under their pod names"
    assert oracle_cfg.batch_size == dp_cfg.batch_size
    assert oracle_cfg.table_rows == trainer_cfg.table_rows == emb_cfg.table_rows == dp_cfg.source.table_rows
    # servers store what the trainers' model and optimizer read and write: row and state widths agree
    assert emb_cfg.model == trainer_cfg.model.name and emb_cfg.row_width == trainer_cfg.model.row_width
    assert emb_cfg.optimizer == trainer_cfg.optimizer
    # an evaluation point is a flush the oracle plans
    assert oracle_cfg.eval_every == (trainer_cfg.eval_every if trainer_cfg.eval_data else 0)
    if "controller" in configs:  # it watches the members the workloads run and releases real workloads
        controller_cfg = configs["controller"][0]
        assert controller_cfg.trainers == replicas(trainer_load)
        assert controller_cfg.checkpoint_dir == trainer_args.checkpoint_dir
        for target in controller_cfg.release:
            kind, _, name = target.partition("/")
            assert loads[name]["kind"].lower() == kind, target
    # torch.distributed rendezvous: trainer 0 through the trainers' headless Service
    job = trainer_load["metadata"]["name"]
    subdomain = trainer_load["spec"]["template"]["spec"]["subdomain"]
    rendezvous = urlparse(trainer_cfg.dist_init)
    assert rendezvous.hostname == f"{job}-0.{subdomain}.{NAMESPACE}.svc.cluster.local"
    (trainer_container,) = trainer_load["spec"]["template"]["spec"]["containers"]
    assert rendezvous.port == container_ports(trainer_container)["rendezvous"]
    # ServiceMonitors select Services that have a metrics port
    for monitor in by_kind(docs, "ServiceMonitor").values():
        matched = [
            s
            for s in services.values()
            if all(
                s["metadata"]["labels"].get(k) == v
                for k, v in monitor["spec"]["selector"]["matchLabels"].items()
            )
        ]
        assert len(matched) == 1 and any(p["name"] == "metrics" for p in matched[0]["spec"]["ports"])
    return configs


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: "default" if v is None else v.stem)
def test_container_args_parse_and_agree_with_ports_and_services(values: Path | None) -> None:
    check_consistency(render(*(["-f", str(values)] if values else [])))


def test_scaling_renders_consistent_shards_and_ranks() -> None:
    docs = render("--set", "embeddingServer.replicaCount=6", "--set", "trainer.replicaCount=4")
    loads = workloads(docs)
    assert loads["bagpipe-embedding-server"]["spec"]["replicas"] == 6
    assert replicas(loads["bagpipe-trainer"]) == 4
    configs = check_consistency(docs)
    (emb,) = loads["bagpipe-embedding-server"]["spec"]["template"]["spec"]["containers"]
    (trn,) = loads["bagpipe-trainer"]["spec"]["template"]["spec"]["containers"]
    emb_envs = [kubelet_env(emb, docs, POD_IP="10.0.0.1", POD_INDEX=str(i)) for i in range(6)]
    shards = {parse_container(emb, env)[0].shard for env in emb_envs}
    ranks = {parse_container(trn, {"POD_IP": "10.0.0.1", "POD_INDEX": str(i)})[0].rank for i in range(4)}
    assert shards == set(range(6)) and ranks == set(range(4))
    assert [parse_drain(run_drain_hook(emb, env)).shard for env in emb_envs] == list(range(6))
    assert configs["embedding-server"][0].initial_shards == 6 and configs["oracle-cacher"][0].trainers == 4


def test_oracle_shards_are_a_statefulset_and_everyone_who_talks_to_them_knows_how_many() -> None:
    """oracleCacher.replicaCount K: pod I is shard I of K (its ordinal); the trainers, the embedding servers
    (their row tiers follow every shard) and the controller (every shard acks a generation) take --oracles."""
    docs = render("--set", "oracleCacher.replicaCount=3")
    loads = workloads(docs)
    oracle = loads["bagpipe-oracle-cacher"]
    assert oracle["kind"] == "StatefulSet" and oracle["spec"]["replicas"] == 3
    configs = check_consistency(docs)
    (container,) = oracle["spec"]["template"]["spec"]["containers"]
    shards = [
        parse_container(container, kubelet_env(container, docs, POD_IP="10.0.0.1", POD_INDEX=str(i)))[0]
        for i in range(3)
    ]
    assert [(cfg.shard, cfg.oracles) for cfg in shards] == [(0, 3), (1, 3), (2, 3)]
    for name in ("trainer", "embedding-server", "controller"):
        assert configs[name][0].oracles == 3, name
    # one oracle: no shard flags at all
    one = check_consistency(render())
    assert one["oracle-cacher"][0].oracles == 1 and one["trainer"][0].oracles == 1


def without_generated(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``docs`` with the values of the chart's auth Secret blanked out (random in every helm template)."""
    docs = copy.deepcopy(docs)
    for doc in docs:
        if doc["kind"] == "Secret" and doc["metadata"]["name"] == AUTH_SECRET:
            doc["data"] = dict.fromkeys(doc["data"], base64.b64encode(b"<generated>").decode())
    return docs


def test_changing_the_server_count_changes_only_replicas() -> None:
    """`helm upgrade --set embeddingServer.replicaCount=N` must not change the servers' pod template (that
    rolls every server, and their rows are in memory), nor anything else but the first shard map's size."""
    # (helm template draws new credentials each time; an upgrade keeps the live ones)
    two, five = (without_generated(render("--set", f"embeddingServer.replicaCount={n}")) for n in (2, 5))
    assert [d["metadata"]["name"] for d in two] == [d["metadata"]["name"] for d in five]
    changed = {(a["kind"], a["metadata"]["name"]) for a, b in zip(two, five, strict=True) if a != b}
    assert changed == {("StatefulSet", "bagpipe-embedding-server"), ("ConfigMap", "bagpipe-embedding-server")}
    sts2, sts5 = (workloads(d)["bagpipe-embedding-server"] for d in (two, five))
    assert (sts2["spec"]["replicas"], sts5["spec"]["replicas"]) == (2, 5)
    scaled = copy.deepcopy(sts2)
    scaled["spec"]["replicas"] = 5
    assert scaled == sts5, "the pod template must not depend on embeddingServer.replicaCount"
    maps = [by_kind(d, "ConfigMap")["bagpipe-embedding-server"]["data"] for d in (two, five)]
    assert maps == [{"initialShards": "2"}, {"initialShards": "5"}]
    assert [check_consistency(d)["embedding-server"][0].initial_shards for d in (two, five)] == [2, 5]


@pytest.mark.parametrize("timeout", [None, 1800])
def test_servers_drain_before_they_stop(timeout: int | None) -> None:
    docs = render(*(["--set", f"embeddingServer.drain.timeoutSeconds={timeout}"] if timeout else []))
    pod = workloads(docs)["bagpipe-embedding-server"]["spec"]["template"]["spec"]
    (emb,) = pod["containers"]
    env = kubelet_env(emb, docs, POD_IP="10.0.0.1", POD_INDEX="3")
    drain = parse_drain(run_drain_hook(emb, env))
    _, server_args = parse_container(emb, env)
    assert drain.shard == 3 and (drain.redis, drain.job) == (server_args.redis, server_args.job)
    assert drain.timeout == (timeout or 600)
    # the grace period includes preStop: Kubernetes kills the pod when it runs out, drained or not
    assert pod["terminationGracePeriodSeconds"] > drain.timeout


@pytest.mark.parametrize("rate", [None, 1000000, 2500.5])
def test_migration_rate_reaches_the_servers(rate: float | None, tmp_path: Path) -> None:
    # from a values file, as the template engine sees numbers there: float64 (1000000 would print as 1e+06)
    path = tmp_path / "values.yaml"
    path.write_text(f"embeddingServer:\n  migrationRowsPerSecond: {rate}\n" if rate is not None else "")
    docs = render("-f", str(path))
    cfg = check_consistency(docs)["embedding-server"][0]
    assert cfg.migration_rows_per_second == (rate or 0.0)
    (emb,) = workloads(docs)["bagpipe-embedding-server"]["spec"]["template"]["spec"]["containers"]
    assert emb["args"][emb["args"].index("--migration-rows-per-second") + 1] == str(rate or 0)


@pytest.mark.parametrize("threads", [None, 3])
def test_lookup_threads_reach_the_servers(threads: int | None) -> None:
    docs = render(*(["--set", f"embeddingServer.lookupThreads={threads}"] if threads is not None else []))
    assert check_consistency(docs)["embedding-server"][0].lookup_threads == (threads or 0)


@pytest.mark.parametrize("directory", [None, "tensorboard/run-1"])
def test_tensorboard_goes_to_the_run_volume(directory: str | None) -> None:
    docs = render(*(["--set", f"training.tensorboard={directory}"] if directory else []))
    trainer = check_consistency(docs)["trainer"][0]  # (its config, as its own parser reads the pod's args)
    mount = yaml.safe_load((CHART / "values.yaml").read_text())["persistence"]["mountPath"]
    assert trainer.tensorboard == (f"{mount}/{directory}" if directory else None)


def test_a_model_class_of_the_users_reaches_trainers_and_servers() -> None:
    """``training.model: MODULE:CLASS`` (the module installed in the image): the trainers build it and the
    embedding servers size their rows by it, each parsing its pod's args."""
    spec = "tests.integration.test_custom_model:WideGatedTower"
    configs = check_consistency(render("--set", f"training.model={spec}"))
    assert configs["trainer"][0].model.name == spec
    server = configs["embedding-server"][0]
    assert server.model == spec and server.row_width == server.embedding_dim + 1  # (first-order weights)


def test_gpu_values_ask_for_gpus_and_the_cuda_image() -> None:
    docs = render("-f", str(CHART / "ci" / "gpu-trainers.yaml"))
    pod = workloads(docs)["bagpipe-trainer"]["spec"]["template"]["spec"]
    (trn,) = pod["containers"]
    assert trn["image"] == "bagpipe:0.1.0-cuda" and trn["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "auto" in trn["args"], "the trainer falls back to CPU where no GPU is present"
    # NCCL's shared-memory transport: /dev/shm is a memory-backed volume, not the runtime's 64 MiB
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in trn["volumeMounts"]
    # the other tiers stay on the CPU image, and CPU trainers get no /dev/shm volume
    for name, load in workloads(docs).items():
        if name != "bagpipe-trainer" and not name.endswith("redis"):
            assert load["spec"]["template"]["spec"]["containers"][0]["image"] == "bagpipe:0.1.0", name
    cpu = workloads(render())["bagpipe-trainer"]["spec"]["template"]["spec"]
    assert not [v for v in cpu["volumes"] if v["name"] == "dshm"]


def test_one_image_from_the_registry_for_every_service() -> None:
    docs = render("--set", "image.registry=registry.example.com/team/", "--set", "image.tag=1.2.3")
    images = {c["image"] for c in bagpipe_containers(docs).values()}
    assert images == {"registry.example.com/team/bagpipe:1.2.3"}
    commands = {tuple(c["command"]) for c in bagpipe_containers(docs).values()}
    services = ("data-processor", "oracle-cacher", "embedding-server", "trainer", "probe")
    assert commands == {*(("bagpipe", s) for s in services), ("python", "-m", "bagpipe.controller")}


def test_the_trainers_are_a_job_that_completes_and_writes_the_model_to_the_run_volume() -> None:
    docs = render("--set", "trainer.replicaCount=3", "--set", "training.batchSize=3072")
    job = by_kind(docs, "Job")["bagpipe-trainer"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3
    # each recovery may replace one trainer pod (the one the controller deleted); without the controller a
    # failed trainer fails the run visibly
    assert job["spec"]["backoffLimit"] == 3
    alone = by_kind(render("--set", "controller.enabled=false"), "Job")["bagpipe-trainer"]
    assert alone["spec"]["backoffLimit"] == 0
    assert not by_kind(docs, "StatefulSet").get("bagpipe-trainer")
    pod = job["spec"]["template"]["spec"]
    (trn,) = pod["containers"]
    # the run's volume: a claim the chart makes (kept after uninstall), mounted in trainers and servers
    (claim,) = by_kind(docs, "PersistentVolumeClaim").values()
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    emb_pod = workloads(docs)["bagpipe-embedding-server"]["spec"]["template"]["spec"]
    for spec in (pod, emb_pod):
        (run_volume,) = [v for v in spec["volumes"] if v["name"] == "run"]
        assert run_volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert {"name": "run", "mountPath": "/bagpipe"} in spec["containers"][0]["volumeMounts"]
    _, args = parse_container(trn, {"POD_IP": "10.0.0.1", "POD_INDEX": "0"})
    assert args.save_final == "/bagpipe/model/final.pt"
    # helm test: the model check reads that file from the same claim, with the run's expectations
    test = by_kind(docs, "Pod")["bagpipe-test-model"]
    (check,) = test["spec"]["containers"]
    assert test["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert check["command"] == ["bagpipe", "check-model"]
    from bagpipe.check_model import build_parser

    wanted = build_parser().parse_args(check["args"])
    assert wanted.path == args.save_final and (wanted.model, wanted.tables) == ("dlrm", 26)
    assert wanted.iterations == 1000 and wanted.embedding_dim == 16
    (volume,) = [v for v in test["spec"]["volumes"] if v["name"] == "run"]
    assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": True}
    # recovery checkpoints: trainers and servers write to one directory on the volume; the oracle plans them
    docs = render("--set", "training.checkpointEvery=200", "--set", "persistence.existingClaim=mine")
    assert not by_kind(docs, "PersistentVolumeClaim")
    configs = check_consistency(docs)
    assert configs["oracle-cacher"][0].checkpoint_every == 200
    trainer_dir = configs["trainer"][1].checkpoint_dir
    assert trainer_dir == configs["embedding-server"][1].checkpoint_dir == "/bagpipe/checkpoints/bagpipe"


def test_the_model_check_passes_a_real_model_and_fails_a_wrong_one(tmp_path: Path) -> None:
    """`bagpipe check-model` (the helm test's command) on a checkpoint written by a real trainer's code."""
    from bagpipe.check_model import main as check_model
    from bagpipe.core import checkpoint

    rows = [4, 3]
    ckpt = {
        "dense": {"w": torch.ones(2, 2)},
        "embeddings": {"0": torch.zeros(4, 8), "1": torch.zeros(3, 8)},
        "meta": {"model": "dlrm", "table_rows": rows, "embedding_dim": 8, "optimizer_steps": 10},
    }
    path = tmp_path / "final.pt"
    checkpoint.save(path, ckpt)
    assert (
        check_model(
            [str(path), "--model", "dlrm", "--tables", "2", "--embedding-dim", "8", "--iterations", "10"]
        )
        == 0
    )
    assert check_model([str(path), "--iterations", "11"]) == 1
    assert check_model([str(path), "--model", "dcn"]) == 1
    assert check_model([str(tmp_path / "missing.pt")]) == 1
    ckpt["dense"]["w"][0, 0] = float("nan")
    checkpoint.save(path, ckpt)
    assert check_model([str(path)]) == 1


TWENTY_SIX_ROWS = "training.tableRows={" + ",".join(["9"] * 26) + "}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["training.batchSize=1001"], "training.batchSize=1001 does not split over trainer.replicaCount=2"),
        (["training.embeddingDim=32"], "training.bottomMlp ends in 16 but training.embeddingDim is 32"),
        (["training.topMlp={64,2}"], "training.topMlp ends in 2"),
        (
            [
                "training.data=avazu:/data/train.csv",
                "training.dataVolume.claimName=d",
                TWENTY_SIX_ROWS,
            ],
            "training.tableRows has 26 entries: avazu data has 22 tables",
        ),
        (["trainer.replicaCount=257", "training.batchSize=25700"], "at most 256 trainers"),
        (["training.iterations=0"], "synthetic data is endless"),
        (["training.data=criteo:/data/day_0.tsv"], "set training.dataVolume.claimName"),
        (
            ["training.resumeBatch=100", "training.checkpointEvery=0"],
            "training.resumeBatch needs training.checkpointEvery",
        ),
        (["persistence.enabled=false"], "training.saveFinal needs persistence.enabled"),
        (
            ["trainer.image.variant=cuda", "trainer.device=cpu"],
            "trainer.image.variant=cuda with trainer.device=cpu",
        ),
    ],
)
def test_values_that_do_not_fit_together_fail_helm_template(args: list[str], message: str) -> None:
    out = run(helm(), "template", "bagpipe", str(CHART), *[a for s in args for a in ("--set", s)])
    assert out.returncode != 0 and message in out.stderr, out.stderr[-800:]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ("trainer:\n  replicaCout: 3\n", "trainer: Additional property replicaCout is not allowed"),
        (
            "embeddingServer:\n  replicaCount: six\n",
            "embeddingServer.replicaCount: Invalid type. Expected: integer, given: string",
        ),
        (
            "training:\n  batchSize: '16384'\n",
            "training.batchSize: Invalid type. Expected: integer, given: string",
        ),
        ("trainers:\n  replicaCount: 2\n", "Additional property trainers is not allowed"),
        (
            "oracleCacher:\n  replicaCount: 0\n",
            "oracleCacher.replicaCount: Must be greater than or equal to 1",
        ),
        ("embeddingServer:\n  migrationRowsPerSecond: -1\n", "migrationRowsPerSecond: Must be greater than"),
        ("embeddingServer:\n  lookupThreads: -1\n", "lookupThreads: Must be greater than"),
        ("embeddingServer:\n  drain: {timeoutSeconds: 0}\n", "drain.timeoutSeconds: Must be greater than"),
        ("auth:\n  jobSecret: too-short\n", "auth.jobSecret: Does not match pattern"),
        ("auth:\n  existingSecret: Team_Auth\n", "auth.existingSecret: Does not match pattern"),
        ("auth:\n  redisPassword: x\n", "auth: Additional property redisPassword is not allowed"),
        (
            "externalRedis:\n  passwordSecret: {name: r, key: k, value: x}\n",
            "externalRedis.passwordSecret: Additional property value is not allowed",
        ),
        ("tls:\n  enabled: true\n  secret: bagpipe-tls\n", "tls: Additional property secret is not allowed"),
        ("tls:\n  serverName: ''\n", "tls.serverName: Does not match pattern"),
        ("training:\n  data: json:/data/x.json\n", "training.data: Does not match pattern"),
        (
            "training:\n  schema:\n    columns: [{name: c, role: lable}]\n",
            "training.schema.columns.0.role must be one of the following",
        ),
        (
            "training:\n  schema:\n    columns: [{name: c, role: categorical, rowz: 3}]\n",
            "training.schema.columns.0: Additional property rowz is not allowed",
        ),
        (
            "training:\n  schema:\n    columns: [{name: c, role: categorical, hashing: md5}]\n",
            "training.schema.columns.0.hashing must be one of the following",
        ),
        (
            "training:\n  schema:\n    columns: [{name: c, role: categorical, rows: 0}]\n",
            "training.schema.columns.0.rows: Must be greater than or equal to 1",
        ),
        ("training:\n  schema:\n    format: orc\n", "training.schema.format must be one of the following"),
        ("training:\n  schema:\n    delimiter: ';'\n", "Additional property delimiter is not allowed"),
    ],
)
def test_schema_rejects_bad_values_with_a_clear_message(values: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(values)
    out = run(helm(), "template", "bagpipe", str(CHART), "-f", str(path))
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


def test_external_redis_needs_a_url() -> None:
    out = run(helm(), "template", "bagpipe", str(CHART), "--set", "redis.enabled=false")
    assert out.returncode != 0 and "set externalRedis.url" in out.stderr


def render_notes(tmp_path: Path, *args: str, crds: bool = True) -> str:
    """NOTES.txt as helm renders it (helm template prints no notes: it goes through a ConfigMap here)."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    body = "\n".join("    " + line for line in notes.splitlines())
    (chart / "templates" / "zz-notes.yaml").write_text(
        f"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: |\n{body}\n"
    )
    (doc,) = render("--show-only", "templates/zz-notes.yaml", *args, chart=chart, crds=crds)
    return str(doc["data"]["notes"])


def test_notes_tell_the_user_how_to_watch_the_run(tmp_path: Path) -> None:
    text = render_notes(tmp_path)
    assert "kubectl -n ml get pods -l app.kubernetes.io/instance=bagpipe -w" in text
    rank0 = "-l job-name=bagpipe-trainer,batch.kubernetes.io/job-completion-index=0"
    assert f"logs -f {rank0}" in text and "Bagpipe training" in text
    assert f"port-forward $(kubectl -n ml get pod {rank0} -o name) 9400" in text
    assert "wait --for=condition=complete job/bagpipe-trainer" in text
    assert "the final model is /bagpipe/model/final.pt on PersistentVolumeClaim bagpipe-run" in text
    assert "kubectl -n ml scale statefulset bagpipe-embedding-server --replicas=N" in text
    assert "--set embeddingServer.replicaCount=N" in text and "restarts them" not in text
    assert "Secret bagpipe-auth, key jobSecret" in text
    assert "TLS" not in text


def test_dashboard_configmap_carries_the_dashboard() -> None:
    cm = by_kind(render(), "ConfigMap")["bagpipe-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "bagpipe.json").read_text())
    assert json.loads(cm["data"]["bagpipe.json"]) == shipped


def test_network_policies_and_rbac_only_for_the_controller() -> None:
    docs = render()
    policies = by_kind(docs, "NetworkPolicy")
    components = ("data-processor", "oracle-cacher", "trainer", "embedding-server", "redis", "controller")
    assert set(policies) == {f"bagpipe-{c}" for c in components}
    for name, policy in policies.items():
        if name == "bagpipe-controller":  # (it serves only metrics)
            assert [r["ports"] for r in policy["spec"]["ingress"]] == [[{"port": 9400, "protocol": "TCP"}]]
            continue
        peers = policy["spec"]["ingress"][0]["from"]
        assert peers == [
            {
                "podSelector": {
                    "matchLabels": {
                        "app.kubernetes.io/name": "bagpipe",
                        "app.kubernetes.io/instance": "bagpipe",
                    }
                }
            }
        ]
    # RBAC only for what the code calls: the controller alone calls the Kubernetes API (its own account and
    # Role, tests/chart/test_controller.py); every other pod's account has no rights and mounts no token
    callers = {
        str(p.relative_to(REPO))
        for p in (REPO / "services").rglob("*.py")
        if "import kubernetes" in p.read_text() or "from kubernetes" in p.read_text()
    }
    assert callers == {"services/bagpipe/controller/kubernetes.py"}
    for kind in ("Role", "RoleBinding"):
        assert set(by_kind(docs, kind)) == {"bagpipe-controller"}, kind
    for kind in ("ClusterRole", "ClusterRoleBinding"):
        assert not by_kind(docs, kind), kind
    accounts = by_kind(docs, "ServiceAccount")
    assert set(accounts) == {"bagpipe", "bagpipe-controller"}
    assert accounts["bagpipe"]["automountServiceAccountToken"] is False
    for name, pod in pod_specs(docs).items():
        controller = name == "bagpipe-controller"
        assert pod["serviceAccountName"] == ("bagpipe-controller" if controller else "bagpipe"), name
        assert pod["automountServiceAccountToken"] is controller, name
    assert {d["kind"] for d in docs} >= {"PodDisruptionBudget", "ServiceAccount", "Pod"}


# The job's credentials: the secret every gRPC call carries and the bundled Redis's password (Secret -> env).

EXTERNAL_REDIS = CHART / "ci" / "external-redis.yaml"
JOB_CONTAINERS = {
    "bagpipe-trainer/trainer",
    "bagpipe-embedding-server/embedding-server",
    "bagpipe-oracle-cacher/oracle-cacher",
    "bagpipe-data-processor/data-processor",
    "bagpipe-controller/controller",
    "bagpipe-test/probe",
}


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def auth_secret_data(docs: list[dict[str, Any]]) -> dict[str, str]:
    secret = by_kind(docs, "Secret")[AUTH_SECRET]
    assert secret["type"] == "Opaque"
    return {k: base64.b64decode(v, validate=True).decode() for k, v in secret["data"].items()}


def test_install_generates_the_job_secret_and_the_redis_password() -> None:
    first, second = (auth_secret_data(render()) for _ in range(2))
    for data in (first, second):
        assert set(data) == {"jobSecret", "redisPassword"}
        alphanumeric = set(string.ascii_letters + string.digits)
        assert all(len(v) == 32 and set(v) <= alphanumeric for v in data.values())
    assert first["jobSecret"] != first["redisPassword"] and first != second, "random, and new at each install"
    # uninstall removes it: nothing that outlives the release needs it (Redis keeps no data)
    secret = by_kind(render(), "Secret")[AUTH_SECRET]
    assert "helm.sh/resource-policy" not in (secret["metadata"].get("annotations") or {})
    given = auth_secret_data(render("--set", "auth.jobSecret=a-job-secret-of-my-own"))
    assert given["jobSecret"] == "a-job-secret-of-my-own" and len(given["redisPassword"]) == 32


def test_generated_credentials_reach_nothing_but_the_secret() -> None:
    """Two renders differ only in the Secret's values: no pod template depends on them (a checksum there would
    restart every embedding server, rows in memory, at each helm template of a GitOps tool)."""
    one, two = render(), render()
    assert secret_values(one) != secret_values(two)
    assert without_generated(one) == without_generated(two)


@contextlib.contextmanager
def fake_cluster(tmp_path: Path, live: dict[str, Any] | None) -> Iterator[tuple[dict[str, str], list[str]]]:
    """A Kubernetes API server that holds one Secret in NAMESPACE, ``live``, or none: what the chart's
    ``lookup`` asks under ``helm template --dry-run=server`` (as in ``helm upgrade``). Yields helm's env and
    the paths asked."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = urlparse(self.path).path
            seen.append(path)
            body: dict[str, Any]
            if path == "/api/v1":  # discovery: where Secrets are
                secrets = {"name": "secrets", "namespaced": True, "kind": "Secret", "verbs": ["get"]}
                code, body = 200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": [secrets]}
            elif live and path == f"/api/v1/namespaces/{NAMESPACE}/secrets/{live['metadata']['name']}":
                code, body = 200, live
            else:
                code, body = 404, {"kind": "Status", "apiVersion": "v1", "reason": "NotFound", "code": 404}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [
                    {"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}
                ],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "users": [{"name": "fake", "user": {}}],
            }
        )
    )
    try:
        yield {**os.environ, "KUBECONFIG": str(kubeconfig)}, seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("given", [None, "a-job-secret-of-my-own"])
def test_upgrade_keeps_the_live_credentials(given: str | None, tmp_path: Path) -> None:
    """New credentials on upgrade would lock the running pods out of each other and of Redis."""
    live = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": AUTH_SECRET, "namespace": NAMESPACE},
        "data": {"jobSecret": b64("live-job-secret"), "redisPassword": b64("live-redis-password")},
    }
    args = ["--dry-run=server", *(["--set", f"auth.jobSecret={given}"] if given else [])]
    with fake_cluster(tmp_path, live) as (env, seen):
        upgraded = auth_secret_data(render(*args, env=env))
    assert f"/api/v1/namespaces/{NAMESPACE}/secrets/{AUTH_SECRET}" in seen
    assert upgraded == {"jobSecret": given or "live-job-secret", "redisPassword": "live-redis-password"}
    with fake_cluster(tmp_path, None) as (env, seen):  # an install: nothing to keep
        installed = auth_secret_data(render(*args, env=env))
    assert f"/api/v1/namespaces/{NAMESPACE}/secrets/{AUTH_SECRET}" in seen
    assert installed["jobSecret"] == (given or installed["jobSecret"]) != "live-job-secret"
    assert len(installed["redisPassword"]) == 32


@pytest.mark.parametrize(
    ("args", "redis_ref"),
    [
        ([], {"name": AUTH_SECRET, "key": "redisPassword"}),
        (["-f", str(EXTERNAL_REDIS)], None),
        (
            [
                "-f",
                str(EXTERNAL_REDIS),
                "--set",
                "externalRedis.passwordSecret.name=infra-redis",
                "--set",
                "externalRedis.passwordSecret.key=password",
            ],
            {"name": "infra-redis", "key": "password"},
        ),
    ],
    ids=["bundled-redis", "external-redis", "external-redis-with-password"],
)
def test_every_container_has_the_job_credentials(args: list[str], redis_ref: dict[str, str] | None) -> None:
    docs = render(*args)
    containers = bagpipe_containers(docs)
    assert set(containers) == JOB_CONTAINERS
    for name, container in containers.items():
        assert secret_ref(container, JOB_SECRET_ENV) == {"name": AUTH_SECRET, "key": "jobSecret"}, name
        assert secret_ref(container, REDIS_PASSWORD_ENV) == redis_ref, name
    assert set(auth_secret_data(docs)) == {"jobSecret", "redisPassword"}
    check_consistency(docs)


def test_an_existing_secret_replaces_the_charts() -> None:
    docs = render("--set", "auth.existingSecret=team-bagpipe-auth")
    assert not by_kind(docs, "Secret")
    containers = bagpipe_containers(docs)
    assert set(containers) == JOB_CONTAINERS
    job, password = ({"name": "team-bagpipe-auth", "key": key} for key in ("jobSecret", "redisPassword"))
    for name, container in containers.items():
        assert secret_ref(container, JOB_SECRET_ENV) == job, name
        assert secret_ref(container, REDIS_PASSWORD_ENV) == password, name
    (redis,) = pod_specs(docs)["bagpipe-redis"]["containers"]
    assert secret_ref(redis, "REDIS_PASSWORD") == password
    check_consistency(docs)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--set", "auth.existingSecret=mine", "--set", "auth.jobSecret=a-job-secret-of-my-own"],
            "set auth.jobSecret or auth.existingSecret, not both",
        ),
        (
            ["-f", str(EXTERNAL_REDIS), "--set", "externalRedis.passwordSecret.name=infra-redis"],
            "externalRedis.passwordSecret needs both name and key",
        ),
    ],
)
def test_ambiguous_credentials_are_refused(args: list[str], message: str) -> None:
    out = run(helm(), "template", "bagpipe", str(CHART), *args)
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert "a-job-secret-of-my-own" not in out.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_chart_redis(
    container: dict[str, Any], argv: list[str], env: dict[str, str], server: Path, **popen: Any
) -> subprocess.Popen[bytes]:
    """The bundled Redis's container as the kubelet runs it (its ``command`` with ``args`` after it, env
    from the chart), with ``server`` standing in for the bagpipe image's ``/usr/bin/redis-server``."""
    assert container["command"][:2] == ["sh", "-c"] and "/usr/bin/redis-server - " in container["command"][2]
    script = container["command"][2].replace("/usr/bin/redis-server", str(server))
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.DEVNULL)
    # (a session of its own: the script pipes into redis-server, which a signal to sh alone would orphan)
    argv = ["sh", "-c", script, *container["command"][3:], *argv]
    return subprocess.Popen(argv, env=env, start_new_session=True, **popen)


def stop_chart_redis(proc: subprocess.Popen[bytes]) -> None:
    """Stops what ``start_chart_redis`` started: the shell and the redis-server its pipe runs."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=10)


def test_bundled_redis_requires_the_password_its_clients_send(tmp_path: Path) -> None:
    """The bundled Redis started here as the kubelet starts it (args expanded from its env), its readiness
    probe run as the kubelet runs it, and the services' Redis client with the chart's URL and env."""
    from bagpipe.control.registry import Registry
    from redis.exceptions import AuthenticationError

    docs = render()
    (redis,) = pod_specs(docs)["bagpipe-redis"]["containers"]
    ref = {"name": AUTH_SECRET, "key": "redisPassword"}
    assert secret_ref(redis, "REDIS_PASSWORD") == secret_ref(redis, "REDISCLI_AUTH") == ref
    env = kubelet_env(redis, docs)
    password = auth_secret_data(docs)["redisPassword"]
    # the password is on no command line: Redis reads it on stdin, from the shell's printf builtin
    assert not [a for a in [*redis["command"], *redis["args"]] if password in expand(a, env)]
    assert "--requirepass" not in redis["args"]
    argv = list(redis["args"])
    port, chart_port = free_port(), argv[argv.index("--port") + 1]
    argv[argv.index("--port") + 1], argv[argv.index("--dir") + 1] = str(port), str(tmp_path)
    server = Path(find_redis_server())
    proc = start_chart_redis(redis, argv, env, server)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
        # readiness: an authenticated PING; without the password it fails
        probe = redis["readinessProbe"]["exec"]["command"]
        assert probe[:2] == ["sh", "-c"] and f"-p {chart_port}" in probe[2]
        assert probe[2].startswith("/usr/bin/redis-cli ")
        script = probe[2].replace(f"-p {chart_port}", f"-p {port}").replace("/usr/bin/redis-cli", "redis-cli")
        path = f"{server.parent}{os.pathsep}{os.environ['PATH']}"
        assert shutil.which("redis-cli", path=path), "redis-cli beside redis-server"

        def probe_rc(probe_env: dict[str, str]) -> int:
            return subprocess.run(["sh", "-c", script], env={**probe_env, "PATH": path}, timeout=9).returncode

        assert probe_rc(env) == 0
        assert probe_rc({k: v for k, v in env.items() if k != "REDISCLI_AUTH"}) != 0
        # the services: the chart's password-less URL, the password from BAGPIPE_REDIS_PASSWORD
        (trainer,) = pod_specs(docs)["bagpipe-trainer"]["containers"]
        trainer_env = kubelet_env(trainer, docs, POD_IP="10.0.0.1", POD_INDEX="0")
        _, args = parse_container(trainer, trainer_env)
        url = args.redis.replace(f"bagpipe-redis:{chart_port}", f"127.0.0.1:{port}")
        assert url != args.redis
        with mock.patch.dict(os.environ, {REDIS_PASSWORD_ENV: trainer_env[REDIS_PASSWORD_ENV]}):
            assert Registry(url, args.job).ping()
        with mock.patch.dict(os.environ):
            os.environ.pop(REDIS_PASSWORD_ENV, None)
            with pytest.raises(AuthenticationError):
                Registry(url, args.job).ping()
    finally:
        stop_chart_redis(proc)
        proc.wait(timeout=10)


# Mutual TLS: the user's Secret (tls.crt, tls.key, ca.crt) in every Bagpipe container, paths in the env.

TLS = ("--set", "tls.enabled=true", "--set", "tls.secretName=x")


def test_tls_mounts_the_secret_in_every_container_and_probes_readyz() -> None:
    docs = render(*TLS)
    pods = pod_specs(docs)
    containers = bagpipe_containers(docs)
    assert set(containers) == JOB_CONTAINERS
    for name, container in containers.items():
        pod = pods[name.split("/")[0]]
        expected = {kind: ("x", key) for kind, key in TLS_KEYS.items()}
        assert tls_files(pod, container) == expected, name
        env = kubelet_env(container, docs)
        assert env[TLS_SERVER_NAME_ENV] == "bagpipe", name
        assert all(env[v].startswith("/etc/bagpipe/tls/") for v in TLS_ENV.values()), name
        (volume,) = [v for v in pod["volumes"] if "secret" in v and v["secret"]["secretName"] == "x"]
        assert volume["secret"]["defaultMode"] == 0o440, "the key: not world-readable (the fsGroup reads it)"
        # no gRPC probe (kubelet's cannot present a certificate): startup and readiness ask /readyz
        metrics = container_ports(container).get("metrics")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container:
                assert "grpc" not in container[probe], (name, probe)
                assert container[probe]["httpGet"]["port"] == "metrics" and metrics, (name, probe)
        for probe in ("startupProbe", "readinessProbe"):
            # (the trainer's and the controller's startup ask /healthz)
            if probe in container and name not in {
                "bagpipe-trainer/trainer",
                "bagpipe-controller/controller",
            }:
                assert container[probe]["httpGet"]["path"] == "/readyz", (name, probe)
    # the bundled Redis takes the same files as its own flags (tests/chart/test_redis_tls.py), not the
    # services' variables
    (redis,) = pods["bagpipe-redis"]["containers"]
    assert not {e["name"] for e in redis.get("env", [])} & {*TLS_ENV.values(), TLS_SERVER_NAME_ENV}
    check_consistency(docs)
    # the drain hook inherits the embedding server's env: TLS files included
    (emb,) = pods["bagpipe-embedding-server"]["containers"]
    assert {*TLS_ENV.values(), TLS_SERVER_NAME_ENV} <= set(kubelet_env(emb, docs))
    named = render(*TLS, "--set", "tls.serverName=bagpipe.ml")
    for name, container in bagpipe_containers(named).items():
        assert kubelet_env(container, named)[TLS_SERVER_NAME_ENV] == "bagpipe.ml", name


def test_without_tls_nothing_changes() -> None:
    docs = render()
    pods = pod_specs(docs)
    for name, container in bagpipe_containers(docs).items():
        assert tls_files(pods[name.split("/")[0]], container) is None, name
        assert not [m for m in container.get("volumeMounts", []) if m["mountPath"].startswith("/etc/bagpipe")]
        if "grpc" in container_ports(container):  # the servers: gRPC health for startup and readiness
            for probe in ("startupProbe", "readinessProbe"):
                assert container[probe]["grpc"] == {"port": container_ports(container)["grpc"]}, (name, probe)
    assert not [v for pod in pods.values() for v in pod.get("volumes", []) if "secret" in v]
    # a Secret's name alone turns nothing on
    assert not [d for d in render("--set", "tls.secretName=x") if "BAGPIPE_TLS" in json.dumps(d)]


def test_tls_needs_a_secret() -> None:
    out = run(helm(), "template", "bagpipe", str(CHART), "--set", "tls.enabled=true")
    assert out.returncode != 0
    message = "tls.enabled is true: set tls.secretName, a Secret with keys tls.crt, tls.key and ca.crt"
    assert message in out.stderr, out.stderr


def test_notes_say_when_grpc_is_mutual_tls(tmp_path: Path) -> None:
    text = render_notes(tmp_path, *TLS)
    assert "gRPC is mutual TLS: Secret x (tls.crt, tls.key, ca.crt)" in text and "DNS:bagpipe." in text


def cert_manager_secret(directory: Path, name: str) -> Path:
    """What cert-manager's CA issuer writes into a Secret: a certificate for DNS ``name``, its key, the CA."""
    certificates(directory, name, TLS_KEYS)
    return directory


def tls_env(
    pod: dict[str, Any], container: dict[str, Any], docs: list[dict[str, Any]], secrets: dict[str, Path]
) -> dict[str, str]:
    """The container's TLS variables with the Secret volume's files at ``secrets[secretName]`` here."""
    files = tls_files(pod, container)
    assert files
    env = {TLS_ENV[kind]: str(secrets[secret] / key) for kind, (secret, key) in files.items()}
    return {**env, TLS_SERVER_NAME_ENV: kubelet_env(container, docs)[TLS_SERVER_NAME_ENV]}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary to make certificates")
@pytest.mark.parametrize(
    ("certified", "served"), [("bagpipe", True), ("bagpipe.ml", True), ("elsewhere", False)]
)
def test_tls_env_lets_the_test_pod_reach_a_server(certified: str, served: bool, tmp_path: Path) -> None:
    """An oracle's gRPC server with the credentials the chart's env gives it, and the helm test's probe with
    its own: the chart's paths, keys and server name agree with what the services read."""
    from concurrent import futures

    import grpc
    from bagpipe import probe
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server_name = "bagpipe" if certified == "elsewhere" else certified
    docs = render(*TLS, "--set", f"tls.serverName={server_name}")
    secrets = {"x": cert_manager_secret(tmp_path / "x", certified)}
    pods = pod_specs(docs)
    (oracle,) = pods["bagpipe-oracle-cacher"]["containers"]
    (prober,) = pods["bagpipe-test"]["containers"]
    with mock.patch.dict(os.environ, tls_env(pods["bagpipe-oracle-cacher"], oracle, docs, secrets)):
        credentials = tls.server_credentials()
    assert credentials is not None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        with mock.patch.dict(os.environ, tls_env(pods["bagpipe-test"], prober, docs, secrets)):
            problem = probe.grpc_serving(f"127.0.0.1:{port}")
        assert (problem is None) == served, problem
        # without TLS (a kubelet gRPC probe, a plaintext client) the server does not answer
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def test_operator_objects_render_only_where_the_cluster_has_their_crds() -> None:
    """`helm install` must work on a cluster without the Prometheus Operator (enabled: auto)."""
    kinds = ("ServiceMonitor", "PrometheusRule")
    with_crds, without = render(), render(crds=False)
    assert all(by_kind(with_crds, k) for k in kinds)
    assert not any(by_kind(without, k) for k in kinds)
    forced = render(
        "--set",
        "prometheus.serviceMonitor.enabled=true",
        "--set",
        "prometheus.rules.enabled=true",
        crds=False,
    )
    assert all(by_kind(forced, k) for k in kinds)
    off = render(
        "--set", "prometheus.serviceMonitor.enabled=false", "--set", "prometheus.rules.enabled=false"
    )
    assert not any(by_kind(off, k) for k in kinds)


# The input's schema (training.schema): a ConfigMap, mounted read-only in every service that reads the data or
# sizes the tables, and --schema in their args.

PARQUET_SCHEMA = CHART / "ci" / "parquet-schema.yaml"
SCHEMA_MAP, SCHEMA_MOUNT = "bagpipe-schema", "/etc/bagpipe/schema"
SCHEMA_READERS = {"data-processor", "oracle-cacher", "embedding-server", "trainer"}


def schema_of_values(path: Path = PARQUET_SCHEMA) -> dict[str, Any]:
    return dict(yaml.safe_load(path.read_text())["training"]["schema"])


def test_the_schema_reaches_every_service_that_reads_the_data_or_sizes_the_tables(tmp_path: Path) -> None:
    from bagpipe.core.schema import Schema

    docs = render("-f", str(PARQUET_SCHEMA))
    schema = schema_of_values()
    layout = Schema.of(schema, "training.schema")
    rows = tuple(c["rows"] for c in schema["columns"] if c["role"] == "categorical")
    assert layout.table_rows == rows and layout.num_dense == 2  # (what the values file means)
    # the values' schema, as JSON, in one ConfigMap
    assert json.loads(by_kind(docs, "ConfigMap")[SCHEMA_MAP]["data"]["schema.json"]) == schema
    checksums = set()
    for name, load in workloads(docs).items():
        pod = load["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        args = [str(a) for a in container.get("args", [])]
        annotations = pod["metadata"].get("annotations") or {}
        if container["name"] not in SCHEMA_READERS:
            assert "--schema" not in args and "checksum/schema" not in annotations, name
            continue
        assert args[args.index("--schema") + 1] == f"{SCHEMA_MOUNT}/schema.json", name
        (volume,) = [v for v in pod["spec"]["volumes"] if v.get("configMap", {}).get("name") == SCHEMA_MAP]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount == {"name": volume["name"], "mountPath": SCHEMA_MOUNT, "readOnly": True}, name
        checksums.add(annotations["checksum/schema"])  # (a new schema rolls the pods that read it)
    assert len(checksums) == 1
    # every service's own parser reads the schema from its mount (here: the ConfigMap's files), and they agree
    configs = check_consistency_with_files(docs, tmp_path)
    assert set(configs) >= SCHEMA_READERS
    for name in ("oracle-cacher", "embedding-server", "trainer"):
        assert configs[name][0].table_rows == rows, name
    processor = configs["data-processor"][0].source
    assert processor.table_rows == rows and processor.layout().to_dict() == layout.to_dict()
    trainer = configs["trainer"][0]
    assert (trainer.model.num_dense, trainer.model.num_tables) == (layout.num_dense, len(rows))
    assert trainer.eval_data == "parquet:/data/clicks/held-out.parquet"
    # helm test's model check expects a table per categorical column
    (check,) = by_kind(docs, "Pod")["bagpipe-test-model"]["spec"]["containers"]
    assert check["args"][check["args"].index("--tables") + 1] == str(len(rows))


def test_a_changed_schema_changes_its_configmap_and_rolls_the_pods_that_read_it(tmp_path: Path) -> None:
    schema = schema_of_values()
    schema["columns"] = [{**c, "rows": 400} if c["name"] == "country" else c for c in schema["columns"]]
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"training": {"schema": schema}}))
    before, after = (
        without_generated(render("-f", str(PARQUET_SCHEMA), *extra)) for extra in ([], ["-f", str(path)])
    )
    changed = {(a["kind"], a["metadata"]["name"]) for a, b in zip(before, after, strict=True) if a != b}
    readers = {
        name for name, load in workloads(before).items() if name.removeprefix("bagpipe-") in SCHEMA_READERS
    }
    assert changed == {("ConfigMap", SCHEMA_MAP), *((workloads(before)[n]["kind"], n) for n in readers)}
    for name in readers:  # only the checksum changes in their pod templates
        old, new = (workloads(d)[name]["spec"]["template"] for d in (before, after))
        assert old["metadata"]["annotations"] != new["metadata"]["annotations"]
        old["metadata"]["annotations"] = new["metadata"]["annotations"]
        assert old == new, name
    assert check_consistency(after)["oracle-cacher"][0].table_rows == (1000000, 400, 24)


def test_table_rows_size_the_tables_a_schema_leaves_unsized(tmp_path: Path) -> None:
    schema = schema_of_values()
    schema["columns"] = [{k: v for k, v in c.items() if k != "rows"} for c in schema["columns"]]
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"training": {"schema": schema, "tableRows": [7, 8, 9]}}))
    configs = check_consistency(render("-f", str(PARQUET_SCHEMA), "-f", str(path)))
    for name in ("oracle-cacher", "embedding-server", "trainer"):
        assert configs[name][0].table_rows == (7, 8, 9), name
    assert configs["data-processor"][0].source.table_rows == (7, 8, 9)


def schema_columns(*columns: str) -> list[str]:
    """``--set-json`` args giving training.schema these columns, each ``NAME:ROLE[:ROWS]``."""
    entries = []
    for column in columns:
        name, role, *rows = column.split(":")
        entries.append({"name": name, "role": role, **({"rows": int(rows[0])} if rows else {})})
    return ["--set-json", f"training.schema.columns={json.dumps(entries)}"]


PARQUET = ["--set", "training.data=parquet:/data/x.parquet", "--set", "training.dataVolume.claimName=d"]
WITH_SCHEMA = ["-f", str(PARQUET_SCHEMA)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (PARQUET, "training.data=parquet:/data/x.parquet needs training.schema"),
        (
            [
                "--set",
                "training.data=tsv:/data/a.tsv\\,/data/b.tsv",
                "--set",
                "training.dataVolume.claimName=d",
            ],
            "training.data=tsv:/data/a.tsv,/data/b.tsv needs training.schema",
        ),
        (
            [*WITH_SCHEMA, "--set", "training.data=criteo:/data/day_0.tsv", "--set", "training.eval.data="],
            "training.schema applies to csv:, tsv: and parquet: data, not training.data=criteo:/data/day_0",
        ),
        (
            [*WITH_SCHEMA, "--set", "training.data=avazu:/data/train.csv", "--set", "training.eval.data="],
            "training.schema applies to csv:, tsv: and parquet: data, not training.data=avazu:/data/train",
        ),
        (
            [*WITH_SCHEMA, "--set", "training.data=synthetic", "--set", "training.iterations=100"],
            "training.schema applies to csv:, tsv: and parquet: data, not training.data=synthetic",
        ),
        (
            [*WITH_SCHEMA, "--set", "training.data=csv:/data/x.csv"],
            "training.schema.format is parquet but training.data=csv:/data/x.csv is csv: data",
        ),
        (
            [*WITH_SCHEMA, "--set", "training.tableRows={1,2}"],
            "training.tableRows has 2 entries: training.schema has 3 categorical columns",
        ),
        (
            [*WITH_SCHEMA, "--set", TWENTY_SIX_ROWS],
            "training.tableRows has 26 entries: training.schema has 3 categorical columns",
        ),
        (
            [*WITH_SCHEMA, *schema_columns("y:label", "a:categorical", "b:categorical:5", "c:categorical")],
            "training.schema gives no rows for categorical column(s) a, c: give each its rows there, or set "
            "training.tableRows",
        ),
        (
            [*WITH_SCHEMA, *schema_columns("x:dense", "a:categorical:5")],
            "training.schema needs exactly one column with role label (the click, 0 or 1), got none",
        ),
        (
            [*WITH_SCHEMA, *schema_columns("y:label", "z:label", "a:categorical:5")],
            "training.schema needs exactly one column with role label (the click, 0 or 1), got y, z",
        ),
        (
            [*WITH_SCHEMA, *schema_columns("y:label", "x:dense", "x:categorical:5")],
            "training.schema: column x is named twice",
        ),
        (
            [*WITH_SCHEMA, *schema_columns("y:label", "x:dense")],
            "training.schema needs at least one column with role categorical",
        ),
        (
            [*PARQUET, "--set-json", 'training.schema={"header": true}'],
            "training.schema has no columns",
        ),
        (
            [*WITH_SCHEMA, "--set", "training.eval.data=csv:/data/held-out.csv"],
            "training.eval.data=csv:/data/held-out.csv is not in the format of training.data=parquet:",
        ),
    ],
)
def test_schema_values_that_do_not_fit_the_data_fail_helm_template(args: list[str], message: str) -> None:
    out = run(helm(), "template", "bagpipe", str(CHART), *args)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-800:]


@pytest.mark.parametrize(
    "values",
    [None, *(v for v in CI_VALUES if v != PARQUET_SCHEMA)],
    ids=lambda v: "default" if v is None else v.stem,
)
def test_without_a_schema_nothing_changes(values: Path | None) -> None:
    docs = render(*(["-f", str(values)] if values else []))
    assert SCHEMA_MAP not in by_kind(docs, "ConfigMap")
    for owner, pod in pod_specs(docs).items():
        assert not [v for v in pod.get("volumes", []) if v["name"] == "schema" or "configMap" in v], owner
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            assert "--schema" not in [str(a) for a in c.get("args", [])], (owner, c["name"])
            assert not [m for m in c.get("volumeMounts", []) if m["mountPath"] == SCHEMA_MOUNT], owner
    for name, load in workloads(docs).items():
        assert "checksum/schema" not in (load["spec"]["template"]["metadata"].get("annotations") or {}), name


def test_a_row_memory_gives_each_server_its_budget_and_a_volume_for_the_rest() -> None:
    docs = render("--set", "embeddingServer.rowMemory=512Mi")
    (emb,) = workloads(docs)["bagpipe-embedding-server"]["spec"]["template"]["spec"]["containers"]
    cfg = parse_container(emb, kubelet_env(emb, docs, POD_IP="10.0.0.1", POD_INDEX="1"))[0]
    assert cfg.row_memory == 512 << 20 and cfg.tier is not None
    mounts = {m["name"]: m["mountPath"] for m in emb["volumeMounts"]}
    assert mounts["rows"] == cfg.row_disk
    volumes = workloads(docs)["bagpipe-embedding-server"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "rows", "emptyDir": {}} in volumes
    plain = workloads(render())["bagpipe-embedding-server"]["spec"]["template"]["spec"]
    assert "--row-memory" not in plain["containers"][0]["args"]
    assert all(v["name"] != "rows" for v in plain["volumes"])
