"""Per-sandbox locks, and per-network exclusion for the GC verb.

Every operation on a sandbox (Setup, Teardown, Check, reaping) holds
`SandboxLocks.hold(id)`; each ADD/DEL chain also holds `NetworkLocks.use()`
of its network, which the GC verb of that network takes alone. Every wait
only awaits on the event loop (the file lock is polled with LOCK_NB rather
than blocking a thread), so the loop stays responsive, deadlines are exact and
cancellation takes effect at once.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

_MAX_ID_BYTES = 200
_POLL_MIN = 0.005  # first retry is quick: most contention is a short ADD/DEL
_POLL_MAX = 0.05  # ...but a long wait should not spin
_OPEN_FLAGS = os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW


class LockTimeout(Exception):
    """A lock was not acquired within its timeout; callers report CNI "Busy"."""

    def __init__(self, key: str, timeout: float, what: str | None = None) -> None:
        self.key = key
        self.timeout = timeout
        super().__init__(f"{what or key} is busy: lock not acquired within {timeout:g}s")


def _lock_name(sandbox_id: str) -> str:
    # Callers validate ids already, but a root process creating and unlinking
    # files defends anyway: the name must be one plain path component.
    if sandbox_id in ("", ".", "..") or "/" in sandbox_id or "\0" in sandbox_id:
        raise ValueError(f"invalid sandbox id for a lock file: {sandbox_id!r}")
    if len(os.fsencode(sandbox_id)) > _MAX_ID_BYTES:
        raise ValueError(f"sandbox id longer than {_MAX_ID_BYTES} bytes: {sandbox_id[:32]!r}...")
    return sandbox_id + ".lock"


def _same_file(fd: int, path: str) -> bool:
    """Whether `fd` still is the file at `path` (its holder may have unlinked it)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _unlock(path: str, fd: int) -> None:
    # Unlink *before* releasing: anyone who opened this inode and gets the lock
    # after us then sees it is no longer at `path` and retries on a fresh file.
    # So two holders can never lock different inodes "at" one path, and lock
    # files exist only while held or contended.
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


class StateDirBusy(Exception):
    """Another agent holds the state dir; `pid` is what it wrote there (0: unknown)."""

    def __init__(self, path: str, pid: int) -> None:
        who = f"pid {pid}" if pid else "a process whose pid is not recorded"
        super().__init__(f"{os.path.dirname(path)} is in use by another cni-agent ({who}); "
                         "two agents on one state_dir would undo each other's work")
        self.pid = pid


def lock_state_dir(state_dir: str) -> int:
    """Hold `<state_dir>/agent.lock` for the life of the process; returns its fd.

    The second agent on a state dir must refuse to start: it would kill the
    first one's plugins and roll back its in-flight sandboxes as "interrupted".
    """
    path = os.path.join(state_dir, "agent.lock")
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            pid = int(os.pread(fd, 32, 0).decode().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        os.close(fd)
        raise StateDirBusy(path, pid) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class SandboxLocks:
    """One lock per sandbox id: FIFO within this process, flock across processes.

    Within the process, waiters for an id queue in arrival order and only the
    head tries the file lock, so a late ADD can never overtake an earlier DEL.
    Not reentrant: holding an id and asking for it again times out.
    """

    def __init__(self, lock_dir: str,
                 observe: Callable[[float, bool], None] | None = None) -> None:
        self._dir = os.path.abspath(lock_dir)
        # Told (seconds waited, timed out) once per acquisition attempt (metrics).
        self._observe = observe or (lambda waited, busy: None)
        # Per id, the waiters in arrival order; the head holds or is acquiring.
        # An id's entry is dropped when its last waiter leaves.
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}
        self._held: set[str] = set()

    def held(self) -> list[str]:
        """Ids currently held by this process (diagnostics and tests)."""
        return sorted(self._held)

    def busy(self, sandbox_id: str) -> bool:
        """Whether someone in this process holds or waits for the id's lock."""
        return sandbox_id in self._queues

    def hold(self, sandbox_id: str, timeout: float,
             deadline: float | None = None) -> AbstractAsyncContextManager[None]:
        """Hold the lock of `sandbox_id`; LockTimeout if not acquired within `timeout`
        (or by `deadline`, in loop time, when the caller's budget started earlier)."""
        path = os.path.join(self._dir, _lock_name(sandbox_id))
        if os.path.dirname(path) != self._dir:  # cannot happen; never trust it blindly
            raise ValueError(f"lock file for {sandbox_id!r} would escape {self._dir}")
        return _Hold(self, sandbox_id, path, timeout, deadline)

    def sweep(self) -> list[str]:
        """Remove lock files nobody holds (left by a killed agent); returns their ids.

        A file is removed only while we hold its lock, with the same
        unlink-then-release protocol as a normal release, so a concurrent holder
        (another process) is never disturbed.
        """
        try:
            names = os.listdir(self._dir)
        except FileNotFoundError:
            return []
        removed = []
        for name in names:
            if not name.endswith(".lock"):
                continue
            sandbox_id = name[: -len(".lock")]
            if sandbox_id in self._queues:
                continue  # in use by this process
            path = os.path.join(self._dir, name)
            fd = self._try_flock(path)
            if fd >= 0:
                _unlock(path, fd)
                removed.append(sandbox_id)
        return removed

    def _try_flock(self, path: str) -> int:
        """One non-blocking attempt: the fd holding the lock, or -1 if held elsewhere.

        Plain syscalls on a local runtime dir: cheap enough for the event loop.
        """
        for _ in range(8):  # a stale inode means its holder just left: retry now
            try:
                fd = os.open(path, _OPEN_FLAGS, 0o600)
            except FileNotFoundError:
                os.makedirs(self._dir, mode=0o700, exist_ok=True)  # lazily, first use
                continue
            locked = False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = _same_file(fd, path)
            except BlockingIOError:
                return -1
            finally:
                if not locked:
                    os.close(fd)
            if locked:
                return fd
        return -1


class _Hold:
    """`SandboxLocks.hold`'s block: a class, not @asynccontextmanager (an
    async generator, its wrapper and the loop's weak set entry for it, on
    every call)."""

    __slots__ = ("_deadline", "_fd", "_id", "_limit", "_locks", "_me", "_path", "_queue")

    def __init__(self, locks: SandboxLocks, sandbox_id: str, path: str, limit: float,
                 deadline: float | None) -> None:
        self._locks, self._id, self._path = locks, sandbox_id, path
        self._limit, self._deadline = limit, deadline
        self._fd = -1

    async def __aenter__(self) -> None:
        locks, sandbox_id, limit = self._locks, self._id, self._limit
        loop = asyncio.get_running_loop()
        deadline = self._deadline
        if deadline is None:
            deadline = loop.time() + limit  # one budget for queueing and the file lock
        self._queue = queue = locks._queues.setdefault(sandbox_id, deque())
        arrived = loop.time()
        self._me = me = loop.create_future()
        queue.append(me)
        try:
            if queue[0] is not me:
                try:
                    async with asyncio.timeout_at(deadline):
                        await me  # resolved by the previous head as it leaves
                except TimeoutError:
                    locks._observe(loop.time() - arrived, True)
                    raise LockTimeout(sandbox_id, limit, f"sandbox {sandbox_id}") from None
            delay = _POLL_MIN
            while (fd := locks._try_flock(self._path)) < 0:  # held by another process
                remaining = deadline - loop.time()
                if remaining <= 0:
                    locks._observe(loop.time() - arrived, True)
                    raise LockTimeout(sandbox_id, limit, f"sandbox {sandbox_id}")
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, _POLL_MAX)
            self._fd = fd
            locks._held.add(sandbox_id)
            locks._observe(loop.time() - arrived, False)
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._leave()

    def _leave(self) -> None:
        # However we leave (done, timeout, cancellation), leave no trace and,
        # if we were the head, hand over to the next waiter in line.
        locks, sandbox_id, queue, me = self._locks, self._id, self._queue, self._me
        if self._fd >= 0:
            locks._held.discard(sandbox_id)
            _unlock(self._path, self._fd)
            self._fd = -1
        was_head = queue[0] is me
        queue.remove(me)
        if not queue:
            del locks._queues[sandbox_id]
        elif was_head and not queue[0].done():
            # A done (cancelled) next head hands over itself in its finally.
            queue[0].set_result(None)


class NetworkLocks:
    """Per network: ADD/DEL chains share it, the GC verb needs it alone.

    The GC verb must not run while an ADD or DEL of its network is in flight
    (the spec; an in-flight ADD is in no valid-attachments list). A waiting GC
    never makes anyone wait: it takes a network only at an instant when no
    chain runs on it, and gives up after its timeout (the caller retries
    later). Chains wait only while a GC verb actually runs, which is bounded
    by the plugins' GC timeout.
    """

    def __init__(self) -> None:
        self._users: dict[str, int] = {}
        self._gc: dict[str, asyncio.Event] = {}  # set when that network's GC verb ends
        self._idle: dict[str, asyncio.Event] = {}  # set when the last chain of a network ends

    def busy(self, network: str) -> bool:
        return self._users.get(network, 0) > 0 or network in self._gc

    def use(self, network: str, timeout: float) -> AbstractAsyncContextManager[None]:
        """Hold `network` for one ADD/DEL chain."""
        return _Use(self, network, timeout)

    @asynccontextmanager
    async def exclusive(self, network: str, timeout: float) -> AsyncIterator[None]:
        """Hold `network` alone (the GC verb); LockTimeout if no idle instant came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.busy(network):
            waiting = self._gc.get(network) or self._idle.setdefault(network, asyncio.Event())
            try:
                async with asyncio.timeout_at(deadline):
                    await waiting.wait()
            except TimeoutError:
                raise LockTimeout(network, timeout, f"network {network}") from None
        done = self._gc[network] = asyncio.Event()
        try:
            yield
        finally:
            del self._gc[network]
            done.set()


class _Use:
    """`NetworkLocks.use`'s block: a class, not @asynccontextmanager (an async
    generator, its wrapper and the loop's weak set entry for it, per chain)."""

    __slots__ = ("_locks", "_network", "_timeout")

    def __init__(self, locks: NetworkLocks, network: str, timeout: float) -> None:
        self._locks, self._network, self._timeout = locks, network, timeout

    async def __aenter__(self) -> None:
        locks, network, timeout = self._locks, self._network, self._timeout
        deadline = asyncio.get_running_loop().time() + timeout
        while (done := locks._gc.get(network)) is not None:
            try:
                async with asyncio.timeout_at(deadline):
                    await done.wait()
            except TimeoutError:
                raise LockTimeout(network, timeout, f"network {network} (its GC is running)") from None
        locks._users[network] = locks._users.get(network, 0) + 1

    async def __aexit__(self, *exc: object) -> None:
        locks, network = self._locks, self._network
        locks._users[network] -= 1
        if not locks._users[network]:
            del locks._users[network]
            idle = locks._idle.pop(network, None)
            if idle is not None:
                idle.set()
