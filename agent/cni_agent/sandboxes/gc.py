"""Garbage collection and reaping: the leaks users hit after crashes and reboots.

Exclusion, in three lines: reaping a sandbox holds that sandbox's lock, taken
only if free (a busy sandbox is live; the next GC looks again); the GC verb of
a network waits for an instant with no ADD/DEL on that network, never blocking
one, and is retried later if none comes. So a GC never makes another
sandbox's operation wait or fail.

The jobs:
- finish what a killed agent left half-done (attachments not "ready" are
  DELed with the exact config bytes recorded before their ADD);
- DEL cached attachments whose sandbox is gone: its namespace was deleted, or
  its path now names another namespace (the reboot case), or — on demand —
  the runtime says it is not valid. Such DELs get an empty netns: a reused
  path must never reach a plugin;
- send the GC verb with the live attachments (CNI >= 1.1.0), to the networks
  the operator declared the agent's own (`gc.networks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field

from cni_agent.cni.cache import CachedAttachment
from cni_agent.cni.config import NetworkConfigList
from cni_agent.cni.errors import CacheError
from cni_agent.cni.logctx import log_fields
from cni_agent.cni.result import version_at_least
from cni_agent.node.blocking import UNANSWERED
from cni_agent.node.locks import LockTimeout, NetworkLocks, SandboxLocks
from cni_agent.node.netns import Pinned
from cni_agent.sandboxes.events import Change
from cni_agent.sandboxes.journal import Journal, Removal, Unconfirmed
from cni_agent.sandboxes.order import Kind, Sequencer
from cni_agent.sandboxes.policy import OWNED_PREFIX, ROOT, Caller, Policy
from cni_agent.sandboxes.records import Phase, SandboxRecord

log = logging.getLogger(__name__)
# Seconds a reaping waits for a scheduled CHECK to yield the lock (it stops at
# once; its plugin is killed and reaped).
YIELD_WAIT = 2.0


@dataclass
class GCReport:
    rolled_back: list[str] = field(default_factory=list)
    deleted: list[tuple[str, str, str]] = field(default_factory=list)  # network, sandbox, ifname
    busy: list[str] = field(default_factory=list)  # sandboxes in use: looked at next time
    unconfirmed: list[str] = field(default_factory=list)  # the recorded inode, unconfirmed: kept
    deferred: list[str] = field(default_factory=list)  # networks whose GC verb waits for a quiet instant
    errors: list[str] = field(default_factory=list)
    # Removals done, but not recorded (the state dir full or read-only): each
    # also in `errors`; a pass finishes them once the disk takes the writes.
    unrecorded: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Snapshot:
    records: dict[str, SandboxRecord]
    entries: dict[str, list[CachedAttachment]]  # by sandbox
    unreadable: list[str]


def gc_verb_allowed(declared: Collection[str]) -> Callable[[str], bool]:
    """`gc.networks`: names, or "*" for every network."""
    names = frozenset(declared)
    return lambda network: "*" in names or network in names


class Reaper:
    def __init__(
        self,
        journal: Journal,
        locks: SandboxLocks,
        netlocks: NetworkLocks,
        networks: Callable[[], Sequence[NetworkConfigList]],
        *,
        gc_verb: Callable[[str], bool] = lambda network: False,
        lock_timeout: float = 60.0,
        verb_wait: float = 10.0,
        retry_delay: float = 30.0,
        interval: float = 0.0,
        on_report: Callable[[GCReport], None] = lambda report: None,
        on_pass: Callable[[GCReport], None] = lambda report: None,
        order: Sequencer | None = None,
    ) -> None:
        self.journal = journal
        # The requests' order: reaping arrives in it, so a scheduled CHECK
        # holding a sandbox's lock yields instead of making it look busy.
        self.order = order or Sequencer()
        self.locks = locks
        self.netlocks = netlocks
        self._networks = networks
        self._gc_verb = gc_verb
        self._lock_timeout = lock_timeout
        self._verb_wait = verb_wait
        self._retry_delay = retry_delay
        self._on_report = on_report  # metrics
        self._on_pass = on_pass  # metrics: each periodic pass
        # Set once start-up recovery is over: no sandbox operation runs before.
        self.recovered = asyncio.Event()
        self._retry: asyncio.Task[None] | None = None
        self.interval = interval  # between reaping passes; 0: none
        self._periodic: asyncio.Task[None] | None = None

    async def recover(self) -> GCReport:
        """Start-up: finish or undo what a killed agent left half-done."""
        report = GCReport()
        try:
            snap = self._snapshot()
            for sid in sorted({*snap.unreadable, *(s for s, r in snap.records.items()
                                                    if r.phase is not Phase.READY)}):
                # A damaged record is set aside (under the lock) and its sandbox
                # handled from its cache entries, like one without a record.
                await self._reap(sid, None, report, wait=self._lock_timeout)
        finally:
            self.recovered.set()
            self._on_report(report)
        return report

    def start_periodic(self) -> None:
        """Reap every `interval` seconds, unprompted: a namespace deleted while
        nobody calls (a crashed runtime, a DEL refused or given up) keeps its
        IP only until the next pass. Each pass pins every record's namespace
        (bounded by the path threads) and skips a sandbox that is in use."""
        if self.interval > 0 and self._periodic is None:
            self._periodic = asyncio.create_task(self._every(), name="cni-agent-reaping")

    async def _every(self) -> None:
        await self.recovered.wait()
        while True:
            await asyncio.sleep(self.interval)
            try:
                self._on_pass(await self.collect(verbs=False))
                await self.journal.restore_cache()
            except Exception:  # a pass that broke must not end all later ones
                log.exception("reaping pass failed; the next one runs in %gs", self.interval)

    async def collect(self, valid_ids: Collection[str] | None = None, verbs: bool = True, *,
                      caller: Caller = ROOT) -> GCReport:
        """Reap stale attachments and (with `verbs`) send GC; `valid_ids`
        overrides liveness detection.

        A `caller` other than root speaks for its own sandboxes only (those
        in its id space are looked at), and sends no GC verb. Whether a
        sandbox is reaped is decided under its lock: never one set up after
        this call arrived, never another owner's, whatever the snapshot said.
        """
        since = self.journal.generation
        await self.recovered.wait()
        report = GCReport()
        snap = self._snapshot(Policy.own_prefix(caller))
        candidates = await self._candidates(snap, valid_ids, report)
        for sid in candidates:
            await self._reap(sid, valid_ids, report, wait=0, since=since, caller=caller)
        if verbs and caller.root:
            await self._send_gc_verbs([n for n in self._networks() if self._gc_verb(n.name)],
                                      report)
        for err in report.errors:
            log.warning("gc: %s", err)
        if report.deleted or report.rolled_back:
            log.info("gc: removed %d stale attachment(s), rolled back %d sandbox(es)",
                     len(report.deleted), len(report.rolled_back))
        self._on_report(report)
        return report

    async def release(self, origin: str, valid: Collection[tuple[str, str]]) -> GCReport:
        """A runtime's GC through the shim: DEL what its network `origin` made and
        no longer lists as (sandbox, ifname). A busy sandbox is left for its next GC."""
        since = self.journal.generation
        await self.recovered.wait()
        report = GCReport()
        records = sorted(self.journal.store.records(), key=lambda r: r.sandbox_id)
        for rec in records:
            if _released(rec, origin, valid):
                await self._release(rec.sandbox_id, origin, valid, report, since)
        if report.deleted:
            log.info("gc of %s: removed %d attachment(s) it no longer lists", origin,
                     len(report.deleted))
        self._on_report(report)
        return report

    @contextlib.asynccontextmanager
    async def _hold(self, sid: str, wait: float) -> AsyncIterator[None]:
        """The sandbox's lock within `wait`; a scheduled CHECK holding it yields."""
        with self.order.arrive(sid, Kind.OTHER):
            if self.order.yielding(sid):
                wait = max(wait, YIELD_WAIT)
            async with self.locks.hold(sid, wait):
                yield

    async def _release(self, sid: str, origin: str, valid: Collection[tuple[str, str]],
                       report: GCReport, since: int) -> None:
        try:
            async with self._hold(sid, 0):
                with log_fields(SANDBOX_ID=sid):
                    rec, entries = await self.journal.view(sid)
                    doomed = _released(rec, origin, valid) if rec is not None else set()
                    if rec is None or not doomed or self.journal.born_after(sid, since):
                        return
                    async with self.journal.live_netns(rec, entries) as ns:
                        removal = await self.journal.remove(rec, doomed, ns, entries)
                    if self.journal.events.on:
                        self.journal.tell_removed(Change.REAPED, rec, removal)
                    kept = {a.ifname for a in removal.left.attachments} if removal.left else set()
                    report.deleted.extend((a.network, sid, a.ifname) for a in rec.attachments
                                          if a.ifname in doomed and a.ifname not in kept)
                    self._account(report, sid, removal)
        except LockTimeout:
            report.busy.append(sid)
        except (*UNANSWERED, CacheError) as e:
            report.errors.append(f"sandbox {sid}: not looked at: {e}")

    async def stop(self) -> None:
        for task in (self._retry, self._periodic):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # --- what to look at ---------------------------------------------------------

    def _snapshot(self, prefix: str = "") -> _Snapshot:
        """The records (of the ids beginning `prefix`) and cache entries: the
        records' own, and (without a prefix narrowing it to one owner) those
        of sandboxes no record names — the cache's index says which files, so
        only those are read. From memory, on the loop."""
        listing = self.journal.store.scan(prefix)
        entries: dict[str, list[CachedAttachment]] = {}
        for r in listing.records:
            entries[r.sandbox_id] = self.journal.recorded_entries(r)
        if not prefix:
            recorded = {r.sandbox_id for r in listing.records}
            for cid in sorted({cid for _, cid, _ in self.journal.runtime.cache.keys()} - recorded):
                entries[cid] = self.journal.runtime.cache.for_container(cid)
        return _Snapshot({r.sandbox_id: r for r in listing.records}, entries, listing.damaged)

    async def _candidates(self, snap: _Snapshot, valid_ids: Collection[str] | None,
                          report: GCReport) -> list[str]:
        """Sandboxes that may need work (decided again under their lock)."""
        out = []
        for sid in sorted(set(snap.records) | set(snap.entries) | set(snap.unreadable)):
            rec = snap.records.get(sid)
            entries = {(e.network, e.ifname): e for e in snap.entries.get(sid, [])}
            try:
                if sid in snap.unreadable or (valid_ids is not None and sid not in valid_ids):
                    out.append(sid)
                elif rec is not None:
                    # An inode-only record (0.1.0) also goes to `_reap`, whose lock
                    # lets a confirmed one take the namespace's stronger identity.
                    weak = rec.netns_id is not None and not rec.netns_id.certain
                    if rec.phase is not Phase.READY or weak or not await self._alive(rec, entries):
                        out.append(sid)
                else:
                    for e in entries.values():
                        if not await self._present(e):
                            out.append(sid)
                            break
            except Unconfirmed:
                report.unconfirmed.append(sid)  # alive as far as can be told: kept
            except UNANSWERED as e:
                report.errors.append(f"sandbox {sid}: not looked at: {e}")  # next GC retries
        return out

    async def _alive(self, rec: SandboxRecord, entries: dict[tuple[str, str], CachedAttachment]
                     ) -> bool:
        async with self.journal.live_netns(rec, entries, confirm=False) as ns:
            return ns is not None

    async def _present(self, entry: CachedAttachment) -> bool:
        """Whether a cache entry's netns path (written by another tool: no identity
        recorded) still is a network namespace.

        One in a member's id space (its record set aside as damaged) is taken
        as present: its path is the member's label, which root never opens
        (a hung mount would hold root's GC); its owner's Teardown with the
        descriptor, or root's GC not listing it, removes it."""
        if entry.container_id.startswith(OWNED_PREFIX):
            return True
        if not entry.netns:
            return False
        async with self.journal.paths.pinned_if_netns(entry.netns) as ns:
            return ns is not None

    # --- one sandbox, under its lock ----------------------------------------------

    async def _reap(self, sid: str, valid_ids: Collection[str] | None, report: GCReport,
                    wait: float, since: int | None = None, caller: Caller = ROOT) -> None:
        try:
            async with self._hold(sid, wait):
                with log_fields(SANDBOX_ID=sid):
                    rec, entries = await self.journal.view(sid)
                    if since is not None and self.journal.born_after(sid, since):
                        return  # set up after this GC arrived: not for it to judge
                    if not Policy.owns(caller, rec.owner if rec else None):
                        return  # another owner's: a caller's GC speaks for its own only
                    async with self.journal.live_netns(rec, entries) as ns:
                        await self._reap_locked(sid, rec, entries, ns, valid_ids, report)
        except LockTimeout:
            report.busy.append(sid)  # an operation is under way: not stale now
        except Unconfirmed:
            report.unconfirmed.append(sid)
        except (*UNANSWERED, CacheError) as e:
            # Alive or not is unknown, or its record cannot be read (or written) now: next GC.
            report.errors.append(f"sandbox {sid}: not looked at: {e}")

    async def _reap_locked(self, sid: str, rec: SandboxRecord | None,
                           entries: dict[tuple[str, str], CachedAttachment], netns: Pinned | None,
                           valid_ids: Collection[str] | None, report: GCReport) -> None:
        if rec is not None:  # a repair's unfinished DEL or ADD: kept lost, not dropped
            rec = await self.journal.interrupted_repairs(rec, netns)
        unfinished = [a.ifname for a in rec.attachments if a.phase is not Phase.READY] if rec else []
        if rec is not None and unfinished:
            undone = await self.journal.remove(rec, unfinished, netns, entries)
            if self.journal.events.on:
                self.journal.tell_removed(Change.REAPED, rec, undone)
            self._account(report, sid, undone, rolled_back=True)
            rec, entries = await self.journal.view(sid)
        foreign = [e for e in entries.values() if not _in(rec, e)]
        unlisted = valid_ids is not None and sid not in valid_ids
        if unlisted:
            dead, stale = rec is not None, foreign
        else:
            # A recorded sandbox is dead when its namespace is; a cache entry of
            # another tool (no identity recorded) when its path is no namespace.
            dead = rec is not None and not netns
            stale = [e for e in foreign if not await self._present(e)]
        doomed = {e.ifname for e in stale}
        if dead and rec is not None:
            # What a runtime made through the shim is its GC's to release, not
            # this caller's list's; a dead namespace's is reaped in any case.
            doomed |= {a.ifname for a in rec.attachments if not (unlisted and a.origin)}
        if not doomed:
            return
        claimed = await self.journal.claim(sid, rec, {(e.network, e.ifname): e for e in stale})
        # A namespace still the recorded one gets its DEL (the caller may have
        # declared a live sandbox invalid); any other path, none.
        removal = await self.journal.remove(claimed, doomed, netns, entries)
        if self.journal.events.on:
            self.journal.tell_removed(Change.REAPED, claimed, removal)
        kept = {a.ifname for a in removal.left.attachments} if removal.left else set()
        report.deleted.extend((a.network, sid, a.ifname) for a in claimed.attachments
                              if a.ifname in doomed and a.ifname not in kept)
        self._account(report, sid, removal)

    @staticmethod
    def _account(report: GCReport, sid: str, removal: Removal, rolled_back: bool = False) -> None:
        if removal.unrecorded:
            report.unrecorded.append(f"sandbox {sid}: {removal.unrecorded}")
            report.errors.append(f"sandbox {sid}: {removal.unrecorded}")
        if removal.errors:
            report.errors.extend(f"sandbox {sid}: {e}" for e in removal.errors)
        elif rolled_back and not removal.unrecorded:
            report.rolled_back.append(sid)
            log.info("rolled back the unfinished attachments of sandbox %s", sid,
                     extra={"SANDBOX_ID": sid})

    # --- the GC verb ------------------------------------------------------------------

    async def _send_gc_verbs(self, networks: Sequence[NetworkConfigList], report: GCReport) -> None:
        for net in networks:
            if not version_at_least(net.cni_version, "1.1.0") or net.disable_gc:
                continue
            try:
                async with self.netlocks.exclusive(net.name, self._verb_wait):
                    # No chain of this network runs now: nothing is half-attached.
                    # What the records hold (the truth), and other tools' entries.
                    valid = {(r.sandbox_id, a.ifname) for r in self.journal.store.records()
                             for a in r.attachments if a.network == net.name}
                    valid.update((cid, ifname) for network, cid, ifname
                                 in self.journal.runtime.cache.keys() if network == net.name)
                    report.errors.extend(f"network {net.name}: {e}"
                                         for e in await self.journal.runtime.gc(net, valid))
            except LockTimeout:
                report.deferred.append(net.name)
        if report.deferred:
            log.info("gc: the GC verb of %s waits for a moment without ADD/DEL; retried in %gs",
                     ", ".join(report.deferred), self._retry_delay)
            self._schedule_retry(report.deferred)

    def _schedule_retry(self, names: Sequence[str]) -> None:
        if self._retry is not None and not self._retry.done():
            return

        async def retry() -> None:
            await asyncio.sleep(self._retry_delay)
            self._retry = None  # a retry that is deferred again schedules the next one
            wanted = set(names)
            report = GCReport()
            await self._send_gc_verbs([n for n in self._networks() if n.name in wanted], report)
            for err in report.errors:
                log.warning("gc: %s", err)

        self._retry = asyncio.create_task(retry(), name="cni-agent-gc-retry")


def _released(rec: SandboxRecord, origin: str, valid: Collection[tuple[str, str]]) -> set[str]:
    """The ready attachments of `rec` that `origin` made and does not list."""
    return {a.ifname for a in rec.attachments
            if a.origin == origin and a.phase is Phase.READY
            and (rec.sandbox_id, a.ifname) not in valid}


def _in(rec: SandboxRecord | None, entry: CachedAttachment) -> bool:
    return rec is not None and rec.attachment(entry.ifname) is not None
