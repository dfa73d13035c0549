"""The DELs cni-agent-shim queued while no agent ran: `state_dir/queue/`.

The shim (shim/cni-agent-shim.c, "the queue") writes one file per DEL that
reached no agent: a temporary file, fsync, rename to `<ns>-<pid>.del`, fsync
of the directory, all under a shared flock of `queue/.lock`. The agent holds
that lock exclusively from before it lists the queue until it exits, so a
shim never queues while an agent runs, and every file the agent finds is
older than the agent itself. A file's owner is who asked.

The agent binds each file to the generation of its sandbox's record before
it runs it, by renaming it to `<name>.g<generation>` (the inode, so the owner,
is kept); the binding is what makes a file found again after a crash (or
brought back by a power loss) never the DEL of a later set-up of its id. A
file that cannot be used is renamed `<name>.bad` and left for a person.

Only files and locks here: what a DEL means is `service.queued`'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from cni_agent.cni.cache import fsync_dir

QUEUE_DIR = "queue"
LOCK = ".lock"
SUFFIX = ".del"
BAD = ".bad"
# A file larger than this is no shim's (its config is at most 1 MiB, escaped).
MAX_FILE = 8 * 1024 * 1024
_BOUND = re.compile(r"^(?P<name>[0-9]+-[0-9]+\.del)\.g(?P<generation>[0-9]+)$")


class QueueBusy(Exception):
    """Another process holds the queue's lock longer than the agent waits."""


@dataclass(frozen=True)
class Queued:
    """One queued DEL."""

    path: str
    name: str  # as the shim named it (arrival order)
    uid: int  # the file's owner: who asked
    generation: int | None  # the generation it is bound to; None: not yet
    env: dict[str, str] = field(default_factory=dict)
    config: str = ""
    netns: tuple[int, int] | None = None  # (st_dev, st_ino) of CNI_NETNS when queued
    queued: float = 0.0  # epoch seconds
    error: str = ""  # why it cannot be used ("" when it can)

    @property
    def sandbox_id(self) -> str:
        return self.env.get("CNI_CONTAINERID", "")

    @property
    def ifname(self) -> str:
        return self.env.get("CNI_IFNAME", "")


def queue_dir(state_dir: str) -> str:
    return os.path.join(state_dir, QUEUE_DIR)


def hold(state_dir: str, timeout: float = 30.0) -> int:
    """Create the queue if needed and take its lock exclusively, waiting up to
    `timeout` for shims writing to it; the descriptor (held for the agent's
    life). Temporary files of shims that died mid-write are removed. Blocking."""
    directory = queue_dir(state_dir)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(directory, LOCK),
                 os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise QueueBusy(f"{directory}/{LOCK} is held by another process") from None
            time.sleep(0.01)
    for name in os.listdir(directory):
        if name.startswith(".tmp-"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
    return fd


def _read(path: str, name: str, generation: int | None) -> Queued:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        return Queued(path, name, -1, generation, error=f"cannot open it: {e.strerror}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return Queued(path, name, st.st_uid, generation, error="not a regular file")
        if st.st_size > MAX_FILE:
            return Queued(path, name, st.st_uid, generation,
                          error=f"larger than {MAX_FILE} bytes")
        data = os.read(fd, MAX_FILE + 1)
    except OSError as e:
        return Queued(path, name, -1, generation, error=f"cannot read it: {e.strerror}")
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
        env, config = doc["env"], doc["config"]
        if doc.get("version") != 1 or not isinstance(config, str) or not isinstance(env, dict) \
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("not a version 1 request")
        ns = doc.get("netns")
        netns = (int(ns["dev"]), int(ns["ino"])) if isinstance(ns, dict) else None
        queued = float(doc.get("queued", 0))
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        return Queued(path, name, st.st_uid, generation, error=f"not a queued DEL: {e}")
    q = Queued(path, name, st.st_uid, generation, env, config, netns, queued)
    if env.get("CNI_COMMAND") != "DEL" or not q.sandbox_id:
        return replace(q, error="not a DEL with a CNI_CONTAINERID")
    return q


def scan(state_dir: str) -> list[Queued]:
    """The queued DELs, in the order they were queued. Blocking."""
    directory = queue_dir(state_dir)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for entry in names:
        bound = _BOUND.match(entry)
        if bound:
            name, generation = bound["name"], int(bound["generation"])
        elif entry.endswith(SUFFIX) and not entry.startswith("."):
            name, generation = entry, None
        else:
            continue  # the lock, temporary files, files set aside
        found.append(_read(os.path.join(directory, entry), name, generation))
    return sorted(found, key=lambda q: q.name)


def bind(q: Queued, generation: int) -> Queued:
    """`q` bound to `generation`, durably (rename, fsync of the directory). Blocking."""
    [bound] = bind_all([(q, generation)])
    return bound


def bind_all(items: list[tuple[Queued, int]]) -> list[Queued]:
    """Each `q` bound to its generation: renamed, then one fsync of the directory. Blocking."""
    out, directories = [], set()
    for q, generation in items:
        directory = os.path.dirname(q.path)
        path = os.path.join(directory, f"{q.name}.g{generation}")
        os.rename(q.path, path)
        directories.add(directory)
        out.append(replace(q, path=path, generation=generation))
    for directory in directories:
        fsync_dir(directory)
    return out


def remove(q: Queued) -> None:
    """Done with `q`: gone, durably. Blocking."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(q.path)
    fsync_dir(os.path.dirname(q.path))


def set_aside(q: Queued) -> str:
    """`q` cannot be used: renamed `<name>.bad`, for a person. Blocking."""
    path = os.path.join(os.path.dirname(q.path), q.name + BAD)
    os.rename(q.path, path)
    fsync_dir(os.path.dirname(q.path))
    return path


def by_sandbox(items: list[Queued]) -> Iterator[tuple[str, list[Queued]]]:
    """The queued DELs per sandbox id, each list and the ids in queue order."""
    groups: dict[str, list[Queued]] = {}
    for q in items:
        groups.setdefault(q.sandbox_id, []).append(q)
    yield from groups.items()
