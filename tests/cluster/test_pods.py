"""The chart's pods as real containers (``make cluster-test``): a small job trains to its end under the
kubelet's part that ``kubelet.py`` plays, through killed and frozen pods and a scaled embedding tier, and
ends with the model ``bagpipe run`` computes with the same flags."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from bagpipe.cli import parse_run
from bagpipe.core import checkpoint
from bagpipe.local.launcher import run

from tests.cluster.kubelet import Cluster, Pod, can_run_containers, render
from tests.integration.test_equivalence import TOLERANCE

IMAGE = os.environ.get("BAGPIPE_TEST_IMAGE", "bagpipe:0.1.0")
RELEASE, NAMESPACE = "bg", "ml"
ITERATIONS, EVERY = 40, 5
# the chart's defaults with small sizes; the same job as RUN_FLAGS
VALUES: dict[str, Any] = {
    "image": {"repository": IMAGE.rpartition(":")[0], "tag": IMAGE.rpartition(":")[2], "pullPolicy": "Never"},
    "trainer": {"replicaCount": 2, "metrics": {"interval": "2s"}},
    "embeddingServer": {"replicaCount": 2, "metrics": {"interval": "2s"}, "drain": {"timeoutSeconds": 120}},
    "oracleCacher": {"metrics": {"interval": "2s"}},
    "dataProcessor": {"metrics": {"interval": "2s"}},
    "controller": {"metrics": {"interval": "2s"}},
    "prometheus": {"serviceMonitor": {"enabled": True}, "rules": {"heartbeatStaleSeconds": 15}},
    "training": {
        "scale": 0.0005,
        "embeddingDim": 8,
        "batchSize": 64,
        "iterations": ITERATIONS,
        "bottomMlp": [16, 8],
        "topMlp": [16, 1],
        "optimizer": "sgd",
        "lr": 0.05,
        "lookahead": 8,
        "checkpointEvery": EVERY,
        "logLevel": "INFO",
    },
}
RUN_FLAGS = (
    "--trainers 2 --embedding-servers 2 --data-processors 1 --scale 0.0005 --embedding-dim 8 --batch-size 64 "
    f"--iterations {ITERATIONS} --bottom-mlp 16,8 --top-mlp 16,1 --optimizer sgd --lr 0.05 --lookahead 8 "
    "--seed 0 --zipf-alpha 1.1 --reuse-delay 24 --transfer-batches 8 --quiet --no-report"
).split()
JOB_S = 600


@pytest.fixture(scope="module", autouse=True)
def podman_runs() -> None:
    why = can_run_containers(IMAGE)
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The model ``bagpipe run`` computes with the same flags, and the initial one."""
    where = tmp_path_factory.mktemp("reference")
    paths = {"initial": where / "initial.pt", "final": where / "final.pt"}
    argv = [*RUN_FLAGS, "--run-dir", str(where / "run")]
    argv += ["--save-initial", str(paths["initial"]), "--save-final", str(paths["final"])]
    run(parse_run(argv))
    return {k: checkpoint.load(p) for k, p in paths.items()}


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(NAMESPACE, tmp_path)
    values = {**VALUES, "controller": {**VALUES["controller"], "prometheusUrl": c.prometheus_url()}}
    try:
        c.start(render(RELEASE, NAMESPACE, values))
        yield c
    finally:
        c.close()


def progress(c: Cluster) -> int:
    """The batch every trainer has trained (-1 before the first), read from the job's Redis."""
    (pod,) = c.pods_of("-redis")
    password = c.secrets[f"{RELEASE}-bagpipe-auth"]["redisPassword"]
    try:
        with redis.Redis(host=pod.ip, port=6379, password=password, socket_timeout=2) as r:
            marks = r.hgetall(f"bagpipe:{RELEASE}:progress")
    except redis.RedisError:
        return -1
    return min((int(v) for v in marks.values()), default=-1) if len(marks) == 2 else -1


def at_checkpoint_batch(c: Cluster, rng: random.Random) -> int:
    """Waits for the trainers to pass a random checkpoint-bearing batch; returns it."""
    batch = rng.choice(range(EVERY, ITERATIONS - EVERY, EVERY))
    c.wait(lambda: progress(c) >= batch, JOB_S, f"training past batch {batch}")
    return batch


def finish(c: Cluster, reference: dict[str, Any]) -> None:
    """The trainer Job completes (every container exited 0 soon after the last batch), the serving tiers end
    once released, and the final model on the run volume is the reference."""
    jobs = c.workload("-trainer")
    c.wait(lambda: jobs.completed_at is not None, JOB_S, "the trainer Job's completion")
    last_batch = max(p.stat().st_mtime for p in (c.claims / f"{RELEASE}-bagpipe-run" / "model").glob("*.pt"))
    assert jobs.completed_at is not None
    assert time.time() - last_batch < 60 + (time.monotonic() - jobs.completed_at), "the Job completed late"
    c.wait(lambda: not any(c.running(s) for s in ("-embedding-server", "-oracle-cacher", "-data-processor")),
           180, "the serving tiers' end")  # fmt: skip
    final = checkpoint.load(c.claims / f"{RELEASE}-bagpipe-run" / "model" / "final.pt")
    diffs = checkpoint.max_abs_difference(final, reference["final"])
    worst = max(diffs, key=lambda k: diffs[k])
    assert diffs[worst] <= TOLERANCE, f"{worst} differs from bagpipe run's by {diffs[worst]:.3g}; {c.events}"
    moved = checkpoint.max_abs_difference(reference["initial"], reference["final"])
    assert max(moved.values()) > 100 * TOLERANCE


def test_the_job_completes_with_the_model_of_bagpipe_run_and_helm_test_passes(
    job: Cluster, reference
) -> None:
    finish(job, reference)
    trainers = [p for p in job.pods.values() if p.workload.name.endswith("-trainer")]
    assert sorted(p.index for p in trainers) == [0, 1] and all(p.exits == [0] for p in trainers), job.events
    codes = job.run_test_pods()
    assert codes and all(code == 0 for code in codes.values()), (codes, job.events)


@pytest.mark.parametrize(
    "target", ["-trainer", "-embedding-server", "-oracle-cacher", "-data-processor", "-redis"]
)
def test_a_killed_pod_is_replaced_and_the_model_is_the_same(job: Cluster, reference, target: str) -> None:
    rng = random.Random(target)
    at_checkpoint_batch(job, rng)
    pods = job.pods_of(target)
    victim: Pod = rng.choice(pods)
    job.kill(victim)
    finish(job, reference)


def test_a_frozen_embedding_server_is_found_and_the_model_is_the_same(job: Cluster, reference) -> None:
    at_checkpoint_batch(job, random.Random(1))
    (_, server) = job.pods_of("-embedding-server")
    job.pause(server)
    finish(job, reference)
    assert 137 in server.exits, job.events


def test_scaling_the_embedding_servers_2_3_2_keeps_the_model(job: Cluster, reference) -> None:
    rng = random.Random(2)
    at_checkpoint_batch(job, rng)
    job.scale("-embedding-server", 3)
    start = progress(job)
    job.wait(lambda: progress(job) >= start + 2 * EVERY, JOB_S, "training with 3 servers")
    job.scale("-embedding-server", 2)
    finish(job, reference)
