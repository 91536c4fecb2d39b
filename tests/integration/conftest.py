"""Helpers to run real local jobs (Redis, gRPC services, torch.distributed) with tiny sizes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from bagpipe.cli import parse_run
from bagpipe.local.launcher import run

TINY = [
    "--scale",
    "0.0005",
    "--embedding-dim",
    "8",
    "--batch-size",
    "64",
    "--data-processors",
    "1",
    "--quiet",
    "--log-level",
    "WARNING",
]
# the dense part's sizes of each model in tests
TINY_MODEL = {
    "dlrm": ["--bottom-mlp", "16,8", "--top-mlp", "16,1"],
    "wdl": ["--deep-mlp", "16,8"],
    "deepfm": ["--deep-mlp", "16,8"],
    "dcn": ["--deep-mlp", "16,8", "--cross-layers", "2"],
}

# Adam's first step moves an element by lr one way or the other, whatever the size of its gradient above
# eps: where a gradient is a sum that cancels to rounding noise, its sign is the noise's. CUDA's kernels
# round otherwise than the CPU reference: on an H200 (2026-11-26), DLRM with Adam on 3 trainers ended 0.006
# from the reference in one element, exactly where the CPU reference itself lands with 1e-6 of relative
# noise on its gradients. So on CUDA the runs with Adam take eps 1e-6, which bounds what a gradient of
# rounding size can move (lr x gradient / eps) and barely changes the step of a gradient of real size.
CUDA_ADAM_EPS = 1e-6


def adam_eps(optimizer: str) -> dict[str, float]:
    """``eps`` for ``flags`` and ``OptimizerConfig``: 1e-6 for Adam where torch sees a GPU (the runs' trainers
    use it), torch's default elsewhere."""
    return {"eps": CUDA_ADAM_EPS} if optimizer == "adam" and torch.cuda.is_available() else {}


class BackgroundRun:
    """A ``run_job`` call in a thread, so that the test can act on the run while it trains."""

    def __init__(self, run_job: Any, name: str, *flags: str) -> None:
        self._result: list[Any] = []
        self._error: list[BaseException] = []

        def job() -> None:
            try:
                self._result.append(run_job(name, *flags))
            except BaseException as e:  # reported by the test thread
                self._error.append(e)

        self.thread = threading.Thread(target=job)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def result(self, timeout: float = 300) -> Any:
        """(summary, paths) once the run ends; its exception if it failed."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the run did not end"
        if self._error:
            raise self._error[0]
        return self._result[0]


@pytest.fixture
def run_job(tmp_path: Path):
    """Runs ``bagpipe run`` with TINY defaults plus ``extra`` flags, without the report unless ``report``;
    returns (summary, paths)."""

    def _run(
        name: str, *extra: str, after_training: Any = None, report: bool = False
    ) -> tuple[dict[str, Any], dict[str, Path]]:
        paths = {"initial": tmp_path / f"{name}-initial.pt", "final": tmp_path / f"{name}-final.pt"}
        model = extra[extra.index("--model") + 1] if "--model" in extra else "dlrm"
        argv = [
            "run",
            *TINY,
            *TINY_MODEL[model],
            *([] if report else ["--no-report"]),  # (a second of plotting a job; tests that read it ask)
            *extra,
            "--run-dir",
            str(tmp_path / name),
            "--save-initial",
            str(paths["initial"]),
            "--save-final",
            str(paths["final"]),
        ]
        return run(parse_run(argv[1:]), after_training=after_training), paths

    return _run


def flags(**options: Any) -> list[str]:
    """``bagpipe run`` flags from keywords: ``flags(trainers=2, batch_size=64)`` gives
    ``["--trainers", "2", "--batch-size", "64"]`` (values as ``str()`` writes them)."""
    argv: list[str] = []
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def exact_flags(iterations: int, batch: int, optimizer: str, trainers: int = 2, **extra: Any) -> list[str]:
    """The layout the recovery and re-sharding tests train in: T trainers, 2 servers, LRPP with delayed
    sync, L=8 (rows change hands), a checkpoint every 5 batches."""
    return flags(
        trainers=trainers,
        embedding_servers=2,
        lookahead=8,
        iterations=iterations,
        batch_size=batch,
        optimizer=optimizer,
        lr="0.05",
        checkpoint_every=5,
        **adam_eps(optimizer),
        **extra,
    )
