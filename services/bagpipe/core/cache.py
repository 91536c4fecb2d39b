"""A trainer's embedding cache: row and optimizer-state tensors addressed by oracle-assigned slots.

The oracle gives every cached key a slot, so the cache needs no id -> slot map of its own: a plan's
``slots`` array is the map. The prefetch thread writes rows into slots the training thread does not
use yet (the lookahead guarantees it), so the two run without locking each other; only growing the
tensors, which replaces them, waits for the training thread to leave its step (``lock``).
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)


class EmbeddingCache:
    """``weights`` [capacity, dim] and ``state`` [capacity, state_width] on ``device``."""

    def __init__(self, dim: int, state_width: int, device: torch.device, capacity: int = 1024) -> None:
        self.dim = dim
        self.state_width = state_width
        self.device = device
        self.weights = torch.zeros((capacity, dim), dtype=torch.float32, device=device)
        self.state = torch.zeros((capacity, state_width), dtype=torch.float32, device=device)
        self.lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return int(self.weights.shape[0])

    def ensure_capacity(self, rows: int) -> None:
        """Grows (at least doubling) so that slots ``0 .. rows-1`` exist."""
        if rows <= self.capacity:
            return
        new_capacity = max(rows, 2 * self.capacity)
        with self.lock:
            weights = torch.zeros((new_capacity, self.dim), dtype=torch.float32, device=self.device)
            state = torch.zeros((new_capacity, self.state_width), dtype=torch.float32, device=self.device)
            weights[: self.capacity] = self.weights
            state[: self.capacity] = self.state
            self.weights, self.state = weights, state
        logger.debug("cache grown to %d rows", new_capacity)

    def insert(self, slots: torch.Tensor, rows: torch.Tensor, state: torch.Tensor) -> None:
        """Stores fetched rows (and their optimizer state) in ``slots``."""
        self.weights.index_copy_(0, slots, rows.to(self.device, non_blocking=True))
        if self.state_width:
            self.state.index_copy_(0, slots, state.to(self.device, non_blocking=True))

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the rows and state in ``slots``, on the CPU (for write-back)."""
        return self.weights.index_select(0, slots).cpu(), self.state.index_select(0, slots).cpu()
