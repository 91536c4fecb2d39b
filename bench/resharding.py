"""Re-sharding benchmark: rows per second migrated, and how much slower iterations are while rows move.

A local run at the quick profile's model, batch and tables (Adagrad: every row travels with its state)
starts with 2 embedding servers; once rank 0 has trained ``--at`` batches it is scaled to 3 with
``bagpipe scale``'s mechanism, then back to 1. Prints, per re-sharding, the rows and bytes moved, the
copy's throughput and the switch time, and the mean iteration time while rows moved against the rest of
the run (target: training goes on, at most 1.5x). Writes ``bench/results/resharding-quick.json``.

    .venv/bin/python bench/resharding.py [--iterations 300] [--at 40] [--rows-per-second R]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bagpipe.cli import parse_run
from bagpipe.local.launcher import run
from bagpipe.local.scaling import request_scale, wait_scaled

sys.path.insert(0, str(Path(__file__).parent))
from suite.profiles import PROFILES  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def _trained(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics" / "trainer-0.csv").read_text().splitlines()) - 1
    except OSError:
        return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--at", type=int, default=40, help="batch after which the job scales to 3 servers")
    p.add_argument(
        "--rows-per-second",
        type=float,
        default=None,
        help="migration throttle per server (default: bagpipe run's; 0: none)",
    )
    p.add_argument("--work", default="runs/bench-resharding")
    a = p.parse_args()
    profile = PROFILES["quick"]
    run_dir = Path(a.work) / time.strftime("%Y%m%d-%H%M%S")
    argv = [
        "run",
        "--quiet",
        "--log-level",
        "WARNING",
        "--run-dir",
        str(run_dir),
        "--scale",
        profile["scale"],
        "--batch-size",
        str(profile["batch"]),
        *profile["model"],
        *profile["optimizer"],
        "--iterations",
        str(a.iterations),
        "--trainers",
        "2",
        "--embedding-servers",
        "2",
    ]
    if a.rows_per_second is not None:
        argv += ["--migration-rows-per-second", str(a.rows_per_second)]
    out: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: out.append(run(parse_run(argv[1:]))))
    thread.start()
    steps = []
    for servers in (3, 1):
        while _trained(run_dir) < a.at and thread.is_alive():
            time.sleep(0.05)
        if not thread.is_alive():
            break
        status = wait_scaled(run_dir, request_scale(run_dir, servers), timeout=600)
        steps.append({"servers": servers, "state": status["state"], "at_batch": _trained(run_dir)})
        a.at = _trained(run_dir) + 10  # a few normal iterations between the two
    thread.join()
    if not out:
        raise SystemExit(f"the run in {run_dir} failed; see its logs")
    summary = out[0]
    r = summary["resharding"]
    print(
        f"run: {summary['iterations']} iterations, {summary['samples_per_second']:,.0f} samples/s, "
        f"batch {profile['batch']}, scale {profile['scale']}, Adagrad, dim 64"
    )
    print(
        f"{'shards':<16} {'buckets':>8} {'rows':>9} {'MiB':>7} {'copy s':>7} {'rows/s':>10} {'MiB/s':>7} "
        f"{'switch ms':>10}"
    )
    for rec in r["reshards"]:
        rate = rec["rows_moved"] / rec["copy_seconds"] if rec.get("copy_seconds") else float("nan")
        mib = rec["bytes_moved"] / 2**20
        print(
            f"{str(rec['from_shards']) + '->' + str(rec['to_shards']):<16} {rec['buckets_moved']:8d} "
            f"{rec['rows_moved']:9,d} {mib:7.1f} {rec['copy_seconds']:7.2f} {rate:10,.0f} "
            f"{mib / rec['copy_seconds']:7.1f} {1000 * rec['switch_seconds']:10.1f}"
        )
    during, other = r["iteration_seconds_during"], r["iteration_seconds_otherwise"]
    print(
        f"iterations while rows moved: {r['iterations_during']}, {1000 * (during or 0):.1f} ms each against "
        f"{1000 * (other or 0):.1f} ms otherwise: {r['slowdown'] or float('nan'):.2f}x (target <= 1.5x)"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "resharding-quick.json").write_text(
        json.dumps(
            {
                "argv": argv,
                "steps": steps,
                "resharding": r,
                "samples_per_second": summary["samples_per_second"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
