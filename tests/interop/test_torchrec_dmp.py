"""The bench's TorchRec distributed job (``bench/torchrec_dmp.py``) is TorchRec's standard setup and trains
what Bagpipe trains: from Bagpipe's initial model (exported), on the same batches, two gloo ranks of
``DistributedModelParallel`` give Bagpipe's loss curve to float noise, with the planner's own plan."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bagpipe.cli import parse_run
from bagpipe.export import export
from bagpipe.local.launcher import run
from bagpipe.local.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
SIZES = ["--scale", "0.001", "--embedding-dim", "16", "--bottom-mlp", "32,16", "--top-mlp", "32,1"]
ITERATIONS, BATCH = 8, 256


def test_torchrec_dmp_trains_bagpipes_loss_curve(tmp_path: Path, torchrec_python: Path) -> None:
    argv = [*SIZES, "--batch-size", str(BATCH), "--iterations", str(ITERATIONS), "--optimizer", "sgd"]
    argv += [
        "--lr",
        "0.1",
        "--save-initial",
        str(tmp_path / "initial.pt"),
        "--run-dir",
        str(tmp_path / "run"),
    ]
    summary = run(parse_run([*argv, "--quiet", "--no-report", "--log-level", "WARNING"]))
    export(tmp_path / "initial.pt", tmp_path / "initial-torchrec.pt", "torchrec")

    common = [str(ROOT / "bench" / "torchrec_dmp.py"), *SIZES, "--batch-size", str(BATCH), "--warmup", "2"]
    common += ["--iterations", str(ITERATIONS), "--optimizer", "sgd", "--lr", "0.1"]
    common += ["--init", str(tmp_path / "initial-torchrec.pt"), "--master", f"127.0.0.1:{free_port()}"]
    ranks = [
        subprocess.Popen([str(torchrec_python), *common, "--rank", str(r)], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0]
    theirs = json.loads(outs[0].strip().splitlines()[-1])
    # TorchRec's planner placed the tables itself: big ones table-wise with FBGEMM's fused kernel
    assert theirs["sharding_types"].get("table_wise", 0) > 0
    assert {p["compute_kernel"] for p in theirs["plan"].values() if p["sharding_type"] == "table_wise"} == {
        "fused"
    }
    diffs = [abs(a - b) for a, b in zip(summary["losses"], theirs["losses"], strict=True)]
    assert theirs["losses"][0] == summary["losses"][0]  # (one initial model)
    assert max(diffs) < 1e-5, diffs
    assert summary["losses"][-1] < summary["losses"][0] - 0.1  # (it trained: the check can fail)
