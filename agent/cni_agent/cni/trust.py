"""What a root agent may trust on disk: plugin directories and binaries.

The agent runs plugins as root, and plugins run further plugins found in
CNI_PATH (bridge runs its IPAM plugin). So every directory in CNI_PATH and
every binary the agent runs must be out of reach of non-root users: it, and
every directory the kernel walks to reach it (symlinks followed), is owned by
root and not writable by group or others. A directory above it may be
world-writable only with the sticky bit (`/tmp`): then nobody but root can
rename or replace the root-owned entry in it. An agent that is not root (the
unit tests) trusts everything, as it cannot be tricked into more than its own
rights. A directory holding a file or symlink that fails the check is left
out of CNI_PATH as a whole: a plugin could run that file.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

_MAX_SYMLINKS = 40  # as the kernel's ELOOP limit


def _walk(path: str) -> list[tuple[str, os.stat_result]]:
    """Every entry the kernel looks at to resolve `path`, with its lstat, in order.

    Symlinks are followed by hand, so the directories their targets pass
    through are checked too; the last entry is what `path` resolves to.
    """
    todo = [c for c in os.path.abspath(path).split("/") if c]
    cur = "/"
    seen = [("/", os.lstat("/"))]
    hops = 0
    while todo:
        name = todo.pop(0)
        if name == ".":
            continue
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        entry = os.path.join(cur, name)
        st = os.lstat(entry)
        seen.append((entry, st))
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > _MAX_SYMLINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(entry)
            if target.startswith("/"):
                cur = "/"
            todo[:0] = [c for c in target.split("/") if c]
            continue
        cur = entry
    return seen


def untrusted_reason(path: str) -> str | None:
    """Why a root agent must not run from `path` (a plugin dir or binary), or None.

    Raises OSError when `path` cannot be resolved (missing).
    """
    return checked(path)[0]


def checked(path: str) -> tuple[str | None, list[tuple[str, os.stat_result]]]:
    """`untrusted_reason(path)`, and the entries it was decided from: each
    lstat'ed, in order (none when not root: nothing is checked then). The
    verdict stands while each of them has the same `identity`."""
    if os.geteuid() != 0:
        return None, []
    walked = _walk(path)
    last = len(walked) - 1
    for i, (entry, st) in enumerate(walked):
        reason = _entry_reason(entry, st, sticky_ok=i < last)
        if reason:
            return reason, walked
    return None, walked


def identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What a verdict on an entry rests on: which inode, its type, mode and owner;
    ctime changes with any chmod, chown or link (a symlink's target: a new inode)."""
    return (st.st_dev, st.st_ino, st.st_mode, st.st_uid, st.st_ctime_ns)


def _entry_reason(entry: str, st: os.stat_result, sticky_ok: bool = False) -> str | None:
    if st.st_uid != 0:
        what = " (a symlink)" if stat.S_ISLNK(st.st_mode) else ""
        return f"{entry}{what} is owned by uid {st.st_uid}, not root"
    if stat.S_ISLNK(st.st_mode) or not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    if sticky_ok and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
        return None  # sticky (/tmp): others cannot replace our root-owned entry in it
    return f"{entry} is writable by non-root users (mode {stat.filemode(st.st_mode)})"


def _unsafe_content(directory: str) -> str | None:
    """Why a dir must stay out of CNI_PATH for what it holds, or None.

    Plugins exec whatever their config names from CNI_PATH (bridge its IPAM
    plugin), out of the agent's sight: so every file in a trusted dir, and
    every symlink's target, must be as safe as the binaries the agent runs.
    """
    with os.scandir(directory) as entries:
        for e in entries:
            st = e.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                try:
                    reason = untrusted_reason(e.path)
                except OSError:
                    continue  # dangling: nothing to run
            elif stat.S_ISREG(st.st_mode):
                reason = _entry_reason(e.path, st)
            else:
                continue
            if reason:
                return reason
    return None


@dataclass(frozen=True)
class PluginPath:
    """The configured plugin dirs, sorted into what goes into CNI_PATH and what not."""

    trusted: tuple[str, ...] = ()
    untrusted: tuple[tuple[str, str], ...] = ()  # (dir, why)
    missing: tuple[str, ...] = ()  # absent now; nothing to run from, nothing to report

    @property
    def cni_path(self) -> str:
        return ":".join(self.trusted)


def check_plugin_dirs(dirs: Sequence[str]) -> PluginPath:
    """Sort `dirs` (blocking: an lstat per path component and per entry)."""
    trusted: list[str] = []
    untrusted: list[tuple[str, str]] = []
    missing: list[str] = []
    for d in dict.fromkeys(dirs):
        try:
            reason = untrusted_reason(d)
            if reason is None and not os.path.isdir(d):
                reason = f"{d} is not a directory"
            if reason is None and os.geteuid() == 0:
                reason = _unsafe_content(d)
        except FileNotFoundError:
            missing.append(d)
            continue
        except OSError as e:
            reason = f"cannot check {d}: {e.strerror}"
        if reason is None:
            trusted.append(d)
        else:
            untrusted.append((d, reason))
    return PluginPath(tuple(trusted), tuple(untrusted), tuple(missing))
