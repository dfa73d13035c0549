"""Agents forked from a process that imported the agent once: the tests' `cni-agent run`.

`make test` is CPU-bound on 2 cores, and about 400 of its tests start an
agent. Each exec of `python -m cni_agent run` spent ~0.22 s of CPU starting
the interpreter and importing the same modules (dataclasses and enums built,
regular expressions compiled) before the agent did anything of its own: a
sixth of the suite's CPU. Here one process per test worker imports them
once and forks an agent per start, as a zygote does.

The child is the agent as `python -m cni_agent run` makes it in everything a
test can see: `cni_agent/__main__.py` run as `__main__` by runpy with the
test's argv, its environment (`os.environ`, so what it spawns gets it too),
its working directory, the test's stdin, stdout and stderr as 0, 1 and 2 and
no other descriptor, default signal dispositions as a new interpreter has
them, and the interpreter's own exit (threads joined, atexit run, stdio
flushed). What differs: `/proc/PID/cmdline` and `/proc/PID/environ` are the
server's, and its parent is the server, not the test: `ForkedPopen` is a
`subprocess.Popen` whose exit status the server reports through a pipe, so
`poll`, `wait`, `send_signal`, `kill`, `pid` and `returncode` behave as for
a child. What the interpreter does before `main` (its start-up, the imports)
is not exercised per agent here; the tests that exec the agent for real (a
`prefix` or `python_args`, `tests/daemon/test_service.py`, the packages under
systemd, the benchmarks) still do.

Protocol, on a SOCK_SEQPACKET socketpair: a request is JSON
`{"argv": [...], "env": {...}, "cwd": "..."}` with three descriptors (the
child's 0, 1, 2); the reply is JSON `{"pid": N}` or `{"error": "..."}` with
one descriptor on success: the read end of a pipe on which the server writes
the child's wait status (4 bytes, native order) once it exits.
"""

from __future__ import annotations

import array
import gc
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
from typing import Any

# What an agent imports before it is READY; imported once, here.
PRELOAD = ("cni_agent.main", "cni_agent.cli.runargs", "cni_agent.service.daemon")
_STATUS = struct.Struct("=i")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MAX_MESSAGE = 1 << 20


def _send(sock: socket.socket, doc: dict[str, Any], fds: list[int]) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([json.dumps(doc).encode()], anc)


def _receive(sock: socket.socket, nfds: int) -> tuple[dict[str, Any] | None, list[int]]:
    """A message and its descriptors; (None, []) at EOF."""
    fds = array.array("i")
    data, anc, _flags, _addr = sock.recvmsg(_MAX_MESSAGE, socket.CMSG_LEN(nfds * fds.itemsize),
                                            socket.MSG_CMSG_CLOEXEC)
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)


# --- the server ---------------------------------------------------------------------------


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork an agent per request until EOF (None); in a child, its request."""
    sel = select.epoll()
    sel.register(sock.fileno(), select.EPOLLIN)
    children: dict[int, tuple[int, int]] = {}  # pidfd → (pid, status pipe's write end)
    while True:
        for fd, _ in sel.poll():
            if fd in children:  # an agent exited
                pid, status_w = children.pop(fd)
                sel.unregister(fd)
                _, status = os.waitpid(pid, 0)
                try:
                    os.write(status_w, _STATUS.pack(status))
                except OSError:  # EPIPE: nobody waits for it any more
                    pass
                os.close(status_w)
                os.close(fd)
                continue
            request, fds = _receive(sock, 3)
            if request is None:
                return None
            status_r, status_w = os.pipe2(os.O_CLOEXEC)
            try:
                pid = os.fork()
            except OSError as e:
                for x in (*fds, status_r, status_w):
                    os.close(x)
                _send(sock, {"error": str(e)}, [])
                continue
            if pid == 0:
                # Closed through their objects, or their finalizers would close
                # whatever the agent opens later under the same numbers.
                sel.close()
                sock.close()
                _become_child(fds, request)
                return request
            for x in fds:
                os.close(x)
            pidfd = os.pidfd_open(pid)
            children[pidfd] = (pid, status_w)
            sel.register(pidfd, select.EPOLLIN)
            _send(sock, {"pid": pid}, [status_r])
            os.close(status_r)


def _become_child(fds: list[int], request: dict[str, Any]) -> None:
    """The forked agent's process as exec would have made it (see the module's doc)."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)  # inheritable, as exec leaves 0, 1 and 2
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # as `-m` puts it there


def _run_agent(request: dict[str, Any]) -> None:
    import runpy

    # As `python -m cni_agent ...`: argv[0] becomes the module's file.
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module("cni_agent", run_name="__main__", alter_sys=True)


def main() -> None:
    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        __import__(name)
    # Fewer pages copied on write: the collector need not walk what every agent shares.
    gc.collect()
    gc.freeze()
    request = _serve(sock)
    if request is None:
        return
    gc.unfreeze()
    _run_agent(request)  # its SystemExit ends this process as it ends an agent's


# --- the test's side ----------------------------------------------------------------------


class ForkServer:
    """One per test process, started at its first agent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.forkserver", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, cwd=_REPO)
        theirs.close()
        self._sock = ours
        return ours

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        """Stop the server (the agents it forked run on)."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def fork(self, argv: list[str], env: dict[str, str], cwd: str,
             stdio: tuple[int, int, int]) -> tuple[int, int]:
        """A forked agent: its pid, and the pipe its wait status comes on."""
        with self._lock:
            sock = self._sock or self._start()
            try:
                _send(sock, {"argv": argv, "env": env, "cwd": cwd}, list(stdio))
                reply, fds = _receive(sock, 1)
            except OSError:
                reply, fds = None, []
            if reply is None:  # the server is gone: the next start makes another
                self._drop()
        if reply is None or "pid" not in reply:
            for fd in fds:
                os.close(fd)
            raise OSError(f"the fork server could not start an agent: {reply}")
        return reply["pid"], fds[0]


class ForkedPopen(subprocess.Popen[str]):
    """`subprocess.Popen` of `python -m cni_agent ARGS...` (`args` = ARGS...),
    forked by `server`; only the stdin, stdout and stderr a file or inherited."""

    def __init__(self, server: ForkServer, args: list[str], **kw: Any) -> None:
        self._server = server
        self._status_fd = -1
        super().__init__(args, **kw)

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any,
                       pass_fds: Any, cwd: Any, env: Any, startupinfo: Any, creationflags: Any,
                       shell: Any, p2cread: int, p2cwrite: int, c2pread: int, c2pwrite: int,
                       errread: int, errwrite: int, *rest: Any) -> None:
        if (p2cwrite, c2pread, errread) != (-1, -1, -1) or hasattr(self, "_devnull"):
            raise ValueError("ForkedPopen: stdin, stdout and stderr are files or inherited")
        stdio = (p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
                 errwrite if errwrite != -1 else 2)
        self.pid, self._status_fd = self._server.fork(
            list(args), dict(os.environ if env is None else env), os.fspath(cwd or os.getcwd()),
            stdio)
        self._child_created = True

    def _status(self, timeout: float | None) -> bool:
        """Read the wait status once it is there within `timeout`; whether it was."""
        if self._status_fd < 0:
            return True
        ready, _, _ = select.select([self._status_fd], [], [], timeout)
        if not ready:
            return False
        data = os.read(self._status_fd, _STATUS.size)
        os.close(self._status_fd)
        self._status_fd = -1
        # EOF without a status: the server died; nothing will tell us more.
        self.returncode = os.waitstatus_to_exitcode(_STATUS.unpack(data)[0] if data else 255 << 8)
        return True

    def _internal_poll(self, _deadstate: Any = None, **_: Any) -> int | None:
        if self.returncode is None:
            self._status(0)
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self.returncode is None and not self._status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode


if __name__ == "__main__":
    main()
