"""Section ``torchrec``: TorchRec beside Bagpipe on the same data and model. Its per-trainer compute alone
(``bench/torchrec_reference.py``), and on CPU its standard distributed job (``bench/torchrec_dmp.py``:
``DistributedModelParallel``, two gloo ranks) and bagpipe's in turns, on loopback and with TorchRec's
rank 1 behind the 1 Gbit/s link, with both loss curves from one initial model. TorchRec runs in its own
interpreter (``make bench-torchrec-env``, or ``--torchrec-python``); the section is skipped, saying how
to install it, where that is missing."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from bagpipe.local.redis_server import free_port
from bagpipe.trainer.worker import trainer_device
from suite.common import BENCH, log
from suite.compare import pooled
from suite.jobs import job
from suite.link import HOST_IF, HOST_IP, NS_IF, NS_IP, limited_link
from suite.report import Target

TORCHREC_PYTHON = BENCH / ".venv-torchrec" / "bin" / "python"
TORCHREC_DMP = BENCH / "torchrec_dmp.py"


def run(profile: dict[str, Any], out: Path) -> dict[str, Any]:
    """TorchRec's per-trainer compute on the same data and model (its own venv: make bench-torchrec-env)."""
    given = profile.get("torchrec_python")
    python = Path(shutil.which(given) or given) if given else TORCHREC_PYTHON
    if not python.exists():
        reason = f"{python} is missing: `make bench-torchrec-env` installs TorchRec 1.8 (~2 min)"
        log(f"torchrec skipped: {reason}")
        return {"skipped": reason}
    argv = [
        str(python),
        str(BENCH / "torchrec_reference.py"),
        *torchrec_sizes(profile),
        "--trainers",
        "2",
        "--iterations",
        "60",
        "--device",
        # beside the trainers' own figures, on the kind of device they resolve to
        trainer_device(profile.get("device", "auto"), 0).type,
    ]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        return {"skipped": f"torchrec_reference.py failed: {done.stderr.strip().splitlines()[-1:]}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    log(f"torchrec compute reference: median {result['median_ms']:.1f} ms")
    if trainer_device(profile.get("device", "auto"), 0).type == "cpu":
        result["distributed"] = torchrec_distributed(python, profile, out)
    return result


def torchrec_sizes(profile: dict[str, Any]) -> list[str]:
    """The profile's batch, data and DLRM sizes as the TorchRec scripts take them."""
    model = dict(zip(profile["model"][::2], profile["model"][1::2], strict=True))
    sizes = ["--batch-size", str(profile["batch"]), "--scale", profile["scale"]]
    return sizes + [
        flag for name in ("--embedding-dim", "--bottom-mlp", "--top-mlp") for flag in (name, model[name])
    ]


def torchrec_dmp_job(
    python: Path,
    profile: dict[str, Any],
    *extra: str,
    netns: str | None = None,
    iterations: int | None = None,
    timeout: float = 1200,
) -> dict[str, Any]:
    """One TorchRec DMP job of two gloo ranks on this machine (rank 1 inside ``netns``, behind its link,
    when given), on the profile's data and model; rank 0's JSON, or ``{"failed": its last line}``."""
    master = f"{HOST_IP if netns else '127.0.0.1'}:{free_port()}"
    common = [
        str(TORCHREC_DMP),
        "--world-size",
        "2",
        "--master",
        master,
        *torchrec_sizes(profile),
        "--iterations",
        str(iterations or profile["iterations"]),
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ranks = []
    for rank in (0, 1):
        prefix = ["ip", "netns", "exec", netns] if netns and rank == 1 else []
        # (gloo binds the interface the peer reaches: the link's ends when rank 1 is behind it)
        rank_env = {**env, "GLOO_SOCKET_IFNAME": (NS_IF if rank else HOST_IF)} if netns else env
        ranks.append(
            subprocess.Popen(
                [*prefix, str(python), *common, "--rank", str(rank)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=rank_env,
            )
        )
    outs = []
    for proc in ranks:
        try:
            outs.append(proc.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for p in ranks:
                p.kill()
            return {"failed": f"timed out after {timeout:.0f} s"}
    if any(p.returncode for p in ranks):
        errors = [e.strip().splitlines()[-1] for (_, e), p in zip(outs, ranks, strict=True) if p.returncode]
        return {"failed": errors[0] if errors else "no output"}
    return dict(json.loads(outs[0][0].strip().splitlines()[-1]))


def torchrec_loss_check(python: Path, profile: dict[str, Any], out: Path) -> dict[str, Any]:
    """Both systems from the same initial model on the same batches with SGD: Bagpipe's initial model,
    exported to TorchRec's DLRM (``bagpipe export --to torchrec``), loaded into the sharded one; the loss
    curves must agree to float noise."""
    n = 40
    init = out / "runs" / "torchrec-check-initial.pt"
    sgd = {**profile, "optimizer": ["--optimizer", "sgd", "--lr", "0.05"]}
    ours = job("torchrec-check-bagpipe", sgd, out, "--save-initial", str(init), iterations=n)
    summary = json.loads((out / "runs" / "torchrec-check-bagpipe" / "summary.json").read_text())
    exported = out / "runs" / "torchrec-check-initial-torchrec.pt"
    from bagpipe.export import export

    export(init, exported, "torchrec")
    theirs = torchrec_dmp_job(
        python, sgd, "--optimizer", "sgd", "--lr", "0.05", "--init", str(exported), iterations=n
    )
    if "failed" in theirs:
        return {"skipped": f"torchrec_dmp.py failed: {theirs['failed']}"}
    diffs = [abs(a - b) for a, b in zip(summary["losses"], theirs["losses"], strict=True)]
    log(f"torchrec loss check: max |loss difference| over {n} batches {max(diffs):.2g}")
    return {
        "iterations": n,
        "optimizer": "sgd 0.05",
        "bagpipe_losses": summary["losses"],
        "torchrec_losses": theirs["losses"],
        "max_abs_difference": max(diffs),
        "bagpipe_median_ms": ours["median_ms"],
    }


def torchrec_distributed(python: Path, profile: dict[str, Any], out: Path) -> dict[str, Any]:
    """TorchRec's distributed training beside Bagpipe's, in turns, on loopback and with TorchRec's rank 1
    (Bagpipe's embedding servers) behind the 1 Gbit/s link; the sharding it cannot run on CPU, with
    TorchRec's error; and the loss curves of both from one initial model."""
    results: dict[str, Any] = {"check": torchrec_loss_check(python, profile, out)}
    refused = {}
    for sharding in ("row_wise", "column_wise"):
        tried = torchrec_dmp_job(python, profile, "--sharding", sharding, iterations=3, timeout=300)
        refused[sharding] = tried.get("failed") or f"ran: {tried.get('sharding_types')}"
        log(f"torchrec {sharding}: {refused[sharding]}")
    results["other_shardings"] = refused
    pairs = profile.get("torchrec_pairs", 3)
    for regime in ("loopback", "1gbit"):
        with contextlib.ExitStack() as stack:
            ns = stack.enter_context(limited_link(regime)) if regime != "loopback" else None
            if regime != "loopback" and ns is None:
                results[regime] = {"skipped": "no limited link here (the log says why)"}
                continue
            link = ["--embedding-server-netns", ns, "--netns-addresses", f"{HOST_IP},{NS_IP}"] if ns else []
            ours, theirs = [], []
            for i in range(pairs):  # in turns, each first in every other pair
                order = ("bagpipe", "torchrec") if i % 2 == 0 else ("torchrec", "bagpipe")
                for system in order:
                    if system == "bagpipe":
                        ours.append(job(f"torchrec-pair-{regime}-bagpipe-{i + 1}", profile, out, *link))
                    else:
                        got = torchrec_dmp_job(python, profile, netns=ns)
                        if "failed" in got:
                            return {
                                **results,
                                regime: {"skipped": f"torchrec_dmp.py failed: {got['failed']}"},
                            }
                        log(f"torchrec {regime} {i + 1}: median {got['median_ms']:.1f} ms")
                        theirs.append(got)
            bagpipe = pooled(ours)
            times = [t for j in theirs for t in j["iteration_ms"]]
            median = statistics.median(times)
            results[regime] = {
                "bagpipe_median_ms": bagpipe["median_ms"],
                "bagpipe_repeat_medians_ms": bagpipe.get("repeat_medians_ms", [bagpipe["median_ms"]]),
                "torchrec_median_ms": median,
                "torchrec_repeat_medians_ms": [j["median_ms"] for j in theirs],
                "torchrec_over_bagpipe": median / bagpipe["median_ms"],
                "bagpipe_samples_per_second": profile["batch"] / (bagpipe["median_ms"] / 1000),
                "torchrec_samples_per_second": profile["batch"] / (median / 1000),
                "plan": theirs[0]["plan"],
                "sharding_types": theirs[0]["sharding_types"],
                "plan_text": theirs[0]["plan_text"],
            }
            log(
                f"torchrec/bagpipe {regime}: {median:.1f} / {bagpipe['median_ms']:.1f} ms = "
                f"{results[regime]['torchrec_over_bagpipe']:.2f}x"
            )
    return results


def table(results: dict[str, Any]) -> list[str]:
    """TorchRec's compute alone, then its distributed training beside bagpipe's."""
    lines: list[str] = []
    tr = results.get("torchrec", {})
    if tr.get("median_ms"):
        lines += [
            "",
            f"TorchRec (FBGEMM table-batched embeddings, fused row-wise Adagrad) on "
            f"{tr.get('device', 'cpu')}, one trainer's slice of "
            f"{tr['samples_per_iteration']} samples, compute only, no communication: median "
            f"{tr['median_ms']:.1f} ms, p90 {tr['p90_ms']:.1f} ms per iteration.",
        ]
    elif tr.get("skipped"):
        lines += ["", f"TorchRec reference skipped: {tr['skipped']}"]
    return lines + distributed_table(tr.get("distributed", {}))


def distributed_table(distributed: dict[str, Any]) -> list[str]:
    """TorchRec's distributed training beside bagpipe: the pairs per link, its plan, the loss check."""
    if not distributed:
        return []
    lines = [
        "",
        "| link | bagpipe median ms (each job) | TorchRec DMP median ms (each job) | TorchRec/bagpipe | "
        "bagpipe samples/s | TorchRec samples/s |",
        "|---|---|---|---|---|---|",
    ]
    plan = None
    for regime in ("loopback", "1gbit"):
        r = distributed.get(regime, {})
        if "skipped" in r:
            lines.append(f"| {regime} | skipped: {r['skipped']} | | | | |")
            continue
        if "torchrec_over_bagpipe" not in r:
            continue
        plan = plan or r.get("sharding_types")
        ours = ", ".join(f"{m:.1f}" for m in r["bagpipe_repeat_medians_ms"])
        theirs = ", ".join(f"{m:.1f}" for m in r["torchrec_repeat_medians_ms"])
        lines.append(
            f"| {regime} | {r['bagpipe_median_ms']:.1f} ({ours}) | "
            f"{r['torchrec_median_ms']:.1f} ({theirs}) | "
            f"{r['torchrec_over_bagpipe']:.2f}x | {r['bagpipe_samples_per_second']:,.0f} | "
            f"{r['torchrec_samples_per_second']:,.0f} |"
        )
    notes = []
    if plan:
        notes.append(
            "TorchRec's planner placed the 26 tables: "
            + ", ".join(f"{n} {kind}" for kind, n in sorted(plan.items()))
            + " (2 gloo ranks, FBGEMM's fused row-wise Adagrad, TrainPipelineSparseDist; at 1gbit its "
            "rank 1 is behind the link, as bagpipe's embedding servers are)."
        )
    for sharding, said in distributed.get("other_shardings", {}).items():
        notes.append(f"Every table {sharding}: {said.split('. To debug')[0]}.")
    check = distributed.get("check", {})
    if "max_abs_difference" in check:
        notes.append(
            f"Loss curves from one initial model (bagpipe's, exported), SGD, {check['iterations']} batches: "
            f"max |TorchRec - bagpipe| = {check['max_abs_difference']:.2g}."
        )
    return lines + ([""] + notes if notes else [])


def targets(results: dict[str, Any]) -> tuple[list[Target], list[str]]:
    """TorchRec DMP over bagpipe on loopback (no target) and at 1 Gbit/s, and the loss check's figure."""
    rows: list[Target] = []
    notes: list[str] = []
    distributed = results.get("torchrec", {}).get("distributed", {})
    for regime in ("loopback", "1gbit"):
        if "torchrec_over_bagpipe" in distributed.get(regime, {}):
            r = distributed[regime]["torchrec_over_bagpipe"]
            want = ">= 3.0" if regime == "1gbit" else "-"
            rows.append((f"torchrec DMP/bagpipe at {regime} (median)", r, want, r >= 3.0 or want == "-"))
    check = distributed.get("check", {})
    if "max_abs_difference" in check:
        diff = check["max_abs_difference"]
        notes.append(
            f"  (torchrec's loss curve against bagpipe's, one start, SGD: max |difference| {diff:.2g})"
        )
    return rows, notes
