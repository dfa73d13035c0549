"""One plugin process, started with posix_spawn and watched from the event loop.

asyncio's subprocess layer (Popen, three pipe transports and protocols, stream
readers, a child watcher) cost ~0.7 ms of the agent's CPU per exec and some 60
loop iterations; this is a posix_spawn and a pidfd (in one epoll per loop,
`_Exits`): one loop wake-up when the plugin exits, then what stdout and
stderr hold is read at once.
The pipes are watched only if the plugin has not exited within `_WATCH_AFTER`
(it may be blocked writing more than a pipe holds): a real plugin (bridge,
portmap: 10-100 ms) is not watched, which cost it two readers and a wake-up
per write. `exec.ProcessExecutor` is its only user.

A plugin is done when it exits: what it wrote is in the pipes by then, so
they are read (briefly, boundedly) and closed; a descendant still holding
them open is no reason to wait. Whatever it left running is killed as its
call ends (`leftovers`), and logged at WARNING.

The process is reaped only after its group was killed: while it is unreaped
(a zombie at worst) its pid, and so its process group id, cannot be reused,
so the kill can never reach a stranger. Its exit status is read at once
(waitid with WNOWAIT), the reaping itself comes `_REAP_AFTER` later: a
wait4 right after a plugin that entered a namespace exits spends 0.2-0.6 ms
of kernel CPU invalidating its /proc entries, a few milliseconds later 30 us
(measured on bridge ADDs; a quarter of the agent's CPU per CRI-O call).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import select
import signal
import threading
from collections.abc import Awaitable, Callable, Mapping

from cni_agent.cni.leftovers import Left, Leftovers

log = logging.getLogger(__name__)

# Python ignores these at start-up and an ignored signal stays ignored across
# exec; Popen's restore_signals put them back to default, so do we.
_DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)
_CHUNK = 65536
# A plugin that exits before this (nearly all do; a result is far smaller than
# the 64 KiB a pipe holds) costs no pipe watching; a slower one is watched from
# then on, so one printing more than a pipe holds is delayed by at most this.
# (The pipes are not enlarged: F_SETPIPE_SZ counts against root's
# pipe-user-pages-soft, node-wide, and past it the pipes of root processes
# without CAP_SYS_RESOURCE, root containers', shrink to 2 pages.)
_WATCH_AFTER = 0.25
# Reads of a pipe once the plugin has exited: what it wrote is there (a pipe
# holds 64 KiB; more was read while it ran); a leftover writing on and on
# must not hold the loop.
_DRAIN_READS = 16
# How long a plugin SIGKILLed at its deadline may take to exit before the
# caller is answered anyway (it is reaped when it does exit).
_EXIT_GRACE = 0.5
# How long an exited plugin stays a zombie before it is reaped (see above).
_REAP_AFTER = 0.02

# Python 3.13 closes every descriptor >= 3 in the child (close_range there);
# before it, every descriptor of ours >= 3 is made close-on-exec at each spawn.
_CLOSEFROM = getattr(os, "POSIX_SPAWN_CLOSEFROM", None)
_CLOSE_RANGE_CLOEXEC = 1 << 2
_DUP2 = os.POSIX_SPAWN_DUP2
_CLOSE_REST: tuple[tuple[int, int], ...] = () if _CLOSEFROM is None else ((_CLOSEFROM, 3),)


def kill_group(pid: int) -> None:
    try:  # not contextlib.suppress: an object and two calls more, on every run
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Cloexec:
    """Descriptors >= 3 close-on-exec, so a plugin inherits only stdin, stdout
    and stderr whatever the agent holds (a descriptor that came on a D-Bus
    message, say). Python makes its own non-inheritable; this is for the rest.
    One close_range(CLOSE_RANGE_CLOEXEC) (Linux 5.11): ~1 us; else a walk of
    /proc/self/fd."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._close_range = getattr(libc, "close_range", None)
        self._last = ctypes.c_uint(0xFFFFFFFF)  # made once: a c_uint per call costs more than the call

    def __call__(self) -> None:
        if self._close_range is not None:
            if self._close_range(3, self._last, _CLOSE_RANGE_CLOEXEC) == 0:
                return
            self._close_range = None  # an older kernel: EINVAL or ENOSYS, every time
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd > 2:
                with contextlib.suppress(OSError):
                    if os.get_inheritable(fd):
                        os.set_inheritable(fd, False)


_cloexec = _Cloexec() if _CLOSEFROM is None else None


class _Exits:
    """The pidfds of the plugins in flight on one event loop, in an epoll of
    their own that the loop watches as one reader: a plugin costs one
    epoll_ctl (EPOLLONESHOT: it reports once, and closing the pidfd drops
    it), not add_reader's and remove_reader's two and their layers of Python."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._epoll = select.epoll()
        self._waiting: dict[int, Callable[[], None]] = {}
        loop.add_reader(self._epoll.fileno(), self._ready)
        # Exited plugins whose status was read, to reap: (pid, pidfd, then).
        self._zombies: list[tuple[int, int, Callable[[int], None]]] = []

    def bury(self, pid: int, pidfd: int, then: Callable[[int], None]) -> None:
        """Reap `pid` (exited, its status read) `_REAP_AFTER` from now, all
        the zombies due by then in one timer; then close `pidfd`, `then(pid)`."""
        if not self._zombies:
            self.loop.call_later(_REAP_AFTER, self._bury)
        self._zombies.append((pid, pidfd, then))

    def _bury(self) -> None:
        zombies, self._zombies = self._zombies, []
        for pid, pidfd, then in zombies:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            finally:
                os.close(pidfd)
                then(pid)

    def watch(self, pidfd: int, on_exit: Callable[[], None]) -> None:
        self._epoll.register(pidfd, select.EPOLLIN | select.EPOLLONESHOT)
        self._waiting[pidfd] = on_exit

    def _ready(self) -> None:
        for pidfd, _ in self._epoll.poll(0):
            on_exit = self._waiting.pop(pidfd, None)
            if on_exit is None:
                continue
            try:  # as the loop does for a callback; the others must still run (they report once)
                on_exit()
            except Exception as e:
                self.loop.call_exception_handler({"message": "plugin exit callback failed",
                                                  "exception": e})


_this_thread = threading.local()  # its loop's _Exits: a loop runs in one thread


def _exits(loop: asyncio.AbstractEventLoop) -> _Exits:
    exits: _Exits | None = getattr(_this_thread, "exits", None)
    if exits is None or exits.loop is not loop:
        exits = _this_thread.exits = _Exits(loop)
    return exits


def _forked() -> None:
    _this_thread.__dict__.pop("exits", None)  # an epoll is shared across fork: the child's own


os.register_at_fork(after_in_child=_forked)


class Child:
    """A spawned plugin: stdin fed, stdout kept up to a cap, stderr up to another."""

    def __init__(self, binary: str, env: Mapping[bytes, bytes], stdin: bytes,
                 max_stdout: int, max_stderr: int, *, leftovers: Leftovers,
                 token: str, label: str = "", timeout: float | None = None) -> None:
        """Spawn `binary` in its own session (so its own process group), in the
        agent's working directory (the daemon's is /). OSError if it cannot run.
        `token`: the run's (in `env` too), for `leftovers`; `label` names it in logs.
        `timeout`: seconds from now after which `finished` returns with
        `timed_out` set (one timer for this and the pipe watch: the caller
        needs no asyncio.timeout of its own)."""
        self._loop = loop = asyncio.get_running_loop()
        self._leftovers, self._token, self._label = leftovers, token, label
        self.left: list[Left] = []  # what it left running (killed), once reaped
        self._stdin_fd = -1
        self._writing = False  # a writer callback is registered for stdin
        fds: list[int] = []
        try:
            for _ in range(3):
                fds += os.pipe2(os.O_CLOEXEC)
            in_r, in_w, out_r, out_w, err_r, err_w = fds
            os.set_blocking(out_r, False)  # ours only: the plugin's ends stay blocking
            os.set_blocking(err_r, False)
            # Fed before the plugin exists, so no wake-up of a plugin blocked in
            # read(). What fits an empty pipe of any size (a page at least, even
            # shrunk: see _WATCH_AFTER) is written whole on the blocking end;
            # more goes through a writer callback.
            if len(stdin) <= select.PIPE_BUF:
                if stdin:
                    os.write(in_w, stdin)  # atomic: all of it, at once
            else:
                os.set_blocking(in_w, False)
                self._pending = memoryview(stdin)
                self._stdin_fd = in_w
                self._fill()
            if _cloexec is not None:
                _cloexec()
            with leftovers.lock:  # registered before another thread's sweep can see it
                self.pid = os.posix_spawn(binary, [binary], env, setsid=True,
                                          setsigdef=_DEFAULT_SIGNALS,
                                          file_actions=((_DUP2, in_r, 0), (_DUP2, out_w, 1),
                                                        (_DUP2, err_w, 2), *_CLOSE_REST))
                leftovers.started(self.pid, token)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        os.close(in_r)
        os.close(out_w)
        os.close(err_w)
        if self._stdin_fd < 0:
            os.close(in_w)  # all written: the plugin reads its end to EOF
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except BaseException:
            kill_group(self.pid)
            os.waitpid(self.pid, 0)
            leftovers.ended(self.pid)
            for fd in (self._stdin_fd, out_r, err_r):
                if fd >= 0:
                    os.close(fd)
            raise
        self._out_fd, self._err_fd = out_r, err_r
        self._caps = {out_r: max_stdout, err_r: max_stderr}
        self._bufs = {out_r: bytearray(), err_r: bytearray()}
        self.too_big = False  # stdout went over its cap (reading stopped there)
        self.timed_out = False  # `timeout` ran out before it exited
        self._exited = False
        self._abandoned = False  # answered before it exited: `_on_exit` reaps it
        self._exit_waiter: asyncio.Future[None] | None = None
        self._watched: set[int] = set()
        self._done: asyncio.Future[None] = loop.create_future()
        self._exits = _exits(loop)  # its loop's, kept for the burial
        self._exits.watch(self._pidfd, self._on_exit)
        now = loop.time()
        watch_at = now + _WATCH_AFTER
        self._deadline = None if timeout is None else now + timeout
        self._timer: asyncio.TimerHandle | None = (
            loop.call_at(self._deadline, self._expire)
            if self._deadline is not None and self._deadline <= watch_at
            else loop.call_at(watch_at, self._watch_pipes))
        if self._stdin_fd >= 0:
            self._write()

    @property
    def stdout(self) -> bytes:
        return bytes(self._bufs[self._out_fd])

    @property
    def stderr(self) -> bytes:
        return bytes(self._bufs[self._err_fd])

    # --- callbacks on the loop ------------------------------------------------------

    def _fill(self) -> bool:
        """Write what the pipe takes; True when stdin is done with (all written, or EPIPE)."""
        try:
            while self._pending:
                self._pending = self._pending[os.write(self._stdin_fd, self._pending):]
        except BlockingIOError:
            return False
        except OSError:
            pass  # EPIPE: the plugin does not read its stdin (or has died)
        return True

    def _write(self) -> None:
        if self._stdin_fd < 0:
            return
        if not self._fill():
            self._loop.add_writer(self._stdin_fd, self._write)  # idempotent: replaces the handle
            self._writing = True
            return
        self._close_stdin()

    def _close_stdin(self) -> None:
        if self._stdin_fd >= 0:
            if self._writing:  # else nothing to remove (a lookup that fails, on every run)
                self._loop.remove_writer(self._stdin_fd)
                self._writing = False
            os.close(self._stdin_fd)
            self._stdin_fd = -1

    def _watch_pipes(self) -> None:
        self._timer = None
        for fd in self._caps:  # the open ones
            self._watch(fd)
        if self._deadline is not None:
            self._timer = self._loop.call_at(self._deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        self.timed_out = True
        self._check_done()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _watch(self, fd: int) -> None:
        self._loop.add_reader(fd, self._read, fd)  # idempotent: replaces the handle
        self._watched.add(fd)

    def _drain(self, fd: int) -> None:
        """Read what `fd` holds now (the plugin has exited), then stop reading it.
        A read returns all the pipe holds up to its size: a short one emptied it,
        so the read that would return EOF is spared."""
        for _ in range(_DRAIN_READS):
            if fd not in self._caps or self._read(fd) < _CHUNK:
                break
        self._stop_reading(fd)

    def _read(self, fd: int) -> int:
        """One read: how many bytes it returned (0 at EOF), -1 if there was
        nothing to read yet."""
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return -1
        except OSError:
            data = b""
        if not data:
            self._stop_reading(fd)
            return 0
        buf, cap = self._bufs[fd], self._caps[fd]
        if len(buf) + len(data) <= cap:
            buf += data
            return len(data)
        buf += data[: cap - len(buf)]  # stderr: the rest is noise, read and dropped
        if fd == self._out_fd:
            self.too_big = True  # an error: no need to read on, the group is killed
            self._stop_reading(fd)
        return len(data)

    def _stop_reading(self, fd: int) -> None:
        if fd in self._caps:
            if fd in self._watched:
                self._loop.remove_reader(fd)
            os.close(fd)
            del self._caps[fd]  # its bytes stay in _bufs
            self._check_done()

    def _on_exit(self) -> None:
        self._exited = True
        self._stop_timer()
        for fd in list(self._caps):
            self._drain(fd)
        self._check_done()
        if self._exit_waiter is not None and not self._exit_waiter.done():
            self._exit_waiter.set_result(None)
        if self._abandoned:
            self._reap()

    def _check_done(self) -> None:
        finished = self.too_big or self._exited or self.timed_out
        if finished and not self._done.done():
            self._done.set_result(None)

    # --- the caller's side ----------------------------------------------------------

    def finished(self) -> Awaitable[None]:
        """Until the process exited (what its pipes held is read), stdout went
        over its cap, or its `timeout` ran out.

        The future itself, no coroutine around it: a cancellation cancels it;
        `reap` waits on one of its own.
        """
        return self._done

    def reap_now(self) -> int | None:
        """`reap` when the plugin has exited (the usual case), else None: no task,
        no loop iteration."""
        if not self._exited:
            return None
        return self._reap()

    async def reap(self) -> int | None:
        """Kill the group, wait (briefly) for the exit and reap; the exit status
        (-N: signal N), None if it has not exited within `_EXIT_GRACE` of the
        SIGKILL (it is reaped when it does: the caller need not wait)."""
        self._kill()
        if not self._exited:
            self._exit_waiter = self._loop.create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_EXIT_GRACE):
                    await asyncio.shield(self._exit_waiter)
        if self._exited:
            return self._reap()
        self._abandoned = True
        log.warning("plugin %s did not exit within %gs of SIGKILL (pid %d); it is reaped "
                    "when it does", self._label, _EXIT_GRACE, self.pid)
        return None

    def _kill(self) -> None:
        """Kill the group; stop the timer, feeding stdin and reading the pipes."""
        kill_group(self.pid)
        self._stop_timer()
        self._close_stdin()
        for fd in list(self._caps):
            self._stop_reading(fd)

    def _reap(self) -> int:
        """Once exited: kill what it left, then its group, and reap it."""
        self.left = self._leftovers.sweep(self.pid, self._token)
        if self.left:
            log.warning("plugin %s left %d process(es) running, killed: %s", self._label,
                        len(self.left), ", ".join(map(str, self.left)))
        self._kill()
        try:  # it has exited (its pidfd said so): its status, leaving it a zombie
            info = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        except BaseException:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, os.WNOHANG)
            os.close(self._pidfd)
            self._leftovers.ended(self.pid)
            raise
        self._leftovers.ended(self.pid, reaped=False)
        self._exits.bury(self.pid, self._pidfd, self._leftovers.reaped)
        assert info is not None  # exited: WNOHANG finds it
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
