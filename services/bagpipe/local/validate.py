"""Checks what a ``RunConfig`` points at before any process starts: its input files, and a CUDA device
where it asks for one. (Its values were checked as it was built: ``RunConfig.__post_init__``.)

A bad input stops the run at once with one line naming the flag and the file, instead of a child
process's traceback seconds later, or a hang.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

from bagpipe.core.data import DataFormatError
from bagpipe.local import configs

if TYPE_CHECKING:
    from bagpipe.local.run_config import RunConfig


class BadFlag(SystemExit):
    """``bagpipe run`` cannot start: the message names the flag or file."""

    def __init__(self, flag: str, why: str) -> None:
        super().__init__(f"bagpipe run: {flag}: {why}")
        self.flag = flag
        self.why = why


def _readable_file(flag: str, path: str) -> None:
    p = Path(path)
    if not p.exists():
        raise BadFlag(flag, f"{path}: no such file")
    if not p.is_file():
        raise BadFlag(flag, f"{path}: not a regular file")
    if not os.access(p, os.R_OK):
        raise BadFlag(flag, f"{path}: not readable")
    if p.stat().st_size == 0:
        raise BadFlag(flag, f"{path}: empty file")


def _paths(source: str) -> list[str]:
    return [p for p in source.partition(":")[2].split(",") if p]


def _init_from_fits(config: RunConfig) -> None:
    """``--init-from`` loads as the trainers and embedding servers will load it (``checkpoint.load_init``):
    a TorchRec DLRM state dict of other sizes than the flags' is refused here, in one line, instead of by
    every service (and every restart of it)."""
    from bagpipe.config_args import model_config_of, table_rows_of
    from bagpipe.core import checkpoint  # (torch: a second or two, only for a run that starts from a model)

    assert config.init_from is not None
    table_rows = table_rows_of(config)
    model = model_config_of(config, len(table_rows))
    try:
        checkpoint.load_init(config.init_from, config.model, config.embedding_dim, table_rows, model)
    except (ValueError, RuntimeError, OSError, pickle.UnpicklingError) as e:  # (torch.load's errors too)
        raise BadFlag("--init-from", f"{config.init_from}: {e}") from None


def check_inputs(config: RunConfig) -> None:
    """Raises BadFlag (a SystemExit with one line) for the first input of ``config`` that is missing or
    does not parse: the data files (their first chunk, as every data processor checks it), the held-out
    data, ``--init-from``, and a CUDA device for ``--device cuda``."""
    if config.resume:
        return  # (the stopped run's own inputs: checked when it started)
    if config.data != "synthetic":
        for path in _paths(config.data):
            _readable_file("--data", path)
        try:
            configs.source(config).check_head()
        except DataFormatError as e:
            raise BadFlag("--data", f"bad data: {e}") from None
    if config.eval_data and config.eval_data != "synthetic":
        for path in _paths(config.eval_data):
            _readable_file("--eval-data", path)
    if config.init_from:
        _readable_file("--init-from", config.init_from)
        _init_from_fits(config)
    if config.device == "cuda":
        import torch  # (only here: a second of every job's start-up otherwise)

        if not torch.cuda.is_available():
            raise BadFlag("--device", "cuda, but torch sees no CUDA device here")
