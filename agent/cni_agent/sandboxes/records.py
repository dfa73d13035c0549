"""Sandbox records: the on-disk write-ahead journal that makes a kill -9 harmless.

libcni writes its cache only after a whole ADD chain succeeded. A runtime
killed in between leaves an IP allocated that nothing remembers. So before the
first plugin of an attachment runs, its intent (network, ifname, the exact
config bytes, args and capabilities) is written durably here in phase
"adding"; it becomes "ready" once cached, "deleting" before its DEL, and
leaves the record when the DEL succeeded. `journal.Journal` drives those
transitions; this module is only the format and the files.

One JSON file per sandbox under `<state_dir>/sandboxes/`, written atomically.
The netns identity recorded at ADD lets GC tell a deleted namespace, or a path
reused by another namespace, from a live one.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from cni_agent.cni.cache import atomic_write
from cni_agent.cni.errors import CacheError
from cni_agent.node.netns import NetnsId


class Phase(StrEnum):
    ADDING = "adding"
    READY = "ready"
    DELETING = "deleting"


@dataclass(frozen=True)
class Attachment:
    """One interface of a sandbox on one network; unique by ifname within it."""

    network: str
    ifname: str
    config: bytes = field(repr=False)
    args: tuple[tuple[str, str], ...] = ()
    capabilities: Mapping[str, Any] = field(default_factory=dict)
    phase: Phase = Phase.ADDING
    # Who made it: "" for Setup, else the runtime network of a shim call (its GC scope).
    origin: str = ""

    def to_json(self) -> dict[str, Any]:
        doc = {
            "network": self.network,
            "ifname": self.ifname,
            "config": base64.b64encode(self.config).decode(),
            "args": [list(kv) for kv in self.args],
            "capabilities": dict(self.capabilities),
            "phase": str(self.phase),
        }
        if self.origin:
            doc["origin"] = self.origin
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], phase: Phase) -> Attachment:
        return cls(
            network=str(doc["network"]),
            ifname=str(doc["ifname"]),
            config=base64.b64decode(doc["config"], validate=True),
            args=tuple((str(k), str(v)) for k, v in doc.get("args", [])),
            capabilities=dict(doc.get("capabilities") or {}),
            # Records of 0.1.0 had one phase for the whole sandbox.
            phase=Phase(doc.get("phase", phase)),
            origin=str(doc.get("origin", "")),
        )


@dataclass(frozen=True)
class SandboxRecord:
    sandbox_id: str
    netns: str
    netns_id: NetnsId | None
    attachments: tuple[Attachment, ...]
    # Identifies the Setup request, so an identical repeat is recognised.
    request: str = ""
    updated: float = field(default_factory=time.time)

    @property
    def phase(self) -> Phase:
        """The sandbox's phase: any unfinished attachment makes it unfinished."""
        phases = {a.phase for a in self.attachments}
        if Phase.DELETING in phases:
            return Phase.DELETING
        if Phase.ADDING in phases:
            return Phase.ADDING
        return Phase.READY

    def attachment(self, ifname: str) -> Attachment | None:
        return next((a for a in self.attachments if a.ifname == ifname), None)

    def with_attachments(self, attachments: Iterable[Attachment], **changes: Any) -> SandboxRecord:
        return replace(self, attachments=tuple(attachments), updated=time.time(), **changes)

    def with_phase(self, phase: Phase, ifnames: Iterable[str] | None = None) -> SandboxRecord:
        """The record with `ifnames` (all when None) moved to `phase`."""
        chosen = None if ifnames is None else set(ifnames)
        return self.with_attachments(
            replace(a, phase=phase) if chosen is None or a.ifname in chosen else a
            for a in self.attachments)

    def to_json(self) -> dict[str, Any]:
        return {
            "sandbox": self.sandbox_id,
            "netns": self.netns,
            "netnsId": self.netns_id.to_json() if self.netns_id else None,
            "phase": str(self.phase),
            "attachments": [a.to_json() for a in self.attachments],
            "request": self.request,
            "updated": self.updated,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SandboxRecord:
        phase = Phase(doc["phase"])
        return cls(
            sandbox_id=str(doc["sandbox"]),
            netns=str(doc.get("netns", "")),
            netns_id=NetnsId.from_json(doc.get("netnsId")),
            attachments=tuple(Attachment.from_json(a, phase) for a in doc["attachments"]),
            request=str(doc.get("request", "")),
            updated=float(doc.get("updated", 0)),
        )


class SandboxStore:
    """Blocking file operations on the agent's own (local) state dir.

    A durable write (two fsyncs) runs off the event loop; the others are a
    few plain syscalls, like the lock files', and cost less on the loop than
    the thread hop that would move them off it (~0.15 ms of CPU each).
    """

    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, "sandboxes")

    def path(self, sandbox_id: str) -> str:
        return os.path.join(self.dir, f"{sandbox_id}.json")

    def write(self, record: SandboxRecord, durable: bool = False) -> None:
        """Only an intent before its first ADD must survive a power loss (`durable`):
        after one, every namespace is gone and any other record state is reaped
        or rolled back alike. A killed process loses nothing either way."""
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            atomic_write(self.path(record.sandbox_id), json.dumps(record.to_json()).encode(),
                         durable=durable)
        except OSError as e:
            raise CacheError(f"cannot write sandbox record: {e}") from e

    def read(self, sandbox_id: str) -> SandboxRecord | None:
        path = self.path(sandbox_id)
        try:
            with open(path, "rb") as f:
                return SandboxRecord.from_json(json.load(f))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CacheError(f"{path}: unreadable sandbox record: {e}") from None

    def delete(self, sandbox_id: str) -> None:
        try:
            os.unlink(self.path(sandbox_id))
        except FileNotFoundError:
            return

    def ids(self) -> list[str]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(n[: -len(".json")] for n in names
                      if n.endswith(".json") and not n.startswith("."))

    def all(self) -> tuple[list[SandboxRecord], list[str]]:
        """Every readable record, and the ids of unreadable ones."""
        records, bad = [], []
        for sid in self.ids():
            try:
                rec = self.read(sid)
            except CacheError:
                bad.append(sid)
                continue
            if rec is not None:
                records.append(rec)
        return records, bad
