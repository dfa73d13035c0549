"""Reading a configuration file the agent did not write: a regular file, bounded.

Shared at the side (like api and config): the agent's own configuration
(`config`) and the network files of `conf_dir` (`cni.config`) are read
through it, each naming the file in its own error.
"""

from __future__ import annotations

import os
import stat

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket"}


class Unreadable(Exception):
    """Why a file was not read (without its path); `missing`: it does not exist."""

    def __init__(self, reason: str, missing: bool = False) -> None:
        super().__init__(reason)
        self.missing = missing


def read_regular(path: str, limit: int) -> bytes:
    """A regular file's bytes, at most `limit`; Unreadable otherwise.

    Anything else is refused before it is opened: a FIFO would block the
    reader (start-up, a scan, `config check`, a reload's thread) until someone
    writes, and opening a device can act (a watchdog starts on open)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a file")
            raise Unreadable(f"not a regular file ({kind}): not read")
        if st.st_size > limit:
            raise Unreadable(f"larger than {limit} bytes: not read")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise Unreadable(f"cannot read: {e.strerror}", isinstance(e, FileNotFoundError)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the stat
            raise Unreadable("not a regular file: not read")
        chunks, size = [], 0
        while chunk := os.read(fd, limit + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise Unreadable(f"larger than {limit} bytes: not read")
        return b"".join(chunks)
    except OSError as e:
        raise Unreadable(f"cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
