"""``KubernetesActuator`` through the real ``kubernetes`` client against a RECORDED FAKE of the API server.

This is the one fake these tests allow: no Kubernetes API server can run here. It is an ``http.server`` on
127.0.0.1 that answers only the exchanges in ``recorded/`` (hand-written in the real API's shapes: the v1
Pod a DELETE returns, the v1 Status of a missing pod, the autoscaling/v1 Scale a PATCH returns) and records
every request it gets. A request the recording does not have, down to its body and content type, gets a 500
(so the client raises) and is kept in ``unexpected``."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from bagpipe.controller import kubernetes as actuator_module
from bagpipe.controller.kubernetes import KubernetesActuator

RECORDED = Path(__file__).parent / "recorded"
NS = "ml"
MERGE_PATCH = "application/merge-patch+json"


def exchange(name: str) -> dict[str, Any]:
    return dict(json.loads((RECORDED / f"{name}.json").read_text()))


class RecordedApiServer:
    """Answers requests equal to a recorded one with its recorded response; everything else: 500."""

    def __init__(self, *names: str) -> None:
        self.exchanges = [exchange(n) for n in names]
        self.requests: list[dict[str, Any]] = []
        self.unexpected: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                path, _, query = self.path.partition("?")
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = {
                    "method": self.command,
                    "path": path,
                    "query": query,
                    "content_type": self.headers.get("Content-Type"),
                    "body": json.loads(raw) if raw else None,
                }
                owner.requests.append(request)
                answers = [e["response"] for e in owner.exchanges if e["request"] == request]
                if answers:
                    status, body = answers[0]["status"], answers[0]["body"]
                else:
                    owner.unexpected.append(request)
                    status = 500
                    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500}
                    body["message"] = f"not in the recording: {request}"
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_DELETE = do_PATCH = do_POST = do_PUT = _any  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def api() -> Iterator[tuple[RecordedApiServer, Any]]:
    """Yields a server for the test to fill with exchanges and an API client pointed at it."""
    server = RecordedApiServer()
    config = kubernetes.client.Configuration(host=f"http://127.0.0.1:{server.port}")
    client = kubernetes.client.ApiClient(config)
    try:
        yield server, client
    finally:
        client.close()
        server.close()


def recorded(server: RecordedApiServer, *names: str) -> None:
    server.exchanges = [exchange(n) for n in names]


def test_kill_deletes_the_members_pod_with_no_grace_period(api: tuple[RecordedApiServer, Any]) -> None:
    server, client = api
    recorded(server, "delete_pod")
    where = {"host": "bagpipe-trainer-1", "pid": 7, "pod": "bagpipe-trainer-1-x7k2p"}
    said = KubernetesActuator(NS, client).kill("trainer/1", where)
    assert said == "deleted pod bagpipe-trainer-1-x7k2p (member trainer/1)"
    assert server.requests == [
        {
            "method": "DELETE",
            "path": "/api/v1/namespaces/ml/pods/bagpipe-trainer-1-x7k2p",
            "query": "",
            "content_type": "application/json",
            "body": {"gracePeriodSeconds": 0},
        }
    ]
    assert server.unexpected == []


def test_a_pod_already_gone_is_not_an_error(api: tuple[RecordedApiServer, Any]) -> None:
    server, client = api
    recorded(server, "delete_missing_pod")
    said = KubernetesActuator(NS, client).kill("embedding_server/1", {"pod": "bagpipe-embedding-server-1"})
    assert said == "pod bagpipe-embedding-server-1 (member embedding_server/1) was already gone"
    assert [(r["method"], r["path"]) for r in server.requests] == [
        ("DELETE", "/api/v1/namespaces/ml/pods/bagpipe-embedding-server-1")
    ]
    assert server.unexpected == []


def test_any_other_api_error_is_raised(api: tuple[RecordedApiServer, Any]) -> None:
    server, client = api
    recorded(server, "delete_pod")  # (another pod: not in the recording, answered 500)
    with pytest.raises(kubernetes.client.ApiException) as raised:
        KubernetesActuator(NS, client).kill("trainer/0", {"pod": "bagpipe-trainer-0-q9w4z"})
    assert raised.value.status == 500
    assert [r["path"] for r in server.unexpected] == ["/api/v1/namespaces/ml/pods/bagpipe-trainer-0-q9w4z"]


def test_kill_without_a_pod_name_names_the_member(api: tuple[RecordedApiServer, Any]) -> None:
    server, client = api
    with pytest.raises(ValueError, match="trainer/1"):
        KubernetesActuator(NS, client).kill("trainer/1", {"host": "h", "pid": 7})
    assert server.requests == []


def test_release_scales_each_target_to_zero_through_its_scale_subresource(
    api: tuple[RecordedApiServer, Any],
) -> None:
    server, client = api
    recorded(server, "scale_statefulset", "scale_deployment")
    said = KubernetesActuator(NS, client).release(
        ["statefulset/bagpipe-embedding-server", "deployment/bagpipe-oracle-cacher"]
    )
    assert said == [
        "scaled statefulset bagpipe-embedding-server to 0 replicas",
        "scaled deployment bagpipe-oracle-cacher to 0 replicas",
    ]
    patch = {"method": "PATCH", "query": "", "content_type": MERGE_PATCH, "body": {"spec": {"replicas": 0}}}
    assert server.requests == [
        {**patch, "path": "/apis/apps/v1/namespaces/ml/statefulsets/bagpipe-embedding-server/scale"},
        {**patch, "path": "/apis/apps/v1/namespaces/ml/deployments/bagpipe-oracle-cacher/scale"},
    ]
    assert server.unexpected == []


@pytest.mark.parametrize(
    "bad", ["daemonset/x", "statefulset/", "deployment", "StatefulSet/x", "deployment/a/b"]
)
def test_a_malformed_target_is_refused_before_any_call(bad: str, api: tuple[RecordedApiServer, Any]) -> None:
    server, client = api
    recorded(server, "scale_statefulset")
    with pytest.raises(ValueError, match=bad):
        KubernetesActuator(NS, client).release(["statefulset/bagpipe-embedding-server", bad])
    assert server.requests == []


def test_the_namespace_defaults_to_the_pods_own(
    api: tuple[RecordedApiServer, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, client = api
    (tmp_path / "namespace").write_text("team-a\n")
    monkeypatch.setattr(actuator_module, "NAMESPACE_FILE", tmp_path / "namespace")
    assert KubernetesActuator(api_client=client).namespace == "team-a"
    assert KubernetesActuator("ml", client).namespace == "ml"


def test_importing_the_module_does_not_import_the_client() -> None:
    code = "import sys, bagpipe.controller.kubernetes; print('kubernetes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
