"""File-system work on caller-supplied paths: off the event loop, bounded.

A path on a hung mount (NFS, FUSE) blocks the thread that resolves it, in the
kernel, for as long as the mount hangs; such a thread cannot be killed. So the
work runs on a few dedicated daemon threads (daemon: a stuck one must not keep
the agent from exiting), each wait is bounded by a timeout that names the
path, and once every thread is stuck new work is refused at once instead of
piling up: a hostile caller can tie up at most `threads` threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Generic, TypeVar

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.errors import InvalidArgument
from cni_agent.node.netns import (
    NetnsId,
    NetnsUnknown,
    Pinned,
    held_by_a_process,
    in_kernel,
    pin,
    pin_fd,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_P = TypeVar("_P", Pinned, "Pinned | None")

DEFAULT_THREADS = 4
DEFAULT_TIMEOUT = 5.0


class PathTimeout(InvalidArgument):
    """A caller's path did not answer in time (a hung mount, most likely)."""

    def __init__(self, field: str, path: str, seconds: float) -> None:
        shown = repr(path if len(path) <= 80 else path[:77] + "...")
        super().__init__(field, f"{shown} did not answer within {seconds:g}s "
                                "(is it on a hung mount?)")
        self.path = path


class PathsBusy(AgentError):
    """Every path thread is stuck in an earlier caller's hung path."""

    def __init__(self, stuck: int) -> None:
        super().__init__(ErrorKind.BUSY, f"{stuck} network namespace path(s) given earlier have "
                                         "not answered yet; refusing more path lookups until "
                                         "they do")


# Each means: whether the path names a namespace is not known now, so what
# it named must be taken as alive (never reaped) until it is known.
UNANSWERED = (PathTimeout, PathsBusy, NetnsUnknown)


class PathWorker:
    def __init__(self, threads: int = DEFAULT_THREADS, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.threads = threads
        self.timeout = timeout
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()  # the counters, shared with the threads
        self._started = 0
        # Threads waiting for work that no job has claimed yet. A job claims one
        # as it is queued (not when the thread wakes up to take it): a thread
        # counted idle until it woke made a second job arriving meanwhile queue
        # behind the first instead of starting a thread of its own.
        self._idle = 0
        self._backlog = 0  # jobs queued with no thread claimed for them
        self._stuck = 0  # jobs still running after their caller gave up on them
        self._stopped = False

    @property
    def stuck(self) -> int:
        with self._lock:
            return self._stuck

    def _submit(self, func: Callable[[], _T]) -> Future[_T]:
        fut: Future[_T] = Future()
        with self._lock:
            if self._stopped:
                raise AgentError(ErrorKind.SHUTTING_DOWN, "cni-agent is shutting down")
            if self._stuck >= self.threads:
                raise PathsBusy(self._stuck)
            if self._idle:
                self._idle -= 1
            elif self._started < self.threads:
                self._started += 1
                threading.Thread(target=self._serve, name=f"cni-agent-paths-{self._started}",
                                 daemon=True).start()
            else:
                self._backlog += 1  # the next thread to finish a job takes it
        self._jobs.put((fut, func))
        return fut

    def _serve(self) -> None:
        while True:
            item = self._jobs.get()  # claimed for us when it was queued
            if item is None:
                return
            fut, func = item
            if fut.set_running_or_notify_cancel():  # else its caller gave up before it started
                try:
                    fut.set_result(func())
                except BaseException as e:
                    fut.set_exception(e)
            with self._lock:
                if self._backlog:
                    self._backlog -= 1
                else:
                    self._idle += 1

    async def run(self, func: Callable[[], _T], field: str, path: str,
                  discard: Callable[[_T], None] | None = None) -> _T:
        """func() on a path thread, within the timeout; `discard` frees a result
        that arrives after the caller gave up (an open fd, say)."""
        cfut = self._submit(func)
        # Our own loop future, not wrap_future's: cancelling it (timeout, caller
        # gone) leaves the job to `_abandon`, with no shield or wait_for around
        # it (each a future and callbacks more, on every namespace lookup).
        loop = asyncio.get_running_loop()
        afut: asyncio.Future[_T] = loop.create_future()

        def done(f: Future[_T]) -> None:  # on the path thread, or here if cancelled
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(_copy_result, f, afut)

        cfut.add_done_callback(done)
        try:
            async with asyncio.timeout(self.timeout):
                return await afut
        except TimeoutError:
            self._abandon(cfut, afut, discard)
            log.warning("%s %r did not answer within %gs", field, path[:200], self.timeout)
            raise PathTimeout(field, path, self.timeout) from None
        except asyncio.CancelledError:
            self._abandon(cfut, afut, discard)
            raise

    def _abandon(self, cfut: Future[_T], afut: asyncio.Future[_T],
                 discard: Callable[[_T], None] | None) -> None:
        if cfut.cancel():
            return  # still queued: it never runs
        with self._lock:
            self._stuck += 1

        def finished(f: Future[_T]) -> None:
            with self._lock:
                self._stuck -= 1
            if discard is not None and not f.cancelled() and f.exception() is None:
                discard(f.result())

        cfut.add_done_callback(finished)

    def pinned(self, path: str, field: str = "netns") -> AbstractAsyncContextManager[Pinned]:
        """The netns at `path`, opened and verified once, closed when the block ends.

        InvalidArgument(field) when it is none (or the agent's own), PathTimeout
        when it does not answer, PathsBusy when the path threads are all stuck.
        """
        return _Held(self, lambda: pin(path, field), field, path,
                     lambda opath: pin(path, field, opath))

    @asynccontextmanager
    async def pinned_fd(self, fd: int, path: str,
                        vet: Callable[[tuple[int, ...] | None], None] | None = None
                        ) -> AsyncIterator[Pinned]:
        """A caller's own descriptor of its namespace, verified and pinned (a
        duplicate: the caller's stays the caller's), recorded as `path`;
        `vet` judges its user-namespace owners first (`netns.pin_fd`). On the
        loop: a descriptor cannot hang the way a path can (no thread hop)."""
        ns = pin_fd(fd, path, vet=vet)
        try:
            yield ns
        finally:
            ns.close()

    def names(self, path: str, ns: Pinned) -> Callable[[], None]:
        """A check, for a path thread (`run`), that root's `path` names the
        namespace of its descriptor (a path root gives is root's to open; a
        member's is a label, never opened): InvalidArgument(netns) when it
        does not, or cannot be opened, in the same words either way."""
        def check() -> None:
            try:
                named = _pin_or_none(path, "netns")
            except InvalidArgument:
                named = None
            try:
                same = named is not None and named.identity.same(ns.identity)
            finally:
                _close(named)
            if not same:
                raise InvalidArgument("netns", "does not name the namespace of netns_fd")

        return check

    def pinned_if_netns(self, path: str, field: str = "netns"
                        ) -> AbstractAsyncContextManager[Pinned | None]:
        """As `pinned`, but None where `pinned` refuses the path; a path that
        does not answer still raises (whether it is a namespace is unknown)."""
        return _Held(self, lambda: _pin_or_none(path, field), field, path,
                     lambda opath: _pin_or_none(path, field, opath))

    def stop(self) -> None:
        """Let idle threads exit; stuck ones are daemons and die with the process."""
        with self._lock:
            self._stopped, n = True, self._started
        for _ in range(n):
            self._jobs.put(None)


class _Held(Generic[_P]):
    """What `open_()` opens on a path thread; or, where resolving the path can
    only wait on the kernel (`netns.in_kernel`: where runtimes put
    namespaces), what `quick(opath)` opens right here, on the loop (no thread
    hop); closed when the block ends. A class, not @asynccontextmanager (an
    async generator, its wrapper and the loop's weak set entry for it, on
    every call that pins a namespace)."""

    __slots__ = ("_field", "_ns", "_open", "_path", "_quick", "_worker")

    def __init__(self, worker: PathWorker, open_: Callable[[], _P], field: str, path: str,
                 quick: Callable[[int], _P]) -> None:
        self._worker, self._field, self._path = worker, field, path
        self._open: Callable[[], _P] = open_
        self._quick: Callable[[int], _P] = quick
        self._ns: _P

    async def __aenter__(self) -> _P:
        opath = in_kernel(self._path)
        if opath != -1:  # a namespace file, or GONE: answered without a thread
            ns = self._quick(opath)
        else:
            ns = await self._worker.run(self._open, self._field, self._path, discard=_close)
        self._ns = ns
        return ns

    async def __aexit__(self, *exc: object) -> None:
        _close(self._ns)


class Given:
    """A namespace at hand (or None) as a block that neither pins nor closes
    it: a class, not @asynccontextmanager (an async generator, its wrapper and
    the loop's weak set entry for it)."""

    __slots__ = ("_ns",)

    def __init__(self, ns: Pinned | None = None) -> None:
        self._ns = ns

    async def __aenter__(self) -> Pinned | None:
        return self._ns

    async def __aexit__(self, *exc: object) -> None:
        return None


@asynccontextmanager
async def process_held(identity: NetnsId) -> AsyncIterator[Pinned | None]:
    """The namespace `identity` names, reached through a process inside it
    (`netns.held_by_a_process`), closed when the block ends; None when no
    process is in it. A worker thread of the loop's, not a path thread:
    /proc and nsfs answer from the kernel, so no caller can make this wait,
    nor take a path thread from root's own paths by it."""
    job = asyncio.get_running_loop().run_in_executor(None, held_by_a_process, identity)
    try:
        ns = await asyncio.shield(job)
    except asyncio.CancelledError:
        job.add_done_callback(_close_found)  # the walk ends on its own: close what it found
        raise
    try:
        yield ns
    finally:
        _close(ns)


def _close_found(job: asyncio.Future[Pinned | None]) -> None:
    if not job.cancelled() and job.exception() is None:
        _close(job.result())


def _copy_result(cfut: Future[_T], afut: asyncio.Future[_T]) -> None:
    """On the loop: the job's outcome to its caller, unless the caller gave up."""
    if afut.done() or cfut.cancelled():
        return
    if (e := cfut.exception()) is not None:
        afut.set_exception(e)
    else:
        afut.set_result(cfut.result())


def _pin_or_none(path: str, field: str, opath: int = -1) -> Pinned | None:
    """None only where the path names no network namespace (or the agent's own);
    any other failure (EACCES, EMFILE, ENOMEM) is NetnsUnknown, not "gone"."""
    try:
        return pin(path, field, opath)
    except NetnsUnknown:
        raise
    except InvalidArgument:
        return None


def _close(ns: Pinned | None) -> None:
    if ns is not None:
        ns.close()
