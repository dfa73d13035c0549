"""One plugin process, started with posix_spawn and watched from the event loop.

asyncio's subprocess layer (Popen, three pipe transports and protocols, stream
readers, a child watcher) cost ~0.7 ms of the agent's CPU per exec and some 60
loop iterations; this is a posix_spawn and a pidfd reader: one loop wake-up
when the plugin exits, then stdout and stderr are read to their end at once.
The pipes are watched only if the plugin has not exited within `_WATCH_AFTER`
(it may be blocked writing more than a pipe holds) or if, once it has, a pipe
is still open (a child of it holds the write end). `exec.ProcessExecutor` is
its only user.

The process is reaped only after its group was killed: while it is unreaped
(a zombie at worst) its pid, and so its process group id, cannot be reused,
so the kill can never reach a stranger.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping

# Python ignores these at start-up and an ignored signal stays ignored across
# exec; Popen's restore_signals put them back to default, so do we.
_DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)
_CHUNK = 65536
# A fast plugin (most, and every no-op one) exits before this and costs no pipe
# watching; a slower one or one with more output than a pipe holds (64 KiB) is
# watched from then on, so is delayed by at most this.
_WATCH_AFTER = 0.01


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class Child:
    """A spawned plugin: stdin fed, stdout kept up to a cap, stderr up to another."""

    def __init__(self, binary: str, env: Mapping[str, str], stdin: bytes,
                 max_stdout: int, max_stderr: int) -> None:
        """Spawn `binary` in its own session (so its own process group), in the
        agent's working directory (the daemon's is /). OSError if it cannot run."""
        self._loop = asyncio.get_running_loop()
        pipes: list[tuple[int, int]] = []
        try:
            for _ in range(3):
                pipes.append(os.pipe2(os.O_CLOEXEC))
            (in_r, in_w), (out_r, out_w), (err_r, err_w) = pipes
            ours, theirs = (in_w, out_r, err_r), (in_r, out_w, err_w)
            for fd in ours:
                os.set_blocking(fd, False)  # ours only: the plugin's ends stay blocking
            # Fed before the plugin exists: a config fits the pipe (64 KiB), so
            # usually no writer callback, and no wake-up of a plugin blocked in read().
            self._pending = memoryview(stdin)
            self._stdin_fd = in_w
            self._fill()
            self.pid = os.posix_spawn(
                binary, [binary], env, setsid=True, setsigdef=_DEFAULT_SIGNALS,
                file_actions=[(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(theirs)])
        except BaseException:
            for fd in (fd for pipe in pipes for fd in pipe):
                os.close(fd)
            raise
        for fd in theirs:
            os.close(fd)
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except BaseException:
            kill_group(self.pid)
            os.waitpid(self.pid, 0)
            for fd in ours:
                os.close(fd)
            raise
        self._out_fd, self._err_fd = out_r, err_r
        self._caps = {self._out_fd: max_stdout, self._err_fd: max_stderr}
        self._bufs = {self._out_fd: bytearray(), self._err_fd: bytearray()}
        self.too_big = False  # stdout went over its cap (reading stopped there)
        self._exited = False
        self._watched: set[int] = set()
        self._done: asyncio.Future[None] = self._loop.create_future()
        self._loop.add_reader(self._pidfd, self._on_exit)
        self._watch_timer: asyncio.TimerHandle | None = self._loop.call_later(
            _WATCH_AFTER, self._watch_pipes)
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
            return
        self._close_stdin()

    def _close_stdin(self) -> None:
        if self._stdin_fd >= 0:
            self._loop.remove_writer(self._stdin_fd)
            os.close(self._stdin_fd)
            self._stdin_fd = -1

    def _watch_pipes(self) -> None:
        self._watch_timer = None
        for fd in self._caps:  # the open ones
            self._watch(fd)

    def _watch(self, fd: int) -> None:
        self._loop.add_reader(fd, self._read, fd)  # idempotent: replaces the handle
        self._watched.add(fd)

    def _drain(self, fd: int) -> None:
        """Read `fd` to its end if it is there; else watch it. A few reads at
        most: a child left behind writing on and on must not hold the loop."""
        for _ in range(4):
            if fd not in self._caps:
                return
            if not self._read(fd):
                break
        if fd in self._caps:
            self._watch(fd)

    def _read(self, fd: int) -> bool:
        """One read; False if there was nothing to read yet."""
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._stop_reading(fd)
            return True
        buf, cap = self._bufs[fd], self._caps[fd]
        if len(buf) + len(data) <= cap:
            buf += data
            return True
        buf += data[: cap - len(buf)]  # stderr: the rest is noise, read and dropped
        if fd == self._out_fd:
            self.too_big = True  # an error: no need to read on, the group is killed
            self._stop_reading(fd)
        return True

    def _stop_reading(self, fd: int) -> None:
        if fd in self._caps:
            if fd in self._watched:
                self._loop.remove_reader(fd)
            os.close(fd)
            del self._caps[fd]  # its bytes stay in _bufs
            self._check_done()

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        self._exited = True
        if self._watch_timer is not None:
            self._watch_timer.cancel()
            self._watch_timer = None
        for fd in list(self._caps):
            self._drain(fd)
        self._check_done()

    def _check_done(self) -> None:
        finished = self.too_big or (self._exited and not self._caps)
        if finished and not self._done.done():
            self._done.set_result(None)

    # --- the caller's side ----------------------------------------------------------

    async def finished(self) -> None:
        """Until both pipes reached EOF and the process exited, or stdout went over its cap.

        A timeout cancels the future awaited here; `reap` makes a new one if it must wait.
        """
        await self._done

    def reap_now(self) -> int | None:
        """`reap` when there is nothing left to wait for (the usual case), else None:
        no task, no loop iteration."""
        if not self._exited or self._caps:
            return None
        kill_group(self.pid)
        self._close_stdin()
        return self._status()

    async def reap(self, grace: float = 5.0) -> int:
        """Kill the group, wait for the exit and reap; the exit status (-N: signal N).

        Pipes are drained (and dropped) for at most `grace` s: something outside
        the group may hold them open, and must not keep us waiting.
        """
        kill_group(self.pid)
        self._close_stdin()
        if not self._exited or self._caps:
            self.too_big = False  # from here on only the exit matters
            self._done = self._loop.create_future()
            self._check_done()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await asyncio.shield(self._done)
            for fd in list(self._caps):
                self._stop_reading(fd)
            if not self._exited:
                await asyncio.shield(self._done)  # SIGKILLed: it exits
        return self._status()

    def _status(self) -> int:
        try:
            _, status = os.waitpid(self.pid, os.WNOHANG)  # it has exited: its pidfd said so
        finally:
            os.close(self._pidfd)
        return os.waitstatus_to_exitcode(status)
