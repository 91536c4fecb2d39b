"""A trainer's embedding cache: row and optimizer-state tensors addressed by oracle-assigned slots.

The oracle gives every cached key a slot (the same on every trainer), so the cache needs no id -> slot
map of its own: a plan's slot arrays are the map. Threads write disjoint slots concurrently: the
prefetcher fills slots the training thread does not use yet, the background synchroniser updates rows
the current batch does not read (the lookahead and delayed-sync plans guarantee both). Only growing the
tensors, which replaces them, needs everyone else out: users hold ``shared()``, growth is exclusive.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

logger = logging.getLogger(__name__)


class SharedLock:
    """Many holders of ``shared()`` or one of ``exclusive()``; a waiting exclusive holder goes first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class EmbeddingCache:
    """``weights`` [capacity, dim] and ``state`` [capacity, state_width] on ``device``.

    With ``fixed`` the capacity is a hard bound (``--cache-rows``) and never grows.
    """

    def __init__(
        self, dim: int, state_width: int, device: torch.device, capacity: int = 1024, fixed: bool = False
    ) -> None:
        self.dim = dim
        self.state_width = state_width
        self.device = device
        self.fixed = fixed
        self.weights = torch.zeros((capacity, dim), dtype=torch.float32, device=device)
        self.state = torch.zeros((capacity, state_width), dtype=torch.float32, device=device)
        self.lock = SharedLock()

    @property
    def capacity(self) -> int:
        return int(self.weights.shape[0])

    def ensure_capacity(self, rows: int) -> None:
        """Grows (at least doubling) so that slots ``0 .. rows-1`` exist."""
        if rows <= self.capacity:
            return
        if self.fixed:
            raise ValueError(
                f"cache: the plan needs {rows} rows, the cache holds {self.capacity} (--cache-rows)"
            )
        new_capacity = max(rows, 2 * self.capacity)
        # allocated and zero-filled before taking the lock (page-faulting in 50 MB took 20-130 ms here,
        # which training waited out); under it, only the copy of the current rows
        weights = torch.zeros((new_capacity, self.dim), dtype=torch.float32, device=self.device)
        state = torch.zeros((new_capacity, self.state_width), dtype=torch.float32, device=self.device)
        with self.lock.exclusive():
            weights[: self.capacity] = self.weights
            state[: self.capacity] = self.state
            self.weights, self.state = weights, state
        logger.debug("cache grown to %d rows", new_capacity)

    def index(self, values: np.ndarray) -> torch.Tensor:
        """Slots (or any positions) from a plan, as an int64 index on the cache's device."""
        return torch.from_numpy(values.astype(np.int64)).to(self.device)

    def insert(self, slots: torch.Tensor, rows: torch.Tensor, state: torch.Tensor) -> None:
        """Stores rows (and their optimizer state) in ``slots``."""
        self.weights.index_copy_(0, slots, rows.to(self.device, non_blocking=True))
        if self.state_width:
            self.state.index_copy_(0, slots, state.to(self.device, non_blocking=True))

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the rows and state in ``slots``, on the CPU (for write-back)."""
        return self.weights.index_select(0, slots).cpu(), self.state.index_select(0, slots).cpu()

    def packed(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows and state of ``slots`` side by side, [n, dim + state_width], on the device."""
        return torch.cat([self.weights.index_select(0, slots), self.state.index_select(0, slots)], dim=1)

    def unpack(self, slots: torch.Tensor, packed: torch.Tensor) -> None:
        """Inverse of ``packed``: stores rows and state given side by side."""
        self.insert(slots, packed[:, : self.dim], packed[:, self.dim :])
