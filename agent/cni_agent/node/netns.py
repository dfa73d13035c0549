"""Network namespaces: side-effect-free identification, pinning and netlink access.

A caller's path is resolved exactly once (`pin`): the open fd is verified
(nsfs, a network namespace, not the agent's own) and everything afterwards
goes through it — plugins get `/proc/<agent pid>/fd/N`, netlink work setns()es
to the fd — so swapping a symlink after the check changes nothing.

Works with pyroute2 0.7.x (distros) and 0.9.x (PyPI). We never use pyroute2's
own netns support: `NetNS(path)` defaults to O_CREAT (a typo would silently
create a namespace), 0.7 forks a helper process per NetNS and 0.9 forks one to
create the socket. Instead a worker thread briefly setns()es into the target,
creates a plain `IPRoute()` (a netlink socket stays bound to the namespace it
was created in) and setns()es straight back. Only the calling thread changes
namespace, and every blocking call runs in `asyncio.to_thread`, so the event
loop never blocks (0.9's sync IPRoute cannot even be built inside a running
loop).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import functools
import logging
import os
import re
import socket
import stat
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from cni_agent.cni.errors import InvalidArgument

__all__ = [
    "Interface",
    "NetnsError",
    "NetnsId",
    "NetnsUnknown",
    "Pinned",
    "bring_up_loopback",
    "check_netns",
    "held_by_a_process",
    "interfaces",
    "is_netns",
    "loopback_down",
    "loopback_up",
    "netns_identity",
    "pin",
    "pin_fd",
    "prepare",
    "userns_owners",
]

log = logging.getLogger(__name__)

NS_GET_NSTYPE = 0xB703  # ioctl on an nsfs fd: returns the CLONE_NEW* type
NS_GET_USERNS = 0xB701  # a new fd of the user namespace owning the namespace
NS_GET_PARENT = 0xB702  # a new fd of a user namespace's parent (EPERM past our own)
NS_GET_OWNER_UID = 0xB704  # the uid that created a user namespace, as our namespace sees it
MAX_USERNS_DEPTH = 33  # the kernel nests at most 32 user namespaces
NS_GET_ID = 0x8008B70D  # _IOR(0xb7, 13, u64): the namespace's id, never reused (Linux >= 6.11)
SO_NETNS_COOKIE = 71  # getsockopt: the socket's netns cookie, never reused in a boot (Linux >= 5.14)
# Test seam: set to "1", the agent acts as on a kernel without NS_GET_ID
# (< 6.11: RHEL 9, Debian 12), so CI on a newer kernel covers that path.
NO_NS_GET_ID_ENV = "CNI_AGENT_TEST_NO_NS_GET_ID"
CLONE_NEWNET = 0x40000000
NSFS_MAGIC = 0x6E736673  # statfs f_type of namespace files
_NS_TYPES = {
    0x00020000: "mnt",
    0x02000000: "cgroup",
    0x04000000: "uts",
    0x08000000: "ipc",
    0x10000000: "user",
    0x20000000: "pid",
    CLONE_NEWNET: "net",
    0x00000080: "time",
}
_PATH_MAX = 4096
_IFF_UP = 0x1
_T = TypeVar("_T")

# os.setns only exists on Python >= 3.12; libc's setns(2) works everywhere.
_libc = ctypes.CDLL(None, use_errno=True)


def _fs_type(fd: int) -> int:
    """statfs f_type of an fd (first field of struct statfs on Linux)."""
    buf = ctypes.create_string_buffer(512)  # larger than struct statfs on every arch
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


class NetnsError(Exception):
    """A namespace could not be opened or configured.

    `gone`: the path names no network namespace (ENOENT, another kind of
    file); False when that cannot be told (EACCES, EMFILE, ENOMEM, ...).
    """

    def __init__(self, path: str, reason: str, gone: bool = True) -> None:
        super().__init__(f"network namespace {_show(path)}: {reason}")
        self.path = path
        self.reason = reason
        self.gone = gone


class NetnsUnknown(InvalidArgument):
    """Whether a path names a network namespace cannot be told now: never "gone"."""


@functools.cache
def _own_netns() -> tuple[int, int]:
    """The agent's own network namespace, read once: the process never leaves
    it (a thread inside another one for a moment, the loop's thread included,
    always comes back), and /proc/self/ns/net read *while* the main thread is
    inside a pod's would name the pod's."""
    st = os.stat("/proc/self/ns/net")
    return st.st_dev, st.st_ino


_own_netns()  # now, at import: before any thread could be inside another namespace


def _boot_id() -> str:
    try:
        return _read_boot_id()
    except OSError:
        return ""


@functools.cache  # a failed read is not remembered: it raised
def _read_boot_id() -> str:
    """This boot's id, read once (it cannot change while the agent runs): it was
    an open and a read on every namespace pinned."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


@dataclass(frozen=True)
class NetnsId:
    """Which namespace a path named when it was recorded.

    (st_dev, st_ino) of an nsfs file is reused once the namespace is freed, at
    once; the kernel's namespace id (NS_GET_ID, Linux >= 6.11) and, where that
    is missing, the netns cookie of a socket made inside it (Linux >= 5.14) are
    not, within a boot. What there is is kept, with the boot it belongs to.
    Nothing a process inside can change (interface names, MACs) counts.
    """

    dev: int
    ino: int
    nsid: int | None = None
    boot: str = ""
    cookie: int | None = None

    def same(self, other: NetnsId | None) -> bool:
        """Whether `other` is certainly or (with only the inode) plausibly the same namespace."""
        if other is None:
            return False
        if self.boot and other.boot and self.boot != other.boot:
            return False
        if self.nsid is not None and other.nsid is not None:
            return self.nsid == other.nsid
        if self.cookie is not None and other.cookie is not None:
            return self.cookie == other.cookie
        return (self.dev, self.ino) == (other.dev, other.ino)

    @property
    def certain(self) -> bool:
        """True when identity rests on an id never reused in a boot, not on a reusable inode."""
        return self.nsid is not None or self.cookie is not None

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {"dev": self.dev, "ino": self.ino, "nsId": self.nsid,
                                  "boot": self.boot}
        if self.cookie is not None:
            doc["cookie"] = self.cookie
        return doc

    @classmethod
    def from_json(cls, doc: object) -> NetnsId | None:
        if isinstance(doc, list) and len(doc) == 2:  # records of 0.1.0: [dev, ino]
            return cls(int(doc[0]), int(doc[1]))
        if isinstance(doc, dict):
            nsid, cookie = doc.get("nsId"), doc.get("cookie")
            return cls(int(doc["dev"]), int(doc["ino"]), None if nsid is None else int(nsid),
                       str(doc.get("boot", "")), None if cookie is None else int(cookie))
        return None


def fd_identity(fd: int) -> NetnsId:
    """The identity of the namespace an nsfs fd refers to; blocking (it may
    setns() this thread for a moment: run it on a worker thread)."""
    st = os.fstat(fd)
    nsid: int | None = None
    if os.environ.get(NO_NS_GET_ID_ENV) != "1":
        buf = bytearray(8)
        try:
            fcntl.ioctl(fd, NS_GET_ID, buf, True)
            nsid = int.from_bytes(buf, sys.byteorder)
        except OSError:  # older kernels: ENOTTY
            nsid = None
    cookie = _netns_cookie(fd) if nsid is None else None
    return NetnsId(st.st_dev, st.st_ino, nsid, _boot_id(), cookie)


def _netns_cookie(fd: int) -> int | None:
    """The cookie of the namespace `fd` (from a socket made inside it); None
    before Linux 5.14, where only the inode is left."""
    def cookie() -> int:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            return int.from_bytes(s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8),
                                  sys.byteorder)

    try:
        return _inside_fd(fd, cookie)
    except OSError:  # ENOPROTOOPT: no cookies on this kernel
        return None


@dataclass(frozen=True)
class Interface:
    name: str
    index: int
    mac: str
    up: bool
    addresses: tuple[str, ...]  # CIDR strings, IPv4 and IPv6


def _kind(mode: int) -> str | None:
    """Why a non-regular file cannot be a namespace (nsfs files stat as regular)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, not a network namespace"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "is a device, not a network namespace"
    if stat.S_ISFIFO(mode):
        return "is a FIFO, not a network namespace"
    if stat.S_ISSOCK(mode):
        return "is a socket, not a network namespace"
    return "is not a regular file, so not a network namespace"


def _open_netns(path: str, opath: int = -1) -> int:
    """Open `path` iff it is a network namespace; never creates or blocks.

    The path is resolved once (symlinks followed, as for /proc/PID/ns/net) by
    an O_PATH open, which has no side effects on FIFOs or devices (`opath`:
    one `in_kernel` made, then owned here); the real fd is reopened from that
    one, so both name the same file whatever happens to the path meanwhile.
    Returns an O_CLOEXEC fd owned by the caller; raises NetnsError otherwise.
    """
    if opath == GONE:
        raise NetnsError(path, "does not exist")
    verified = opath >= 0  # `in_kernel`'s: a file on nsfs, by statx
    if not verified:
        opath = _open_path(path)
    try:
        if not verified:
            try:
                mode, fs_type = os.fstat(opath).st_mode, _fs_type(opath)
            except OSError as e:
                raise NetnsError(path, f"cannot stat: {e.strerror}", gone=False) from None
            if (why := _kind(mode)) is not None:
                raise NetnsError(path, why)
            if fs_type != NSFS_MAGIC:
                raise NetnsError(path, "is a regular file, not a namespace")
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY  # no O_CREAT
        try:
            fd = os.open(f"/proc/self/fd/{opath}", flags)
        except OSError as e:
            raise NetnsError(path, f"cannot open: {e.strerror}", gone=False) from None
    finally:
        os.close(opath)
    try:
        try:
            nstype = fcntl.ioctl(fd, NS_GET_NSTYPE)
        except OSError:
            raise NetnsError(path, "is a regular file, not a namespace") from None
        if nstype != CLONE_NEWNET:
            name = _NS_TYPES.get(nstype, hex(nstype))
            raise NetnsError(path, f"is a {name} namespace, not a network namespace")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_path(path: str) -> int:
    if not path:
        raise NetnsError(path, "is empty")
    if "\0" in path:
        raise NetnsError(path, "contains a NUL byte")
    if len(os.fsencode(path)) > _PATH_MAX:
        raise NetnsError(path, f"is longer than {_PATH_MAX} bytes")
    if not os.path.isabs(path):
        raise NetnsError(path, "is not an absolute path")
    try:
        return os.open(path, os.O_PATH | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise NetnsError(path, "does not exist") from None
    except OSError as e:
        raise NetnsError(path, f"cannot open: {e.strerror}", gone=False) from None


# Where runtimes put their namespaces: `ip netns`, CRI-O, containerd and podman
# under /run/netns (or /var/run/netns, /var/run being /run), and /proc/PID/ns/net.
_RUN_NETNS = re.compile(r"/(?:var/)?run/netns/([^/]+)")
_PROC_NETNS = re.compile(r"/proc/[1-9][0-9]*(?:/task/[1-9][0-9]*)?/ns/net")
GONE = -2  # `in_kernel`: the path names nothing
_SYS_OPENAT2 = 437  # the same number on every architecture (a syscall added in 5.6)
_RESOLVE_NO_SYMLINKS = 0x04
_AT_EMPTY_PATH = 0x1000
_AT_STATX_DONT_SYNC = 0x4000
_STATX_TYPE = 0x1
_STATX_MODE = 28  # offset of stx_mode (u16) in struct statx
_STATX_DEV = 136  # offset of stx_dev_major, stx_dev_minor (u32 each)
_OPEN_HOW = struct.Struct("=QQQ")


def in_kernel(path: str) -> int:
    """An O_PATH fd of `path`, opened without a thread, when nothing resolving
    it can wait on a filesystem outside the kernel; -1 when that cannot be told
    (a path thread opens it). So for the places runtimes put namespaces:
    /run/netns/NAME resolved with no symlink followed (tmpfs, then the nsfs
    bind mount) and /proc/PID/ns/net (procfs, then nsfs); the fd must then be
    nsfs by what statx says without asking the filesystem (AT_STATX_DONT_SYNC:
    a FUSE or NFS mount there is never asked), else it goes to a thread too.
    GONE when the path names nothing (for `pin`'s `opath`)."""
    if (m := _RUN_NETNS.fullmatch(path)) is not None and m.group(1) not in (".", "..") and (
            not path.startswith("/var/") or _var_run_is_run()):
        how = _OPEN_HOW.pack(os.O_PATH | os.O_CLOEXEC, 0, _RESOLVE_NO_SYMLINKS)
        fd = int(_libc.syscall(_SYS_OPENAT2, -100, f"/run/netns/{m.group(1)}".encode(),
                               how, _OPEN_HOW.size))  # -100: AT_FDCWD
        if fd < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOENT, errno.ENOTDIR):
                return GONE
            return -1  # ELOOP (a symlink on the way), ENOSYS (< 5.6), ...: a thread
    elif _PROC_NETNS.fullmatch(path):
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return GONE
        except OSError:
            return -1
    else:
        return -1
    buf = ctypes.create_string_buffer(256)  # struct statx
    if _libc.statx(fd, b"", _AT_EMPTY_PATH | _AT_STATX_DONT_SYNC, _STATX_TYPE, buf) != 0 or \
            not stat.S_ISREG(struct.unpack_from("=H", buf, _STATX_MODE)[0]) or \
            struct.unpack_from("=II", buf, _STATX_DEV) != _nsfs_dev():
        os.close(fd)
        return -1
    return fd


@functools.cache
def _var_run_is_run() -> bool:
    try:
        return os.readlink("/var/run") in ("/run", "../run")
    except OSError:
        return False


@functools.cache
def _nsfs_dev() -> tuple[int, int]:
    """nsfs's device (every namespace file is on its one superblock), as statx
    gives it: (major, minor)."""
    st = os.stat("/proc/self/ns/net")
    return os.major(st.st_dev), os.minor(st.st_dev)


_nsfs_dev()  # at import, with `_own_netns`


def _show(path: str) -> str:
    """The path for error messages: quoted, and bounded in length."""
    if not path:
        return "path"
    return repr(path if len(path) <= 80 else path[:77] + "...")


def netns_identity(path: str) -> NetnsId | None:
    """The identity of the network namespace at `path`, else None."""
    try:
        fd = _open_netns(path)
    except NetnsError:
        return None
    try:
        return fd_identity(fd)
    finally:
        os.close(fd)


def is_netns(path: str) -> bool:
    return netns_identity(path) is not None


def userns_owners(fd: int) -> tuple[int, ...] | None:
    """The owner uids of the user namespaces above the namespace `fd`, from the
    one owning it up to (not including) the agent's own: () when the agent's
    user namespace owns it (root's `ip netns add`, a runtime's pods), None when
    the chain cannot be read. Blocking (a few ioctls), for a worker thread.

    A caller whose uid owns every one of them is privileged over the namespace
    (the kernel's rule: the owner of a user namespace, living in its parent,
    has every capability in it); opening its nsfs file proves nothing.
    """
    own = os.stat("/proc/self/ns/user")
    try:
        current = fcntl.ioctl(fd, NS_GET_USERNS)  # a new O_CLOEXEC fd
    except OSError:
        return None
    owners: list[int] = []
    try:
        for _ in range(MAX_USERNS_DEPTH):
            st = os.fstat(current)
            if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
                return tuple(owners)
            buf = bytearray(4)
            fcntl.ioctl(current, NS_GET_OWNER_UID, buf, True)
            owners.append(int.from_bytes(buf, sys.byteorder))
            parent = fcntl.ioctl(current, NS_GET_PARENT)
            os.close(current)
            current = parent
    except OSError:
        return None
    finally:
        os.close(current)
    return None


class Pinned:
    """A network namespace held open for one request; the only way it is reached.

    `path` is the caller's, as given (records, cache, Show); `plugin_path` is
    what plugins open. Close it when the request ends.
    """

    __slots__ = ("_fd", "identity", "path")

    def __init__(self, path: str, fd: int, identity: NetnsId) -> None:
        self.path = path
        self.identity = identity
        self._fd = fd

    @property
    def fd(self) -> int:
        if self._fd < 0:
            raise ValueError(f"network namespace {_show(self.path)} is closed")
        return self._fd

    @property
    def plugin_path(self) -> str:
        # Plugins are processes of their own: they reach our open fd through
        # our pid (/proc/self would be theirs). It stays open while they run.
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pin(path: str, field: str = "netns", opath: int = -1) -> Pinned:
    """Open and verify the netns at `path` once, or InvalidArgument(field, reason).

    Blocking (it resolves a caller's path): run it off the event loop, unless
    `opath` is what `in_kernel` opened of it (then owned here).
    """
    try:
        fd = _open_netns(path, opath)
    except NetnsError as e:
        raise (InvalidArgument if e.gone else NetnsUnknown)(field, f"{_show(path)} {e.reason}") from None
    try:
        try:
            ident = fd_identity(fd)
        except OSError as e:
            raise NetnsUnknown(field, f"{_show(path)}: cannot identify: {e.strerror}") from None
        # Two live namespaces never share an inode, and we hold this one open.
        if (ident.dev, ident.ino) == _own_netns():
            raise InvalidArgument(
                field, f"{_show(path)}: refusing to configure the agent's own network namespace"
            )
        return Pinned(path, fd, ident)
    except BaseException:
        os.close(fd)
        raise


_NSFS_NAME = re.compile(r"[a-z_]+:\[\d+\]")


def _on_nsfs(fd: int) -> bool:
    """Whether `fd` is a namespace file, from /proc alone: its name there is
    "<type>:[<inode>]", or (opened through a bind mount, as `ip netns` makes
    them) the mount it is on is nsfs."""
    if _NSFS_NAME.fullmatch(os.readlink(f"/proc/self/fd/{fd}")):
        return True
    with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
        mnt = next((line.split()[1] for line in f if line.startswith(b"mnt_id:")), None)
    if mnt is None:
        return False
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] == mnt and b"-" in fields:
                return fields[fields.index(b"-") + 1:][:1] == [b"nsfs"]
    return False


def pin_fd(fd: int, path: str, field: str = "netns_fd",
           vet: Callable[[tuple[int, ...] | None], None] | None = None) -> Pinned:
    """Verify a descriptor a caller opened itself and pin (a duplicate of) it,
    or InvalidArgument(field): as `pin`, minus the path, which the agent never
    opens for this caller; `path` is only the name it is recorded by.

    `vet` is shown the namespace's user-namespace owners (`userns_owners`)
    before anything else is done with it, and raises to refuse it.
    Never blocks (a descriptor, not a path: nothing it touches can hang), so
    it runs on the loop; the identity may setns() this thread for a moment.
    """
    try:
        own_fd = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    except (OSError, TypeError, ValueError):
        raise InvalidArgument(field, "is not an open file descriptor") from None
    try:
        # First by what /proc says of it, which never reaches the file's
        # filesystem (a file on a hung FUSE mount would hang an fstat). Only a
        # namespace file is looked at further, and nsfs answers at once.
        if not _on_nsfs(own_fd):
            raise InvalidArgument(field, "is not a network namespace")
        if _kind(os.fstat(own_fd).st_mode) is not None or _fs_type(own_fd) != NSFS_MAGIC:
            raise InvalidArgument(field, "is not a network namespace")
        try:
            nstype = fcntl.ioctl(own_fd, NS_GET_NSTYPE)
        except OSError:
            raise InvalidArgument(field, "is not a network namespace") from None
        if nstype != CLONE_NEWNET:
            raise InvalidArgument(field, f"is a {_NS_TYPES.get(nstype, hex(nstype))} namespace, "
                                         "not a network namespace")
        if vet is not None:
            vet(userns_owners(own_fd))
        ident = fd_identity(own_fd)
        if (ident.dev, ident.ino) == _own_netns():
            raise InvalidArgument(field, "refusing to configure the agent's own network namespace")
        return Pinned(path, own_fd, ident)
    except BaseException:
        os.close(own_fd)
        raise


def held_by_a_process(identity: NetnsId) -> Pinned | None:
    """The namespace `identity` names, pinned through /proc/PID/ns/net of a
    process inside it; None when no process is in it. Blocking (a walk of
    /proc), for a worker thread.

    How root reaches a namespace it was only ever given as a caller's
    descriptor (a member's): never by the caller's path, which could be on a
    mount that never answers, only by what the kernel says of its processes
    (procfs, then nsfs: nothing outside the kernel is asked, `in_kernel`).
    A pid reused between the walk and the open is caught: the pinned
    namespace must have the identity (an id never reused in a boot where
    the kernel has one). A namespace kept only by a bind mount or an open
    descriptor has no process in it, so it is not found: docs/security.md.
    """
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        path = f"/proc/{pid}/ns/net"
        try:
            st = os.stat(path)
        except OSError:  # exited, or a kernel thread's
            continue
        if (st.st_dev, st.st_ino) != (identity.dev, identity.ino):
            continue
        opath = in_kernel(path)
        if opath < 0:  # gone meanwhile (never -1 for /proc: no thread is needed)
            continue
        try:
            ns = pin(path, "netns", opath)
        except InvalidArgument:  # exited meanwhile
            continue
        if identity.same(ns.identity):
            return ns
        ns.close()
    return None


def check_netns(path: str, field: str = "netns") -> NetnsId:
    """Identity of the netns at `path`, or InvalidArgument(field, reason)."""
    with pin(path, field) as ns:
        return ns.identity


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _inside(target: Pinned, make: Callable[[], _T]) -> _T:
    """make() with this thread briefly inside the netns `target`; blocking.

    For sockets: one stays bound to the namespace it was created in, so the
    thread goes straight back and uses it from home.
    """
    return _inside_fd(target.fd, make)


def _inside_fd(fd: int, make: Callable[[], _T]) -> _T:
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd)
        return make()
    finally:
        try:
            _setns(home)
        except OSError:
            # This pool thread would silently run later host work inside
            # a container's namespace; dying is safer (systemd restarts).
            log.critical("cannot restore thread network namespace", exc_info=True)
            os.abort()
        finally:
            os.close(home)


def _pinned(target: Pinned | str, func: Callable[[Pinned], _T]) -> _T:
    """func(target), a path (tests, tools) pinned for the call; the agent passes its handle."""
    if isinstance(target, str):
        with Pinned(target, _open_netns(target), NetnsId(0, 0)) as ns:
            return func(ns)
    return func(target)


def _with_iproute(target: Pinned, func: Callable[[Any], _T]) -> _T:
    """Run func(IPRoute bound to the netns `target`); blocking, for to_thread."""
    # Imported on first use: pyroute2 costs ~0.15 s and ~11 MiB, which an agent
    # that is only starting (or only reporting readiness) need not pay.
    from pyroute2 import IPRoute, NetlinkError

    try:
        ipr = _inside(target, IPRoute)
    except (OSError, NetlinkError) as e:
        raise NetnsError(target.path, f"cannot open netlink socket: {e}") from e
    try:
        with ipr:
            return func(ipr)
    except (OSError, NetlinkError) as e:
        raise NetnsError(target.path, str(e)) from e


# Every network namespace's loopback device has index 1 (LOOPBACK_IFINDEX).
_LOOPBACK_IFINDEX = 1
SIOCGIFNAME, SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8910, 0x8913, 0x8914
_IFREQ = struct.Struct("16sH22x")  # struct ifreq: the name, then (a union with) the flags
_IFREQ_INDEX = struct.Struct("16si20x")  # ...or the index


SIOCGIFINDEX = 0x8933


def prepare(target: Pinned, ifnames: Sequence[str], loopback: bool) -> tuple[list[str], bool]:
    """Before a Setup's first plugin: the requested interfaces already in the
    namespace (a Setup must not take over, or roll back, what it did not
    create), else `lo` up when `loopback` (what `ip link set lo up` does), and
    whether this call brought it up (`loopback_down` undoes that when the
    Setup fails); blocking. Ioctls on one socket made inside the namespace: no
    netlink (pyroute2 cost ~1 ms of CPU per Setup), a few syscalls."""
    try:
        sock = _inside(target, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    except OSError as e:
        raise NetnsError(target.path, f"cannot open a socket: {e}") from e
    try:
        with sock:
            present = []
            for ifname in ifnames:
                try:
                    fcntl.ioctl(sock, SIOCGIFINDEX, _IFREQ_INDEX.pack(ifname.encode(), 0))
                except OSError as e:
                    if e.errno != errno.ENODEV:
                        raise
                else:
                    present.append(ifname)
            return present, loopback and not present and _set_loopback(sock, up=True)
    except OSError as e:
        raise NetnsError(target.path, str(e)) from e


def _set_loopback(sock: socket.socket, up: bool) -> bool:
    """Set `lo` up or down (`sock` is inside the namespace); whether it was not so."""
    req = fcntl.ioctl(sock, SIOCGIFNAME, _IFREQ_INDEX.pack(b"", _LOOPBACK_IFINDEX))
    name = _IFREQ_INDEX.unpack(req)[0]
    _, flags = _IFREQ.unpack(fcntl.ioctl(sock, SIOCGIFFLAGS, _IFREQ.pack(name, 0)))
    if bool(flags & _IFF_UP) == up:
        return False
    fcntl.ioctl(sock, SIOCSIFFLAGS, _IFREQ.pack(name, flags | _IFF_UP if up else flags & ~_IFF_UP))
    return True


def loopback_down(target: Pinned) -> bool:
    """Set `lo` down again, as a failed Setup that brought it up found it,
    unless the namespace now holds another link (another sandbox's, set up
    meanwhile in the same namespace, relies on it); blocking. Whether it did."""
    try:
        names = [n for _, n in _inside(target, socket.if_nameindex)]
        if any(n != "lo" for n in names):
            return False
        with _inside(target, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as sock:
            _set_loopback(sock, up=False)
            return True
    except OSError as e:
        raise NetnsError(target.path, str(e)) from e


def loopback_up(target: Pinned | str) -> None:
    """Set `lo` up inside the network namespace `target`; blocking."""
    _pinned(target, lambda ns: prepare(ns, (), True))


def _list_interfaces(ipr: Any) -> list[Interface]:
    addrs: dict[int, list[str]] = {}
    for msg in ipr.get_addr():
        # IFA_LOCAL is our address on point-to-point links (IFA_ADDRESS = peer).
        ip = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
        if ip:
            addrs.setdefault(msg["index"], []).append(f"{ip}/{msg['prefixlen']}")
    return [
        Interface(
            name=str(msg.get_attr("IFLA_IFNAME")),
            index=int(msg["index"]),
            mac=str(msg.get_attr("IFLA_ADDRESS") or ""),
            up=bool(msg["flags"] & _IFF_UP),
            addresses=tuple(addrs.get(msg["index"], ())),
        )
        for msg in ipr.get_links()
    ]


async def bring_up_loopback(target: Pinned | str) -> None:
    """Set `lo` up inside the network namespace `target`."""
    await asyncio.to_thread(loopback_up, target)


async def interfaces(target: Pinned | str) -> list[Interface]:
    """All links of the network namespace `target`, with their addresses."""
    return await asyncio.to_thread(_pinned, target, lambda ns: _with_iproute(ns, _list_interfaces))
