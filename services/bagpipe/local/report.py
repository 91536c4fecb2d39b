"""The run report: plots of a local run from the trainers' per-iteration CSV files.

``write_report`` makes ``iteration_breakdown.png`` (stacked stage times per trainer: the warm-up batch
by batch on its own scale, told apart by summary.py's rule, beside the steady state), ``loss.png``,
``cache.png`` (hit rate, rows fetched and synchronised per iteration), ``eval.png`` (held-out logloss and
AUC, with ``--eval-data``) and ``report.html``: the run record at the top (model, data, layout, git
revision, package versions, every flag from config.json), then the plots and the summary. It opens
straight from the run directory.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bagpipe.local.record import RECORD_KEY  # noqa: E402
from bagpipe.local.summary import trainer_logs, warm_up  # noqa: E402
from bagpipe.trainer.metrics import STAGES  # noqa: E402

COLOURS = ("#8c8c8c", "#c7c7c7", "#1f77b4", "#aec7e8", "#d62728", "#ff9896", "#2ca02c", "#ffbb78")


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_report(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Writes the plots and ``report.html`` into ``run_dir``; returns the HTML path."""
    trainers = trainer_logs(run_dir)
    if not trainers:
        raise RuntimeError(f"no per-iteration metrics under {run_dir / 'metrics'}")
    window = max(1, min(20, len(next(iter(trainers.values()))["batch"]) // 20))

    fig, axes = plt.subplots(
        len(trainers),
        2,
        figsize=(11, 3.2 * len(trainers)),
        squeeze=False,
        gridspec_kw={"width_ratios": [1, 4]},
    )
    for (warm_ax, ax), (rank, cols) in zip(axes, trainers.items(), strict=True):
        start = warm_up(cols["iteration_seconds"])
        batches = cols["batch"]
        # the warm-up (start-up, the first plans, compiling) on its own scale, batch by batch
        bottom = [0.0] * start
        for stage, colour in zip(STAGES, COLOURS, strict=False):
            heights = [1000 * v for v in cols[f"{stage}_seconds"][:start]]
            warm_ax.bar(batches[:start], heights, bottom=bottom, color=colour, width=0.9)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        warm_ax.set_title(f"warm-up: {start} batch{'es' if start != 1 else ''}", fontsize=10)
        if start <= 10:
            warm_ax.set_xticks(batches[:start])
        warm_ax.set_ylabel("ms per iteration")
        warm_ax.grid(alpha=0.3)
        # the steady state after it, at a scale its stages can be read at
        steady = {k: v[start:] for k, v in cols.items()}
        if not steady["batch"]:
            continue
        stacks = [[1000 * v for v in _smooth(steady[f"{s}_seconds"], window)] for s in STAGES]
        ax.stackplot(steady["batch"], stacks, labels=STAGES, colors=COLOURS, linewidth=0)
        total = [1000 * v for v in _smooth(steady["iteration_seconds"], window)]
        ax.plot(steady["batch"], total, "k-", lw=0.8, label="iteration")
        ax.set_ylim(0, 1.25 * sorted(total)[int(0.99 * (len(total) - 1))])
        ax.set_title(f"trainer {rank}: steady state (moving mean over {window})", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 1].legend(loc="upper right", fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("batch")
    axes[-1, 1].set_xlabel("batch")
    fig.tight_layout()
    fig.savefig(run_dir / "iteration_breakdown.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 3.5))
    cols = trainers[min(trainers)]
    ax.plot(cols["batch"], cols["loss"], color="#1f77b4", alpha=0.35, lw=0.8, label="global batch loss")
    ax.plot(
        cols["batch"], _smooth(cols["loss"], window), color="#1f77b4", lw=1.6, label=f"moving mean ({window})"
    )
    ax.set_xlabel("batch")
    ax.set_ylabel("BCE loss")
    ax.set_title("loss", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for rank, c in trainers.items():
        hit = [1 - m / u if u else 1.0 for m, u in zip(c["rows_missed"], c["rows_used"], strict=True)]
        ax1.plot(c["batch"], [100 * v for v in _smooth(hit, window)], lw=1.2, label=f"trainer {rank}")
    ax1.set_ylabel("cache hit rate (%)")
    ax1.set_title("cache hit rate and rows moved per iteration", fontsize=10)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    for key, label in (
        ("rows_prefetched", "fetched"),
        ("rows_synced_critical", "synchronised, critical"),
        ("rows_synced_background", "synchronised, background"),
        ("rows_written_back", "written back"),
    ):
        ax2.plot(
            cols["batch"], _smooth(cols[key], window), lw=1.2, label=f"{label} (trainer {min(trainers)})"
        )
    ax2.set_xlabel("batch")
    ax2.set_ylabel("rows")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(run_dir / "cache.png", dpi=110)
    plt.close(fig)

    evals = summary.get("evaluations") or []
    if evals:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2))
        done = [e["batches"] for e in evals]
        ax1.plot(done, [e["logloss"] for e in evals], "o-", color="#d62728", lw=1.4)
        ax1.set_ylabel("logloss")
        ax2.plot(done, [e["auc"] for e in evals], "o-", color="#2ca02c", lw=1.4)
        ax2.set_ylabel("ROC AUC")
        for ax in (ax1, ax2):
            ax.set_xlabel("batches trained")
            ax.grid(alpha=0.3)
        fig.suptitle(f"held-out data ({evals[-1]['samples']:,} samples)", fontsize=10)
        fig.tight_layout()
        fig.savefig(run_dir / "eval.png", dpi=110)
        plt.close(fig)
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>"
        for k, v in summary.items()
        if k not in ("losses", "evaluations")
    )
    run_config = _run_config(run_dir)
    eval_section = ""
    if evals:
        eval_section = '<h2>Held-out evaluation</h2><img src="eval.png" alt="held-out logloss and AUC">'
        eval_section += _eval_table(evals)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Bagpipe run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}}
th{{text-align:left;padding-right:1em}}td,th{{font-size:13px;vertical-align:top}}
img{{max-width:100%;border:1px solid #ddd;margin:.5em 0}}</style></head>
<body><h1>Bagpipe run {html.escape(run_dir.name)}</h1>
{run_config}
<h2>Iteration breakdown</h2><img src="iteration_breakdown.png" alt="iteration breakdown">
<h2>Loss</h2><img src="loss.png" alt="loss">
{eval_section}
<h2>Cache</h2><img src="cache.png" alt="cache hit rate and rows moved">
<h2>Summary</h2><table>{rows}</table>
<p>Per-iteration data: <code>metrics/trainer-&lt;rank&gt;.csv</code>; final scrapes of every service:
<code>metrics/*.prom</code>.</p>
</body></html>
"""
    out = run_dir / "report.html"
    out.write_text(page)
    return out


def _eval_table(evals: list[dict[str, Any]]) -> str:
    head = "<tr><th>batches</th><th>samples</th><th>logloss</th><th>AUC</th><th>seconds</th></tr>"
    body = "".join(
        f"<tr><td>{e['batches']}</td><td>{e['samples']:,}</td><td>{e['logloss']:.5f}</td><td>{e['auc']:.5f}</td>"
        f"<td>{e['seconds']:.2f}</td></tr>"
        for e in evals
    )
    return f"<table>{head}{body}</table>"


def _run_config(run_dir: Path) -> str:
    """The run's record from config.json (what ran, with which code and packages), readable."""
    path = run_dir / "config.json"
    if not path.exists():
        return ""
    config = json.loads(path.read_text())
    record = config.pop(RECORD_KEY, {}) or {}
    model = config.get("model", "dlrm")
    sizes = (
        f"bottom {config.get('bottom_mlp') or 'default'}, top {config.get('top_mlp') or 'default'}"
        if model == "dlrm"
        else f"deep {config.get('deep_mlp') or 'default'}"
    )
    headline = [
        ("model", f"{model}, embedding dim {config.get('embedding_dim')}, {sizes}"),
        ("optimizer", f"{config.get('optimizer')}, lr {config.get('lr')}"),
        (
            "data",
            f"{config.get('data')}, batch {config.get('batch_size')}, {config.get('iterations')} iterations",
        ),
        (
            "layout",
            f"{config.get('trainers')} trainers, {config.get('embedding_servers')} embedding servers, "
            f"{config.get('data_processors')} data processors",
        ),
        ("held-out", config.get("eval_data") or "none"),
        (
            "code",
            f"git {record.get('git_revision') or 'unknown'}"
            + (" (modified)" if record.get("git_dirty") else ""),
        ),
        ("packages", ", ".join(f"{k} {v}" for k, v in (record.get("packages") or {}).items() if v)),
        (
            "machine",
            f"{record.get('host')}, {record.get('cpus')} CPUs, Python {record.get('python')}, "
            f"{record.get('platform')}",
        ),
        ("started", f"{record.get('started')}: {record.get('command', '')}"),
    ]
    top = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in headline)
    flags = "".join(
        f"<tr><th>--{html.escape(k.replace('_', '-'))}</th><td>{html.escape(_fmt(v))}</td></tr>"
        for k, v in sorted(config.items())
    )
    return (
        f"<h2>Run</h2><table>{top}</table><details><summary>every flag (config.json)</summary>"
        f"<table>{flags}</table></details>"
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    return str(value)
