"""The result cache, in libcni's on-disk format.

`<state>/results/<network>-<containerID>-<ifname>` holding
`{"kind":"cniCacheV1", "containerId", "config" (base64 of the list bytes),
"ifName", "networkName", "netns", "cniArgs", "capabilityArgs", "result"}`,
so cnitool-era tools and people can read what the agent did. Entries are
written in place and not fsynced, as libcni writes its own: the agent's
journal holds each result too, and rewrites an entry that a crash left
half-written or a power loss took or zeroed (`sandboxes.journal`).

Only the agent writes its state dir, so what the directory holds is known
without reading it (`index`, built by one scan at start-up): whose file each
name is, and which sandboxes have entries no record names.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cni_agent.cni.errors import CacheError

CACHE_KIND = "cniCacheV1"
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class CachedAttachment:
    container_id: str
    network: str
    ifname: str
    netns: str
    config: bytes = field(repr=False)
    cni_args: tuple[tuple[str, str], ...] = ()
    capability_args: Mapping[str, Any] = field(default_factory=dict)
    result: Mapping[str, Any] | None = None
    path: str = ""

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "kind": CACHE_KIND,
            "containerId": self.container_id,
            "config": base64.b64encode(self.config).decode(),
            "ifName": self.ifname,
            "networkName": self.network,
            "netns": self.netns,
        }
        if self.cni_args:
            doc["cniArgs"] = [list(kv) for kv in self.cni_args]
        if self.capability_args:
            doc["capabilityArgs"] = dict(self.capability_args)
        if self.result is not None:
            doc["result"] = dict(self.result)
        return doc


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, mode: int = 0o600, durable: bool = True) -> None:
    """Write a file so a crash leaves either the old or the new content.

    The rename alone survives a killed process; `durable` adds the fsyncs that
    make it survive a power loss too (for writes a recovery depends on).
    """
    directory = os.path.dirname(path)
    # As mkstemp does, minus its Python-level retries and file object (the
    # agent writes a few of these per Setup; the daemon sweeps `.tmp-*`).
    tmp = os.path.join(directory, f".tmp-{os.urandom(8).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(directory)


class ResultCache:
    """File operations on the local state dir. Writing, reading or unlinking one
    entry is a few syscalls, cheaper on the event loop than a thread hop; the
    one scan of the directory (start-up) runs off the loop."""

    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, "results")
        # File name → the (network, container id, ifname) its content names;
        # None until `scan` built it (then every read goes by it).
        self._index: dict[str, tuple[str, str, str]] | None = None

    def path(self, network: str, container_id: str, ifname: str) -> str:
        return os.path.join(self.dir, f"{network}-{container_id}-{ifname}")

    def _ensure_dir(self) -> None:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)

    def scan(self, trusted: Mapping[str, tuple[str, str, str]] | None = None,
             before: int = 0) -> tuple[list[CachedAttachment], list[str], set[str]]:
        """Read the entries and index them: the readable ones, the paths of
        those that are not (kept out of the index: their names are free), and
        the names of `trusted` files taken as what they say without reading
        them (file name → the (network, container id, ifname) it holds: what
        the agent itself wrote before its clean stop at `before`, a ctime in
        ns), when not empty and not changed since.
        Blocking: start-up, off the loop."""
        index: dict[str, tuple[str, str, str]] = {}
        good: list[CachedAttachment] = []
        bad: list[str] = []
        taken: set[str] = set()
        trusted = trusted or {}
        try:
            listing = list(os.scandir(self.dir))
        except FileNotFoundError:
            listing = []
        for item in listing:
            if item.name.startswith("."):
                continue
            key = trusted.get(item.name)
            if key is not None:
                try:
                    st = item.stat(follow_symlinks=False)
                    # ctime: a write after the stop, even one that put the
                    # old mtime back, is newer (same tick: read it)
                    if st.st_size > 0 and st.st_ctime_ns < before:
                        index[item.name] = key
                        taken.add(item.name)
                        continue
                except OSError:
                    continue
            try:
                entry = self.read_path(item.path)
            except FileNotFoundError:
                continue
            except CacheError:
                bad.append(item.path)
                continue
            index[item.name] = (entry.network, entry.container_id, entry.ifname)
            good.append(entry)
        self._index = index
        return good, bad, taken

    def write(self, entry: CachedAttachment) -> None:
        """Write the entry in place, as libcni does: an entry a killed agent
        left half-written is written again from the journal at start-up, and
        only the agent writes this directory (no temporary file, no rename)."""
        try:
            data = json.dumps(entry.to_json()).encode()
            path = self.path(entry.network, entry.container_id, entry.ifname)
            try:
                fd = os.open(path, _WRITE, 0o600)
            except FileNotFoundError:  # the first entry (or the dir was removed)
                self._ensure_dir()
                fd = os.open(path, _WRITE, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        except OSError as e:
            raise CacheError(f"cannot write result cache: {e}") from e
        if self._index is not None:
            self._index[os.path.basename(path)] = (entry.network, entry.container_id,
                                                   entry.ifname)

    def delete(self, network: str, container_id: str, ifname: str) -> None:
        """Remove the attachment's entry, never another's that has the same name."""
        path = self.path(network, container_id, ifname)
        if not self.free_for(network, container_id, ifname):
            return  # the file is another attachment's (libcni's names can collide)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CacheError(f"cannot remove cache entry: {e}") from e
        if self._index is not None:
            self._index.pop(os.path.basename(path), None)

    def free_for(self, network: str, container_id: str, ifname: str) -> bool:
        """Whether the attachment's libcni-named file is absent, unreadable (its
        own DEL removes it), or its own: `<network>-<id>-<ifname>` is not
        one-to-one when the parts contain '-' ("testnet" + "v6-x" and
        "testnet-v6" + "x" name one file)."""
        if "-" not in network + container_id + ifname:
            return True  # then the name has two '-' only: no other split of it exists
        if self._index is not None:
            held = self._index.get(f"{network}-{container_id}-{ifname}")
            return held is None or held == (network, container_id, ifname)
        try:
            entry = self.read_path(self.path(network, container_id, ifname))
        except (FileNotFoundError, CacheError):
            return True
        return _is(entry, network, container_id, ifname)

    def read_path(self, path: str) -> CachedAttachment:
        """Read one entry; CacheError when it is unreadable or not ours."""
        try:
            with open(path, "rb") as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as e:
            raise CacheError(f"{path}: unreadable cache entry: {e}") from None
        return _entry_from_json(doc, path)

    def read(self, network: str, container_id: str, ifname: str) -> CachedAttachment | None:
        """The attachment's entry; None when there is none, or when the file by
        its name belongs to another attachment (checked by the entry's own fields)."""
        try:
            entry = self.read_path(self.path(network, container_id, ifname))
        except FileNotFoundError:
            return None
        return entry if _is(entry, network, container_id, ifname) else None

    def _names(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.dir) if not n.startswith("."))
        except FileNotFoundError:
            return []

    def _scan(self, match: str | None, check: Mapping[str, str]) -> list[CachedAttachment]:
        if self._index is not None:
            names = sorted(n for n, key in self._index.items()
                           if all(_KEYS[k](key) == v for k, v in check.items()))
        else:
            names = [n for n in self._names() if match is None or match in n]
        found = []
        for name in names:
            try:
                entry = self.read_path(os.path.join(self.dir, name))
            except (FileNotFoundError, CacheError):
                continue
            if all(getattr(entry, k) == v for k, v in check.items()):
                found.append(entry)
        return found

    def for_container(self, container_id: str) -> list[CachedAttachment]:
        """Attachments of a container: by the index (no file is read when it has
        none); before `scan`, names containing `-<id>-`, then the JSON checked."""
        return self._scan(f"-{container_id}-", {"container_id": container_id})

    def for_network(self, network: str) -> list[CachedAttachment]:
        return self._scan(f"{network}-", {"network": network})

    def all(self) -> list[CachedAttachment]:
        return self._scan(None, {})

    def keys(self) -> list[tuple[str, str, str]]:
        """(network, container id, ifname) of every entry: from the index, no
        file read (before `scan`: every file read)."""
        if self._index is not None:
            return sorted(self._index.values())
        return sorted((e.network, e.container_id, e.ifname) for e in self.all())


_KEYS = {"network": lambda key: key[0], "container_id": lambda key: key[1]}


def _is(entry: CachedAttachment, network: str, container_id: str, ifname: str) -> bool:
    return (entry.network, entry.container_id, entry.ifname) == (network, container_id, ifname)


def _entry_from_json(doc: Any, path: str) -> CachedAttachment:
    if not isinstance(doc, dict) or doc.get("kind") != CACHE_KIND:
        raise CacheError(f"{path}: not a {CACHE_KIND} entry")
    try:
        config = base64.b64decode(doc["config"], validate=True)
        args_raw: Sequence[Any] = doc.get("cniArgs") or []
        args = tuple((str(k), str(v)) for k, v in args_raw)
        caps = doc.get("capabilityArgs") or {}
        result = doc.get("result")
        entry = CachedAttachment(
            container_id=str(doc["containerId"]),
            network=str(doc["networkName"]),
            ifname=str(doc["ifName"]),
            netns=str(doc.get("netns", "")),
            config=config,
            cni_args=args,
            capability_args=caps if isinstance(caps, dict) else {},
            result=result if isinstance(result, dict) else None,
            path=path,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CacheError(f"{path}: malformed cache entry: {e}") from None
    return entry
