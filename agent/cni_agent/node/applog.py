"""An append-only log with group commit: the file work under the sandbox journal.

One directory holds segment files `log-N` and snapshots `snapshot-N` (the
whole state through segment N). A record is one line, `<crc32, 8 hex> <payload>`:
appending it is one `pwrite` on the event loop (it survives a killed process
at once: the page cache has it); `commit` makes everything appended so far
survive a power loss too, with one `fdatasync` shared by every caller that
waits meanwhile (group commit), run by the kernel (`aiosync`: Linux AIO,
completed through an eventfd the loop watches) or, where it has none, on one
dedicated thread.

Recovery (`open`) reads the newest snapshot, then every later segment in
order, and keeps every line whose checksum holds. A line that does not hold
(torn by a power cut, zeroed by a filesystem that extended the file before
writing it) was never committed — a commit covers a line only once it and
everything before it are on disk — so dropping it loses nothing anyone was
promised; its bytes are kept in the damaged dir for a post-mortem. Appends
then go to a new segment: never after a damaged line.

Compaction writes the state as it is now into a snapshot off the loop, after
starting a new segment, then removes what the snapshot covers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import queue
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from cni_agent.node.aiosync import KernelSync

log = logging.getLogger(__name__)

_SEGMENT = re.compile(r"log-(\d{8})")
_SNAPSHOT = re.compile(r"snapshot-(\d{8})")
_END = b"~end "  # a snapshot's last line: "~end <records>"
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


def frame(payload: bytes) -> bytes:
    """One line of the log: checksum, space, payload (which holds no newline)."""
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def unframe(line: bytes) -> bytes | None:
    """The payload of a line (without its newline), None when the line is damaged."""
    if len(line) < 9 or line[8:9] != b" ":
        return None
    payload = line[9:]
    try:
        crc = int(line[:8], 16)
    except ValueError:
        return None
    return payload if zlib.crc32(payload) == crc else None


def lines_of(data: bytes) -> tuple[list[bytes], list[tuple[int, bytes]]]:
    """The payloads of the good lines of `data`, and (offset, bytes) of each
    damaged stretch (a run of bad lines, or a last line without its newline)."""
    good: list[bytes] = []
    bad: list[tuple[int, bytes]] = []
    pos = 0
    run_start = -1
    while pos < len(data):
        end = data.find(b"\n", pos)
        stop = len(data) if end < 0 else end + 1
        payload = unframe(data[pos:end]) if end >= 0 else None
        if payload is None:
            if run_start < 0:
                run_start = pos
        else:
            if run_start >= 0:
                bad.append((run_start, data[run_start:pos]))
                run_start = -1
            good.append(payload)
        pos = stop
    if run_start >= 0:
        bad.append((run_start, data[run_start:]))
    return good, bad


@dataclass
class Replay:
    """What `AppendLog.open` read."""

    payloads: list[bytes] = field(default_factory=list)  # in order: snapshot, then segments
    problems: list[str] = field(default_factory=list)  # damage found, for the log
    files: int = 0  # snapshot and segments read
    from_segments: int = 0  # lines read from segments (compaction is due when > 0)
    damaged: list[tuple[str, int, bytes]] = field(default_factory=list)  # file, offset, bytes
    last_segment: int = -1  # the newest segment (or snapshot) read
    sizes: list[int] = field(default_factory=lambda: [0, 0])  # snapshot's bytes, segments'


class _Committer:
    """One daemon thread running the log's blocking jobs in order, each
    answered on the loop that submitted it."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.AbstractEventLoop,
                                            Callable[[Any, BaseException | None], None]] | None]
        self._jobs = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._name = name

    def submit(self, job: Callable[[], Any],
               done: Callable[[Any, BaseException | None], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put((job, asyncio.get_running_loop(), done))

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, loop, done = item
            result: Any = None
            error: BaseException | None = None
            try:
                result = job()
            except BaseException as e:  # handed to the loop, raised there
                error = e
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(done, result, error)

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None


class AppendLog:
    """The log of one directory. No descriptor is held open for writing between
    appends (one open, pwrite, close each): a file open for writing would keep
    the state dir's filesystem from being remounted read-only, and an agent
    must not stand in an operator's way. Syncs open the files read-only."""

    def __init__(self, directory: str, damaged_dir: str, segment: int) -> None:
        self.dir = directory
        self.damaged_dir = damaged_dir
        self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._segment = segment  # the number of the next segment to open
        self._path = ""  # the current segment
        self._size = 0  # bytes in the current segment
        self.bytes_since_snapshot = 0  # in the segments the newest snapshot does not cover
        self.snapshot_bytes = 0
        self._seq = 0  # lines appended
        self._synced = 0  # lines known durable
        self._dirty_dir = False  # a file was created or renamed since the last sync
        # Earlier segments with lines not yet durable: (path, its last line's seq).
        self._retired: list[tuple[str, int]] = []
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._syncing = False
        self._compacting = False
        self._broken = False  # a failed append left bytes its truncate could not remove
        self._committer = _Committer("cni-agent-journal")
        # Made now, at start-up, not at the first commit: the descriptors an
        # agent holds are the same before and after its first calls.
        self._kernel: KernelSync | bool | None = KernelSync.create() or False
        self.syncs = 0  # commits' syncs started (group commit: fewer than commits)
        self._open_segment()

    # --- start-up (blocking) ------------------------------------------------------------

    @classmethod
    def open(cls, directory: str, damaged_dir: str) -> tuple[AppendLog, Replay]:
        """Read what the directory holds and start a new segment for appends;
        blocking (start-up, off the loop). Damaged stretches are kept in
        `damaged_dir`."""
        os.makedirs(directory, mode=0o700, exist_ok=True)
        replay = read(directory)
        for name, offset, damaged in replay.damaged:
            kept = _keep_damaged(damaged_dir, f"{name}@{offset}", damaged)
            replay.problems.append(f"{os.path.join(directory, name)}: {len(damaged)} damaged "
                                   f"byte(s) at offset {offset} dropped (never committed; kept "
                                   f"in {kept})")
        # A stale temporary snapshot of a compaction a crash interrupted.
        for name in os.listdir(directory):
            if name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
        opened = cls(directory, damaged_dir, replay.last_segment + 1)
        opened.snapshot_bytes, opened.bytes_since_snapshot = replay.sizes
        return opened, replay

    def write_snapshot_now(self, payloads: Iterable[bytes]) -> None:
        """The whole state, as `payloads`, made durable before this returns, and
        everything older removed; blocking (start-up only: an upgrade's import)."""
        through = self._segment - 1  # the current one: `_open_segment` counted past it
        self._retired.append((self._path, self._seq))
        self._open_segment()
        self._write_snapshot(through, payloads, self.bytes_since_snapshot)
        self._retired.clear()

    # --- appending (on the loop) -------------------------------------------------------

    def append(self, payload: bytes) -> None:
        """One line, written (not yet durable); OSError if the disk does not
        take it, and then nothing of it is in the log."""
        line = frame(payload)
        fd = os.open(self._path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            if self._broken:
                os.ftruncate(fd, self._size)  # OSError: still unusable
                self._broken = False
            done = 0
            try:
                while done < len(line):
                    done += os.pwrite(fd, line[done:], self._size + done)
            except OSError:
                if done:
                    try:
                        os.ftruncate(fd, self._size)
                    except OSError:
                        self._broken = True
                raise
        finally:
            os.close(fd)
        self._size += len(line)
        self.bytes_since_snapshot += len(line)
        self._seq += 1

    async def commit(self) -> None:
        """Until every line appended so far is durable (one fdatasync for all
        who wait meanwhile); OSError when the sync failed."""
        target = self._seq
        if self._synced >= target:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        if not self._syncing:
            self._start_sync()
        await fut

    def _batch(self) -> tuple[list[str], int, Callable[[BaseException | None], None]]:
        """What a sync of every line appended so far covers (the files, the
        directory's fd or -1), and what to call with its outcome."""
        target = self._seq
        retired = list(self._retired)
        paths = [path for path, _ in retired] + [self._path]
        dir_fd = self._dir_fd if self._dirty_dir else -1
        self._dirty_dir = False

        def done(error: BaseException | None) -> None:
            if error is None:
                self._synced = max(self._synced, target)
                self._retired = [item for item in self._retired if item not in retired]
                self._release(target, None)
            else:
                if dir_fd >= 0:
                    self._dirty_dir = True
                self._release(target, error)

        return paths, dir_fd, done

    def _start_sync(self) -> None:
        paths, dir_fd, synced = self._batch()
        self._syncing = True
        self.syncs += 1

        def done(error: BaseException | None) -> None:
            self._syncing = False
            synced(error)
            if self._waiters:
                self._start_sync()

        kernel = self._kernel_sync()
        if kernel is not None and kernel.submit(paths, dir_fd, done):
            return
        self._committer.submit(functools.partial(_sync_all, paths, dir_fd),
                               lambda _, error: done(error))

    def _kernel_sync(self) -> KernelSync | None:
        """The kernel's asynchronous fdatasync (`aiosync`), made on first use;
        None where there is none (then the journal's thread syncs)."""
        if self._kernel is None:
            self._kernel = KernelSync.create() or False
        return self._kernel if isinstance(self._kernel, KernelSync) else None

    def _release(self, target: int, error: BaseException | None) -> None:
        """End the commits waiting for lines up to `target`."""
        waiting, self._waiters = self._waiters, []
        for want, fut in waiting:
            if fut.done():
                continue
            if want <= target:
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error if isinstance(error, OSError)
                                      else OSError(str(error)))
            else:
                self._waiters.append((want, fut))

    # --- compaction --------------------------------------------------------------------

    @property
    def compacting(self) -> bool:
        return self._compacting

    def compact(self, payloads: Callable[[], Iterable[bytes]]) -> asyncio.Task[None] | None:
        """Start a snapshot of the state as it is now — `payloads`, called off
        the loop, must produce exactly the state of every line appended before
        this call — and the removal of what it covers; the task finishing it,
        None when one is under way. Appends go on meanwhile, into a new
        segment, started here: no line can fall between the two."""
        if self._compacting:
            return None
        through, covered = self._segment - 1, self.bytes_since_snapshot
        current = (self._path, self._size)
        self._retired.append((self._path, self._seq))
        try:
            self._open_segment()
        except OSError:
            self._retired.pop()
            self._path, self._size = current
            raise
        self._compacting = True

        async def finish() -> None:
            try:
                await asyncio.to_thread(self._write_snapshot, through, payloads(), covered)
            finally:
                self._compacting = False

        return asyncio.get_running_loop().create_task(finish(), name="cni-agent-compaction")

    def _open_segment(self) -> None:
        path = os.path.join(self.dir, f"log-{self._segment:08d}")
        os.close(os.open(path, _FLAGS, 0o600))
        self._path = path
        self._size = 0
        self._dirty_dir = True
        self._segment += 1

    def _write_snapshot(self, through: int, payloads: Iterable[bytes], covered: int) -> None:
        """Blocking: snapshot-`through`, durable, then the files it replaces gone
        (`covered`: the bytes of the segments it replaces)."""
        final = os.path.join(self.dir, f"snapshot-{through:08d}")
        tmp = final + ".tmp"
        count = 0
        size = 0
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            chunk: list[bytes] = []
            for payload in payloads:
                chunk.append(frame(payload))
                count += 1
                if len(chunk) >= 256:
                    size += _write_all(fd, b"".join(chunk))
                    chunk.clear()
            chunk.append(frame(_END + str(count).encode()))
            size += _write_all(fd, b"".join(chunk))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, final)
        os.fsync(self._dir_fd)
        self.bytes_since_snapshot = max(0, self.bytes_since_snapshot - covered)
        self.snapshot_bytes = size
        snapshots, segments = _listing(self.dir)
        for n in snapshots:
            if n < through:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.dir, f"snapshot-{n:08d}"))
        for n in segments:
            if n <= through:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.dir, f"log-{n:08d}"))

    # --- the end -------------------------------------------------------------------------

    def sync_now(self) -> None:
        """Blocking: everything appended made durable (at shutdown)."""
        for path, _ in self._retired:
            _sync_file(path)
        _sync_file(self._path)
        os.fsync(self._dir_fd)
        self._retired.clear()
        self._synced = self._seq

    def close(self) -> None:
        self._committer.stop()
        if isinstance(self._kernel, KernelSync):
            self._kernel.close()
            self._kernel = None
        if self._dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._dir_fd)
        self._dir_fd = -1


def _sync_all(paths: list[str], dir_fd: int) -> None:
    """What one commit syncs, on a thread: the segments, then the directory
    (-1: nothing of it changed)."""
    for path in paths:
        _sync_file(path)
    if dir_fd >= 0:
        os.fsync(dir_fd)


def _sync_file(path: str) -> None:
    """fdatasync of a segment through a read-only descriptor (what a compaction
    removed meanwhile has nothing left to sync)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def read(directory: str) -> Replay:
    """What a log directory holds, read and nothing written: the newest whole
    snapshot, then every later segment in order (a reader beside a running
    agent may see its last line half-written: that line is left out)."""
    replay = Replay()
    if not os.path.isdir(directory):
        return replay
    snapshots, segments = _listing(directory)
    base = -1
    chosen: tuple[int, list[bytes], list[tuple[int, bytes]]] | None = None
    for n in sorted(snapshots, reverse=True):
        path = os.path.join(directory, f"snapshot-{n:08d}")
        payloads, bad, whole = _read_snapshot(path)
        if whole:
            chosen = (n, payloads, bad)
            break
        replay.problems.append(f"{path} is incomplete (no trailer counting its records): an "
                               "older snapshot is read instead, if there is one")
        if chosen is None and not any(m <= n for m in segments):
            # What it covers is gone (a compaction removes it only once its
            # snapshot is durable): the best there is, unless an older one is whole.
            chosen = (n, payloads, bad)
    if chosen is not None:
        base, payloads, bad = chosen
        name = f"snapshot-{base:08d}"
        replay.payloads.extend(payloads)
        replay.files += 1
        replay.sizes[0] = os.path.getsize(os.path.join(directory, name))
        # A damaged line in a snapshot is outside damage (it was fsynced before
        # it was renamed into place): it costs that line only.
        replay.damaged.extend((name, offset, damaged) for offset, damaged in bad)
    replay.last_segment = base
    for n in sorted(segments):
        if n <= base:
            continue
        name = f"log-{n:08d}"
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        good, bad = lines_of(data)
        replay.sizes[1] += len(data)
        replay.payloads.extend(good)
        replay.from_segments += len(good)
        replay.files += 1
        replay.damaged.extend((name, offset, damaged) for offset, damaged in bad)
        replay.last_segment = n
    return replay


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return len(data)


def _listing(directory: str) -> tuple[list[int], list[int]]:
    snapshots, segments = [], []
    for name in os.listdir(directory):
        if m := _SNAPSHOT.fullmatch(name):
            snapshots.append(int(m.group(1)))
        elif m := _SEGMENT.fullmatch(name):
            segments.append(int(m.group(1)))
    return snapshots, segments


def _read_snapshot(path: str) -> tuple[list[bytes], list[tuple[int, bytes]], bool]:
    """A snapshot's payloads, its damaged stretches, and whether it is whole:
    its trailer there, counting every record it holds."""
    with open(path, "rb") as f:
        data = f.read()
    good, bad = lines_of(data)
    if not good or not good[-1].startswith(_END):
        return good, bad, False
    try:
        count = int(good[-1][len(_END):])
    except ValueError:
        return good[:-1], bad, False
    return good[:-1], bad, count == len(good) - 1 or bool(bad)


def _keep_damaged(damaged_dir: str, name: str, data: bytes) -> str:
    os.makedirs(damaged_dir, mode=0o700, exist_ok=True)
    path = os.path.join(damaged_dir, f"journal-{name}-{time.time_ns()}")
    with open(path, "wb") as f:
        f.write(data)
    return path
