"""The controller's hands in a cluster: deleting a stuck member's pod (its workload replaces it) and, once
the job has finished, scaling the serving tiers to zero, through the Kubernetes API.

The ``kubernetes`` client is imported here, when an actuator is made: the services and a local run never
pay for importing it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# where a pod's service account puts its namespace
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
RELEASE_KINDS = ("statefulset", "deployment")
# an API server that does not answer must not hang recovery
REQUEST_TIMEOUT_S = 30.0


class KubernetesActuator:
    """Deletes members' pods and scales workloads in one namespace (the pod's own unless given)."""

    def __init__(self, namespace: str | None = None, api_client: Any = None) -> None:
        import kubernetes

        if api_client is None:
            kubernetes.config.load_incluster_config()
            api_client = kubernetes.client.ApiClient()
        self.namespace = namespace or NAMESPACE_FILE.read_text().strip()
        self._core = kubernetes.client.CoreV1Api(api_client)
        self._apps = kubernetes.client.AppsV1Api(api_client)
        self._api_exception = kubernetes.client.ApiException
        self._delete_options = kubernetes.client.V1DeleteOptions

    def kill(self, member: str, where: dict[str, Any]) -> str:
        """Deletes ``member``'s pod, ``where["pod"]``, at once: a frozen process gets no grace period to
        hold its replacement back. A pod already gone is not an error."""
        pod = where.get("pod")
        if not pod:
            raise ValueError(f"{member}: no pod name to delete (its registration has no 'pod')")
        try:
            self._core.delete_namespaced_pod(
                pod,
                self.namespace,
                body=self._delete_options(grace_period_seconds=0),
                # (the client names no type for a DELETE's body; the server would assume JSON)
                _headers={"Content-Type": "application/json"},
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        except self._api_exception as e:
            if e.status == 404:
                return f"pod {pod} (member {member}) was already gone"
            raise
        return f"deleted pod {pod} (member {member})"

    def release(self, targets: list[str]) -> list[str]:
        """Scales each ``statefulset/NAME`` or ``deployment/NAME`` to zero replicas (its scale subresource,
        the one right the controller's Role grants on them). Every target is checked before any call."""
        parsed = []
        for target in targets:
            kind, _, name = target.partition("/")
            if kind not in RELEASE_KINDS or not name or "/" in name:
                raise ValueError(f"release target {target!r}: expected statefulset/NAME or deployment/NAME")
            parsed.append((kind, name))
        done = []
        for kind, name in parsed:
            patch = (
                self._apps.patch_namespaced_stateful_set_scale
                if kind == "statefulset"
                else self._apps.patch_namespaced_deployment_scale
            )
            # a merge patch: only replicas changes (the client's default for a dict is a strategic merge)
            patch(
                name,
                self.namespace,
                {"spec": {"replicas": 0}},
                _content_type="application/merge-patch+json",
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            done.append(f"scaled {kind} {name} to 0 replicas")
        return done
