"""What a plugin left running when its call ends: found, killed, reaped.

A plugin is done when it exits. A careless one leaves a daemon behind (fork,
setsid, fork), maybe holding its stdout; killing its process group misses
another session. The agent makes itself a child subreaper
(PR_SET_CHILD_SUBREAPER): whatever a plugin run leaves is re-parented to the
agent instead of init, so at the end of each run the agent's own children
that are not a plugin in flight are exactly the leftovers of plugin runs.

Why a subreaper and not a cgroup per plugin run: it needs nothing of the
host. A cgroup per run needs cgroup v2 with delegation (`Delegate=yes`, the
agent moved into a leaf of its own, a spawn into the cgroup without a race:
clone3, which posix_spawn cannot do); none of it exists on this suite's
cgroup-v1 machines or outside systemd, so it would be a second mechanism,
not the only one. The subreaper costs one prctl at start and one read of
`/proc/self/task/<tid>/children` per plugin run; the rest happens only when
something was left.

A leftover is attributed to a run before it is touched: its session or
process group is the plugin's (pid = sid = pgid: plugins start in a session
of their own), or its environment carries the run's token (`RUN_ENV`, which
every descendant inherits). A leftover of a run still in flight is left to
that run's end. One that carries none of these marks (`setsid env -i`, a Go
helper with its own environment) is still a plugin's in the daemon, which
starts no process but plugins (`adopt`): it is this run's unless a run in
flight started before it (then that run's end, or a later one, decides).
Elsewhere (a test harness's process, with subprocesses of its own) a child
without the marks is never touched.
Killed ones are reaped from the event loop (a pidfd each): nothing blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

RUN_ENV = "CNI_AGENT_RUN"  # a plugin run's token, in its environment and its descendants'
_PR_SET_CHILD_SUBREAPER = 36
_MAX_TREE = 4096  # processes walked below one leftover: a fork bomb must not hold the loop


# This process's pid, without a getpid() on every plugin run: the agent
# forks nothing but plugins (posix_spawn runs no Python in the child); a fork
# that does (a test's multiprocessing) sets it again.
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def make_subreaper() -> bool:
    """Make this process its descendants' reaper; False where the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("cannot become a child subreaper (%s): processes plugins leave in "
                    "another session are not found", os.strerror(ctypes.get_errno()))
        return False
    return True


@dataclass(frozen=True)
class Left:
    """A process a plugin run left running (killed by now)."""

    pid: int
    name: str  # its comm

    def __str__(self) -> str:
        return f"{self.pid} ({self.name})"


def _stat(pid: int) -> tuple[str, str, int, int, int] | None:
    """(comm, state, pgrp, session, start time in clock ticks since boot) of `pid`;
    None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    head, _, tail = data.rpartition(b") ")
    fields = tail.split()
    try:
        return (head.partition(b" (")[2].decode(errors="replace"), fields[0].decode(),
                int(fields[2]), int(fields[3]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def _token(pid: int) -> str:
    """The run token in `pid`'s environment; "" when it has none (or is a zombie)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return ""
    key = RUN_ENV.encode() + b"="
    for item in env.split(b"\0"):
        if item.startswith(key):
            return item[len(key):].decode(errors="replace")
    return ""


def _children_of(pid: int) -> list[int]:
    """The children of every thread of `pid` (a Go program forks from any thread)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return out


class Leftovers:
    """The agent's registry of plugin runs in flight, and the sweeper of what they leave."""

    def __init__(self) -> None:
        self._running: dict[int, str] = {}  # plugin pid -> its run token
        self._reaping: dict[int, int] = {}  # our leftover child -> its pidfd
        self._killed: set[int] = set()  # pids killed below a leftover: reaped when they come to us
        self._count = 0
        self._files: dict[int, int] = {}  # thread id -> its open children file
        self._adopting = False  # every child that is no plugin in flight is a plugin's
        self._zombies: set[int] = set()  # exited plugins whose run is over, not yet reaped
        # Held from a spawn to its `started`, and while a sweep lists strangers:
        # loops in other threads may share this registry, and one's sweep must
        # not see another's plugin before it is registered (it would kill it).
        self.lock = threading.Lock()

    def adopt(self) -> bool:
        """Make this process the reaper of what plugins leave, and take every child
        of it that is no plugin in flight for a plugin's leftover, marked or not:
        for a process that starts nothing but plugins (the daemon). False where
        the kernel refuses."""
        self._adopting = make_subreaper()
        return self._adopting

    def token(self) -> str:
        self._count += 1
        return f"{_pid}-{self._count}"

    def started(self, pid: int, token: str) -> None:
        self._running[pid] = token

    def ended(self, pid: int, reaped: bool = True) -> None:
        """Plugin `pid`'s run is over; not `reaped` yet: a zombie of ours, no
        leftover, until `reaped`."""
        if not reaped:  # before it leaves `_running`: never a stranger meanwhile
            self._zombies.add(pid)
        self._running.pop(pid, None)

    def reaped(self, pid: int) -> None:
        self._zombies.discard(pid)

    def _our_children(self) -> set[int]:
        """Children of the main thread (orphans are re-parented to it) and of this
        one (plugins are spawned from the loop's thread). The files stay open: a
        pread of one is ~1 us, an open of a /proc file 20 us."""
        found: set[int] = set()
        # The main thread's id is the pid: no gettid() when the loop runs there (the daemon's).
        here = _pid if threading.current_thread() is threading.main_thread() else \
            threading.get_native_id()
        for tid in {_pid, here}:
            fd = self._files.get(tid)
            if fd is None:
                try:
                    fd = self._files[tid] = os.open(f"/proc/self/task/{tid}/children",
                                                    os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue  # no CONFIG_PROC_CHILDREN: nothing is found
            data = os.pread(fd, 65536, 0)
            while len(data) % 65536 == 0 and data:  # a full read: there may be more
                more = os.pread(fd, 65536, len(data))
                if not more:
                    break
                data += more
            if data:
                found.update(map(int, data.split()))
        return found

    def _strangers(self) -> set[int]:
        """Our children that are neither a plugin in flight nor being reaped (nor
        an exited plugin about to be)."""
        with self.lock:
            return (self._our_children() - self._running.keys() - self._reaping.keys()
                    - self._zombies)

    def sweep(self, pid: int, token: str) -> list[Left]:
        """Kill what the run of plugin `pid` (token `token`) left, and what
        finished runs left; the list of those of this run. Call it once the
        plugin has exited (its children are ours then), before it is reaped."""
        strangers = self._strangers()  # not `pid`: it is in flight until it is reaped
        mine: list[Left] = []
        if self._killed:  # forget those their own dying parents reaped
            self._killed = {p for p in self._killed if os.path.exists(f"/proc/{p}")}
        if not strangers:
            return mine
        in_flight = set(self._running.values()) - {token}
        for child in strangers:
            stat = _stat(child)
            if stat is None:
                continue
            name, state, pgrp, session, start = stat
            if pid in (pgrp, session):
                owner = token
            elif child in self._killed:
                owner = ""  # killed under an earlier leftover: a zombie to reap
            else:
                owner = _token(child)
                if not owner and self._adopting:
                    owner = self._unmarked(start, pid, token)
                if not owner or owner in in_flight:
                    continue  # not a plugin's, or its run's own end will see to it
            if state != "Z":
                self._kill_tree(child)
            self._reap_later(child)
            if owner == token:
                mine.append(Left(child, name))
        return mine

    def _unmarked(self, start: int, pid: int, token: str) -> str:
        """Whose leftover a child without a run's marks is, started at `start`:
        "" while a run in flight started no later (it may be that run's: its end,
        or a later one, decides); else this run's (`token`), or an earlier
        finished run's ("-") if it is older than plugin `pid`."""
        for other in self._running.keys() - {pid}:
            st = _stat(other)
            if st is not None and st[4] <= start:
                return ""
        mine = _stat(pid)
        return token if mine is None or mine[4] <= start else "-"

    def _kill_tree(self, top: int) -> None:
        """SIGKILL `top` and everything below it; the dead come back to us (we
        reap) as their parents die."""
        pids, frontier = [top], [top]
        while frontier and len(pids) < _MAX_TREE:
            frontier = [c for p in frontier for c in _children_of(p)]
            pids += frontier
        for p in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        self._killed.update(pids[1:])

    def _reap_later(self, child: int) -> None:
        try:
            pidfd = os.pidfd_open(child)
        except OSError:
            return  # reaped meanwhile
        self._reaping[child] = pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._reap, child)

    def _reap(self, child: int) -> None:
        pidfd = self._reaping.pop(child)
        loop = asyncio.get_running_loop()
        loop.remove_reader(pidfd)
        os.close(pidfd)
        self._killed.discard(child)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, os.WNOHANG)
        # Its own children (killed with it) are ours now: reap them in turn.
        if self._killed:
            loop.call_soon(self._collect)

    def _collect(self) -> None:
        for child in self._strangers() & self._killed:
            self._reap_later(child)
