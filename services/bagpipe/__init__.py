"""Bagpipe: distributed training of recommendation models with lookahead embedding caching.

The Python API (``bagpipe.api``): ``from bagpipe import RunConfig, run``. Its names load on first use, so
that the services, which import ``bagpipe.*`` modules, do not load the launcher.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bagpipe.api import ConfigError, Evaluation, RunConfig, RunSummary, run

__all__ = ["ConfigError", "Evaluation", "RunConfig", "RunSummary", "run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from bagpipe import api

        return getattr(api, name)
    raise AttributeError(f"module 'bagpipe' has no attribute {name!r}")
