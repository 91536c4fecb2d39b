"""``make bench``: Bagpipe side by side with the ideal and no-cache systems, and the paper's sweeps.

Every comparison runs in one invocation on the same data and model (bagpipe's and the ideal's jobs in
turns, ``interleaved``; no-cache's alone), and reports medians and p90s of the per-iteration time (the
trainers' own clocks, from their per-iteration logs, warm-up excluded) and their ratios, with Bagpipe's
iteration-stage breakdown. Sections:

* ``systems``   ideal / bagpipe / no-cache on loopback (2 trainers, 2 embedding servers), and what
                Bagpipe's consistent checkpoints cost (every job elsewhere runs without them, as the
                ideal system has none);
* ``models``    the same for each model (DLRM, Wide&Deep, DeepFM, Deep&Cross) at the profile's sizes;
* ``torchrec``  TorchRec's per-trainer compute on the same data and model (its own venv; skipped,
                saying how to install it, when absent);
* ``network``   the same with the embedding servers in a network namespace behind a veth link limited
                by ``tc tbf`` to 10 Gbit/s and 1 Gbit/s (skipped, saying why, where namespaces are not
                permitted);
* ``oracle``    oracle planning throughput versus batch size, number of tables and L (paper Figure 17),
                and end to end (the samples' checks, planning, serialising the trainers' plans);
* ``embedding_server`` one server with every Kaggle row: lookups per second at 16 k keys per call, and
                its resident memory against its rows and optimizer state;
* ``lookahead`` L in {5, 10, 50, 100, 200, 300}: peak cache rows and time per iteration (paper Table 3);
* ``skew``      top-1% share of accesses 90% .. 1% and Zipf alpha 1 .. 5: ideal, bagpipe and no-cache
                at each point (paper Figures 18 and 19); bagpipe's and the ideal's jobs alive at once
                and run in turns (``interleaved``), so that both meet the machine at the same speed.

Each section is a module of ``bench/sections`` (its measurement, tables, targets and plots); what they
share is in ``bench/suite``. This file reads the command line and runs them.

After the tables it prints issue 17's targets against the figures at hand, and the machine's speed
before and after the sections (``machine_probe.py``: fixed compute, random-read and interpreter
workloads), since the absolute targets move with the hour on a shared machine.

``--profile quick`` (``make bench``) takes about 30 minutes on 2 cores; ``--profile full`` uses the
paper's DLRM (Table 2) and batch 16,384 where this machine can hold them, and takes hours here.
Results: ``bench/results/bench-<profile>.json``, ``bench/results/*.png`` and a Markdown table
``bench/results/bench-<profile>.md``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "services"))
sys.path.insert(0, str(REPO / "bench"))

from machine_probe import describe as describe_machine  # noqa: E402
from sections import SECTIONS  # noqa: E402
from suite import record, report  # noqa: E402
from suite.common import in_own_process, log  # noqa: E402
from suite.profiles import PROFILES  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    p.add_argument(
        "--only",
        default=None,
        help=f"comma-separated sections of {', '.join(SECTIONS)} (default: the profile's, or all of them)",
    )
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="the trainers' device (bagpipe run --device); auto is CUDA where torch sees a GPU",
    )
    p.add_argument(
        "--torchrec-python",
        default=None,
        help="the interpreter that has TorchRec and FBGEMM (default bench/.venv-torchrec; for CUDA, one "
        "with an fbgemm-gpu built for its torch)",
    )
    p.add_argument(
        "--rates",
        default=None,
        help="comma-separated links of section network (default: the profile's); the others keep their last "
        "figures",
    )
    a = p.parse_args()
    a.only = a.only or ",".join(PROFILES[a.profile].get("sections", SECTIONS))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = {**PROFILES[a.profile], "device": a.device, "torchrec_python": a.torchrec_python}
    if a.rates:
        profile["rates"] = a.rates.split(",")
    started = time.perf_counter()
    # sections not run this time keep their last figures, and their dates (when each was measured)
    results, section_dates = record.last_results(out / f"bench-{a.profile}.json", SECTIONS)

    def save() -> dict[str, Any]:
        seconds = time.perf_counter() - started
        return record.save(out, a.profile, profile, results, seconds, machine, section_dates)

    machine = {"before": in_own_process("machine_probe.py")}
    log(f"machine probe before: {describe_machine(machine['before'])}")
    for name in a.only.split(","):
        log(f"section {name}")
        measured = SECTIONS[name].run(profile, out)
        if name == "network" and a.rates and "skipped" not in measured:  # (the other links' last figures)
            measured = {**results.get("network", {}), **measured}
        results[name] = measured
        section_dates[name] = time.strftime("%Y-%m-%d %H:%M")
        save()  # after every section: one that fails later does not lose the others' figures
    machine["after"] = in_own_process("machine_probe.py")
    meta = save()
    made = report.plots(results, out, a.profile, SECTIONS)
    text = report.table(results, SECTIONS)
    record.write_markdown(out, a.profile, meta, a.only, section_dates, text)
    shutil.rmtree(out / "runs", ignore_errors=True)
    print(text)
    print("\nissue 17's targets:\n" + "\n".join(report.targets(results, SECTIONS)))
    print(
        "\nthe machine's speed (bench/machine_probe.py, best of five; lower is faster):\n"
        f"  before the sections: {describe_machine(machine['before'])}\n"
        f"  after them:          {describe_machine(machine['after'])}"
    )
    print(
        f"\nwrote {out}/bench-{a.profile}.json, bench-{a.profile}.md, {', '.join(made)} in "
        f"{meta['seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
