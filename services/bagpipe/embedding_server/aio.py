"""Many page reads in one system call: Linux's native asynchronous I/O (``io_submit``), for a row tier's
file opened with ``O_DIRECT``.

A random 4 KiB read from a virtual machine's disk costs about 25 µs of kernel CPU when each is its own
``preadv`` (measured here, one thread or sixteen alike): the request, the doorbell to the device and its
interrupt are paid per read. Handed to the kernel 64 at a time, the same reads cost about 4 µs each, as the
block layer takes them to the device together. On 2 cores shared with the trainers that difference is
the row tier's cost (about 500 rows a batch from disk at a tenth of the shard in memory).

The requests (``struct iocb``) and their completions (``struct io_event``) are numpy structured arrays,
filled and checked whole: no Python work per read. ``Reader`` returns None where the kernel or the
container refuses these calls (another OS, seccomp), and the caller reads with ``preadv`` instead.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform

import numpy as np

logger = logging.getLogger(__name__)

# (io_setup, io_destroy, io_getevents, io_submit) by architecture
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_PREAD = 0  # IOCB_CMD_PREAD
DEPTH = 256  # reads in flight at once

_IOCB = np.dtype(
    [
        ("data", "<u8"),
        ("key", "<u4"),
        ("rw_flags", "<i4"),
        ("opcode", "<u2"),
        ("reqprio", "<i2"),
        ("fildes", "<u4"),
        ("buf", "<u8"),
        ("nbytes", "<u8"),
        ("offset", "<i8"),
        ("reserved2", "<u8"),
        ("flags", "<u4"),
        ("resfd", "<u4"),
    ]
)
_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
assert _IOCB.itemsize == 64 and _EVENT.itemsize == 32


class Reader:
    """An I/O context of ``DEPTH`` reads for one file descriptor. Not thread-safe: one caller at a time."""

    @classmethod
    def open(cls, fd: int) -> Reader | None:
        """A reader for ``fd``, or None where native asynchronous I/O is not available here."""
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None or os.name != "posix" or platform.system() != "Linux":
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        context = ctypes.c_ulong(0)
        if libc.syscall(numbers[0], DEPTH, ctypes.byref(context)) != 0:
            logger.info("no native asynchronous I/O here (io_setup: %s)", os.strerror(ctypes.get_errno()))
            return None
        return cls(libc, numbers, context, fd)

    def __init__(
        self, libc: ctypes.CDLL, numbers: tuple[int, int, int, int], context: ctypes.c_ulong, fd: int
    ):
        self._libc, self._context, self._fd = libc, context, fd
        self._destroy, self._getevents, self._submit = numbers[1], numbers[2], numbers[3]
        self._iocbs = np.zeros(DEPTH, dtype=_IOCB)
        self._pointers = self._iocbs.ctypes.data + _IOCB.itemsize * np.arange(DEPTH, dtype=np.uint64)
        self._events = np.zeros(DEPTH, dtype=_EVENT)

    def read(
        self, address: int, buffer_offsets: np.ndarray, file_offsets: np.ndarray, sizes: np.ndarray
    ) -> None:
        """Reads ``sizes[i]`` bytes at ``file_offsets[i]`` of the file into memory at ``address +
        buffer_offsets[i]`` (all aligned as ``O_DIRECT`` needs); OSError if any read fails or comes short."""
        for start in range(0, sizes.size, DEPTH):
            count = min(DEPTH, sizes.size - start)
            part = slice(start, start + count)
            iocbs = self._iocbs[:count]
            iocbs.fill(0)
            iocbs["data"] = np.arange(count)
            iocbs["opcode"] = _PREAD
            iocbs["fildes"] = self._fd
            iocbs["buf"] = address + buffer_offsets[part].astype(np.uint64)
            iocbs["nbytes"] = sizes[part]
            iocbs["offset"] = file_offsets[part]
            self._run(count)
            results = self._events["res"][:count]
            order = self._events["data"][:count].astype(np.int64)
            wanted = sizes[part][order]
            if (results != wanted).any():
                bad = int(np.flatnonzero(results != wanted)[0])
                code = int(-results[bad]) if results[bad] < 0 else errno.EIO
                raise OSError(
                    code,
                    f"read of {int(wanted[bad])} bytes at {int(file_offsets[part][order[bad]])}: "
                    + (os.strerror(code) if results[bad] < 0 else f"got {int(results[bad])}"),
                )

    def _run(self, count: int) -> None:
        """Submits the first ``count`` requests and waits for all their completions (into ``_events``)."""
        submitted = 0
        while submitted < count:
            pointers = self._pointers[submitted:count]
            got = self._libc.syscall(
                self._submit,
                self._context,
                ctypes.c_long(count - submitted),
                ctypes.c_void_p(pointers.ctypes.data),
            )
            if got < 0:
                code = ctypes.get_errno()
                if code in (errno.EINTR, errno.EAGAIN):
                    continue
                self._wait(submitted)  # (the reads in flight still write into the caller's buffer)
                raise OSError(code, f"io_submit: {os.strerror(code)}")
            submitted += got
        self._wait(count)

    def _wait(self, count: int) -> None:
        """Waits for ``count`` completions."""
        done = 0
        while done < count:
            events = self._events[done:]
            got = self._libc.syscall(
                self._getevents,
                self._context,
                ctypes.c_long(count - done),
                ctypes.c_long(count - done),
                ctypes.c_void_p(events.ctypes.data),
                None,
            )
            if got < 0:
                code = ctypes.get_errno()
                if code == errno.EINTR:
                    continue
                raise OSError(code, f"io_getevents: {os.strerror(code)}")
            done += got

    def close(self) -> None:
        if self._context.value:
            self._libc.syscall(self._destroy, self._context)
            self._context = ctypes.c_ulong(0)
