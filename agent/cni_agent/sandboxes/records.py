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

# The record format; a record of a later version (a newer agent's, after a
# downgrade) is damaged to this one: set aside, never guessed at.
RECORD_VERSION = 1


class DamagedRecord(CacheError):
    """A sandbox record that cannot be read: empty, not JSON, unknown phase or version."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: unreadable sandbox record: {reason}")
        self.path = path
        self.reason = reason


class StateUnavailable(CacheError):
    """A sandbox record that cannot be read now (too many open files, no
    memory, an I/O or permission error): the operation fails, the file stays.
    Only what a record contains makes it damaged, never the read failing."""

    def __init__(self, path: str, error: OSError) -> None:
        super().__init__(f"{path}: cannot read the sandbox record now ({error.strerror or error}); "
                         "it is left in place")
        self.path = path
        self.errno = error.errno


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
        if self.check is not None:
            doc["check"] = self.check.to_json()
        if self.lost is not None:
            doc["lost"] = self.lost.to_json()
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
            check=CheckState.from_json(doc.get("check")),
            lost=Lost.from_json(doc.get("lost")),
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
        )


class SandboxStore:
    """Blocking file operations on the agent's own (local) state dir.

    Every write is durable (the file fsynced before its rename, the directory
    after): a rename that a power loss undoes, or that leaves a 0-byte file
    (XFS without the fsyncs), would cost a phase change. Writes run off the
    event loop; reads and unlinks are a few plain syscalls, like the lock
    files', and cost less on the loop than a thread hop (~0.15 ms of CPU).
    """

    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, "sandboxes")
        self.damaged_dir = os.path.join(self.dir, "damaged")
        # Removals the disk did not take (full, read-only): sandbox → the
        # attachments whose DEL ran without its "deleting" mark, or whose end
        # could not be written. Every read shows them "deleting" until a write
        # records it, so each operation and reaping pass sees a sandbox being
        # torn down (and the next pass finishes it), not a ready one.
        self._unrecorded: dict[str, frozenset[str]] = {}

    def path(self, sandbox_id: str) -> str:
        return os.path.join(self.dir, f"{sandbox_id}.json")

    def write(self, record: SandboxRecord) -> None:
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            atomic_write(self.path(record.sandbox_id), json.dumps(record.to_json()).encode())
        except OSError as e:
            raise CacheError(f"cannot write sandbox record: {e}") from e
        pending = self._unrecorded.get(record.sandbox_id)
        if pending:  # what the written record now says of them is recorded
            left = frozenset(i for i in pending if (a := record.attachment(i)) is not None
                             and a.phase is not Phase.DELETING)
            self._set_unrecorded(record.sandbox_id, left)

    def unrecorded(self, sandbox_id: str, ifnames: Iterable[str]) -> None:
        """The removal of `ifnames` ran (or runs) though the disk did not take
        its record: show them "deleting" until a write or delete records it."""
        self._set_unrecorded(sandbox_id,
                             self._unrecorded.get(sandbox_id, frozenset()) | frozenset(ifnames))

    def pending(self) -> list[str]:
        """The sandboxes with a removal the disk has not recorded yet."""
        return sorted(self._unrecorded)

    def _set_unrecorded(self, sandbox_id: str, ifnames: frozenset[str]) -> None:
        if ifnames:
            self._unrecorded[sandbox_id] = ifnames
        else:
            self._unrecorded.pop(sandbox_id, None)

    def _overlaid(self, record: SandboxRecord) -> SandboxRecord:
        pending = self._unrecorded.get(record.sandbox_id)
        if not pending:
            return record
        return replace(record, attachments=tuple(
            replace(a, phase=Phase.DELETING) if a.ifname in pending else a
            for a in record.attachments))

    def read(self, sandbox_id: str) -> SandboxRecord | None:
        """The record, None when there is none; DamagedRecord when what it holds
        is unusable (empty, not JSON, an unknown phase or version), to be set
        aside; StateUnavailable when it cannot be read now (EMFILE, ENFILE,
        ENOMEM, EIO, EACCES, EINTR, or any other errno: a failing read says
        nothing about the content, and setting it aside would lose the owner,
        the namespace's identity and the check state for good)."""
        path = self.path(sandbox_id)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StateUnavailable(path, e) from None
        try:
            record = SandboxRecord.from_json(json.loads(data))
        except (ValueError, KeyError, TypeError) as e:
            raise DamagedRecord(path, str(e) or type(e).__name__) from None
        return self._overlaid(record)

    def set_aside(self, sandbox_id: str) -> str:
        """Move an unreadable record to `damaged/` (kept for a post-mortem, never
        read again); its path there, "" when it was gone already. Call with the
        sandbox's lock held: a writer may not race the rename."""
        os.makedirs(self.damaged_dir, mode=0o700, exist_ok=True)
        target = os.path.join(self.damaged_dir, f"{sandbox_id}.json")
        if os.path.lexists(target):  # an earlier damaged one: keep both ('~' is in no id)
            target = os.path.join(self.damaged_dir, f"{sandbox_id}.json~{time.time_ns()}")
        try:
            os.rename(self.path(sandbox_id), target)
        except FileNotFoundError:
            return ""
        return target

    def damaged(self, sandbox_id: str) -> str:
        """Where the sandbox's damaged record is: in place (not set aside yet), or
        the latest set aside in `damaged/`; "" when it has none."""
        if os.path.exists(self.path(sandbox_id)):
            return self.path(sandbox_id)
        try:
            names = os.listdir(self.damaged_dir)
        except FileNotFoundError:
            return ""
        plain = f"{sandbox_id}.json"
        mine = [n for n in names if n == plain or n.startswith(plain + "~")]
        # The plain name is the first set aside; numbered ones came later.
        mine.sort(key=lambda n: (n != plain, len(n), n))
        return os.path.join(self.damaged_dir, mine[-1]) if mine else ""

    def delete(self, sandbox_id: str) -> None:
        try:
            os.unlink(self.path(sandbox_id))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CacheError(f"cannot remove sandbox record: {e}") from e
        self._unrecorded.pop(sandbox_id, None)

    def ids(self, prefix: str = "") -> list[str]:
        """The ids of the records (those beginning `prefix`)."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(n[: -len(".json")] for n in names
                      if n.endswith(".json") and not n.startswith(".") and n.startswith(prefix))

    def scan(self, prefix: str = "") -> Listing:
        """Every record (of the ids beginning `prefix`): the readable ones, the
        ids of damaged ones, and of those that cannot be read now (to be left
        alone: looked at again next time)."""
        listing = Listing([], [], [])
        for sid in self.ids(prefix):
            try:
                rec = self.read(sid)
            except DamagedRecord:
                listing.damaged.append(sid)
                continue
            except StateUnavailable:
                listing.unavailable.append(sid)
                continue
            if rec is not None:
                listing.records.append(rec)
        return listing

    def all(self, prefix: str = "") -> tuple[list[SandboxRecord], list[str]]:
        """Every readable record (of the ids beginning `prefix`), and the ids
        of damaged ones (`scan` without those that cannot be read now)."""
        listing = self.scan(prefix)
        return listing.records, listing.damaged


@dataclass(frozen=True)
class Listing:
    records: list[SandboxRecord]
    damaged: list[str]
    unavailable: list[str]
