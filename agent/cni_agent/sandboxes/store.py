"""The sandbox records, in memory, over the journal's append-only log.

Every change of a record is one line appended to `<state_dir>/journal/`: the
record as it now is, or a line naming a sandbox whose record is gone. The
line is written on the event loop, so a killed agent loses nothing; `commit`
makes the lines so far survive a power loss too (a group commit,
`node.applog`). The journal commits each intent before its plugins run, and
nothing else: docs/reliability.md says why that is enough. Reads never
touch the disk.

At start-up `open` replays the log. The records of an agent before 0.7 (one
JSON file per sandbox under `<state_dir>/sandboxes/`) are imported then, made
durable in the journal, and removed: an upgrade keeps every live sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from cni_agent.cni.cache import fsync_dir
from cni_agent.cni.errors import CacheError
from cni_agent.node import applog
from cni_agent.node.applog import AppendLog
from cni_agent.sandboxes.records import DamagedRecord, Phase, SandboxRecord

log = logging.getLogger(__name__)

JOURNAL_DIR = "journal"
CLEAN = "clean"  # in the journal's dir: the agent that wrote it stopped cleanly
LEGACY_DIR = "sandboxes"  # records of agents before 0.7; `damaged/` below it stays in use
# Compaction once the segments since the last snapshot hold this much more
# than the live records (at least COMPACT_MIN): a node's churn costs disk
# space in proportion to what is alive, and a restart replays little.
COMPACT_MIN = 4 * 1024 * 1024
COMPACT_FACTOR = 2


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # one encoder: json.dumps makes one a call


def dumps(record: SandboxRecord) -> bytes:
    return _ENCODE(record.to_json()).encode()


def parse_record(doc: object) -> SandboxRecord:
    """A record from its JSON; ValueError (or KeyError, TypeError) when unusable."""
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return SandboxRecord.from_json(doc)


@dataclass(frozen=True)
class Damaged:
    """A record whose content is unusable (an unknown phase or version: a newer
    agent's): kept in `path`, the sandbox handled from its cache entries."""

    path: str
    reason: str
    payload: bytes  # kept in the journal until it is set aside


@dataclass(frozen=True)
class Listing:
    records: list[SandboxRecord]
    damaged: list[str]


class SandboxStore:
    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, JOURNAL_DIR)
        self.legacy_dir = os.path.join(state_dir, LEGACY_DIR)
        self.damaged_dir = os.path.join(self.legacy_dir, "damaged")
        self._records: dict[str, SandboxRecord] = {}
        self._damaged: dict[str, Damaged] = {}
        self._sizes: dict[str, int] = {}  # bytes of each sandbox's latest line
        self._live = 0  # their sum: what a snapshot would hold
        self._log: AppendLog | None = None
        self._compaction: asyncio.Task[None] | None = None
        # Removals the disk did not take (full, read-only): sandbox → the
        # attachments whose DEL ran without its "deleting" mark, or whose end
        # could not be written. Every read shows them "deleting" until a write
        # records it, so each operation and reaping pass sees a sandbox being
        # torn down (and the next pass finishes it), not a ready one.
        self._unrecorded: dict[str, frozenset[str]] = {}
        self.compact_due = False  # segments were replayed at start: a snapshot is due
        # When the agent before stopped cleanly (its mark's ctime, in ns), or
        # None (`open` says).
        self.clean_stop: int | None = None
        # The highest generation ever given (records.SandboxRecord.generation):
        # from the records, the lines that end them, and the snapshot's mark.
        self.last_generation = 0

    # --- start-up (blocking) ------------------------------------------------------------

    def open(self) -> list[str]:
        """Replay the journal, and import an older agent's record files; what
        was found wrong, for the log. Blocking: start-up, before any call."""
        self.clean_stop = _take_mark(os.path.join(self.dir, CLEAN))
        wal, replay = AppendLog.open(self.dir, self.damaged_dir)
        notes = list(replay.problems)
        for payload in replay.payloads:
            self._apply(payload, notes)
        imported = self._import_legacy(notes)
        if imported:
            # Durable in the journal before the files go: a crash in between
            # imports them again, the same records.
            wal.write_snapshot_now(self._payloads())
            for path in imported:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            fsync_dir(self.legacy_dir)  # else a power loss could bring them back, stale
            log.info("imported %d sandbox record(s) of an earlier version from %s into %s",
                     len(imported), self.legacy_dir, self.dir)
        self._log = wal
        self.compact_due = replay.from_segments > 0 and not imported
        return notes

    def _apply(self, payload: bytes, notes: list[str]) -> None:
        try:
            doc = json.loads(payload)
        except ValueError:
            notes.append(f"{self.dir}: a journal line that is not JSON was skipped")
            return
        if isinstance(doc, dict) and isinstance(doc.get("deleted"), str):
            self._forget(doc["deleted"])
            generation = doc.get("generation")
            if type(generation) is int and generation > self.last_generation:
                self.last_generation = generation
            return
        sid = doc.get("sandbox") if isinstance(doc, dict) else None
        if not isinstance(sid, str) or not sid:
            notes.append(f"{self.dir}: a journal line naming no sandbox was skipped")
            return
        if doc.get("mark") == "deleting" and isinstance(doc.get("ifnames"), list):
            rec = self._records.get(sid)
            if rec is not None:  # else damaged or gone: the mark is moot
                self._records[sid] = rec.with_phase(Phase.DELETING,
                                                    [str(i) for i in doc["ifnames"]])
            return
        if doc.get("mark") == "added" and isinstance(doc.get("result"), dict):
            rec = self._records.get(sid)
            if rec is not None:
                ready = {str(i) for i in doc.get("ready") or ()}
                added = doc.get("ifname")
                self._records[sid] = rec.with_attachments(
                    replace(a, result=doc["result"] if a.ifname == added else a.result,
                            phase=Phase.READY if a.ifname in ready else a.phase,
                            repairing=None if a.ifname == added else a.repairing)
                    for a in rec.attachments)
            return
        try:
            rec = parse_record(doc)
        except (ValueError, KeyError, TypeError) as e:
            self._forget(sid)
            path = _keep(self.damaged_dir, sid, payload)
            self._damaged[sid] = Damaged(path, str(e) or type(e).__name__, payload)
            notes.append(f"sandbox {sid}: its journal record is unusable ({e}); kept in {path}, "
                         "the sandbox is handled from its cache entries")
            return
        self.last_generation = max(self.last_generation, rec.generation)
        self._set(rec, len(payload))

    def _import_legacy(self, notes: list[str]) -> list[str]:
        """Read the record files an agent before 0.7 wrote (they override what
        the journal says of the same sandbox); the paths to remove once the
        journal holds them. A damaged one is set aside, as that agent did."""
        try:
            names = sorted(os.listdir(self.legacy_dir))
        except FileNotFoundError:
            return []
        done: list[str] = []
        for name in names:
            path = os.path.join(self.legacy_dir, name)
            if name.startswith(".tmp-"):  # a write a crash interrupted
                done.append(path)
                continue
            if not name.endswith(".json") or name.startswith("."):
                continue
            sid = name[: -len(".json")]
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                notes.append(f"cannot read {path} now ({e.strerror}); it is imported at the "
                             "next start")
                continue
            try:
                rec = parse_record(json.loads(data))
                if rec.sandbox_id != sid:
                    raise ValueError(f"it names sandbox {rec.sandbox_id!r}")
            except (ValueError, KeyError, TypeError) as e:
                self._forget(sid)
                moved = _set_aside_file(self.damaged_dir, sid, path)
                notes.append(f"sandbox {sid}: record {path} is damaged ({e or type(e).__name__});"
                             f" moved to {moved}, the sandbox is handled from its cache entries")
                continue
            self._forget(sid)
            self._set(rec, len(data))
            done.append(path)
        return done

    # --- reading (memory) ---------------------------------------------------------------

    def read(self, sandbox_id: str) -> SandboxRecord | None:
        """The record, None when there is none; DamagedRecord when what the
        journal holds of it is unusable (to be set aside)."""
        damaged = self._damaged.get(sandbox_id)
        if damaged is not None:
            raise DamagedRecord(damaged.path, damaged.reason)
        rec = self._records.get(sandbox_id)
        return None if rec is None else self._overlaid(rec)

    def read_owner(self, sandbox_id: str) -> int | None:
        """The uid a sandbox's record names (None: no usable record)."""
        rec = self._records.get(sandbox_id)
        return None if rec is None else rec.owner

    def ids(self, prefix: str = "") -> list[str]:
        return sorted(s for s in (*self._records, *self._damaged) if s.startswith(prefix))

    def records(self, prefix: str = "") -> Iterator[SandboxRecord]:
        for sid, rec in self._records.items():
            if sid.startswith(prefix):
                yield self._overlaid(rec)

    def scan(self, prefix: str = "") -> Listing:
        """Every record (of the ids beginning `prefix`) and the ids of damaged ones."""
        return Listing(sorted(self.records(prefix), key=lambda r: r.sandbox_id),
                       sorted(s for s in self._damaged if s.startswith(prefix)))

    def all(self, prefix: str = "") -> tuple[list[SandboxRecord], list[str]]:
        listing = self.scan(prefix)
        return listing.records, listing.damaged

    def damaged(self, sandbox_id: str) -> str:
        """Where the sandbox's damaged record is kept; "" when it has none."""
        if sandbox_id in self._damaged:
            return self._damaged[sandbox_id].path
        try:
            names = os.listdir(self.damaged_dir)
        except FileNotFoundError:
            return ""
        plain = f"{sandbox_id}.json"
        mine = [n for n in names if n == plain or n.startswith(plain + "~")]
        # The plain name is the first set aside; numbered ones came later.
        mine.sort(key=lambda n: (n != plain, len(n), n))
        return os.path.join(self.damaged_dir, mine[-1]) if mine else ""

    # --- writing (on the loop) ----------------------------------------------------------

    def write(self, record: SandboxRecord) -> None:
        """Append the record as it now is: survives a killed agent at once, a
        power loss after the next `commit`. CacheError when the disk refuses it
        (then nothing changed). A new record gets the next generation; a
        record that has one keeps it."""
        record = self._stamped(record)
        payload = dumps(record)
        self._append(payload)  # a generation it refused is simply not used (no harm)
        self._damaged.pop(record.sandbox_id, None)
        self._set(record, len(payload))
        pending = self._unrecorded.get(record.sandbox_id)
        if pending:  # what the written record now says of them is recorded
            left = frozenset(i for i in pending if (a := record.attachment(i)) is not None
                             and a.phase is not Phase.DELETING)
            self._set_unrecorded(record.sandbox_id, left)
        self._maybe_compact()

    def mark_deleting(self, record: SandboxRecord, ifnames: Iterable[str]) -> None:
        """`write` of `record`, which is the record as it was with `ifnames`
        now "deleting", as a short line: a Teardown's first write, which the
        whole record would make ten times longer."""
        names = sorted(ifnames)
        record = self._carried(record)
        payload = _ENCODE({"sandbox": record.sandbox_id, "mark": "deleting",
                           "ifnames": names}).encode()
        self._append(payload)
        self._set(record, self._sizes.get(record.sandbox_id, 0))
        self._maybe_compact()

    def mark_added(self, record: SandboxRecord, ifname: str, ready: Iterable[str]) -> None:
        """`write` of `record`, which is the record as it was with the result of
        `ifname`'s ADD, and `ready` now "ready", as a line of those alone (the
        intent before it holds the rest: its config, args and capabilities)."""
        record = self._carried(record)
        att = record.attachment(ifname)
        assert att is not None and att.result is not None
        payload = _ENCODE({"sandbox": record.sandbox_id, "mark": "added", "ifname": ifname,
                           "result": att.result, "ready": sorted(ready)}).encode()
        self._append(payload)
        self._damaged.pop(record.sandbox_id, None)
        self._set(record, self._sizes.get(record.sandbox_id, 0) + len(payload))
        self._maybe_compact()

    def delete(self, sandbox_id: str) -> None:
        if sandbox_id in self._records or sandbox_id in self._damaged:
            known = self._records.get(sandbox_id)
            end: dict[str, object] = {"deleted": sandbox_id}
            if known is not None and known.generation:
                end["generation"] = known.generation  # the highest survives it
            self._append(_ENCODE(end).encode())
            self._forget(sandbox_id)
            self._maybe_compact()
        self._unrecorded.pop(sandbox_id, None)

    def set_aside(self, sandbox_id: str) -> str:
        """Drop a damaged record from the journal (its content stays where
        `damaged` says); that path, "" when it has none. Call with the
        sandbox's lock held."""
        damaged = self._damaged.get(sandbox_id)
        if damaged is None:
            return ""
        self._append(json.dumps({"deleted": sandbox_id}).encode())
        self._forget(sandbox_id)
        return damaged.path

    async def commit(self) -> None:
        """Everything written so far made durable (shared with every caller
        waiting meanwhile); CacheError when the disk does not."""
        wal = self._log
        assert wal is not None
        try:
            await wal.commit()
        except OSError as e:
            raise CacheError(f"cannot make the sandbox record durable: {e}") from e

    def _append(self, payload: bytes) -> None:
        if self._log is None:
            raise CacheError("the sandbox journal is not open")
        try:
            self._log.append(payload)
        except OSError as e:
            raise CacheError(f"cannot write sandbox record: {e}") from e

    def generation(self, sandbox_id: str) -> int:
        """The generation of the sandbox's record; 0 when it has none (or one
        from before generations)."""
        rec = self._records.get(sandbox_id)
        return rec.generation if rec is not None else 0

    def stamp(self, sandbox_id: str) -> int:
        """The sandbox's generation, giving its record one first if it has
        none (written before generations): written, durable with the next
        `commit`. 0 when it has no record. CacheError when the disk refuses."""
        rec = self._records.get(sandbox_id)
        if rec is None:
            return 0
        if not rec.generation:
            self.write(rec)
        return self.generation(sandbox_id)

    def _carried(self, record: SandboxRecord) -> SandboxRecord:
        """`record` with the generation of the record it changes."""
        if record.generation:
            return record
        known = self._records.get(record.sandbox_id)
        if known is None or not known.generation:
            return record
        return replace(record, generation=known.generation)

    def _stamped(self, record: SandboxRecord) -> SandboxRecord:
        """`record` with its generation: the one it changes, else the next."""
        record = self._carried(record)
        if record.generation:
            return record
        self.last_generation += 1
        return replace(record, generation=self.last_generation)

    # --- removals the disk did not record -------------------------------------------------

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

    # --- memory and compaction ---------------------------------------------------------

    def _set(self, rec: SandboxRecord, size: int) -> None:
        sid = rec.sandbox_id
        self._records[sid] = rec
        self._live += size - self._sizes.get(sid, 0)
        self._sizes[sid] = size

    def _forget(self, sandbox_id: str) -> None:
        self._records.pop(sandbox_id, None)
        self._damaged.pop(sandbox_id, None)
        self._live -= self._sizes.pop(sandbox_id, 0)

    def _payloads(self) -> list[bytes]:
        return [*(dumps(r) for r in self._records.values()),
                *(d.payload for d in self._damaged.values()), *self._high_water()]

    def _high_water(self) -> list[bytes]:
        """A snapshot's last line: the highest generation given, as the end of
        a record of no sandbox (which agents before generations skip)."""
        if not self.last_generation:
            return []
        return [_ENCODE({"deleted": "", "generation": self.last_generation}).encode()]

    def _maybe_compact(self) -> None:
        wal = self._log
        if wal is None or wal.bytes_since_snapshot <= max(COMPACT_MIN,
                                                          COMPACT_FACTOR * self._live):
            return  # after every append: the cheap test first
        if wal.compacting or (self._compaction is not None and not self._compaction.done()):
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # a tool writing a state dir, not the daemon: no compaction
        self.compact_soon()

    def compact_soon(self) -> None:
        """Write a snapshot of the records as they are now, off the loop. Call
        it with the records in memory up to date with every line appended."""
        wal = self._log
        if wal is None or (self._compaction is not None and not self._compaction.done()):
            return
        records = list(self._records.values())  # as of now: immutable records
        damaged = [d.payload for d in self._damaged.values()]
        high_water = self._high_water()

        def payloads() -> Iterator[bytes]:
            yield from (dumps(r) for r in records)
            yield from damaged
            yield from high_water

        try:
            task = wal.compact(payloads)  # the new segment starts now, with this state
        except OSError as e:
            log.warning("journal compaction could not start (tried again later): %s", e)
            return
        if task is not None:
            self._compaction = asyncio.get_running_loop().create_task(
                self._compacted(wal, task), name="cni-agent-journal-compaction")

    async def _compacted(self, wal: AppendLog, task: asyncio.Task[None]) -> None:
        started = time.monotonic()
        try:
            await task
        except OSError as e:
            log.warning("journal compaction failed (tried again later): %s", e)
            return
        log.debug("journal compacted to %d bytes in %.0f ms", wal.snapshot_bytes,
                  (time.monotonic() - started) * 1000)

    async def close(self) -> None:
        """At shutdown: whatever was written made durable, then the log closed."""
        if self._compaction is not None:
            with contextlib.suppress(Exception):
                await self._compaction
        self.shutdown()

    def shutdown(self) -> None:
        """`close`, blocking and without a loop (tools that write a state dir)."""
        if self._log is not None:
            try:
                self._log.sync_now()
                _leave_mark(os.path.join(self.dir, CLEAN))
            except OSError as e:
                log.warning("cannot sync the journal at shutdown: %s", e)
            self._log.close()
            self._log = None


def _take_mark(path: str) -> int | None:
    """When the mark was left (its ctime in ns), if it is there; gone
    (durably) once this returns."""
    try:
        made = os.stat(path).st_ctime_ns
        os.unlink(path)
    except FileNotFoundError:
        return None
    fsync_dir(os.path.dirname(path))
    return made


def _leave_mark(path: str) -> None:
    """The mark, durably: the next start finds it unless a crash came first."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    fsync_dir(os.path.dirname(path))


def _keep(directory: str, sandbox_id: str, data: bytes) -> str:
    """Write a damaged record's content to `directory` (never over an earlier one)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    target = os.path.join(directory, f"{sandbox_id}.json")
    if os.path.lexists(target):  # an earlier damaged one: keep both ('~' is in no id)
        target = os.path.join(directory, f"{sandbox_id}.json~{time.time_ns()}")
    with open(target, "wb") as f:
        f.write(data)
    return target


def _set_aside_file(directory: str, sandbox_id: str, path: str) -> str:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    target = os.path.join(directory, f"{sandbox_id}.json")
    if os.path.lexists(target):
        target = os.path.join(directory, f"{sandbox_id}.json~{time.time_ns()}")
    os.rename(path, target)
    return target


def recorded(state_dir: str) -> dict[str, dict[str, object]]:
    """The records a state dir's journal holds, as JSON documents by sandbox
    id, read without changing anything (tests, post-mortems; a line a running
    agent is writing is left out)."""
    out: dict[str, dict[str, object]] = {}
    for payload in applog.read(os.path.join(state_dir, JOURNAL_DIR)).payloads:
        try:
            doc = json.loads(payload)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        if isinstance(doc.get("deleted"), str):
            out.pop(doc["deleted"], None)
        elif doc.get("mark") == "deleting" and isinstance(doc.get("sandbox"), str):
            marked = out.get(doc["sandbox"])
            if marked is not None:
                for a in marked.get("attachments") or ():  # type: ignore[attr-defined]
                    if a.get("ifname") in (doc.get("ifnames") or ()):
                        a["phase"] = "deleting"
                marked["phase"] = "deleting"
        elif doc.get("mark") == "added" and isinstance(doc.get("sandbox"), str):
            added = out.get(doc["sandbox"])
            if added is not None:
                atts = added.get("attachments") or ()
                for a in atts:  # type: ignore[attr-defined]
                    if a.get("ifname") == doc.get("ifname"):
                        a["result"] = doc.get("result")
                        a.pop("repairing", None)  # its ADD finished
                    if a.get("ifname") in (doc.get("ready") or ()):
                        a["phase"] = "ready"
                phases = {a.get("phase") for a in atts}  # type: ignore[attr-defined]
                added["phase"] = ("deleting" if "deleting" in phases else
                                  "adding" if "adding" in phases else "ready")
        elif isinstance(doc.get("sandbox"), str):
            out[doc["sandbox"]] = doc
    return out
