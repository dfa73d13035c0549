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
        self._ctx = ctypes.c_ulong(ctx)
        self._efd = efd
        # Made once: a batch's iocbs, the pointers io_submit reads, the events
        # io_getevents fills and its zero timeout (one batch at a time, of at
        # most _MAX iocbs: `submit` refuses a larger one).
        self._iocb_buf = ctypes.create_string_buffer(_IOCB.size * _MAX)
        base = ctypes.addressof(self._iocb_buf)
        self._pointers = (ctypes.c_void_p * _MAX)(*(base + i * _IOCB.size for i in range(_MAX)))
        self._events = ctypes.create_string_buffer(_EVENT.size * _MAX)
        self._zero = _Timespec(0, 0)
        self._no_wait = ctypes.byref(self._zero)
        # The batch in flight: its descriptors, what is left to complete, the
        # first error, and whom to tell.
        self._fds: list[int] = []
        self._left = 0
        self._error: OSError | None = None
        self._done: Callable[[BaseException | None], None] | None = None
        # The loop watching the eventfd: registered at the first batch and left
        # so (a registration per batch cost two epoll_ctl and a handle).
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
        refused to start, or for more than _MAX at once (then nothing is under
        way and `done` is not called)."""
        assert self._done is None, "one batch at a time"
        if len(paths) + (dir_fd >= 0) > _MAX:
            return False  # more than the context holds at once: the caller's thread syncs them
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
            asyncio.get_running_loop().call_soon(done, None)
            return True
        for i, (fd, cmd) in enumerate(jobs):
            _IOCB.pack_into(self._iocb_buf, i * _IOCB.size, i, 0, 0, cmd, 0, fd, 0, 0, 0, 0,
                            _IOCB_FLAG_RESFD, self._efd)
        submitted = self._libc.syscall(self._submit, self._ctx, len(jobs), self._pointers)
        if submitted != len(jobs):
            err = ctypes.get_errno()
            if submitted > 0:  # some are under way: wait for them, then report
                self._start(fds, submitted, done,
                            OSError(err or errno.EIO, os.strerror(err or errno.EIO)))
                return True
            for fd in fds:
                os.close(fd)
            return False
        self._start(fds, submitted, done, None)
        return True

    def _start(self, fds: list[int], count: int,
               done: Callable[[BaseException | None], None], error: OSError | None) -> None:
        self._fds, self._left, self._error, self._done = fds, count, error, done
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._unwatch()
            loop.add_reader(self._efd, self._ready)
            self._loop = loop

    def _unwatch(self) -> None:
        """The eventfd no longer watched (by a loop that may be closed by now)."""
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._efd)
            self._loop = None

    def _ready(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)
        if self._done is None:
            return  # a count left by the last batch's completions: drained
        events = self._events
        got = self._libc.syscall(self._getevents, self._ctx, 0, _MAX, events, self._no_wait)
        for i in range(max(0, got)):
            res = _EVENT.unpack_from(events, i * _EVENT.size)[2]
            if res < 0 and self._error is None:
                self._error = OSError(-res, os.strerror(-res))
        self._left -= max(0, got)
        if self._left > 0:
            return
        for fd in self._fds:
            os.close(fd)
        done, error = self._done, self._error
        self._fds, self._done, self._error = [], None, None
        done(error)

    def close(self) -> None:
        """Wait for a batch in flight, then let the context go."""
        self._unwatch()
        if self._done is not None:
            while self._left > 0:  # at shutdown: the kernel finishes quickly
                got = self._libc.syscall(self._getevents, self._ctx, 1, _MAX, self._events,
                                         None)
                if got < 0:
                    break
                self._left -= got
            for fd in self._fds:
                os.close(fd)
            self._fds, self._done = [], None
        self._libc.syscall(self._destroy, self._ctx)
        os.close(self._efd)
