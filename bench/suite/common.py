"""Where the bench lives, its log line, and a measurement run in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def in_own_process(script: str, **options: Any) -> dict[str, Any]:
    """Runs ``bench/<script>`` with ``--<option> value`` for each option and returns the JSON it writes
    (``--out``): a measurement in a process of its own does not inherit this one's heap, threads and
    allocator state from the sections before it."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        argv = [str(x) for k, v in options.items() for x in (f"--{k.replace('_', '-')}", v)]
        subprocess.run(
            [sys.executable, str(BENCH / script), *argv, "--out", str(result)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(result.read_text())
