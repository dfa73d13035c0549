"""Sandbox records: the write-ahead journal that makes a kill -9 harmless.

libcni writes its cache only after a whole ADD chain succeeded. A runtime
killed in between leaves an IP allocated that nothing remembers. So before the
first plugin runs, the intent (every attachment with the exact config bytes,
args and capabilities) is written durably here with phase "adding"; it becomes
"ready" when all attachments are cached. Teardown marks "deleting" first. On
start-up (and at every GC) a record not "ready" is rolled back or finished
with DEL, so every sandbox ends up fully set up and cached, or fully gone.

One JSON file per sandbox under `<state_dir>/sandboxes/`, written atomically.
The netns identity (device, inode) recorded at ADD lets GC tell a deleted
namespace, or a path reused by another namespace, from a live one.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from cni_agent.cni.cache import atomic_write
from cni_agent.cni.errors import CacheError


class Phase(StrEnum):
    ADDING = "adding"
    READY = "ready"
    DELETING = "deleting"


@dataclass(frozen=True)
class AttachmentIntent:
    network: str
    ifname: str
    config: bytes = field(repr=False)
    args: tuple[tuple[str, str], ...] = ()
    capabilities: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "network": self.network,
            "ifname": self.ifname,
            "config": base64.b64encode(self.config).decode(),
            "args": [list(kv) for kv in self.args],
            "capabilities": dict(self.capabilities),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> AttachmentIntent:
        return cls(
            network=str(doc["network"]),
            ifname=str(doc["ifname"]),
            config=base64.b64decode(doc["config"], validate=True),
            args=tuple((str(k), str(v)) for k, v in doc.get("args", [])),
            capabilities=dict(doc.get("capabilities") or {}),
        )


@dataclass(frozen=True)
class SandboxRecord:
    sandbox_id: str
    netns: str
    netns_id: tuple[int, int] | None
    phase: Phase
    attachments: tuple[AttachmentIntent, ...]
    # Identifies the request, so an identical repeat is recognised.
    request: str = ""
    updated: float = field(default_factory=time.time)

    def with_phase(self, phase: Phase) -> SandboxRecord:
        return replace(self, phase=phase, updated=time.time())

    def to_json(self) -> dict[str, Any]:
        return {
            "sandbox": self.sandbox_id,
            "netns": self.netns,
            "netnsId": list(self.netns_id) if self.netns_id else None,
            "phase": str(self.phase),
            "attachments": [a.to_json() for a in self.attachments],
            "request": self.request,
            "updated": self.updated,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SandboxRecord:
        nid = doc.get("netnsId")
        return cls(
            sandbox_id=str(doc["sandbox"]),
            netns=str(doc.get("netns", "")),
            netns_id=(int(nid[0]), int(nid[1])) if nid else None,
            phase=Phase(doc["phase"]),
            attachments=tuple(AttachmentIntent.from_json(a) for a in doc["attachments"]),
            request=str(doc.get("request", "")),
            updated=float(doc.get("updated", 0)),
        )


class SandboxStore:
    """Blocking file operations; callers run them off the event loop."""

    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, "sandboxes")

    def path(self, sandbox_id: str) -> str:
        return os.path.join(self.dir, f"{sandbox_id}.json")

    def write(self, record: SandboxRecord) -> None:
        """Only the intent before the first ADD must survive a power loss: after
        one, every namespace is gone and any other record state is reaped or
        rolled back alike. A killed process loses nothing either way."""
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            atomic_write(self.path(record.sandbox_id), json.dumps(record.to_json()).encode(),
                         durable=record.phase is Phase.ADDING)
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
