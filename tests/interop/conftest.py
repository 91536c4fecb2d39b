"""TorchRec's own interpreter (``bench/.venv-torchrec``), for the tests that run TorchRec itself."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHREC_PYTHON = ROOT / "bench" / ".venv-torchrec" / "bin" / "python"


@pytest.fixture(scope="module")
def torchrec_python() -> Path:
    """TorchRec's interpreter, or a skip that says what is missing and how to make it."""
    make = "make bench-torchrec-env creates it (torch 2.13, fbgemm-gpu-cpu 1.8, torchrec 1.8; ~2 min)"
    if not TORCHREC_PYTHON.exists():
        pytest.skip(f"TorchRec's interpreter {TORCHREC_PYTHON.relative_to(ROOT)} does not exist: {make}")
    probe = subprocess.run(
        [str(TORCHREC_PYTHON), "-c", "import torchrec.models.dlrm"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode:
        why = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"{TORCHREC_PYTHON.relative_to(ROOT)} cannot import torchrec ({why}): {make}")
    return TORCHREC_PYTHON
