"""The chart's pods as real containers (``make cluster-test``): a small job trains to its end under the
kubelet's part that ``kubelet.py`` plays, through killed and frozen pods and a scaled embedding tier, and
ends with the model ``bagpipe run`` computes with the same flags."""

from __future__ import annotations

import base64
import json
import os
import random
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from bagpipe.cli import parse_run
from bagpipe.core import checkpoint, snapshots
from bagpipe.local.launcher import run

from tests.certificates import certificates
from tests.cluster.conftest import FIGURES
from tests.cluster.kubelet import Cluster, Pod, can_run_containers, render
from tests.integration.conftest import flags
from tests.integration.test_equivalence import TOLERANCE

IMAGE = os.environ.get("BAGPIPE_TEST_IMAGE", "bagpipe:0.1.0")
RELEASE, NAMESPACE = "bg", "ml"
ITERATIONS, EVERY = 120, 10
# long enough for buckets to move to a third server and back while it trains
SCALING_ITERATIONS = 600
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
RUN_FLAGS = [
    *flags(trainers=2, embedding_servers=2, data_processors=1, scale=0.0005, embedding_dim=8, batch_size=64),
    *flags(bottom_mlp="16,8", top_mlp="16,1", optimizer="sgd", lr=0.05, lookahead=8, seed=0),
    *flags(zipf_alpha=1.1, reuse_delay=24, transfer_batches=8),
    "--quiet",
    "--no-report",
]
JOB_S = 600


@pytest.fixture(scope="module", autouse=True)
def podman_runs() -> None:
    why = can_run_containers(IMAGE)
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict[str, Any]]:
    """The model ``bagpipe run`` computes with the same flags for so many iterations, and the initial one."""
    done: dict[int, dict[str, Any]] = {}

    def reference(iterations: int) -> dict[str, Any]:
        if iterations not in done:
            where = tmp_path_factory.mktemp(f"reference-{iterations}")
            paths = {"initial": where / "initial.pt", "final": where / "final.pt"}
            argv = [*RUN_FLAGS, "--iterations", str(iterations), "--run-dir", str(where / "run")]
            argv += ["--save-initial", str(paths["initial"]), "--save-final", str(paths["final"])]
            run(parse_run(argv))
            done[iterations] = {k: checkpoint.load(p) for k, p in paths.items()}
        return done[iterations]

    return reference


@pytest.fixture
def reference(references: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    return references(ITERATIONS)


@contextmanager
def cluster(
    workdir: Path,
    iterations: int = ITERATIONS,
    extra: tuple[dict[str, Any], ...] = (),
    claims: Path | None = None,
    training: dict[str, Any] | None = None,
    **values: Any,
) -> Iterator[Cluster]:
    """The chart with VALUES (and ``iterations``, ``training`` values and top-level ``values``) running
    under podman in ``workdir``, beside the ``extra`` objects a user would have made (a Secret), with its
    volumes in ``claims`` (a reinstall's: the same volumes)."""
    c = Cluster(NAMESPACE, workdir, claims=claims)
    values = {
        **VALUES,
        "controller": {**VALUES["controller"], "prometheusUrl": c.prometheus_url()},
        "training": {**VALUES["training"], "iterations": iterations, **(training or {})},
        **values,
    }
    try:
        c.start([*render(RELEASE, NAMESPACE, values), *extra])
        yield c
    finally:
        c.close()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Cluster]:
    with cluster(tmp_path) as c:
        yield c


def redis_of(c: Cluster) -> redis.Redis:
    (pod,) = c.pods_of("-redis")
    password = c.secrets[f"{RELEASE}-bagpipe-auth"]["redisPassword"]
    return redis.Redis(host=pod.ip, port=6379, password=password, socket_timeout=2)


def generation(c: Cluster) -> int:
    with redis_of(c) as r:
        return int(r.hget(f"bagpipe:{RELEASE}:generation", "number") or 0)


def shards_with_rows(c: Cluster) -> set[int]:
    """The embedding servers that hold buckets in the shard map in force."""
    try:
        with redis_of(c) as r:
            text = r.get(f"bagpipe:{RELEASE}:shard_map")
    except redis.RedisError:
        return set()
    return set(json.loads(text)["bucket_to_shard"]) if text else set()


def progress(c: Cluster) -> int:
    """The batch every trainer has trained (-1 before the first), read from the job's Redis."""
    try:
        with redis_of(c) as r:
            marks = r.hgetall(f"bagpipe:{RELEASE}:progress")
    except redis.RedisError:
        return -1
    return min((int(v) for v in marks.values()), default=-1) if len(marks) == 2 else -1


def at_checkpoint_batch(c: Cluster, rng: random.Random, iterations: int = ITERATIONS) -> int:
    """Waits for the trainers to pass a random checkpoint-bearing batch in the first three quarters of the
    job; returns it."""
    batch = rng.choice(range(EVERY, iterations * 3 // 4, EVERY))
    c.wait(lambda: progress(c) >= batch, JOB_S, f"training past batch {batch}")
    return batch


def still_training(c: Cluster, iterations: int = ITERATIONS) -> None:
    now = progress(c)
    assert now < iterations - 1, f"the job had trained to batch {now} already: make it longer"


def finish(c: Cluster, reference: dict[str, Any], what: str) -> None:
    """The trainer Job completes (every container exited 0 soon after the last batch), the serving tiers end
    once released, and the final model on the run volume is the reference."""
    jobs = c.workload("-trainer")
    c.wait(lambda: jobs.completed_at is not None, JOB_S, "the trainer Job's completion")
    final_path = c.claims / f"{RELEASE}-bagpipe-run" / "model" / "final.pt"
    assert jobs.completed_at is not None
    # (rank 0 writes the final model after the last batch; the last container to exit completes the Job)
    after = jobs.completed_at - final_path.stat().st_mtime
    assert after < 60, f"the Job completed {after:.0f} s after the final model was written"
    c.wait(lambda: not any(c.running(s) for s in ("-embedding-server", "-oracle-cacher", "-data-processor")),
           180, "the serving tiers' end")  # fmt: skip
    final = checkpoint.load(final_path)
    diffs = checkpoint.max_abs_difference(final, reference["final"])
    worst = max(diffs, key=lambda k: diffs[k])
    assert diffs[worst] <= TOLERANCE, f"{worst} differs from bagpipe run's by {diffs[worst]:.3g}; {c.events}"
    moved = checkpoint.max_abs_difference(reference["initial"], reference["final"])
    assert max(moved.values()) > 100 * TOLERANCE
    restarts = sum(c.restarted.values())
    FIGURES.append(
        f"{what}: trained in {jobs.completed_at - c.started_at:.0f} s, the Job complete {after:.1f} s after "
        f"the final model, {restarts} container(s) restarted in place, model within {diffs[worst]:.1g} of "
        "bagpipe run's"
    )


def test_the_job_completes_with_the_model_of_bagpipe_run_and_helm_test_passes(
    job: Cluster, reference
) -> None:
    finish(job, reference, "undisturbed")
    trainers = [p for p in job.pods.values() if p.workload.name.endswith("-trainer")]
    assert sorted(p.index for p in trainers) == [0, 1] and all(p.exits == [0] for p in trainers), job.events
    codes = job.run_test_pods()
    assert codes and all(code == 0 for code in codes.values()), (codes, job.events)


@pytest.mark.parametrize(
    "target", ["-trainer", "-embedding-server", "-oracle-cacher", "-data-processor", "-redis"]
)
def test_a_killed_pod_is_replaced_and_the_model_is_the_same(job: Cluster, reference, target: str) -> None:
    rng = random.Random(target)
    batch = at_checkpoint_batch(job, rng)
    victim: Pod = rng.choice(job.pods_of(target))
    job.kill(victim)
    still_training(job)
    finish(job, reference, f"SIGKILL of {victim.name} at batch {batch}")
    assert 137 in victim.exits, job.events
    if target != "-data-processor":  # (a data processor holds no state: its restart is no failure)
        assert generation(job) >= 2, "the job was not rolled back"


def test_two_oracle_shards_one_killed_keep_the_model(tmp_path: Path, reference) -> None:
    """``oracleCacher.replicaCount: 2``: a StatefulSet of two shards, each its pod's ordinal (--shard). Shard
    1's pod is killed mid-run: every shard rewinds with the new generation, and the model is bagpipe run's
    with one oracle (the model does not depend on the number of shards)."""
    oracles = {**VALUES["oracleCacher"], "replicaCount": 2}
    with cluster(tmp_path, oracleCacher=oracles) as job:
        pods = sorted(job.pods_of("-oracle-cacher"), key=lambda p: p.index or 0)
        assert [p.index for p in pods] == [0, 1], job.events
        batch = at_checkpoint_batch(job, random.Random(3))
        job.kill(pods[1])
        still_training(job)
        finish(job, reference, f"2 oracle shards, SIGKILL of {pods[1].name} at batch {batch}")
        assert 137 in pods[1].exits, job.events
        assert generation(job) >= 2, "the job was not rolled back"


def test_a_frozen_embedding_server_is_found_and_the_model_is_the_same(job: Cluster, reference) -> None:
    batch = at_checkpoint_batch(job, random.Random(1))
    (_, server) = job.pods_of("-embedding-server")
    job.pause(server)
    still_training(job)
    finish(job, reference, f"{server.name} frozen at batch {batch}")
    assert 137 in server.exits, job.events
    assert generation(job) >= 2, "the job was not rolled back"


def tier_peak(c: Cluster, series: str) -> float:
    """The largest value Prometheus scraped of an embedding server's ``bagpipe_embedding_server_tier_``
    series over the job (0 when it has none)."""
    query = f"max(max_over_time(bagpipe_embedding_server_tier_{series}[1h]))"
    url = f"{c.prometheus_url()}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    with urllib.request.urlopen(url, timeout=10) as answer:
        result = json.load(answer)["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def test_scaling_the_embedding_servers_2_3_2_keeps_the_model(tmp_path: Path, references) -> None:
    """As the StatefulSet's controller would: a new pod joins and takes buckets; later the highest one gets
    SIGTERM after its preStop drain, which hands its buckets back first. Each server keeps only 24 KiB of
    its rows in memory (about a tenth), the rest on its emptyDir: the rows move from disk too."""
    tier = {**VALUES["embeddingServer"], "rowMemory": "24Ki"}
    with cluster(tmp_path, SCALING_ITERATIONS, embeddingServer=tier) as job:
        at_checkpoint_batch(job, random.Random(2), SCALING_ITERATIONS // 4)
        job.scale("-embedding-server", 3)
        job.wait(lambda: 2 in shards_with_rows(job), JOB_S, "buckets on the third server")
        still_training(job, SCALING_ITERATIONS)
        job.scale("-embedding-server", 2)
        job.wait(lambda: job.running("-embedding-server") == 2, JOB_S, "the third server's drain and end")
        assert shards_with_rows(job) == {0, 1}
        still_training(job, SCALING_ITERATIONS)
        finish(job, references(SCALING_ITERATIONS), "embedding servers scaled 2 -> 3 -> 2")
        # (the tier was in use: rows on disk, read ahead of the fetches by the oracle's fetch stream)
        assert tier_peak(job, "rows_on_disk") > 0
        assert tier_peak(job, 'rows_total{op="prefetched"}') > 0


def test_with_tls_the_job_completes_over_mutual_tls_and_the_bundled_redis_speaks_only_tls(
    tmp_path: Path, reference
) -> None:
    """``tls.enabled`` with a Secret like cert-manager's: every gRPC call and the Redis connections (the
    bagpipe image's Debian Redis, TLS only) use the job's certificate; the model is the same."""
    files = certificates(
        tmp_path / "certificates", "bagpipe", {"cert": "tls.crt", "key": "tls.key", "ca": "ca.crt"}
    )
    data = {Path(f).name: base64.b64encode(Path(f).read_bytes()).decode() for f in files.values()}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "job-tls"}, "data": data}
    tls = {"enabled": True, "secretName": "job-tls"}
    with cluster(tmp_path / "job", extra=(secret,), tls=tls) as job:
        finish(job, reference, "mutual TLS, TLS Redis")
        with pytest.raises(redis.ConnectionError), redis_of(job) as r:  # (no plaintext port)
            r.ping()
        codes = job.run_test_pods()
        assert codes and all(code == 0 for code in codes.values()), (codes, job.events)


def test_a_release_installed_again_from_an_older_checkpoint_ends_with_the_same_model(
    tmp_path: Path, reference
) -> None:
    """``training.resumeBatch: N`` on the volume of a finished run: the job begins at checkpoint N (not the
    newest, whose later checkpoints it discards), replays the batches after it and ends with the model of
    the run that never stopped; the restarted servers load the newest and roll back to N."""
    claims = tmp_path / "volumes"
    with cluster(tmp_path / "first", claims=claims) as job:
        finish(job, reference, "first install")
    kept = snapshots.complete(claims / f"{RELEASE}-bagpipe-run" / "checkpoints" / RELEASE)
    assert len(kept) >= 2, kept
    older = kept[-2]
    with cluster(tmp_path / "again", claims=claims, training={"resumeBatch": older}) as job:
        finish(job, reference, f"installed again from checkpoint {older} (newest {kept[-1]})")
        with redis_of(job) as r:
            assert int(r.hget(f"bagpipe:{RELEASE}:generation", "start_batch") or -1) == older
