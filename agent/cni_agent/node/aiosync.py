"""fdatasync with no thread of ours: Linux AIO's IOCB_CMD_FDSYNC (4.18+).

The kernel runs the sync on its own workqueue and says it is done through an
eventfd the event loop watches: a journal commit then costs the agent one
io_submit and one wake-up, where a sync on a thread costs a thread round trip
(a futex wake, the GIL twice, the loop's self-pipe): measured, most of what a
commit cost. Where the kernel or the architecture lacks it, `create` answers
None and the caller keeps its thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import platform
import struct
import sys
from collections.abc import Callable

# (io_setup, io_destroy, io_getevents, io_submit), by architecture.
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB_CMD_FSYNC, _IOCB_CMD_FDSYNC = 2, 3
_IOCB_FLAG_RESFD = 1
# struct iocb (64 bytes, little-endian: aio_key before aio_rw_flags) and io_event (32).
_IOCB = struct.Struct("<QIIHhIQQqQII")
_EVENT = struct.Struct("<QQqq")
_MAX = 16  # iocbs at once: the journal syncs a few files per commit


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class KernelSync:
    def __init__(self, libc: ctypes.CDLL, numbers: tuple[int, int, int, int], ctx: int,
                 efd: int) -> None:
        self._libc = libc
        self._setup, self._destroy, self._getevents, self._submit = numbers
        self._ctx = ctx
        self._efd = efd
        # The batch in flight: its descriptors, its iocbs (alive until done),
        # what is left to complete, the first error, and whom to tell.
        self._fds: list[int] = []
        self._iocbs: list[ctypes.Array[ctypes.c_char]] = []
        self._left = 0
        self._error: OSError | None = None
        self._done: Callable[[BaseException | None], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def create(cls) -> KernelSync | None:
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None or sys.byteorder != "little":
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        ctx = ctypes.c_ulong(0)
        if libc.syscall(numbers[0], _MAX, ctypes.byref(ctx)) != 0:
            return None  # ENOSYS, EAGAIN (aio-max-nr reached): a thread does it
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return cls(libc, numbers, ctx.value, efd)

    def submit(self, paths: list[str], dir_fd: int,
               done: Callable[[BaseException | None], None]) -> bool:
        """Start syncing the data of `paths` (and `dir_fd`, when >= 0, fully);
        `done(error)` is called on the loop once all are. False when the kernel
        refused to start (then nothing is under way and `done` is not called)."""
        assert self._done is None, "one batch at a time"
        fds: list[int] = []
        try:
            for path in paths:
                try:
                    fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
                except FileNotFoundError:
                    continue  # compacted away meanwhile: its snapshot is durable
        except OSError:
            for fd in fds:
                os.close(fd)
            return False
        jobs = [(fd, _IOCB_CMD_FDSYNC) for fd in fds]
        if dir_fd >= 0:
            jobs.append((dir_fd, _IOCB_CMD_FSYNC))
        if not jobs:
            self._loop = asyncio.get_running_loop()
            self._loop.call_soon(done, None)
            return True
        iocbs = [ctypes.create_string_buffer(_IOCB.size) for _ in jobs]
        for i, (fd, cmd) in enumerate(jobs):
            _IOCB.pack_into(iocbs[i], 0, i, 0, 0, cmd, 0, fd, 0, 0, 0, 0,
                            _IOCB_FLAG_RESFD, self._efd)
        pointers = (ctypes.c_void_p * len(iocbs))(*(ctypes.addressof(b) for b in iocbs))
        submitted = self._libc.syscall(self._submit, ctypes.c_ulong(self._ctx), len(iocbs),
                                       pointers)
        if submitted != len(iocbs):
            err = ctypes.get_errno()
            if submitted > 0:  # some are under way: wait for them, then report
                self._start(fds, iocbs, submitted, done,
                            OSError(err or errno.EIO, os.strerror(err or errno.EIO)))
                return True
            for fd in fds:
                os.close(fd)
            return False
        self._start(fds, iocbs, submitted, done, None)
        return True

    def _start(self, fds: list[int], iocbs: list[ctypes.Array[ctypes.c_char]], count: int,
               done: Callable[[BaseException | None], None], error: OSError | None) -> None:
        self._fds, self._iocbs, self._left, self._error, self._done = fds, iocbs, count, error, done
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._efd, self._ready)

    def _ready(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)
        events = ctypes.create_string_buffer(_EVENT.size * _MAX)
        got = self._libc.syscall(self._getevents, ctypes.c_ulong(self._ctx), 0, _MAX, events,
                                 ctypes.byref(_Timespec(0, 0)))
        for i in range(max(0, got)):
            res = _EVENT.unpack_from(events, i * _EVENT.size)[2]
            if res < 0 and self._error is None:
                self._error = OSError(-res, os.strerror(-res))
        self._left -= max(0, got)
        if self._left > 0:
            return
        assert self._loop is not None and self._done is not None
        self._loop.remove_reader(self._efd)
        for fd in self._fds:
            os.close(fd)
        done, error = self._done, self._error
        self._fds, self._iocbs, self._done, self._error = [], [], None, None
        done(error)

    def close(self) -> None:
        """Wait for a batch in flight, then let the context go."""
        if self._done is not None and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._efd)
            while self._left > 0:  # at shutdown: the kernel finishes quickly
                events = ctypes.create_string_buffer(_EVENT.size * _MAX)
                got = self._libc.syscall(self._getevents, ctypes.c_ulong(self._ctx), 1, _MAX,
                                         events, None)
                if got < 0:
                    break
                self._left -= got
            for fd in self._fds:
                os.close(fd)
            self._fds, self._iocbs, self._done = [], [], None
        self._libc.syscall(self._destroy, ctypes.c_ulong(self._ctx))
        os.close(self._efd)
