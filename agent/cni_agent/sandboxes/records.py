"""Sandbox records: what the journal keeps of each sandbox, and their format.

libcni writes its cache only after a whole ADD chain succeeded. A runtime
killed in between leaves an IP allocated that nothing remembers. So before the
first plugin of an attachment runs, its intent (network, ifname, the exact
config bytes, args and capabilities) is made durable in the journal in phase
"adding"; it becomes "ready" with its result once its chain ran, "deleting"
before its DEL, and leaves the record when the DEL succeeded.
`journal.Journal` drives those transitions, `store.SandboxStore` keeps the
records (in memory, over an append-only log); this module is only the format.

The netns identity recorded at ADD lets GC tell a deleted namespace, or a path
reused by another namespace, from a live one.
"""

from __future__ import annotations

import base64
import functools
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from cni_agent.cni.errors import CacheError
from cni_agent.node.netns import NetnsId

# The record format; a record of a later version (a newer agent's, after a
# downgrade) is damaged to this one: set aside, never guessed at.
RECORD_VERSION = 1


@functools.lru_cache(maxsize=256)
def _config(text: str) -> bytes:
    """A recorded config, decoded once: the records of one network share it
    (one bytes object in memory, one decoding when a journal is replayed)."""
    return base64.b64decode(text, validate=True)


@functools.lru_cache(maxsize=256)
def _b64(data: bytes) -> str:
    """base64 of a config, remembered: every write of a record encodes its
    attachments' configs, and a node has a few distinct ones."""
    return base64.b64encode(data).decode()


class DamagedRecord(CacheError):
    """A sandbox record that cannot be read: empty, not JSON, unknown phase or version."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: unreadable sandbox record: {reason}")
        self.path = path
        self.reason = reason


class CheckVerdict(StrEnum):
    """What the last CHECK of an attachment said, measured against its baseline."""

    OK = "ok"  # passed (the first pass is the baseline)
    DRIFTED = "drifted"  # the plugin's own CHECK failed after it had passed: something changed it
    UNSUPPORTED = "unsupported"  # failed and never passed: the plugin's CHECK proves nothing
    DISABLED = "disabled"  # the network's cniVersion (< 0.4.0) or disableCheck: no CHECK
    # The CHECK could not run (a timeout, a plugin that could not start, the
    # agent's own error): no word on the attachment, never drift, never repaired.
    FAILED_TO_RUN = "failed-to-run"
    # Repaired, but its re-ADD returned another address than it had.
    NEW_ADDRESS = "repaired-with-new-address"
    # Its repair's re-ADD failed: gone from the namespace, kept in the record
    # and retried with backoff (`Lost`).
    LOST = "lost"


# What an agent that knows only the first four verdicts (0.3 to 0.5) reads in
# "verdict"; the full one is in "state", a key those agents ignore.
_COMPAT = {CheckVerdict.NEW_ADDRESS: CheckVerdict.OK, CheckVerdict.LOST: CheckVerdict.DRIFTED}


def _verdict(value: Any) -> CheckVerdict | None:
    try:
        return CheckVerdict(value)
    except ValueError:
        return None


@dataclass(frozen=True)
class CheckState:
    """The outcome of an attachment's CHECKs, kept in its record across restarts."""

    verdict: CheckVerdict
    at: float  # time of the last CHECK (epoch seconds)
    reason: str = ""  # the plugin's message of the last failure
    passed: bool = False  # has it ever passed (the baseline exists)
    repairs: int = 0
    # What the last repair did when it is worth saying: refused ("repair would
    # change the address: ..."), the address it changed, why it failed.
    repair: str = ""

    def to_json(self) -> dict[str, Any]:
        compat = _COMPAT.get(self.verdict, self.verdict)
        if self.verdict is CheckVerdict.FAILED_TO_RUN:
            compat = CheckVerdict.OK if self.passed else CheckVerdict.UNSUPPORTED
        doc: dict[str, Any] = {"verdict": str(compat), "at": self.at, "reason": self.reason,
                               "passed": self.passed, "repairs": self.repairs}
        if compat is not self.verdict:
            doc["state"] = str(self.verdict)
        if self.repair:
            doc["repair"] = self.repair
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> CheckState | None:
        if not isinstance(doc, Mapping):
            return None
        # A state a later agent wrote and this one does not know falls back to
        # its "verdict"; a check state is never worth a damaged record.
        verdict = _verdict(doc.get("state")) or _verdict(doc.get("verdict"))
        if verdict is None:
            return None
        return cls(verdict, float(doc["at"]), str(doc.get("reason", "")),
                   bool(doc.get("passed", False)), int(doc.get("repairs", 0)),
                   str(doc.get("repair", "")))


@dataclass(frozen=True)
class Lost:
    """An attachment whose repair's re-ADD failed: kept in the record (its
    network, ifname, config and args, the addresses to ask for again) and
    retried with backoff until an ADD succeeds or the sandbox is torn down.
    Agents before 0.6 ignore the key: to them it is a ready attachment with no
    cache entry, which their Teardown and reaping DEL (DEL is idempotent)."""

    since: float  # when the repair failed
    reason: str  # the last ADD's error
    attempts: int  # ADDs that failed so far (the repair's own is the first)
    next_try: float  # epoch seconds
    ips: tuple[str, ...] = ()  # what it had before its repair
    mac: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"since": self.since, "reason": self.reason, "attempts": self.attempts,
                "next": self.next_try, "ips": list(self.ips), "mac": self.mac}

    @classmethod
    def from_json(cls, doc: Any) -> Lost | None:
        if not isinstance(doc, Mapping):
            return None
        return cls(float(doc["since"]), str(doc.get("reason", "")), int(doc.get("attempts", 1)),
                   float(doc.get("next", 0)), tuple(str(i) for i in doc.get("ips") or ()),
                   str(doc.get("mac", "")))


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
    # Its CHECKs (drift.py); None: not checked yet. An optional key, so records
    # without it (0.1, 0.2) load, and older agents ignore it: no version bump.
    check: CheckState | None = None
    # Set while it is lost (its repair's re-ADD failed): an optional key too.
    lost: Lost | None = None
    # While a repair runs (its DEL, then its re-ADD): what it is if the repair
    # never finishes. A restart finding it finishes the DEL or rolls the ADD
    # back and keeps the attachment lost with this, as a failed ADD would;
    # cleared by the ADD's success. Older agents ignore the key (they finish
    # the removal, or roll the intent back).
    repairing: Lost | None = field(default=None, compare=False)
    # The ADD chain's result, as the libcni cache entry holds it (the journal
    # is its source of truth: the cache is rewritten from it). None: no result
    # (not added yet, or lost). Not part of an attachment's identity.
    result: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        doc = {
            "network": self.network,
            "ifname": self.ifname,
            "config": _b64(self.config),
            "args": [list(kv) for kv in self.args],
            "capabilities": dict(self.capabilities),
            "phase": str(self.phase),
        }
        if self.origin:
            doc["origin"] = self.origin
        if self.check is not None:
            doc["check"] = self.check.to_json()
        if self.lost is not None:
            doc["lost"] = self.lost.to_json()
        if self.repairing is not None:
            doc["repairing"] = self.repairing.to_json()
        if self.result is not None:
            doc["result"] = self.result
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], phase: Phase) -> Attachment:
        result = doc.get("result")
        return cls(
            network=str(doc["network"]),
            ifname=str(doc["ifname"]),
            config=_config(doc["config"]),
            args=tuple((str(k), str(v)) for k, v in doc.get("args", [])),
            capabilities=dict(doc.get("capabilities") or {}),
            # Records of 0.1.0 had one phase for the whole sandbox.
            phase=Phase(doc.get("phase", phase)),
            origin=str(doc.get("origin", "")),
            check=CheckState.from_json(doc.get("check")),
            lost=Lost.from_json(doc.get("lost")),
            repairing=Lost.from_json(doc.get("repairing")),
            result=result if isinstance(result, dict) else None,
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
    owner: int = 0  # the uid that set it up (records before 0.2: root's)
    # Which set-up of this id it is: a node-wide number, larger for every new
    # record (the store stamps it at the record's first write, and keeps the
    # highest across deletions and compactions). A DEL queued while the agent
    # was down is for the generation it was bound to; another one is not its
    # (service/queued.py). 0: unknown (records before the queue); an optional
    # key, so older agents ignore it: no version bump.
    generation: int = field(default=0, compare=False)

    @property
    def by_descriptor(self) -> bool:
        """Whether its namespace is known by its identity alone (a caller that
        is not root gave a descriptor): `netns` is then only the caller's
        label, never opened by the agent (sandboxes/owners.py)."""
        return self.owner != 0

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

    def with_check(self, ifname: str, check: CheckState) -> SandboxRecord:
        return self.with_attachment(ifname, check=check)

    def with_attachment(self, ifname: str, **changes: Any) -> SandboxRecord:
        """The record with the attachment `ifname` changed (its place kept)."""
        return replace(self, attachments=tuple(replace(a, **changes) if a.ifname == ifname
                                               else a for a in self.attachments))

    def with_phase(self, phase: Phase, ifnames: Iterable[str] | None = None) -> SandboxRecord:
        """The record with `ifnames` (all when None) moved to `phase`."""
        chosen = None if ifnames is None else set(ifnames)
        return self.with_attachments(
            replace(a, phase=phase) if chosen is None or a.ifname in chosen else a
            for a in self.attachments)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": RECORD_VERSION,
            "sandbox": self.sandbox_id,
            "netns": self.netns,
            "netnsId": self.netns_id.to_json() if self.netns_id else None,
            "phase": str(self.phase),
            "attachments": [a.to_json() for a in self.attachments],
            "request": self.request,
            "updated": self.updated,
            "owner": self.owner,
            **({"generation": self.generation} if self.generation else {}),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SandboxRecord:
        version = doc.get("version", RECORD_VERSION)  # records before 0.2 had none
        if type(version) is not int or not 1 <= version <= RECORD_VERSION:
            raise ValueError(f"record version {version!r} is not one this agent knows "
                             f"(up to {RECORD_VERSION})")
        phase = Phase(doc["phase"])
        return cls(
            sandbox_id=str(doc["sandbox"]),
            netns=str(doc.get("netns", "")),
            netns_id=NetnsId.from_json(doc.get("netnsId")),
            attachments=tuple(Attachment.from_json(a, phase) for a in doc["attachments"]),
            request=str(doc.get("request", "")),
            updated=float(doc.get("updated", 0)),
            owner=int(doc.get("owner", 0)),
            generation=int(doc.get("generation", 0)),
        )
