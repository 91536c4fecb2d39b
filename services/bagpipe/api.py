"""Bagpipe from Python: ``run(RunConfig(...))`` trains one job, as ``bagpipe run`` does, and returns its
summary as a ``RunSummary``.

    from bagpipe import RunConfig, run

    summary = run(RunConfig(model="dcn", trainers=2, iterations=200, run_dir="runs/dcn"))
    print(summary.final_loss, summary.samples_per_second, summary.final_model)

``RunConfig`` takes every flag of ``bagpipe run`` as a keyword (``--batch-size`` is ``batch_size``) and
raises ``ConfigError`` (a ``ValueError`` naming the field and its flag) as it is built; ``run`` raises it
too for an input that is missing or does not parse, before anything starts. The CLI is this function
with the flags parsed into a ``RunConfig``. In a notebook the progress bar is tqdm's notebook widget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bagpipe.flags import ConfigError
from bagpipe.local.run_config import RunConfig

__all__ = ["ConfigError", "Evaluation", "RunConfig", "RunSummary", "run"]


@dataclass(frozen=True)
class Evaluation:
    """One held-out evaluation (``--eval-data``): after ``batches`` batches, on ``samples`` samples."""

    batches: int
    samples: int
    logloss: float
    auc: float
    seconds: float


@dataclass(frozen=True)
class RunSummary:
    """What a finished run reports (``summary.json`` of its run directory, typed). ``figures`` holds all of
    it, the fields below included, as the JSON has it."""

    run_dir: Path
    iterations: int  # batches trained, over every generation of the run
    samples_per_second: float  # the slowest trainer's, of the last generation
    seconds_per_iteration: float
    first_loss: float | None
    final_loss: float | None  # the mean of the last 10 batches' losses
    losses: list[float]
    cache_hit_rate: float
    lookahead: float  # the mean L the oracle planned with
    stage_seconds_per_iteration: dict[str, float]  # data_wait, prefetch_wait, forward, ...
    evaluations: list[Evaluation]
    failures_recovered: int
    checkpoint_dir: Path | None  # the run's recovery checkpoints (None: --checkpoint-every 0)
    final_model: Path | None  # --save-final's interchange checkpoint
    report: Path | None  # report.html (None: --no-report)
    figures: dict[str, Any] = field(repr=False)

    @classmethod
    def of(cls, summary: dict[str, Any], config: RunConfig) -> RunSummary:
        recovery = summary.get("recovery") or {}
        checkpoints = recovery.get("checkpoint_dir")
        return cls(
            run_dir=Path(summary["run_dir"]),
            iterations=summary["iterations"],
            samples_per_second=summary["samples_per_second"],
            seconds_per_iteration=summary["seconds_per_iteration"],
            first_loss=summary["first_loss"],
            final_loss=summary["final_loss"],
            losses=list(summary["losses"]),
            cache_hit_rate=summary["cache_hit_rate"],
            lookahead=summary["lookahead"]["mean"],
            stage_seconds_per_iteration=dict(summary["stage_seconds_per_iteration"]),
            evaluations=[Evaluation(**e) for e in summary.get("evaluations", [])],
            failures_recovered=recovery.get("failures_detected", 0),
            checkpoint_dir=Path(checkpoints) if checkpoints else None,
            final_model=Path(config.save_final) if config.save_final else None,
            report=Path(summary["report"]) if summary.get("report") else None,
            figures=summary,
        )


def run(config: RunConfig) -> RunSummary:
    """Trains the job ``config`` describes to its end, every service a local process, and returns its
    summary. Raises ``ConfigError`` for an input that cannot be read (nothing started), ``RuntimeError``
    when the job failed beyond recovery; a ``KeyboardInterrupt`` (a notebook's stop button) stops every
    process, and the run goes on later with ``run(RunConfig(resume=RUN_DIR))``."""
    from bagpipe.local import launcher
    from bagpipe.local.validate import BadFlag

    if config.resume:
        config = config.resumed()
    try:
        summary = launcher.run(config)
    except BadFlag as e:
        raise ConfigError(e.flag.removeprefix("--").replace("-", "_"), e.flag, e.why) from None
    return RunSummary.of(summary, config)
