"""The result cache, in libcni's on-disk format.

`<state>/results/<network>-<containerID>-<ifname>` holding
`{"kind":"cniCacheV1", "containerId", "config" (base64 of the list bytes),
"ifName", "networkName", "netns", "cniArgs", "capabilityArgs", "result"}`,
so cnitool-era tools and people can read what the agent did. Writes are
atomic (temp file, fsync, rename, fsync of the directory): a crash leaves
the old entry or the new one, never half of either.
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
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
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
    """Blocking file operations on the local state dir. Writes (durable) and
    scans (they grow with the node) run off the event loop; reading or
    unlinking one entry is a few syscalls, cheaper on the loop than a thread hop."""

    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, "results")

    def path(self, network: str, container_id: str, ifname: str) -> str:
        return os.path.join(self.dir, f"{network}-{container_id}-{ifname}")

    def _ensure_dir(self) -> None:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)

    def write(self, entry: CachedAttachment) -> None:
        try:
            self._ensure_dir()
            data = json.dumps(entry.to_json()).encode()
            atomic_write(self.path(entry.network, entry.container_id, entry.ifname), data)
        except OSError as e:
            raise CacheError(f"cannot write result cache: {e}") from e

    def delete(self, network: str, container_id: str, ifname: str) -> None:
        """Remove the attachment's entry, never another's that has the same name.

        Not fsynced: an entry that reappears after a power loss names an
        attachment whose namespace is gone, which GC reaps (DEL is idempotent).
        """
        path = self.path(network, container_id, ifname)
        if not self.free_for(network, container_id, ifname):
            return  # the file is another attachment's (libcni's names can collide)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise CacheError(f"cannot remove cache entry: {e}") from e

    def free_for(self, network: str, container_id: str, ifname: str) -> bool:
        """Whether the attachment's libcni-named file is absent, unreadable (its
        own DEL removes it), or its own: `<network>-<id>-<ifname>` is not
        one-to-one when the parts contain '-' ("testnet" + "v6-x" and
        "testnet-v6" + "x" name one file)."""
        if "-" not in network + container_id + ifname:
            return True  # then the name has two '-' only: no other split of it exists
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
        found = []
        for name in self._names():
            if match is not None and match not in name:
                continue
            try:
                entry = self.read_path(os.path.join(self.dir, name))
            except (FileNotFoundError, CacheError):
                continue
            if all(getattr(entry, k) == v for k, v in check.items()):
                found.append(entry)
        return found

    def for_container(self, container_id: str) -> list[CachedAttachment]:
        """Attachments of a container: names containing `-<id>-`, then the JSON checked."""
        return self._scan(f"-{container_id}-", {"container_id": container_id})

    def for_network(self, network: str) -> list[CachedAttachment]:
        return self._scan(f"{network}-", {"network": network})

    def all(self) -> list[CachedAttachment]:
        return self._scan(None, {})


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
