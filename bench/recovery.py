"""Recovery benchmark: time to detect and to recover, and the cost of checkpointing.

1. **Scales side by side** (``--scales``, default 0.01 and 1.0, the latter 33.8 M rows): the default model
   with Adagrad, a checkpoint every ``--checkpoint-every`` batches, trainer 1 SIGKILLed once 7 checkpoints
   are complete. In-place recovery (the controller rolls the servers back from their undo logs, only the
   trainers start again) should not depend on the tables: targets detect <= 10 s, training again <= 10 s
   after the detection, and the recovery time at the largest scale <= 1.2x the smallest's.
2. **Per component** (``--components``): each kind of service gets SIGKILL (or SIGSTOP for a frozen
   trainer) once rank 0 has trained a third of the batches, at ``--scale``.

Detection time is from the signal to the controller's verdict (the run's failure record); recovery time is
from the verdict until every trainer trains again. A run without failures with and without checkpoints
gives the slowdown. Prints tables and writes ``bench/results/recovery-quick.json``.

    .venv/bin/python bench/recovery.py [--scales 0.01,1.0] [--components] [--checkpoint-every 50]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from bagpipe.cli import parse_run
from bagpipe.local.keeper import children_matching
from bagpipe.local.launcher import run

RESULTS = Path(__file__).parent / "results"
TARGETS = [
    ("trainer", "bagpipe.trainer --rank 1", signal.SIGKILL),
    ("trainer (frozen)", "bagpipe.trainer --rank 1", signal.SIGSTOP),
    ("embedding server", "bagpipe.embedding_server --shard 1", signal.SIGKILL),
    ("oracle cacher", "bagpipe.oracle_cacher", signal.SIGKILL),
    ("data processor", "bagpipe.data_processor", signal.SIGKILL),
    ("redis", "redis-server", signal.SIGKILL),
]


def _rows(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics" / "trainer-0.csv").read_text().splitlines()) - 1
    except OSError:
        return 0


def one_run(
    flags: list[str], run_dir: Path, kill: tuple[str, int] | None, at: int
) -> tuple[dict[str, Any], float]:
    argv = ["run", "--log-level", "WARNING", *flags, "--run-dir", str(run_dir), "--quiet"]
    out: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: out.append(run(parse_run(argv[1:]))))
    started = time.time()
    thread.start()
    signalled = 0.0
    if kill is not None:
        while _rows(run_dir) < at and thread.is_alive():
            time.sleep(0.01)
        pids = children_matching(kill[0])
        if len(pids) != 1:
            raise RuntimeError(f"not exactly one {kill[0]} to signal: {pids}")
        os.kill(pids[0], kill[1])
        signalled = time.time()
    thread.join()
    if not out:
        raise RuntimeError(f"the run in {run_dir} failed")
    return out[0], (signalled or started)


def _failure_row(name: str, sig: int, summary: dict[str, Any], signalled: float) -> dict[str, Any]:
    failure = summary["recovery"]["failures"][0]
    return {
        "component": name,
        "signal": signal.Signals(sig).name,
        "blamed": failure["component"],
        "detect_seconds": failure["detected_at"] - signalled,
        "recover_seconds": failure.get("recovered_seconds", float("nan")),
        "replayed_iterations": failure["replayed_iterations"],
        "iterations": summary["iterations"],
    }


def compare_scales(a: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Trainer 1 SIGKILLed after 7 complete checkpoints, at each scale (recovery_seconds: from the
    detection until every trainer trains again)."""
    at = 7 * a.checkpoint_every + a.checkpoint_every // 5
    rows = []
    for scale in a.scales:
        flags = [
            "--iterations",
            str(at + a.checkpoint_every // 2),
            "--optimizer",
            "adagrad",
            "--scale",
            str(scale),
            "--checkpoint-every",
            str(a.checkpoint_every),
            "--failure-timeout",
            str(a.failure_timeout),
            "--log-level",
            a.log_level,
        ]
        summary, signalled = one_run(
            flags, work / f"scale-{scale:g}", ("bagpipe.trainer --rank 1", signal.SIGKILL), at
        )
        row = _failure_row("trainer", signal.SIGKILL, summary, signalled)
        row["scale"] = scale
        row["checkpoints_before_the_kill"] = at // a.checkpoint_every  # (complete before batch ``at``)
        rows.append(row)
    print(f"trainer SIGKILL after 7 checkpoints (every {a.checkpoint_every}), default model, Adagrad:")
    print(f"{'scale':>8} {'detect s':>9} {'recover s':>10} {'replayed':>9}")
    for r in rows:
        print(
            f"{r['scale']:8g} {r['detect_seconds']:9.1f} {r['recover_seconds']:10.1f} "
            f"{r['replayed_iterations']:9d}"
        )
    ratio = rows[-1]["recover_seconds"] / rows[0]["recover_seconds"]
    print(
        f"recovery at scale {rows[-1]['scale']:g} / at {rows[0]['scale']:g}: {ratio:.2f}x "
        "(targets: detect <= 10 s, recover <= 10 s, ratio <= 1.2)"
    )
    return rows


def components(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    flags = [
        "--iterations",
        str(a.iterations),
        "--batch-size",
        str(a.batch_size),
        "--scale",
        str(a.scale),
        "--failure-timeout",
        str(a.failure_timeout),
    ]
    rows: list[dict[str, Any]] = []
    plain, _ = one_run([*flags, "--checkpoint-every", "0"], work / "no-checkpoints", None, 0)
    checked, _ = one_run(
        [*flags, "--checkpoint-every", str(a.checkpoint_every)], work / "checkpoints", None, 0
    )
    slowdown = checked["seconds_per_iteration"] / plain["seconds_per_iteration"] - 1
    cost = checked["recovery"]["checkpoint_seconds_per_iteration"] / checked["seconds_per_iteration"]
    for name, pattern, sig in TARGETS:
        summary, signalled = one_run(
            [*flags, "--checkpoint-every", str(a.checkpoint_every)],
            work / name.replace(" ", "-"),
            (pattern, sig),
            a.iterations // 3,
        )
        rows.append(_failure_row(name, sig, summary, signalled))
    print(
        f"checkpoint every {a.checkpoint_every} batches: {100 * cost:.1f}% of iteration time checkpointing,"
        f" {100 * slowdown:+.1f}% time per iteration against no checkpoints (target <= 5%)"
    )
    print(f"{'component':<18} {'signal':<8} {'blamed':<20} {'detect s':>9} {'recover s':>10} {'replayed':>9}")
    for r in rows:
        print(
            f"{r['component']:<18} {r['signal']:<8} {r['blamed']:<20} {r['detect_seconds']:9.1f} "
            f"{r['recover_seconds']:10.1f} {r['replayed_iterations']:9d}"
        )
    print("targets: detect <= 10 s, recover <= 10 s")
    return {"flags": flags, "checkpoint_share": cost, "slowdown": slowdown, "failures": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scales", type=lambda t: [float(x) for x in t.split(",")], default=[0.01, 1.0])
    p.add_argument("--components", action="store_true", help="also kill each kind of service")
    p.add_argument("--iterations", type=int, default=120)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--scale", type=float, default=0.01)
    p.add_argument("--failure-timeout", type=float, default=10.0)
    p.add_argument("--work", default="runs/bench-recovery")
    p.add_argument("--log-level", default="WARNING", help="the services' (INFO: where recovery's time goes)")
    a = p.parse_args()
    work = Path(a.work) / time.strftime("%Y%m%d-%H%M%S")
    out: dict[str, Any] = {"checkpoint_every": a.checkpoint_every, "time": time.strftime("%Y-%m-%d %H:%M")}
    if a.scales:
        out["scales"] = compare_scales(a, work)
    if a.components:
        out["components"] = components(a, work)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "recovery-quick.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
