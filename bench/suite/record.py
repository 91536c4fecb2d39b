"""The results files of a run: ``bench-<profile>.json`` (the settings, the machine, and every section's
figures, a section not run keeping its last ones and their date) and ``bench-<profile>.md``."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from bagpipe.local.record import run_record
from machine_probe import describe as describe_machine


def last_results(path: Path, sections: Collection[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The figures of ``sections`` in an earlier run's JSON at ``path`` (none where it is absent), and
    when each was measured."""
    if not path.exists():
        return {}, {}
    last = json.loads(path.read_text())
    results = {k: v for k, v in last.items() if k in sections}
    dated = last.get("meta", {}).get("section_dates", {})
    when = f"{last.get('meta', {}).get('date', '?')} or earlier"  # (results from before the dates)
    return results, {k: dated.get(k, when) for k in results}


def gpus() -> str:
    """The GPUs torch sees here, for the record of a run."""
    import torch

    if not torch.cuda.is_available():
        return "no GPU"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} x {names[0]} (torch {torch.__version__})"


def save(
    out: Path,
    profile_name: str,
    settings: dict[str, Any],
    results: dict[str, Any],
    seconds: float,
    machine: dict[str, Any],
    section_dates: dict[str, str],
) -> dict[str, Any]:
    """Writes ``bench-<profile>.json``: the run's record (``meta``) and every section's figures; returns
    the record."""
    meta = {
        "profile": profile_name,
        "settings": settings,
        "seconds": seconds,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {gpus()}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine_probe": machine,
        "section_dates": section_dates,
        # (the code measured: a run's record names its commit, and whether the tree had changes)
        **{k: v for k, v in run_record().items() if k in ("git_revision", "git_dirty")},
    }
    (out / f"bench-{profile_name}.json").write_text(json.dumps({"meta": meta, **results}, indent=2))
    return meta


def write_markdown(
    out: Path, profile_name: str, meta: dict[str, Any], only: str, section_dates: dict[str, str], text: str
) -> None:
    """Writes ``bench-<profile>.md``: what ran, when each section's figures were measured, the machine's
    speed before and after, and the tables (``text``)."""
    machine = meta["machine_probe"]
    (out / f"bench-{profile_name}.md").write_text(
        f"# bench ({profile_name}, {meta['date']}, {meta['machine']})\n\n"
        f"Sections run this time: {only}. When each section's figures were measured: "
        f"{', '.join(f'{k} {v}' for k, v in section_dates.items())}.\n\n"
        f"The machine's speed (`bench/machine_probe.py`) this time: before the sections "
        f"{describe_machine(machine['before'])}; after them {describe_machine(machine['after'])}.\n\n"
        f"{text}\n"
    )
