"""``bagpipe export --to torchrec CHECKPOINT OUT``: a trained model in another framework's format.

Reads an interchange checkpoint (``--save-final``) and writes ``OUT``, the ``torch.save``'d state dict of
TorchRec's ``torchrec.models.dlrm.DLRM`` (core/interop.py has the mapping), and ``OUT.json`` beside it:
the sizes to build that model with, so that ``load_state_dict(strict=True)`` takes the state dict and the
model gives Bagpipe's logits (docs/models.md, "Exporting to TorchRec").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bagpipe.core import checkpoint, interop

FORMATS = ("torchrec",)


def sidecar(out: str | os.PathLike[str]) -> Path:
    """Where the build description of ``out`` goes: ``OUT.json``."""
    return Path(f"{os.fspath(out)}.json")


def export(source: str | os.PathLike[str], out: str | os.PathLike[str], to: str = "torchrec") -> str:
    """Writes ``out`` and its sidecar from the interchange checkpoint ``source``; returns what was written,
    in one line. ValueError (or OSError) says why the checkpoint cannot be exported, before anything is
    written."""
    if to not in FORMATS:
        raise ValueError(f"--to: one of {', '.join(FORMATS)}, got {to!r}")
    if not Path(source).is_file():
        raise ValueError(f"{source}: no such file")
    try:
        state, spec = interop.to_torchrec(checkpoint.load(source))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    spec["source"] = os.fspath(source)
    checkpoint.save(out, state)  # (an OrderedDict of tensors: torch.load(weights_only=True) reads it)
    sidecar(out).write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
    return (
        f"wrote {out}: TorchRec DLRM state dict ({len(spec['tables'])} tables of dim "
        f"{spec['tables'][0]['embedding_dim']}, dense_arch {spec['dense_arch_layer_sizes']}, over_arch "
        f"{spec['over_arch_layer_sizes']}); {sidecar(out)}: the sizes to build it with"
    )
