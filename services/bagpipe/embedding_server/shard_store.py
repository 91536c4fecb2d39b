"""One embedding-server shard: the rows of its buckets of every table, with optimizer state.

(Over 400 lines: the table, its undo log and a migration's copy change the same rows under the
server's one gate; the rules between them are kept in one class.)

Storage is one dense float32 array ``[local_rows, dim + state_width]``, each row followed by its
optimizer state (``weights`` and ``state`` are views of its two column ranges): a lookup gathers one
contiguous run of bytes per key, not two. A key's local row, and a local row's key, are arithmetic on
the shard map, so the only per-row cost is the row itself (plus two flags).

A row also carries an "initial" flag: set, it guarantees that the row holds its initial value
(``embedding_init``) and zero optimizer state, so a lookup can leave it out of the reply for a client
that computes initial rows the same way (the same ``fingerprint``). Every path that stores values into a
row clears it (a write-back, a restore, a loaded checkpoint, a row received by re-sharding) or carries it
with the row (a staying row's copy); a cleared flag is never wrong, only slower.

Re-sharding (``Migration``) builds the arrays of the next shard-map version beside the current ones
while the current ones go on serving: the rows that stay are copied over locally and the incoming ones
arrive from their old shards, in chunks; every write after a row's copy marks it dirty. At the switch
(``seal``) the dirty rows are copied again (or sent, with the "changed since the last checkpoint" flags
of the leaving rows), and once every old owner's last rows are in, the new arrays replace the old ones
(``finish``). So a write is never lost, and never applied twice: it lands in the current arrays and is
carried over by exactly one copy, the last one after it. The transient cost is the new arrays beside the
old ones (at most the shard's size again).

The undo log (``track_undo``) lets a server roll back in place to a recent checkpoint (``undo_to``) without
reading a file: per checkpoint since the oldest one still wanted, a segment holds the value (and initial
flag) at that checkpoint of every row written after it, saved by the first write to the row in the segment.
It costs one boolean gather per write-back, plus a copy of the rows new to the segment, and memory in
proportion to the rows written since the oldest kept checkpoint. Whatever rewrites rows wholesale (a restore,
a loaded checkpoint, a migration that replaces the arrays) invalidates it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from numba import njit

from bagpipe import allocator
from bagpipe.core.embedding_init import fingerprint, init_rows
from bagpipe.core.shard_map import ShardMap
from bagpipe.core.snapshots import Gathered
from bagpipe.embedding_server.row_tier import RowTier, TierSpec
from bagpipe.errors import InvalidArgument
from bagpipe.wire import Gather

logger = logging.getLogger(__name__)

_INIT_CHUNK = 1 << 18


def packed_rows(rows: int, dim: int, state_width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Zeros ``[rows, dim + state_width]``, with views of its row and state columns; on huge pages where the
    kernel grants them, since lookups and write-backs visit its rows at random (``allocator``)."""
    table = allocator.huge_page_zeros((rows, dim + state_width), np.float32)
    return table, table[:, :dim], table[:, dim:]


# rows a tiered shard takes from a checkpoint at once (a few tens of MB beyond its budget while it loads)
LOAD_CHUNK_ROWS = 1 << 16

# no trained embedding value comes near this; a write beyond it is a bug or an attack
DEFAULT_MAX_ABS = 1e6


def check_values(
    keys: np.ndarray, rows: np.ndarray, state: np.ndarray, max_abs: float, non_negative: slice | None = None
) -> None:
    """Rows must be finite and within ``max_abs``; optimizer state finite, and >= 0 in the columns
    ``non_negative`` (default all: Adagrad's sums of squares; Adam's second moment only).
    Raises InvalidArgument naming the first bad key and value."""
    non_neg = np.zeros(state.shape[1:], dtype=bool)
    non_neg[non_negative if non_negative is not None else slice(None)] = True
    for name, values, bad, why in (
        (
            "rows",
            rows,
            ~np.isfinite(rows) | (np.abs(rows) > max_abs),
            f"at most {max_abs:g} in absolute value (--max-abs-value)",
        ),
        ("state", state, ~np.isfinite(state) | ((state < 0) & non_neg), None),
    ):
        if bad.any():
            i, j = np.unravel_index(int(np.argmax(bad)), bad.shape)
            value = float(values[i, j])
            if why is None:  # (a sum of squares cannot be negative; Adam's first moment can)
                why = "finite and >= 0" if non_neg[j] else "finite"
            raise InvalidArgument(name, f"key {int(keys[i])}: value {value:.7g} (must be {why})")


_FLOAT32_MAX = float(np.finfo(np.float32).max)


@njit(cache=True, nogil=True)
def _first_repeat(index, seen):  # type: ignore[no-untyped-def]
    """The position of the first entry of ``index`` that an earlier one repeats, or -1. ``seen`` is a bitmap
    of local rows, all clear on entry and on return."""
    bad = -1
    three, seven = np.uint64(3), np.uint64(7)
    for i in range(index.size):
        r = np.uint64(index[i])  # (unsigned: no wrap-around code per access)
        bit = np.uint8(np.uint64(1) << (r & seven))
        old = seen[r >> three]
        if old & bit:
            bad = i
            break
        seen[r >> three] = old | bit
    for i in range(index.size if bad < 0 else bad):  # (each byte set above had been clear)
        seen[np.uint64(index[i]) >> three] = 0
    return bad


@njit(cache=True, nogil=True)
def _check_and_store(table, index, rows, state, max_abs, state_low):  # type: ignore[no-untyped-def]
    """``_store_rows`` for keys known to be distinct: the values' checks, then the stores."""
    n = index.size
    dim = rows.shape[1]
    width = state.shape[1]
    high = np.float32(_FLOAT32_MAX)
    bad = -1
    for i in range(n):
        fails = 0
        for j in range(dim):
            fails += not abs(rows[i, j]) <= max_abs
        for j in range(width):
            v = state[i, j]
            fails += not ((v >= state_low[j]) & (v <= high))
        if fails:
            bad = i
            break
    if bad >= 0:
        return bad
    for i in range(n):
        r = np.uint64(index[i])
        for j in range(dim):
            table[r, j] = rows[i, j]
        for j in range(width):
            table[r, dim + j] = state[i, j]
    return -1


@njit(cache=True, nogil=True)
def _store_rows(table, index, rows, state, max_abs, state_low, seen):  # type: ignore[no-untyped-def]
    """A write-back's checks and stores: returns -1 having stored every row into ``table`` (each row then
    its state, one run of bytes per key), or the position of a row refused (its key came earlier in the
    request, or a value fails ``check_values``' rules) having stored nothing. ``max_abs`` is finite; state
    column ``j`` must lie in ``[state_low[j], _FLOAT32_MAX]``. ``seen``: as ``_first_repeat``'s. The checks
    count failed comparisons (NaN fails every one) rather than branch, so that they compile to vector code.

    Repeated keys first, then values and stores in a function of their own. With the repeat check in the
    values' loop, or its loop in the same function as theirs, the kernel took 2.5 times as long: 230-280
    against 75-95 us for 1,000 rows of dim 64 with Adagrad state (bench/README.md, "Embedding server")."""
    bad = _first_repeat(index, seen)
    if bad >= 0:
        return bad
    return _check_and_store(table, index, rows, state, max_abs, state_low)


@njit(cache=True, nogil=True)
def _local_rows(keys, position, num_keys, num_buckets, rows_per_bucket, out):  # type: ignore[no-untyped-def]
    """``ShardStore.local_index`` in one pass: writes the local row of every key into ``out`` and returns
    -1, or returns the position of the first key out of ``[0, num_keys)`` or of a bucket not held here
    (``position`` -1). numpy's range check, bucket gather, check and index arithmetic took six passes."""
    buckets = np.uint64(num_buckets)
    for i in range(keys.size):
        k = keys[i]
        if k < 0 or k >= num_keys:
            return i
        u = np.uint64(k)  # (in range: unsigned division and indexing, without Python's sign rules)
        p = position[u % buckets]
        if p < 0:
            return i
        out[i] = p * rows_per_bucket + np.int64(u // buckets)
    return -1


class _UndoSegment:
    """The values at checkpoint ``baseline`` of the rows first written after it: local rows, their packed rows
    and initial flags, one chunk per write that brought rows new to the segment (concatenated only by a
    roll-back, so that a write-back pays no copy of what is already logged)."""

    __slots__ = ("baseline", "index", "packed", "initial", "rows")

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.index: list[np.ndarray] = []
        self.packed: list[np.ndarray] = []
        self.initial: list[np.ndarray] = []
        self.rows = 0

    def add(self, index: np.ndarray, packed: np.ndarray, initial: np.ndarray) -> None:
        self.index.append(index)
        self.packed.append(packed)
        self.initial.append(initial)
        self.rows += index.size


class ShardStore:
    """Rows and optimizer state of shard ``shard`` of ``shard_map``."""

    def __init__(
        self,
        shard_map: ShardMap,
        shard: int,
        offsets: np.ndarray,
        dim: int,
        state_width: int,
        seed: int,
        tier: TierSpec | None = None,
    ) -> None:
        """``tier``: rows and state within a memory budget, the rest on disk (``row_tier``); without it, every
        row in memory."""
        if shard < 0:
            raise ValueError(f"shard: must be >= 0, got {shard}")
        if int(offsets[-1]) != shard_map.num_keys:
            raise ValueError(
                f"table rows total {int(offsets[-1])} but the shard map has {shard_map.num_keys} keys"
            )
        self.shard_map = shard_map
        self.shard = shard
        self.offsets = offsets
        self.dim = dim
        self.state_width = state_width
        self._position, local_rows = shard_map.local_layout(shard)
        self._owned = shard_map.buckets_of(shard)  # the bucket at each local position
        self.seed = seed
        self.local_rows = local_rows
        self.tier_spec = tier
        # with a tier, rows never written are nowhere (computed where needed): no table
        self.tier: RowTier | None = None
        self.table, self.weights, self.state = packed_rows(0 if tier else local_rows, dim, state_width)
        local_keys = shard_map.local_keys(shard)
        if tier is not None:
            self.tier = tier.tier(local_rows, dim + state_width, f"shard-{shard}-v{shard_map.version}")
        for start in range(0, local_rows if tier is None else 0, _INIT_CHUNK):
            keys = local_keys[start : start + _INIT_CHUNK]
            valid = keys >= 0
            self.weights[start : start + keys.size][valid] = init_rows(keys[valid], offsets, dim, seed)
        self.rows_held = int((local_keys >= 0).sum())
        self._changed = np.zeros(local_rows, dtype=bool)  # written since the last snapshot
        self._initial = np.ones(local_rows, dtype=bool)  # still the initial row and zero state
        self.fingerprint = fingerprint(offsets, dim, seed)  # (of the initial rows: embedding_init)
        self._seen = np.zeros(0, dtype=np.uint8)  # (_store_rows' bitmap, sized on first use)
        self.migration: Migration | None = None
        self.max_abs = DEFAULT_MAX_ABS  # a written value beyond this is refused (--max-abs-value)
        self.non_negative: slice | None = None  # state columns that must be >= 0 (None: all)
        self._undo: list[_UndoSegment] | None = None  # oldest first, the last one logging (None: off)
        self._undo_logged = np.zeros(0, dtype=bool)  # local rows the last segment holds
        # the checkpoint whose rows the shard holds as it was built (``build_store``); None once a row is
        # stored, rolled back or migrated: a roll-back to it has nothing to do
        self.built_batch: int | None = None

    def load_checkpoint(
        self, ckpt: Mapping[str, Any], state_keys: tuple[str, ...], embedding_dim: int, linear: bool
    ) -> None:
        """Replaces this shard's rows (and state, when the checkpoint has this optimizer's) with those of an
        interchange checkpoint (core/checkpoint.py); ValueError names the entry that does not fit."""
        import torch  # (only here: a server loads torch only to read a checkpoint, 185 MB resident)

        from bagpipe.core import checkpoint

        local_keys = self.shard_map.local_keys(self.shard)

        def table(t: int) -> tuple[torch.Tensor, tuple[torch.Tensor, int] | None]:
            rows = checkpoint.table_rows(dict(ckpt), t, embedding_dim, linear)
            size = int(self.offsets[t + 1] - self.offsets[t])
            if tuple(rows.shape) != (size, self.dim):
                got = tuple(rows.shape)
                raise ValueError(f"embeddings/{t}: expected {size} rows of width {self.dim}, got {got}")
            saved = checkpoint.table_state(dict(ckpt), t, state_keys, linear) if self.state_width else None
            if saved is not None and tuple(saved[0].shape) != (size, self.state_width):
                raise ValueError(
                    f"optimizer/embeddings/{t}: expected state [{size}, {self.state_width}], "
                    f"got {tuple(saved[0].shape)}"
                )
            return rows, saved

        tables = range(self.offsets.size - 1)
        for t in tables:  # all checked first, a table at a time (the copies of one at most resident): a
            table(t)  # bad checkpoint changes nothing
        self._invalidate_undo()
        self.built_batch = None
        for t in tables:
            rows_t, saved = table(t)
            mine = np.flatnonzero((local_keys >= self.offsets[t]) & (local_keys < self.offsets[t + 1]))
            index = torch.from_numpy(local_keys[mine] - self.offsets[t])
            if self.tier is not None:  # (a part at a time: the shard's rows may be many times the budget)
                for at in range(0, mine.size, LOAD_CHUNK_ROWS):
                    part, where = mine[at : at + LOAD_CHUNK_ROWS], index[at : at + LOAD_CHUNK_ROWS]
                    packed = self.packed(part, peek=True)
                    packed[:, : self.dim] = rows_t.index_select(0, where).numpy()
                    if saved is not None:
                        packed[:, self.dim :] = saved[0].index_select(0, where).numpy()
                    self._store(part, packed)
            else:
                self.weights[mine] = rows_t.index_select(0, index).numpy()
                if saved is not None:
                    self.state[mine] = saved[0].index_select(0, index).numpy()
            self._initial[mine] = False

    def local_index(self, keys: np.ndarray, field: str = "keys") -> np.ndarray:
        """Local rows of ``keys``; InvalidArgument if any key is out of range or not on this shard."""
        m = self.shard_map
        if keys.dtype == np.int64:
            index = np.empty(keys.size, dtype=np.int64)
            if _local_rows(keys, self._position, m.num_keys, m.num_buckets, m.rows_per_bucket, index) < 0:
                return index
        # (other key types, and the error: numpy's passes name the lowest or highest key out of range)
        if keys.size:
            low, high = int(keys.min()), int(keys.max())
            if low < 0 or high >= self.shard_map.num_keys:
                bad = low if low < 0 else high
                raise InvalidArgument(field, f"key {bad} out of range [0, {self.shard_map.num_keys})")
        position = self._position[keys % self.shard_map.num_buckets]
        foreign = np.flatnonzero(position < 0)
        if foreign.size:
            key = int(keys[foreign[0]])
            raise InvalidArgument(
                field,
                f"key {key} belongs to shard {int(self.shard_map.shard_of(keys[foreign[:1]])[0])}, "
                f"not {self.shard}",
            )
        return position * self.shard_map.rows_per_bucket + keys // self.shard_map.num_buckets

    def holds(self, keys: np.ndarray) -> np.ndarray:
        """Whether each of ``keys`` (in range) is on this shard."""
        return self._position[keys % self.shard_map.num_buckets] >= 0

    def keys_of(self, index: np.ndarray) -> np.ndarray:
        """Global keys of local rows ``index`` (-1 for padding past the last key)."""
        per = self.shard_map.rows_per_bucket
        keys = self._owned[index // per] + self.shard_map.num_buckets * (index % per)
        keys[keys >= self.shard_map.num_keys] = -1
        return keys.astype(np.int64, copy=False)

    # ---- rows, wherever they lie
    def packed(self, index: np.ndarray, peek: bool = False) -> np.ndarray:
        """The rows of local ``index``, each followed by its state, ``[n, dim + state_width]``, a copy. With a
        tier, rows never written are computed from their seed and the others read from where they lie
        (``peek``: without entering memory, for a snapshot, the undo log or a migration)."""
        if self.tier is None:
            return self.table[index]
        out = np.empty((index.size, self.dim + self.state_width), dtype=np.float32)
        initial = self._initial[index]
        if initial.any():
            out[initial] = 0.0
            out[initial, : self.dim] = init_rows(
                self.keys_of(index[initial]), self.offsets, self.dim, self.seed
            )
        if not initial.all():
            out[~initial] = (self.tier.peek if peek else self.tier.read)(index[~initial])
        return out

    def _store(self, index: np.ndarray, packed: np.ndarray) -> None:
        """Stores whole rows (``index`` distinct), in runs the tier's budget holds."""
        if self.tier is None:
            self.table[index] = packed
            return
        step = max(1, self.tier.capacity // 2)
        for start in range(0, index.size, step):
            self.tier.write(index[start : start + step], packed[start : start + step])

    def close(self) -> None:
        """Removes the tier's files (a shard replaced by one built anew, or by a migration's)."""
        if self.tier is not None:
            self.tier.close()

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the rows and state of ``keys`` (views of one gathered ``[n, dim + state]`` block)."""
        packed = self.gather(keys)
        return packed[:, : self.dim], packed[:, self.dim :]

    def gather(self, keys: np.ndarray) -> np.ndarray:
        """The rows of ``keys``, each followed by its state: ``[n, dim + state_width]``, a copy."""
        return np.asarray(self.rows(keys))

    def rows(self, keys: np.ndarray) -> Gather:
        """``gather``, not yet done: a reply gathers the rows straight into its bytes (``wire.Gather``).
        With a tier, gathered now: a later request may move rows out of memory before the reply is copied."""
        index = self.local_index(keys)
        if self.tier is not None:
            return Gather(self.packed(index), np.arange(index.size, dtype=np.int64))
        return Gather(self.table, index)

    def gather_changed(self, keys: np.ndarray) -> tuple[np.ndarray, Gather]:
        """``rows`` without those still at their initial value: the positions in ``keys`` of those
        (ascending), and the rows of the others, in order."""
        index = self.local_index(keys)
        initial = self._initial[index]
        positions = initial.nonzero()[0]
        if self.tier is not None:  # (gathered now, as in ``rows``)
            rows = self.tier.read(index[~initial])
            return positions, Gather(rows, np.arange(rows.shape[0], dtype=np.int64))
        return positions, Gather(self.table, index[~initial] if positions.size else index)

    def untouched(self) -> bool:
        """Whether every row still holds its initial value and zero state: nothing was stored into any row
        since the shard was filled (no write, restore, checkpoint or migration), and none is under way."""
        return self.migration is None and bool(self._initial.all())

    def write(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """Validates everything first, then stores: a bad request changes nothing.

        Compiled passes check the keys for repeats, then every value, then store the rows (``_store_rows``):
        the numpy checks (a sort for duplicates, a dozen passes over the values) took 3.5 times as long. A
        refused request is checked again by them, for the error that names the first bad key and value."""
        index = self.local_index(keys)
        for name, values, width in (("rows", rows, self.dim), ("state", state, self.state_width)):
            if values.shape != (index.size, width):
                shape = list(values.shape)
                raise InvalidArgument(name, f"shape {shape} for {index.size} keys of width {width}")
        if self.tier is not None:
            self._write_tiered(keys, index, rows, state)
            return
        # Before the store: a row's value at the segment's checkpoint is the one it holds now. If the write
        # is then refused, the logged value is the unchanged one, which a roll-back restores to itself (and a
        # repeated key, refused, logs the same value twice): harmless.
        self._log_undo(index)
        self._size_seen()
        state_low, max_abs = self._limits()
        bad = _store_rows(
            self.table,
            index,
            np.ascontiguousarray(rows, dtype=np.float32),
            np.ascontiguousarray(state, dtype=np.float32),
            max_abs,
            state_low,
            self._seen,
        )
        if bad >= 0:  # (the same checks in the order they always ran, for the same error)
            if np.unique(index).size != index.size:
                raise InvalidArgument("keys", "duplicate keys in one write-back")
            check_values(keys, rows, state, self.max_abs, self.non_negative)
            raise AssertionError(f"write-back refused at key {int(keys[bad])} by no check")
        self._changed[index] = True
        self._initial[index] = False
        self.built_batch = None
        if self.migration is not None:
            self.migration.dirty[index] = True

    def _size_seen(self) -> None:
        if self._seen.size * 8 < self.local_rows:
            self._seen = np.zeros((self.local_rows + 7) // 8, dtype=np.uint8)

    def _limits(self) -> tuple[np.ndarray, np.float32]:
        """What ``_store_rows`` checks the values against: each state column's lowest value, and |row|'s
        highest."""
        state_low = np.full(self.state_width, -_FLOAT32_MAX, dtype=np.float32)
        state_low[self.non_negative if self.non_negative is not None else slice(None)] = 0
        return state_low, np.float32(min(self.max_abs, _FLOAT32_MAX))  # (float32, as numpy compares)

    def _write_tiered(self, keys: np.ndarray, index: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """``write`` with a tier: the checks (the same kernels, storing into a request-sized block), then the
        undo log, then the rows into the tier. A refused write changes nothing, the log included."""
        self._size_seen()
        state_low, max_abs = self._limits()
        block = np.empty((index.size, self.dim + self.state_width), dtype=np.float32)
        bad = _first_repeat(index, self._seen)
        if bad < 0:
            bad = _check_and_store(
                block,
                np.arange(index.size, dtype=np.int64),
                np.ascontiguousarray(rows, dtype=np.float32),
                np.ascontiguousarray(state, dtype=np.float32),
                max_abs,
                state_low,
            )
        if bad >= 0:
            if np.unique(index).size != index.size:
                raise InvalidArgument("keys", "duplicate keys in one write-back")
            check_values(keys, rows, state, self.max_abs, self.non_negative)
            raise AssertionError(f"write-back refused at key {int(keys[bad])} by no check")
        self._log_undo(index)
        self._store(index, block)
        self._changed[index] = True
        self._initial[index] = False
        self.built_batch = None
        if self.migration is not None:
            self.migration.dirty[index] = True

    def _log_undo(self, index: np.ndarray) -> None:
        """Saves the value at the segment's checkpoint of each row of ``index`` new to it (before a store)."""
        if self._undo is None:
            return
        logged = self._undo_logged[index]
        if not logged.all():
            new = index[~logged]
            self._undo[-1].add(new, self.packed(new, peek=True), self._initial[new])
            self._undo_logged[new] = True

    def warm_up(self) -> None:
        """Compiles the write and key kernels (or loads them from numba's cache) for the arrays a server's
        requests bring (read-only views of their bytes), so that the first request does not wait."""
        rows = np.frombuffer(b"", dtype=np.float32).reshape(0, self.dim)
        state = np.frombuffer(b"", dtype=np.float32).reshape(0, self.state_width)
        self.write(np.zeros(0, dtype=np.int64), rows, state)
        self.local_index(np.frombuffer(b"", dtype=np.int64))  # (a lookup's keys: a read-only view too)

    def take_changes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global keys, rows and state of the rows written since the last call (copies), and forgets them:
        the next snapshot holds only what changes after this one."""
        index = np.flatnonzero(self._changed)
        self._changed[index] = False
        if self.tier is not None:
            packed = self.packed(index, peek=True)
            return self.keys_of(index), packed[:, : self.dim], packed[:, self.dim :]
        return self.keys_of(index), self.weights[index], self.state[index]

    def take_all(self) -> tuple[np.ndarray, Gathered | _Peeked, Gathered | _Peeked]:
        """Global keys of every row no longer initial, and their rows and state as views gathered only as
        they are read (a full snapshot writes them a chunk at a time, with no write in between: no copy of
        the shard); forgets the changes, as ``take_changes`` does."""
        index = np.flatnonzero(~self._initial)
        self._changed[:] = False
        if self.tier is not None:
            width = self.dim + self.state_width
            return (
                self.keys_of(index),
                _Peeked(self, index, slice(0, self.dim)),
                _Peeked(self, index, slice(self.dim, width)),
            )
        return self.keys_of(index), Gathered(self.weights, index), Gathered(self.state, index)

    def keep_all(self) -> None:
        """Marks every row no longer initial changed again (a full snapshot could not be written)."""
        self._changed |= ~self._initial

    def keep_changes(self, keys: np.ndarray) -> None:
        """Marks ``keys`` changed again (a snapshot of them could not be written)."""
        self._changed[self.local_index(keys)] = True

    def restore(self, deltas: Iterable[tuple[int, np.ndarray, np.ndarray, np.ndarray]]) -> int:
        """Applies checkpoint row files in order (``snapshots.row_deltas``), keeping the keys of this shard;
        returns the rows restored. The state they produce is the snapshot baseline (nothing is changed)."""
        self._invalidate_undo()  # (first: a delta refused part way leaves the earlier ones applied)
        self.built_batch = None
        restored = 0
        for _, keys, rows, state in deltas:
            if rows.shape[1:] != (self.dim,) or state.shape[1:] != (self.state_width,):
                raise ValueError(
                    f"checkpoint rows of width {rows.shape[1:]} and state {state.shape[1:]} do not fit this "
                    "server "
                    f"(dim {self.dim}, state width {self.state_width}): other --embedding-dim or --optimizer?"
                )
            if keys.size and (keys.min() < 0 or keys.max() >= self.shard_map.num_keys):
                raise ValueError(
                    f"checkpoint keys outside [0, {self.shard_map.num_keys}): other --table-rows?"
                )
            mine = np.flatnonzero(self._position[keys % self.shard_map.num_buckets] >= 0)
            index = self.local_index(keys[mine])
            if self.tier is not None:
                self._store(index, np.concatenate([rows[mine], state[mine]], axis=1))
            else:
                self.weights[index] = rows[mine]
                self.state[index] = state[mine]
            self._initial[index] = False
            restored += mine.size
        return restored

    # ---- undo log
    def track_undo(self, batch: int) -> None:
        """Starts an undo log (dropping any earlier one) whose baseline is checkpoint ``batch``: the shard
        holds that checkpoint's rows now (0 for a fresh shard, or the checkpoint it was restored from)."""
        self._undo = [_UndoSegment(batch)]
        self._undo_logged = np.zeros(self.local_rows, dtype=bool)

    def undo_checkpoint(self, batch: int) -> None:
        """This server takes its snapshot for checkpoint ``batch`` now: later writes log into a new segment
        whose baseline it is. Nothing without ``track_undo``; ValueError for a batch before the last one.

        Again for the same batch (a snapshot retried after a failure, perhaps with writes in between: the
        checkpoint holds the rows of the retry), the baseline moves to now: the rows logged since the first
        try held their values at the checkpoint before it, so they join its segment."""
        if self._undo is None:
            return
        current = self._undo[-1]
        if batch < current.baseline:
            raise ValueError(f"undo checkpoint {batch} after checkpoint {current.baseline}")
        if current.index:  # (only the rows logged: no pass over the shard per checkpoint)
            self._undo_logged[np.concatenate(current.index)] = False
        if batch == current.baseline:
            self._undo.pop()
            if self._undo and current.rows:
                older = self._undo[-1]
                have = np.zeros(self.local_rows, dtype=bool)
                for chunk in older.index:
                    have[chunk] = True
                index = np.concatenate(current.index)
                new = ~have[index]
                older.add(
                    index[new], np.concatenate(current.packed)[new], np.concatenate(current.initial)[new]
                )
        self._undo.append(_UndoSegment(batch))

    def forget_undo_before(self, batch: int) -> None:
        """Drops the segments of checkpoints before ``batch`` (complete: nobody rolls back further). The
        last segment stays whatever its baseline: the writes log into it."""
        if self._undo is not None:
            self._undo = [s for s in self._undo[:-1] if s.baseline >= batch] + self._undo[-1:]

    def can_undo_to(self, batch: int) -> bool:
        return self._undo is not None and any(s.baseline == batch for s in self._undo)

    @property
    def undo_rows(self) -> int:
        """Rows the undo log holds (a row is held once per segment it was written in)."""
        return sum(s.rows for s in self._undo) if self._undo is not None else 0

    def undo_to(self, batch: int) -> int:
        """Rolls back in place to checkpoint ``batch``: every row written since gets back its value and
        initial flag at it, and no row counts as changed (the shard equals the checkpoint, the next
        snapshot's baseline). Returns the rows restored; ValueError if ``can_undo_to(batch)`` is false or a
        migration is under way."""
        if self.migration is not None:
            raise ValueError(f"cannot undo to checkpoint {batch}: a migration is under way")
        if self._undo is None or not self.can_undo_to(batch):
            raise ValueError(f"cannot undo to checkpoint {batch}: the undo log does not reach it")
        self.built_batch = None
        undone = [s for s in self._undo if s.baseline >= batch and s.rows]
        # newest first, so that an older segment's value (the earlier state) overrides a newer one's; within
        # a segment a row repeats only with the same value (a refused write): any order of stores will do
        for s in reversed(undone):
            index = np.concatenate(s.index)
            if self.tier is not None:  # (a row repeats in a segment only with the same value: once)
                index, first = np.unique(index, return_index=True)
                initial = np.concatenate(s.initial)[first]
                self.tier.drop(index[initial])  # (initial again: stored nowhere)
                self._store(index[~initial], np.concatenate(s.packed)[first][~initial])
                self._initial[index] = initial
                continue
            self.table[index] = np.concatenate(s.packed)
            self._initial[index] = np.concatenate(s.initial)
        restored = np.unique(np.concatenate([c for s in undone for c in s.index])).size if undone else 0
        self._undo = [s for s in self._undo if s.baseline < batch] + [_UndoSegment(batch)]
        self._undo_logged[:] = False
        self._changed[:] = False
        return int(restored)

    def _invalidate_undo(self) -> None:
        """Rows rewritten wholesale: the log no longer holds their values at any checkpoint."""
        if self._undo is not None:
            logger.info("undo log dropped: the rows were rewritten wholesale")
        self._undo = None
        self._undo_logged = np.zeros(0, dtype=bool)

    # ---- re-sharding
    def adopt(self, shard_map: ShardMap) -> None:
        """Takes over ``shard_map`` (a later version) while this shard holds no buckets in either."""
        if shard_map.version <= self.shard_map.version:
            raise ValueError(
                f"shard map version {shard_map.version} is not later than this shard's "
                f"{self.shard_map.version}"
            )
        if self.rows_held or self.shard in shard_map.owners or shard_map.num_keys != self.shard_map.num_keys:
            raise ValueError(
                f"shard {self.shard} holds rows: it cannot skip to shard map version {shard_map.version}"
            )
        self.shard_map = shard_map
        self._position = shard_map.local_layout(self.shard)[0]
        self._owned = shard_map.buckets_of(self.shard)

    def begin_migration(self, new_map: ShardMap, attempt: int = 0) -> Migration:
        """Starts building this shard's arrays for ``new_map`` (the next version), as try ``attempt`` of the
        coordinator (the id every message of this try carries)."""
        if self.migration is not None:
            raise ValueError(f"a migration to version {self.migration.new_map.version} is under way")
        if (
            new_map.version <= self.shard_map.version
            or new_map.num_keys != self.shard_map.num_keys
            or new_map.num_buckets != self.shard_map.num_buckets
        ):
            raise ValueError(
                f"shard map version {new_map.version} ({new_map.num_keys} keys, "
                f"{new_map.num_buckets} buckets) "
                f"cannot follow version {self.shard_map.version} ({self.shard_map.num_keys} keys, "
                f"{self.shard_map.num_buckets} buckets)"
            )
        self.built_batch = None
        self.migration = Migration(self, new_map, attempt)
        return self.migration

    def abort_migration(self) -> None:
        if self.migration is not None:
            self.migration.close()
        self.migration = None

    def read_rows(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(Migration.) Global keys, rows and state of local rows ``index`` (copies); they are clean from now
        on: a later write marks them dirty again."""
        m = self.migration
        assert m is not None
        m.dirty[index] = False
        packed = self.packed(index, peek=True)
        return self.keys_of(index), packed[:, : self.dim], packed[:, self.dim :]

    def finish_migration(self) -> None:
        """Switches to the new arrays once sealed and every incoming shard's last rows are in."""
        m = self.migration
        assert m is not None and m.ready
        self.shard_map = m.new_map
        if m.changes_layout:
            self._position, self._owned = m.position, m.new_map.buckets_of(self.shard)
            self.table, self.weights, self.state, self._changed = m.table, m.weights, m.state, m.changed
            if self.tier is not None:
                self.tier.close()
                self.tier = m.tier
            self.local_rows = m.rows
            self._initial = m.initial
            self._invalidate_undo()  # (it indexes the old arrays)
            self.rows_held = int((m.new_map.local_keys(self.shard) >= 0).sum())
        self.migration = None


class Migration:
    """This shard's part in moving from ``store.shard_map`` to ``new_map`` (see the module docstring)."""

    def __init__(self, store: ShardStore, new_map: ShardMap, attempt: int = 0) -> None:
        old = store.shard_map
        self.store = store
        self.new_map = new_map
        self.attempt = attempt
        self.dirty = np.zeros(store.local_rows, dtype=bool)
        here = store.keys_of(np.arange(store.local_rows))  # (transient: the migration's own arrays
        valid = here >= 0  # are the shard's size again anyway)
        goes_to = new_map.shard_of(np.where(valid, here, 0))
        # local rows that stay here, and those that leave, per new owner
        self.staying = np.flatnonzero(valid & (goes_to == store.shard))
        self.leaving = {
            int(d): np.flatnonzero(valid & (goes_to == d))
            for d in np.unique(goes_to[valid])
            if d != store.shard
        }
        incoming = (new_map.bucket_to_shard == store.shard) & (old.bucket_to_shard != store.shard)
        self.sources = {int(s) for s in np.unique(old.bucket_to_shard[incoming])}
        self.incoming_buckets = np.flatnonzero(incoming)
        self.position, rows = new_map.local_layout(store.shard)
        if not self.changes_layout:  # the same buckets here: the arrays stay, only the version changes
            rows = 0
        self.rows = rows
        spec = store.tier_spec
        self.tier: RowTier | None = None  # (with a tier, the new layout's: the budget again, for a while)
        if spec is not None and rows:
            name = f"shard-{store.shard}-v{new_map.version}-{attempt:x}"
            self.tier = spec.tier(rows, store.dim + store.state_width, name)
        self.table, self.weights, self.state = packed_rows(0 if spec else rows, store.dim, store.state_width)
        self.changed = np.zeros(rows, dtype=bool)
        # (a staying row's copy brings its flag; with a tier, a row is initial until stored; a local row past
        # the last key of its bucket holds no key, and stays initial: no snapshot takes it)
        self.initial = np.full(rows, spec is not None, dtype=bool)
        if rows:
            self.initial[new_map.local_keys(store.shard) < 0] = True
        self.sealed = False
        self.finals: set[int] = set()  # sources whose last rows have arrived

    def _put(self, target: np.ndarray, rows: np.ndarray, state: np.ndarray, stored: np.ndarray) -> None:
        """Rows into the new layout; with a tier, only those ``stored`` (the others are initial: nowhere)."""
        if self.tier is None:
            self.weights[target] = rows
            self.state[target] = state
            return
        step = max(1, self.tier.capacity // 2)
        target, packed = target[stored], np.concatenate([rows[stored], state[stored]], axis=1)
        for start in range(0, target.size, step):
            self.tier.write(target[start : start + step], packed[start : start + step])

    def close(self) -> None:
        """A migration dropped: its tier's files go."""
        if self.tier is not None:
            self.tier.close()

    @property
    def changes_layout(self) -> bool:
        return bool(self.leaving or self.sources)

    @property
    def ready(self) -> bool:
        return self.sealed and self.finals >= self.sources

    def new_index(self, keys: np.ndarray, field: str = "keys") -> np.ndarray:
        position = self.position[keys % self.new_map.num_buckets]
        if (position < 0).any():
            raise InvalidArgument(
                field,
                f"key {int(keys[np.argmax(position < 0)])} is not on shard {self.store.shard} "
                f"in shard map version {self.new_map.version}",
            )
        return position * self.new_map.rows_per_bucket + keys // self.new_map.num_buckets

    def copy_staying(self, index: np.ndarray) -> None:
        """Copies local rows ``index`` (of rows that stay) into the new arrays."""
        initial = self.store._initial[index]
        keys, rows, state = self.store.read_rows(index)
        target = self.new_index(keys)
        self._put(target, rows, state, ~initial)
        self.initial[target] = initial

    def receive(
        self, source: int, keys: np.ndarray, rows: np.ndarray, state: np.ndarray, changed: np.ndarray | None
    ) -> None:
        """Rows of ``source`` arriving (``changed``: the last message, with the keys changed since the last
        checkpoint). Validates before storing: a bad message changes nothing."""
        if source not in self.sources:
            raise InvalidArgument(
                "from_shard",
                f"shard {source} sends no rows to shard {self.store.shard} in version {self.new_map.version}",
            )
        if source in self.finals:
            raise InvalidArgument("from_shard", f"shard {source} already sent its last rows")
        for name, k in (("keys", keys), ("changed_keys", changed if changed is not None else keys[:0])):
            if k.size and (k.min() < 0 or k.max() >= self.new_map.num_keys):
                raise InvalidArgument(name, f"keys outside [0, {self.new_map.num_keys})")
            wrong = self.store.shard_map.bucket_to_shard[k % self.new_map.num_buckets] != source
            if wrong.any():
                raise InvalidArgument(name, f"key {int(k[np.argmax(wrong)])} is not on shard {source}")
        target = self.new_index(keys)
        flags = self.new_index(changed, "changed_keys") if changed is not None else None
        check_values(keys, rows, state, self.store.max_abs, self.store.non_negative)
        self._put(target, rows, state, np.ones(target.size, dtype=bool))
        if self.tier is not None:
            self.initial[target] = False
        if flags is not None:
            self.changed[flags] = True
            self.finals.add(source)

    def seal(self) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """The switch (atomic: call it on the serving loop): the dirty rows that stay are copied again, with
        their changed flags; returns, per new owner, the dirty leaving rows (keys, rows, state) and the keys
        changed since the last checkpoint, to send as that owner's last message. From now on the old arrays
        take no writes."""
        store = self.store
        self.sealed = True
        dirty = self.staying[self.dirty[self.staying]]
        self.copy_staying(dirty)
        keys = store.keys_of(self.staying)
        self.changed[self.new_index(keys)] = store._changed[self.staying]
        out = {}
        for dst, rows in self.leaving.items():
            again = rows[self.dirty[rows]]
            k, w, st = store.read_rows(again)
            out[dst] = (k, w, st, store.keys_of(rows[store._changed[rows]]))
            store._changed[rows] = False
        return out


class _Peeked:
    """``snapshots.Gathered`` for a tiered shard: columns ``columns`` of the rows of local ``index``, read a
    slice at a time without entering memory (a full snapshot reads each slice once for the rows, once for
    the state)."""

    def __init__(self, store: ShardStore, index: np.ndarray, columns: slice) -> None:
        self.store = store
        self.index = index
        self.columns = columns
        self.shape = (index.size, columns.stop - columns.start)

    def __getitem__(self, part: slice) -> np.ndarray:
        return self.store.packed(self.index[part], peek=True)[:, self.columns]
