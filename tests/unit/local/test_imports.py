"""What the launcher and the lighter services import before they spawn or serve anything."""

from __future__ import annotations

import subprocess
import sys


def imported(*modules: str) -> set[str]:
    """The top-level packages a fresh interpreter has loaded after importing ``modules``."""
    code = (
        f"import sys\nimport {', '.join(modules)}\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(done.stdout.split())


def test_the_launcher_starts_a_job_without_torch_or_matplotlib() -> None:
    """``bagpipe run`` spawns every service only after its own imports: torch (about a second) is for the
    trainers, and for the launcher only where GPUs may be; matplotlib only where a report is drawn."""
    loaded = imported("bagpipe.cli", "bagpipe.local.launcher")
    assert "torch" not in loaded and "matplotlib" not in loaded


def test_core_data_imports_no_numba() -> None:
    """TorchRec's interpreter (bench/torchrec_reference.py) draws synthetic samples from core.data without
    numba installed; the compiled deduplication is imported only where a batch is built."""
    assert "numba" not in imported("bagpipe.core.data")
