"""A kubelet's part for the chart's rendered pods, under podman: test code, never part of the product.

``helm template`` renders the chart; :class:`Cluster` starts every pod of every workload (StatefulSets,
Deployments, the trainers' indexed Job, and ``helm test``'s pods on demand) as one podman container, as a
kubelet and the workload controllers would:

* the container's ``command``/``args`` with ``$(VAR)`` expansion, its env from values, ``fieldRef``
  (name, namespace, pod IP, labels, annotations), ``secretKeyRef`` and ``configMapKeyRef``;
* DNS on one container network: every Service's name, each StatefulSet pod's ``<pod>.<service>``, each
  indexed Job pod's ``<pod>.<subdomain>``, each also with ``.<namespace>.svc.cluster.local``; a pod's IP
  stays through container restarts, a new pod gets a new one;
* the pod's and container's security contexts (user, group, ``fsGroup`` on volumes, read-only root,
  capabilities, no privilege escalation, non-root enforced);
* ``emptyDir`` (``medium: Memory`` as tmpfs), every PersistentVolumeClaim as one host folder shared by
  all pods, Secret and ConfigMap volumes;
* restart policies: Deployments and StatefulSets restart an exited container; the indexed Job runs each
  index to exit 0, with its ``podFailurePolicy`` (``Ignore``: a new pod, not counted; ``FailJob``) and
  ``backoffLimit``;
* startup and liveness probes (httpGet, grpc, tcpSocket, exec): a container whose liveness probe fails
  ``failureThreshold`` times is stopped (SIGTERM, SIGKILL after the grace period) and started again;
* scaling a StatefulSet: new ordinals join; a removed pod runs its ``preStop`` hook, then gets SIGTERM.

What it does not do, because no API server runs here: the controller's pod deletion and its release of
the serving tiers go through the Kubernetes API, so the controller runs with ``--kill none`` and no
``--release``, and :meth:`Cluster.release` scales those workloads to zero as the API server's workload
controllers would on the controller's request. Readiness gates no Service (every pod is in DNS at once,
as with ``publishNotReadyAddresses``); resource limits, NetworkPolicies, RBAC and Service environment
variables are not applied.

A real Prometheus (Debian's) scrapes the pods as the chart's ServiceMonitors say (the operator's
labels, then each ServiceMonitor's relabelings) and the controller reads it through
``controller.prometheusUrl``.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import logging
import os
import random
import re
import shutil
import socket
import string
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
HELM = REPO / ".tools" / "helm" / "helm"
PROMETHEUS = REPO / ".tools" / "prometheus" / "usr" / "bin" / "prometheus"
TICK_S = 0.5
# podman here: runc (crun refuses this host's hybrid cgroups) and explicit ulimits at or below the hard
# limits (raising them is refused)
ULIMITS = ("nofile=20000:20000", "nproc=4096:4096")
VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    runtime = ["--runtime", "runc"] if shutil.which("runc") else []
    return subprocess.run(
        ["podman", *runtime, *args], capture_output=True, text=True, check=check, timeout=timeout
    )


def can_run_containers(image: str) -> str | None:
    """None when podman starts a container of ``image`` here, else why not (one line)."""
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman runc)"
    try:
        if podman("image", "exists", image, check=False).returncode != 0:
            return f"no image {image} (make image CONTAINER_ENGINE=podman)"
        run = podman("run", "--rm", *(f"--ulimit={u}" for u in ULIMITS), "--entrypoint", "true", image,
                     check=False, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"podman cannot start a container: {e}"
    if run.returncode != 0:
        return f"podman cannot start a container: {run.stderr.strip().splitlines()[-1:]}"
    return None


def render(release: str, namespace: str, values: dict[str, Any], *extra: str) -> list[dict[str, Any]]:
    """``helm template`` of the chart with ``values`` (and ServiceMonitors: the API is announced)."""
    out = subprocess.run(
        [str(HELM), "template", release, str(REPO / "deploy" / "helm"), "-n", namespace,
         "--api-versions", "monitoring.coreos.com/v1", "-f", "-", *extra],
        input=json.dumps(values), capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)``: replaced when VAR is defined, kept as written when not; ``$$`` is ``$``."""
    return VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _suffix(n: int = 5) -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=n))


@dataclass
class Workload:
    kind: str  # StatefulSet, Deployment, Job or Pod (helm test's)
    name: str
    spec: dict[str, Any]
    replicas: int = 1
    # (Job) per completion index: done, and failures counted against backoffLimit
    completed: set[int] = field(default_factory=set)
    failures: int = 0
    failed: str | None = None
    completed_at: float | None = None  # (wall clock: files' times compare with it)

    @property
    def template(self) -> dict[str, Any]:
        return self.spec if self.kind == "Pod" else self.spec["template"]


@dataclass
class Pod:
    workload: Workload
    name: str
    hostname: str
    ip: str
    labels: dict[str, str]
    annotations: dict[str, str]
    index: int | None = None  # the ordinal (StatefulSet) or the completion index (Job)
    container: str = ""
    restarts: int = 0
    started: float = 0.0
    started_ok: bool = False  # the startup probe passed (or there is none)
    probe_due: float = 0.0
    probe_failures: int = 0
    exit_code: int | None = None
    finished: bool = False  # (a Job or test pod) its container ended and will not be run again
    deleting: bool = False
    exits: list[int] = field(default_factory=list)

    @property
    def spec(self) -> dict[str, Any]:
        return dict(self.workload.template["spec"])


class Cluster:
    """The rendered ``manifests`` of one release, run as podman containers under ``workdir``."""

    def __init__(
        self, namespace: str, workdir: Path, *, prometheus: bool = True, claims: Path | None = None
    ) -> None:
        """A container network and (``prometheus``) a Prometheus address for a release in ``namespace``:
        render the chart with :meth:`prometheus_url` as ``controller.prometheusUrl``, then :meth:`start`
        it; :meth:`close` removes everything but the volumes. ``claims``: where the PersistentVolumeClaims'
        folders are (another cluster's: the same volumes, as a release installed again finds them)."""
        self.namespace = namespace
        self.workdir = workdir
        self.net = f"bagpipe-test-{_suffix(6)}"
        self._pick_subnet()
        self.pods: dict[str, Pod] = {}
        self.workloads: dict[str, Workload] = {}
        self.released: list[str] = []
        self.releases: list[str] = []
        self.events: list[str] = []
        self.restarted: dict[str, int] = {}  # containers started again in place, by pod
        self.started_at = 0.0
        self.secrets: dict[str, dict[str, str]] = {}
        self.config_maps: dict[str, dict[str, str]] = {}
        self.services: list[dict[str, Any]] = []
        self.service_monitors: list[dict[str, Any]] = []
        self.tests: list[dict[str, Any]] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self._prometheus: subprocess.Popen[bytes] | None = None
        self._with_prometheus = prometheus
        with socket.socket() as s:
            s.bind(("", 0))
            self.prometheus_port = s.getsockname()[1]
        self.claims = claims or workdir / "volumes"
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        for attempt in range(5):  # (a random /24 may overlap a network this host already has)
            made = podman("network", "create", "--subnet", str(self.subnet), "--gateway", self.gateway,
                          self.net, check=False)  # fmt: skip
            if made.returncode == 0:
                break
            if attempt == 4:
                raise RuntimeError(f"podman network create: {made.stderr.strip()}")
            self._pick_subnet()

    def _pick_subnet(self) -> None:
        self.subnet = ipaddress.ip_network(f"10.{random.randint(90, 250)}.{random.randint(0, 255)}.0/24")
        hosts = iter(self.subnet.hosts())
        self.gateway = str(next(hosts))
        self._hosts = hosts

    def _load(self, manifests: list[dict[str, Any]]) -> None:
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for o in manifests:
            by_kind.setdefault(o["kind"], []).append(o)
        self.secrets = {o["metadata"]["name"]: self._secret_data(o) for o in by_kind.get("Secret", [])}
        self.config_maps = {
            o["metadata"]["name"]: dict(o.get("data") or {}) for o in by_kind.get("ConfigMap", [])
        }
        self.services = by_kind.get("Service", [])
        self.service_monitors = by_kind.get("ServiceMonitor", [])
        for kind in ("StatefulSet", "Deployment", "Job"):
            for o in by_kind.get(kind, []):
                spec = o["spec"]
                replicas = spec.get("parallelism", 1) if kind == "Job" else spec.get("replicas", 1)
                self.workloads[o["metadata"]["name"]] = Workload(kind, o["metadata"]["name"], spec, replicas)
        self.releases = self._without_api_server()
        hook = "helm.sh/hook"
        self.tests = [
            o for o in by_kind.get("Pod", []) if o["metadata"].get("annotations", {}).get(hook) == "test"
        ]

    def _without_api_server(self) -> list[str]:
        """The controller's command line without what needs the Kubernetes API: ``--kill kubernetes``
        becomes ``--kill none`` and the ``--release`` workloads are returned (:meth:`release` does that)."""
        releases: list[str] = []
        for w in self.workloads.values():
            for container in w.template["spec"]["containers"]:
                args = container.get("args") or []
                if "--kill" not in args:
                    continue
                kept: list[str] = []
                it = iter(args)
                for a in it:
                    if a == "--release":
                        releases.append(next(it))
                    elif a == "--kill":
                        next(it)
                        kept += ["--kill", "none"]
                    elif a == "--namespace":
                        next(it)
                    else:
                        kept.append(a)
                container["args"] = kept
        return releases

    # ---- life
    def start(self, manifests: list[dict[str, Any]]) -> None:
        """Starts every workload of the rendered ``manifests`` (the kubelet's loop runs from here on)."""
        self._load(manifests)
        self.started_at = time.time()
        if self._with_prometheus:
            self._start_prometheus()
        with self._lock:
            for w in self.workloads.values():
                self._reconcile(w)
        self._thread.start()

    def close(self) -> None:
        """Stops the loop, then removes every container of this cluster (whatever state the pods are in),
        the network and Prometheus."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        with self._lock:
            for pod in list(self.pods.values()):
                self._save_log(pod)
        left = podman("ps", "-aq", "--filter", f"label=bagpipe-test={self.net}", check=False).stdout.split()
        if left:
            podman("rm", "-f", "-t", "0", *left, check=False)
        podman("network", "rm", "-f", self.net, check=False)
        if self._prometheus is not None:
            self._prometheus.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._prometheus.wait(10)

    # ---- what a test asks
    def workload(self, suffix: str) -> Workload:
        (w,) = [w for n, w in self.workloads.items() if n.endswith(suffix)]
        return w

    def pods_of(self, suffix: str) -> list[Pod]:
        with self._lock:
            return sorted(
                (p for p in self.pods.values() if p.workload.name.endswith(suffix) and not p.finished),
                key=lambda p: (p.index if p.index is not None else -1, p.name),
            )

    def kill(self, pod: Pod, signal: str = "KILL") -> None:
        self.events.append(f"{time.strftime('%X')} kill -{signal} {pod.name}")
        podman("kill", "-s", signal, pod.container, check=False)

    def pause(self, pod: Pod) -> None:
        self.events.append(f"{time.strftime('%X')} pause {pod.name}")
        podman("pause", pod.container)

    def scale(self, suffix: str, replicas: int) -> None:
        """``kubectl scale``: the workload's controller adds pods, or deletes the highest ordinals (their
        preStop hook first, then SIGTERM and the grace period)."""
        w = self.workload(suffix)
        self.events.append(f"{time.strftime('%X')} scale {w.name} {w.replicas} -> {replicas}")
        with self._lock:
            w.replicas = replicas
            self._reconcile(w)

    def release(self, names: list[str]) -> None:
        """What the controller's ``--release`` asks of the API server once the job is done: each workload
        scaled to zero."""
        for name in names:
            self.released.append(name)
            kind, _, workload = name.partition("/")
            (w,) = [w for w in self.workloads.values() if w.name == workload and w.kind.lower() == kind]
            self.events.append(f"{time.strftime('%X')} release {name}")
            with self._lock:
                w.replicas = 0
                self._reconcile(w)

    def running(self, suffix: str) -> int:
        return len(self.pods_of(suffix))

    def wait(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:g} s; events: {self.events[-20:]}")
            job = [w for w in self.workloads.values() if w.kind == "Job" and w.failed]
            if job:
                raise RuntimeError(f"job {job[0].name} failed: {job[0].failed}; events: {self.events[-20:]}")
            time.sleep(TICK_S)

    def run_test_pods(self, timeout: float = 300) -> dict[str, int]:
        """``helm test``: each test pod run to its end; its exit code by name."""
        codes: dict[str, int] = {}
        for manifest in self.tests:
            w = Workload("Pod", manifest["metadata"]["name"], manifest)
            with self._lock:
                pod = self._new_pod(w, manifest["metadata"]["name"], None)
            self.wait(lambda p=pod: p.finished, timeout, f"test pod {pod.name}")
            codes[pod.name] = pod.exit_code if pod.exit_code is not None else -1
        return codes

    def log(self, pod: Pod) -> str:
        return (
            podman("logs", pod.container, check=False).stdout
            + podman("logs", pod.container, check=False).stderr
        )

    def prometheus_url(self) -> str:
        return f"http://{self.gateway}:{self.prometheus_port}"

    # ---- the workload controllers
    def _reconcile(self, w: Workload) -> None:
        pods = [p for p in self.pods.values() if p.workload is w and not p.deleting]
        if w.kind == "StatefulSet":
            have = {p.index for p in pods}
            for i in range(w.replicas):
                if i not in have:
                    self._new_pod(w, f"{w.name}-{i}", i)
            for p in pods:
                if p.index is not None and p.index >= w.replicas:
                    self._delete(p)
        elif w.kind == "Deployment":
            template_hash = _suffix(8)
            for _ in range(w.replicas - len(pods)):
                self._new_pod(w, f"{w.name}-{template_hash}-{_suffix()}", None)
            for p in pods[w.replicas :]:
                self._delete(p)
        elif w.kind == "Job" and w.failed is None:
            live = {p.index for p in pods if not p.finished}
            for i in range(w.spec.get("completions", 1)):
                if i not in w.completed and i not in live:
                    self._new_pod(w, f"{w.name}-{i}-{_suffix()}", i)

    def _new_pod(self, w: Workload, name: str, index: int | None) -> Pod:
        meta = w.template.get("metadata", {})
        labels = dict(meta.get("labels") or {})
        annotations = dict(meta.get("annotations") or {})
        hostname = name
        if w.kind == "StatefulSet":
            labels["apps.kubernetes.io/pod-index"] = str(index)
            labels["statefulset.kubernetes.io/pod-name"] = name
        elif w.kind == "Job":
            labels["batch.kubernetes.io/job-completion-index"] = str(index)
            annotations["batch.kubernetes.io/job-completion-index"] = str(index)
            hostname = f"{w.name}-{index}"
        pod = Pod(
            w,
            name,
            w.template["spec"].get("hostname", hostname),
            str(next(self._hosts)),
            labels,
            annotations,
            index,
        )
        self.pods[name] = pod
        self.events.append(f"{time.strftime('%X')} new pod {name} ({pod.ip})")
        self._run(pod)
        self._write_targets()
        return pod

    def _delete(self, pod: Pod) -> None:
        pod.deleting = True
        self.events.append(f"{time.strftime('%X')} delete pod {pod.name}")
        threading.Thread(target=self._terminate, args=(pod,), name=f"delete-{pod.name}", daemon=True).start()

    def _terminate(self, pod: Pod) -> None:
        (container,) = self._containers(pod)
        grace = int(pod.spec.get("terminationGracePeriodSeconds", 30))
        started = time.monotonic()
        hook = container.get("lifecycle", {}).get("preStop", {}).get("exec")
        if hook:
            env = self._env(pod, container)
            args = ["exec", *(f"--env={k}={v}" for k, v in env.items()), pod.container, *hook["command"]]
            with contextlib.suppress(subprocess.TimeoutExpired):
                done = podman(*args, check=False, timeout=grace)
                self.events.append(f"{time.strftime('%X')} preStop {pod.name}: exit {done.returncode}")
        left = max(1, int(grace - (time.monotonic() - started)))
        podman("stop", "-t", str(left), pod.container, check=False, timeout=left + 30)
        with self._lock:
            self._save_log(pod)
            podman("rm", "-f", "-t", "0", pod.container, check=False)
            self.pods.pop(pod.name, None)
            self._write_targets()

    # ---- a container
    def _containers(self, pod: Pod) -> list[dict[str, Any]]:
        return list(pod.spec["containers"])

    def _env(self, pod: Pod, container: dict[str, Any]) -> dict[str, str]:
        env: dict[str, str] = {}
        if pod.workload.kind == "Job" and pod.index is not None:
            env["JOB_COMPLETION_INDEX"] = str(pod.index)
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env)
                continue
            source = e["valueFrom"]
            if "fieldRef" in source:
                env[e["name"]] = self._field(pod, source["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                env[e["name"]] = self.secrets[ref["name"]][ref["key"]]
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                env[e["name"]] = str(self.config_maps[ref["name"]][ref["key"]])
            else:
                raise NotImplementedError(f"pod {pod.name}: env {e['name']}: {source}")
        return env

    def _field(self, pod: Pod, path: str) -> str:
        simple = {
            "metadata.name": pod.name,
            "metadata.namespace": self.namespace,
            "status.podIP": pod.ip,
            "status.hostIP": self.gateway,
            "spec.nodeName": "podman",
            "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
        }
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m is None:
            raise NotImplementedError(f"pod {pod.name}: fieldRef {path}")
        return (pod.labels if m.group(1) == "labels" else pod.annotations).get(m.group(2), "")

    def _aliases(self, pod: Pod) -> list[str]:
        names = []
        for svc in self.services:
            selector = svc["spec"].get("selector") or {}
            if selector and all(pod.labels.get(k) == v for k, v in selector.items()):
                names.append(svc["metadata"]["name"])
        sub = pod.spec.get("subdomain") or (
            pod.workload.spec.get("serviceName") if pod.workload.kind == "StatefulSet" else None
        )
        if sub:
            names.append(f"{pod.hostname}.{sub}")
        return names + [f"{n}.{self.namespace}.svc.cluster.local" for n in names]

    def _volume_dirs(self, pod: Pod) -> dict[str, tuple[str, bool]]:
        """Each volume of the pod: a host folder (or ``tmpfs``) and whether it is read only."""
        group = pod.spec.get("securityContext", {}).get("fsGroup")
        out: dict[str, tuple[str, bool]] = {}
        for v in pod.spec.get("volumes") or []:
            name = v["name"]
            if "emptyDir" in v:
                if v["emptyDir"] and v["emptyDir"].get("medium") == "Memory":
                    out[name] = ("tmpfs", False)
                    continue
                path = self.workdir / "pods" / pod.name / name
                path.mkdir(parents=True, exist_ok=True)
                path.chmod(0o777)
                out[name] = (str(path), False)
            elif "persistentVolumeClaim" in v:
                path = self.claims / v["persistentVolumeClaim"]["claimName"]
                if not path.exists():
                    path.mkdir(parents=True)
                    if group is not None:
                        os.chown(path, 0, int(group))
                    path.chmod(0o2775)
                out[name] = (str(path), bool(v["persistentVolumeClaim"].get("readOnly")))
            elif "secret" in v or "configMap" in v:
                kind = "secret" if "secret" in v else "configMap"
                ref = v[kind]
                data = self.secrets[ref["secretName"]] if kind == "secret" else self.config_maps[ref["name"]]
                items = ref.get("items") or [{"key": k, "path": k} for k in data]
                path = self.workdir / "pods" / pod.name / name
                path.mkdir(parents=True, exist_ok=True)
                for item in items:
                    f = path / item["path"]
                    f.parent.mkdir(parents=True, exist_ok=True)
                    f.write_text(str(data[item["key"]]))
                    f.chmod(int(item.get("mode", ref.get("defaultMode", 0o644))))
                    if group is not None:
                        os.chown(f, 0, int(group))
                out[name] = (str(path), True)
            else:
                raise NotImplementedError(f"pod {pod.name}: volume {v}")
        return out

    def _run(self, pod: Pod) -> None:
        if self._stop.is_set():  # (closing: nothing starts again)
            return
        (container,) = self._containers(pod)
        spec = pod.spec
        pod_sc = spec.get("securityContext") or {}
        sc = {**pod_sc, **(container.get("securityContext") or {})}
        user, group = sc.get("runAsUser"), sc.get("runAsGroup")
        if sc.get("runAsNonRoot") and not user:
            raise RuntimeError(f"pod {pod.name}: runAsNonRoot without a non-root runAsUser")
        env = self._env(pod, container)
        pod.container = f"{self.net}-{pod.name}"
        # a pod's network outlives its containers: the same IP and MAC when one is started again (a new MAC
        # behind the same IP leaves every peer's ARP entry stale for half a minute: its connections time out)
        mac = "02:42:" + ":".join(f"{int(b):02x}" for b in pod.ip.split("."))
        args = [
            "run", "-d", "--name", pod.container, "--hostname", pod.hostname,
            "--network", self.net, "--ip", pod.ip, "--mac-address", mac,
            "--label", f"bagpipe-test={self.net}",
            *(f"--ulimit={u}" for u in ULIMITS),
        ]  # fmt: skip
        for alias in self._aliases(pod):
            args += ["--network-alias", alias]
        if user is not None:
            args += ["--user", f"{user}:{group if group is not None else user}"]
        if pod_sc.get("fsGroup") is not None:
            args += ["--group-add", str(pod_sc["fsGroup"])]
        if sc.get("readOnlyRootFilesystem"):
            args.append("--read-only")
            args.append("--read-only-tmpfs=false")
        caps = sc.get("capabilities") or {}
        for cap in caps.get("drop") or []:
            args += ["--cap-drop", cap]
        for cap in caps.get("add") or []:
            args += ["--cap-add", cap]
        if sc.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        for k, v in env.items():
            args += ["--env", f"{k}={v}"]
        volumes = self._volume_dirs(pod)
        for m in container.get("volumeMounts") or []:
            source, read_only = volumes[m["name"]]
            if source == "tmpfs":
                args += ["--tmpfs", f"{m['mountPath']}:rw,mode=1777"]
                continue
            if m.get("subPath"):
                source = str(Path(source) / m["subPath"])
            ro = read_only or bool(m.get("readOnly"))
            args += ["--volume", f"{source}:{m['mountPath']}:{'ro' if ro else 'rw'},Z"]
        command = [expand(c, env) for c in container.get("command") or []]
        cargs = [expand(a, env) for a in container.get("args") or []]
        if command:
            args += ["--entrypoint", json.dumps(command)]
        args += [container["image"], *cargs]
        podman("rm", "-f", "-t", "0", pod.container, check=False)
        podman(*args)
        pod.started = time.monotonic()
        pod.started_ok = "startupProbe" not in container
        pod.probe_due = pod.started + float(
            (container.get("startupProbe") or container.get("livenessProbe") or {}).get(
                "initialDelaySeconds", 0
            )
        )
        pod.probe_failures = 0
        pod.exit_code = None

    def _save_log(self, pod: Pod) -> None:
        logs = podman("logs", pod.container, check=False)
        with open(self.workdir / "logs" / f"{pod.name}.log", "a") as f:
            f.write(logs.stdout + logs.stderr)

    # ---- the kubelet's loop
    def _loop(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self._tick()
            except Exception:  # (a test must see the harness stop, not hang)
                logger.exception("kubelet")
                self.events.append("kubelet loop failed; see the log")

    def _states(self) -> dict[str, dict[str, Any]]:
        out = podman(
            "ps", "-a", "--filter", f"label=bagpipe-test={self.net}", "--format", "json", check=False
        )
        return {c["Names"][0]: c for c in json.loads(out.stdout or "[]")}

    def _tick(self) -> None:
        states = self._states()
        with self._lock:
            for pod in list(self.pods.values()):
                if pod.deleting or pod.finished:
                    continue
                state = states.get(pod.container)
                if state is None:
                    continue
                if state["State"] == "exited":
                    self._exited(pod, int(state.get("ExitCode", 0)))
                elif state["State"] == "running" or state["State"] == "paused":
                    self._probe(pod)
            for w in self.workloads.values():
                self._reconcile(w)

    def _exited(self, pod: Pod, code: int) -> None:
        pod.exits.append(code)
        self._save_log(pod)
        self.events.append(f"{time.strftime('%X')} {pod.name} exited {code}")
        w = pod.workload
        policy = pod.spec.get("restartPolicy", "Always")
        if policy == "Always":
            self._restart(pod)
            return
        pod.finished, pod.exit_code = True, code
        if w.kind != "Job":
            return
        if code == 0:
            assert pod.index is not None
            w.completed.add(pod.index)
            if len(w.completed) == w.spec.get("completions", 1):
                w.completed_at = time.time()
                self.events.append(f"{time.strftime('%X')} job {w.name} complete")
                self.release(self.releases)
            return
        action = None
        for rule in (w.spec.get("podFailurePolicy") or {}).get("rules", []):
            codes = rule.get("onExitCodes") or {}
            inside = code in codes.get("values", [])
            if (codes.get("operator", "In") == "In") == inside:
                action = rule["action"]
                break
        if action == "FailJob":
            w.failed = f"pod {pod.name} exited {code} (podFailurePolicy FailJob)"
        elif action == "Ignore":
            self.events.append(f"{time.strftime('%X')} {pod.name}: exit {code} ignored (podFailurePolicy)")
        else:
            w.failures += 1
            if w.failures > int(w.spec.get("backoffLimit", 6)):
                w.failed = (
                    f"backoffLimit {w.spec.get('backoffLimit', 6)} passed (pod {pod.name} exited {code})"
                )

    def _restart(self, pod: Pod) -> None:
        pod.restarts += 1
        self.restarted[pod.name] = pod.restarts
        self._run(pod)

    # ---- probes
    def _probe(self, pod: Pod) -> None:
        (container,) = self._containers(pod)
        probe = container.get("livenessProbe") if pod.started_ok else container.get("startupProbe")
        if probe is None or time.monotonic() < pod.probe_due:
            return
        pod.probe_due = time.monotonic() + float(probe.get("periodSeconds", 10))
        ok = self._check(pod, container, probe)
        if ok:
            pod.probe_failures = 0
            if not pod.started_ok:
                pod.started_ok = True
                liveness = container.get("livenessProbe") or {}
                pod.probe_due = time.monotonic() + float(liveness.get("initialDelaySeconds", 0))
            return
        pod.probe_failures += 1
        if pod.probe_failures < int(probe.get("failureThreshold", 3)):
            return
        what = "liveness" if pod.started_ok else "startup"
        self.events.append(
            f"{time.strftime('%X')} {pod.name}: {what} probe failed {pod.probe_failures} times"
        )
        grace = int(pod.spec.get("terminationGracePeriodSeconds", 30))
        if podman("stop", "-t", str(grace), pod.container, check=False, timeout=grace + 30).returncode != 0:
            podman("rm", "-f", "-t", "0", pod.container, check=False)  # (a frozen one: SIGKILL and thaw)
        pod.exits.append(137)
        if pod.spec.get("restartPolicy", "Always") == "Always":
            self._restart(pod)
        else:
            self._exited(pod, 137)

    def _port(self, container: dict[str, Any], port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        (p,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
        return int(p)

    def _check(self, pod: Pod, container: dict[str, Any], probe: dict[str, Any]) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "httpGet" in probe:
                h = probe["httpGet"]
                url = f"http://{pod.ip}:{self._port(container, h['port'])}{h.get('path', '/')}"
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    return 200 <= r.status < 400
            if "tcpSocket" in probe:
                with socket.create_connection(
                    (pod.ip, self._port(container, probe["tcpSocket"]["port"])), timeout
                ):
                    return True
            if "grpc" in probe:
                g = probe["grpc"]
                with grpc.insecure_channel(f"{pod.ip}:{self._port(container, g['port'])}") as ch:
                    answer = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=g.get("service", "")), timeout=timeout
                    )
                return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)
            if "exec" in probe:
                done = podman(
                    "exec", pod.container, *probe["exec"]["command"], check=False, timeout=timeout + 5
                )
                return done.returncode == 0
        except (OSError, grpc.RpcError, subprocess.TimeoutExpired):
            return False
        raise NotImplementedError(f"pod {pod.name}: probe {probe}")

    # ---- secrets
    @staticmethod
    def _secret_data(o: dict[str, Any]) -> dict[str, str]:
        data = {k: base64.b64decode(v).decode() for k, v in (o.get("data") or {}).items()}
        data.update({k: str(v) for k, v in (o.get("stringData") or {}).items()})
        return data

    # ---- Prometheus, as the operator would configure it from the ServiceMonitors
    def _start_prometheus(self) -> None:
        directory = self.workdir / "prometheus"
        directory.mkdir(parents=True, exist_ok=True)
        jobs = []
        for sm in self.service_monitors:
            for i, endpoint in enumerate(sm["spec"]["endpoints"]):
                name = f"serviceMonitor/{self.namespace}/{sm['metadata']['name']}/{i}"
                relabel = [
                    {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                    {"target_label": "endpoint", "replacement": endpoint.get("port", "")},
                ]
                for r in endpoint.get("relabelings") or []:
                    rule: dict[str, Any] = {"action": r.get("action", "replace").lower()}
                    for ours, theirs in (("source_labels", "sourceLabels"), ("target_label", "targetLabel"),
                                         ("regex", "regex"), ("replacement", "replacement"),
                                         ("separator", "separator")):  # fmt: skip
                        if theirs in r:
                            rule[ours] = r[theirs]
                    relabel.append(rule)
                jobs.append(
                    {
                        "job_name": name,
                        "scrape_interval": endpoint.get("interval", "30s"),
                        "metrics_path": endpoint.get("path", "/metrics"),
                        "file_sd_configs": [{"files": [str(directory / f"{_sanitize(name)}.json")]}],
                        "relabel_configs": relabel,
                    }
                )
        (directory / "prometheus.yml").write_text(json.dumps({"scrape_configs": jobs}, indent=1))
        self._write_targets()
        with open(directory / "prometheus.log", "w") as log:  # (the child keeps its own descriptor)
            self._prometheus = subprocess.Popen(
                [
                    str(PROMETHEUS),
                    f"--config.file={directory / 'prometheus.yml'}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address=0.0.0.0:{self.prometheus_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        ready = f"http://127.0.0.1:{self.prometheus_port}/-/ready"
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(ready, timeout=2) as r:
                if r.status == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start; see {directory / 'prometheus.log'}")
            time.sleep(0.2)

    def _write_targets(self) -> None:
        if not self._with_prometheus:
            return
        directory = self.workdir / "prometheus"
        for sm in self.service_monitors:
            selector = sm["spec"]["selector"].get("matchLabels", {})
            services = [
                s
                for s in self.services
                if all(s["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())
            ]
            for i, endpoint in enumerate(sm["spec"]["endpoints"]):
                name = f"serviceMonitor/{self.namespace}/{sm['metadata']['name']}/{i}"
                groups = []
                for svc in services:
                    ports = {p.get("name"): p for p in svc["spec"].get("ports", [])}
                    if endpoint.get("port") not in ports:
                        continue
                    for pod in self.pods.values():
                        sel = svc["spec"].get("selector") or {}
                        if (
                            pod.deleting
                            or pod.finished
                            or not all(pod.labels.get(k) == v for k, v in sel.items())
                        ):
                            continue
                        (container,) = self._containers(pod)
                        port = self._port(
                            container, ports[endpoint["port"]].get("targetPort", endpoint["port"])
                        )
                        labels = {
                            "__meta_kubernetes_namespace": self.namespace,
                            "__meta_kubernetes_service_name": svc["metadata"]["name"],
                            "__meta_kubernetes_pod_name": pod.name,
                            "__meta_kubernetes_pod_ip": pod.ip,
                        }
                        labels.update(
                            {f"__meta_kubernetes_pod_label_{_sanitize(k)}": v for k, v in pod.labels.items()}
                        )
                        labels.update(
                            {
                                f"__meta_kubernetes_pod_annotation_{_sanitize(k)}": v
                                for k, v in pod.annotations.items()
                            }
                        )
                        groups.append({"targets": [f"{pod.ip}:{port}"], "labels": labels})
                target = directory / f"{_sanitize(name)}.json"
                tmp = target.with_suffix(".tmp")
                tmp.write_text(json.dumps(groups))
                tmp.replace(target)
