"""A real Prometheus server for a local run (``bagpipe run --prometheus``), scraping every service.

The binary comes from ``$BAGPIPE_PROMETHEUS``, ``PATH``, or ``.tools/prometheus`` in the repository,
where ``make tools`` unpacks Debian's ``prometheus`` package (no root needed). Targets carry the labels
``service`` and ``member`` (``rank`` for trainers, ``shard`` for embedding servers); the job label is
the service name, as a ServiceMonitor would set it in Kubernetes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
TOOLS = REPO / ".tools" / "prometheus" / "usr" / "bin"


def find_binary(name: str) -> str:
    """``prometheus`` or ``promtool``: the env override, then PATH, then ``make tools``'s copy."""
    override = os.environ.get(f"BAGPIPE_{name.upper()}")
    for candidate in (override, shutil.which(name), str(TOOLS / name)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        f"no {name} binary: run `make tools` (unpacks Debian's prometheus package into .tools/), "
        f"put {name} on PATH, or set BAGPIPE_{name.upper()}"
    )


def _scope(service: str, member: str) -> dict[str, str]:
    """The labels the chart's ServiceMonitors add, which the dashboard's variables select: a trainer's
    rank, an embedding server's or oracle's shard (a local run has no namespace or release; the variables'
    "All" matches the missing labels)."""
    if service == "trainer":
        return {"rank": member}
    if service in ("embedding_server", "oracle_cacher"):
        return {"shard": member}
    return {}


def scrape_config(endpoints: dict[str, str], interval_s: int = 1) -> dict[str, Any]:
    """One job per service, one target per member, labelled like the Kubernetes deployment."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for name, address in sorted(endpoints.items()):
        service, member = name.split("/", 1)
        jobs.setdefault(service, []).append(
            {
                "targets": [address],
                "labels": {"service": service, "member": member, **_scope(service, member)},
            }
        )
    return {
        "global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s"},
        "scrape_configs": [
            {"job_name": service, "static_configs": targets} for service, targets in jobs.items()
        ],
    }


class PrometheusServer:
    """Starts ``prometheus`` on a free loopback port with a config scraping ``endpoints``."""

    def __init__(self, workdir: Path, endpoints: dict[str, str], port: int) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        self._config = config
        config.write_text(json.dumps(scrape_config(endpoints), indent=2))  # JSON is valid YAML
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 (closed in stop())
        self._proc = subprocess.Popen(
            [
                find_binary("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=7d",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not start; see {workdir / 'prometheus.log'}")
            time.sleep(0.2)

    def retarget(self, endpoints: dict[str, str]) -> None:
        """Scrapes ``endpoints`` from now on (a restarted job's services listen on new ports): SIGHUP
        makes Prometheus reload its configuration."""
        self._config.write_text(json.dumps(scrape_config(endpoints), indent=2))
        self._proc.send_signal(signal.SIGHUP)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query through the HTTP API; raises on a PromQL error."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            raise ValueError(f"{expr}: {e.read().decode(errors='replace')}") from None
        if body.get("status") != "success":
            raise ValueError(f"{expr}: {body}")
        return list(body["data"]["result"])

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()
