"""The journal: one owner for the lifecycle of every attachment.

begin-add (the intent, committed: durable before any plugin runs) → added
(the ADD chain ran; its result in the record and the cache) → ready →
begin-delete → gone, and undo (DEL of whatever was begun). Setup, Teardown,
start-up recovery and GC all go through here, so the record, the cache and
the plugins can only change together, in this order. Every ADD and DEL chain
holds its network (`NetworkLocks.use`), which the GC verb of that network
takes alone.

The records (`store.SandboxStore`) are the source of truth, the libcni cache
a view of them: written without fsync, read by nobody but other tools and
people, and rewritten from the records at start-up and by reaping passes.
Nothing here leaves the event loop but the intent's commit and the opening
of a path.

Callers hold the sandbox's lock and decide *what* to do; the journal does it
completely and reports what it could not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from cni_agent.cni.cache import CachedAttachment
from cni_agent.cni.config import NetworkConfigList, parse_list_or_none
from cni_agent.cni.errors import CacheError, CNIError, ConfigError, EntryKept, InvalidArgument
from cni_agent.cni.logctx import log_fields
from cni_agent.cni.result import with_sandbox
from cni_agent.cni.runtime import CNIRuntime, RuntimeConf
from cni_agent.node.blocking import Given, PathWorker, process_held
from cni_agent.node.locks import NetworkLocks
from cni_agent.node.netns import (
    NetnsError,
    NetnsId,
    NetnsUnknown,
    Pinned,
    interfaces,
    loopback_down,
    prepare,
)
from cni_agent.sandboxes import cacheview
from cni_agent.sandboxes.cacheview import entry_of
from cni_agent.sandboxes.events import Change, Events, State
from cni_agent.sandboxes.records import (
    Attachment,
    CheckState,
    CheckVerdict,
    DamagedRecord,
    Phase,
    SandboxRecord,
)
from cni_agent.sandboxes.spoofguard import Guard
from cni_agent.sandboxes.store import SandboxStore

log = logging.getLogger(__name__)

Entries = Mapping[tuple[str, str], CachedAttachment]  # by (network, ifname)

_PARSED_LIMIT = 64


def recorded_links(rec: SandboxRecord, entries: Entries) -> dict[str, str]:
    """ifname → MAC of what the ready attachments left in their namespace, as
    their cached results report it (the sandboxed interface of each, with a MAC)."""
    out: dict[str, str] = {}
    for a in rec.attachments:
        entry = entries.get((a.network, a.ifname))
        if a.phase is not Phase.READY or entry is None or not isinstance(entry.result, Mapping):
            continue
        for iface in entry.result.get("interfaces") or ():
            if (isinstance(iface, Mapping) and iface.get("name") == a.ifname
                    and iface.get("sandbox") and iface.get("mac")):
                out[a.ifname] = str(iface["mac"]).lower()
    return out


@dataclass(frozen=True)
class Removal:
    """What `Journal.remove` did."""

    left: SandboxRecord | None  # what is left of the record (None: nothing, its file is gone)
    errors: list[str] = field(default_factory=list)  # DELs that failed: kept, to be retried
    # What the disk did not take, the DELs having run (full, read-only): "" when
    # all was recorded. Those attachments show "deleting" until a write records
    # it (`SandboxStore.unrecorded`); the next reaping pass finishes them.
    unrecorded: str = ""
    # The DELs that succeeded are in the journal (the record's update or
    # removal was written): what a sandbox event may tell.
    recorded: bool = True


class Identity(Enum):
    SAME = "same"  # the namespace the record was set up in
    OTHER = "other"  # certainly another one (or the path names none)
    UNCONFIRMED = "unconfirmed"  # the recorded inode, but nothing can confirm it


async def identify(rec: SandboxRecord, entries: Entries, ns: Pinned) -> tuple[Identity, bool]:
    """Whether the pinned namespace is the one `rec` was set up in, and whether
    the record should now take its stronger identity (NS_GET_ID or cookie).

    An id never reused in a boot settles it. A record that has only the inode
    (0.1.0, or a kernel with neither id) may name a namespace that reused a
    dead one's inode, so its links are compared with what the attachments left:
    a match confirms it (and earns the record the stronger id, so it can never
    vouch for a later namespace); a mismatch proves nothing — a process inside
    may rename eth0 or change its MAC — so it stays unconfirmed: neither reaped
    nor entered.
    """
    recorded = rec.netns_id
    if recorded is None or not recorded.same(ns.identity):
        return Identity.OTHER, False
    if recorded.certain and ns.identity.certain:
        return Identity.SAME, False
    expected = recorded_links(rec, entries)
    if not expected:
        return Identity.SAME, False  # nothing to confirm by: the inode is all there is
    try:
        found = {i.name: i.mac.lower() for i in await interfaces(ns)}
    except NetnsError as e:
        log.warning("cannot list the links of %s to confirm its identity: %s", ns.path, e)
        return Identity.UNCONFIRMED, False
    missing = [n for n, mac in sorted(expected.items()) if found.get(n) != mac]
    if missing:
        log.warning("netns %s has the recorded inode but not the recorded %s: its identity is "
                    "unconfirmed, so it is neither reaped nor entered", ns.path, ", ".join(missing))
        return Identity.UNCONFIRMED, False
    return Identity.SAME, ns.identity.certain


async def is_recorded(rec: SandboxRecord, entries: Entries, ns: Pinned) -> bool:
    """Whether the pinned namespace is, as far as can be told, the recorded one."""
    return (await identify(rec, entries, ns))[0] is Identity.SAME


class Unconfirmed(NetnsUnknown):
    """A recorded namespace's identity can be neither confirmed nor refuted now."""

    def __init__(self, path: str) -> None:
        super().__init__("netns", f"{path!r} has the recorded inode but its identity cannot be "
                                  "confirmed")


class InterfaceExists(InvalidArgument):
    """An interface a new attachment would create is in the namespace already.

    Refused before any plugin runs: a failed ADD's rollback DEL would delete
    it, and it is not this call's (another sandbox's, or the namespace's own).
    """

    def __init__(self, names: Sequence[str], netns: str) -> None:
        shown = ", ".join(names)
        super().__init__("networks", f"interface {shown} already exists in network namespace "
                                     f"{netns}: a Setup never takes over an interface it did not "
                                     "create")


class CacheCollision(InvalidArgument):
    """libcni names a cache entry `<network>-<id>-<ifname>`, and '-' may be in
    all three: another attachment's entry would be the same file."""

    def __init__(self, network: str, ifname: str) -> None:
        super().__init__("sandbox_id", f"the cache entry of {network}/{ifname} of this sandbox "
                                       "would be the same file as another attachment's (network "
                                       "names and ids containing '-' can name the same file); "
                                       "choose another id")


class Journal:
    def __init__(
        self,
        runtime: CNIRuntime,
        store: SandboxStore,
        netlocks: NetworkLocks,
        *,
        current: Callable[[str], NetworkConfigList | None] = lambda name: None,
        lock_timeout: float = 60.0,
        paths: PathWorker | None = None,
        guard: Guard | None = None,
    ) -> None:
        self.runtime = runtime
        # Members' anti-spoofing filters, installed and removed with their
        # attachments (without nftables: none, and members get no filterable network).
        self.guard = guard or Guard(None)
        # Every open of a caller's (or recorded) netns path goes through here.
        self.paths = paths or PathWorker()
        self.store = store
        self.netlocks = netlocks
        self._current = current
        self.lock_timeout = lock_timeout
        # Config bytes → parsed list: DELs of one network reuse one parse.
        self._parsed: dict[bytes, NetworkConfigList | None] = {}
        # Cache entry path → the (network, sandbox, ifname) of a Setup or
        # Attach under way that will write it (`claiming`).
        self._claims: dict[str, tuple[str, str, str]] = {}
        # When each sandbox set up since start-up was born, in a count that
        # only grows: a GC that began earlier never reaps it (`born_after`).
        self._born: dict[str, int] = {}
        self.generation = 0
        # Each committed change of a sandbox, to the service's watchers (events.py).
        self.events = Events()

    def born_after(self, sandbox_id: str, generation: int) -> bool:
        """Whether the sandbox was set up after `generation` was read."""
        return self._born.get(sandbox_id, 0) > generation

    # --- reading ----------------------------------------------------------------

    def open(self) -> list[str]:
        """Start-up, blocking: replay the records, then make the cache agree
        with them (`cacheview.agree`). What was found wrong, for the log."""
        notes = self.store.open()
        return notes + cacheview.agree(self.store, self.runtime.cache)

    async def restore_cache(self) -> list[str]:
        """A reaping pass's look at the cache (`cacheview.restore`)."""
        return await cacheview.restore(self.store, self.runtime.cache)

    async def view(self, sandbox_id: str, repair: bool = True
                   ) -> tuple[SandboxRecord | None, dict[tuple[str, str], CachedAttachment]]:
        """The record and the cache entries of a sandbox, from memory: the
        record's results; without a record, the entries other tools or an
        older run left (the cache's index says which files: usually none). A
        damaged record counts as none: with `repair` (the caller holds the
        sandbox's lock) it is set aside, so it never blocks the sandbox again.
        """
        try:
            rec = self.store.read(sandbox_id)
        except DamagedRecord as e:
            rec = None
            if repair:
                moved = self.store.set_aside(sandbox_id)
                log.warning("sandbox %s: record %s is damaged (%s); set aside in %s, the sandbox "
                            "is handled from its cache entries", sandbox_id, e.path, e.reason,
                            moved or "(gone already)", extra={"SANDBOX_ID": sandbox_id})
        if rec is None:
            found = self.runtime.cache.for_container(sandbox_id)
        else:
            found = self.recorded_entries(rec)
        return rec, {(e.network, e.ifname): e for e in found}

    def recorded_entries(self, rec: SandboxRecord) -> list[CachedAttachment]:
        """The cache entries of `rec`'s attachments, as the record holds them."""
        return [entry_of(rec, a) for a in rec.attachments if a.result is not None]

    def live_netns(self, rec: SandboxRecord | None, entries: Entries, confirm: bool = True,
                   given: Pinned | None = None) -> AbstractAsyncContextManager[Pinned | None]:
        """The record's namespace, pinned, if its path still names the one
        recorded at ADD; else None (gone, replaced, or no namespace). A
        member's namespace (`SandboxRecord.by_descriptor`) is `given` if that
        is it, else reached through a process inside it (`process_held`); a
        namespace no process is in counts as gone.

        `given`: the caller's path, pinned when its call arrived: used when it
        is the recorded path (no second open of it).
        `blocking.UNANSWERED` (PathTimeout, PathsBusy, NetnsUnknown, Unconfirmed)
        when whether it is alive is not known: it must be taken as alive. With
        `confirm` (the caller holds the sandbox's lock), a record confirmed alive
        is given the namespace's stronger identity.
        """
        if rec is None or rec.netns_id is None or not (rec.netns or rec.by_descriptor):
            return Given(None)
        pinned: AbstractAsyncContextManager[Pinned | None]
        if rec.by_descriptor:
            # A member's: its descriptor again, else a process inside it; its
            # label is never opened (a path on a mount that never answers
            # would hold a path thread of root's, and root's GC, forever).
            if given is not None and rec.netns_id.same(given.identity):
                pinned = Given(given)  # its opener closes it
            else:
                pinned = process_held(rec.netns_id)
        elif given is not None and given.path == rec.netns:
            pinned = Given(given)  # its opener closes it
        else:
            pinned = self.paths.pinned_if_netns(rec.netns)
        return _Live(self, rec, entries, confirm, pinned)

    def _confirmed(self, rec: SandboxRecord, ns: Pinned) -> None:
        """`rec` is alive in `ns`, whose identity is stronger than the recorded one."""
        try:
            self.store.write(replace(rec, netns_id=ns.identity))
        except CacheError as e:  # a full disk must not stop a Teardown: later
            log.warning("sandbox %s: netns %s confirmed, but its stronger id is not "
                        "recorded: %s", rec.sandbox_id, rec.netns, e)
        else:
            log.info("sandbox %s: netns %s confirmed; its record now carries the "
                     "kernel's namespace id", rec.sandbox_id, rec.netns)

    # --- adding -----------------------------------------------------------------

    def claiming(self, sandbox_id: str, new: Sequence[Attachment]) -> _Claiming:
        """Reserve the cache entries `new` will have while this call adds them:
        a concurrent Setup of another attachment whose libcni-named entry is
        the same file is refused (CacheCollision); `begin_add` refuses one
        whose file is already another attachment's on disk."""
        return _Claiming(self._claims, {self.runtime.cache.path(a.network, sandbox_id, a.ifname):
                                        (a.network, sandbox_id, a.ifname) for a in new})

    async def begin_add(self, rec: SandboxRecord, new: Sequence[Attachment], ns: Pinned,
                        loopback: bool = False) -> tuple[SandboxRecord, bool]:
        """Commit the intent of `new` (durable before any of their plugins runs);
        the record, and whether `lo` was brought up (by this call: it was down).

        First, none of `new`'s interfaces may be in the namespace
        (InterfaceExists), none of their cache entries another attachment's
        (CacheCollision), and with `loopback` (a new sandbox) `lo` is brought
        up (NetnsError if it cannot be): a few syscalls, on the loop. Whatever
        is raised, no plugin ran and `lo` is as it was, so nothing is to undo.
        """
        begun = rec.with_attachments((*rec.attachments, *new))
        cache = self.runtime.cache
        present, raised = prepare(ns, [a.ifname for a in new], loopback)
        try:
            if present:
                raise InterfaceExists(present, rec.netns)
            for a in new:
                if not cache.free_for(a.network, rec.sandbox_id, a.ifname):
                    raise CacheCollision(a.network, a.ifname)
            self.store.write(begun)
            try:
                await self.store.commit()
            except BaseException:
                self._undo_intent(rec)
                raise
        except BaseException:
            if raised:
                _lo_down(ns, rec.sandbox_id)
            raise
        if not rec.attachments:
            self.generation += 1
            self._born[rec.sandbox_id] = self.generation
        return begun, raised

    def _undo_intent(self, rec: SandboxRecord) -> None:
        """An intent that could not be made durable: no plugin ran, so the record
        goes back to what it was. If even that is refused, the intent stays,
        and its rollback (a DEL, harmless) comes with the next reaping pass."""
        try:
            if rec.attachments:
                self.store.write(rec)
            else:
                self.store.delete(rec.sandbox_id)
        except CacheError as e:
            log.warning("sandbox %s: an intent not made durable stays in the journal (%s); the "
                        "next reaping pass rolls it back", rec.sandbox_id, e)

    async def loopback_down(self, sandbox_id: str, ns: Pinned) -> None:
        """A failed Setup that brought `lo` up leaves it as it found it: down."""
        _lo_down(ns, sandbox_id)

    async def add(self, rec: SandboxRecord, att: Attachment, net: NetworkConfigList,
                  ns: Pinned, ready: Collection[str] = (),
                  capabilities: Mapping[str, Any] | None = None
                  ) -> tuple[SandboxRecord, dict[str, Any]]:
        """The ADD chain of one begun attachment, in the pinned namespace; the
        runtime caches its result (with the caller's path), and the record
        takes it — with `ready` (this attachment and those added before it)
        made ready in the same write. The record, and the result."""
        rt = _conf(rec.sandbox_id, att if capabilities is None
                   else replace(att, capabilities=capabilities), ns)
        with log_fields(NETWORK=net.name, IFNAME=att.ifname):
            async with self.netlocks.use(net.name, self.lock_timeout):
                result = await self.runtime.add(net, rt)
            # Before it is ready or answered: a member's pod is never reported
            # set up unfiltered. AntispoofFailed is the ADD's failure (rolled back).
            await self.guard.added(rec, att, net, result)
            ready = set(ready)
            rec = rec.with_attachments(
                replace(a, result=result if a.ifname == att.ifname else a.result,
                        phase=Phase.READY if a.ifname in ready else a.phase,
                        repairing=None if a.ifname == att.ifname else a.repairing)
                for a in rec.attachments)
            self.store.mark_added(rec, att.ifname, ready)
            log.debug("sandbox %s: %s/%s added", rec.sandbox_id, net.name, att.ifname)
        return rec, result

    async def check(self, att: Attachment, entry: CachedAttachment, ns: Pinned) -> bool:
        """CHECK with the config, args and capabilities the ADD used, and its cached
        result; False when the network's list does not allow CHECK."""
        net = self._config_for(att, entry)
        rt = _conf(entry.container_id, att, ns)
        with log_fields(NETWORK=att.network, IFNAME=att.ifname):
            return await self.runtime.check(net, rt, prev_result=_as_plugin_sees(entry.result, ns))

    async def recreate(self, rec: SandboxRecord, att: Attachment, entry: CachedAttachment | None,
                       ns: Pinned, capabilities: Mapping[str, Any],
                       lost: Callable[[CNIError], Attachment],
                       ) -> tuple[SandboxRecord, dict[str, Any] | CNIError]:
        """DEL, then ADD again, one ready (or lost) attachment — a drift repair
        or its retry — in its place in the record, with its recorded config and
        args and `capabilities`. The record, and the new result or the ADD's error.

        Each step goes through the write-ahead record, so a crash anywhere
        leaves nothing a restart does not finish or undo. When the DEL fails,
        or the ADD does (rolled back: DEL), the attachment stays in the record
        as `lost(error)`: ready, with no cache entry, to be retried (DEL first).
        CacheError when the disk does not take a record: its first (nothing
        done), or the one after the DEL (the attachment reads "deleting", and
        the next reaping pass finishes the DEL and keeps it lost)."""
        net = self._config_for(att, entry)
        # What it is if this repair never finishes (the agent stopped during its
        # DEL or its ADD): lost, as after a failed ADD; a restart's recovery
        # makes it so (`interrupted_repairs`), never a removal that drops it.
        # Written "deleting" with it (the short "deleting" mark would not carry it).
        interrupted = lost(CNIError("its repair was under way when the agent stopped"))
        marked = replace(att, phase=Phase.DELETING, repairing=interrupted.lost)
        rec = rec.with_attachments(marked if a.ifname == att.ifname else a
                                   for a in rec.attachments)
        self.store.write(rec)
        # The record keeps the caller's capabilities (a runtime's repeat ADD is
        # compared with them); only this ADD asks for the same IPs and MAC.
        new = replace(marked, phase=Phase.ADDING, check=None, lost=None, result=None)
        # The DEL's own last write puts the ADD's intent in the attachment's
        # place: no record without it in between.
        removal = await self.remove(rec, [att.ifname], ns,
                                    {(att.network, att.ifname): entry} if entry else {},
                                    replacing={att.ifname: new})
        if removal.unrecorded:
            raise CacheError(f"DEL before the new ADD: {removal.unrecorded}")
        if removal.errors:  # still in the record, "deleting": lost instead, retried
            failed = CNIError(f"DEL before the new ADD failed: {removal.errors[0]}")
            base = removal.left or rec
            kept = base.with_attachments(replace(lost(failed), result=None)
                                         if a.ifname == att.ifname else a
                                         for a in base.attachments)
            self.store.write(kept)
            return kept, failed
        assert removal.left is not None  # `new` is in it
        begun = removal.left
        await self.store.commit()  # the intent, durable before the ADD
        try:
            done, result = await self.add(begun, new, net, ns, ready=[att.ifname],
                                          capabilities=capabilities)
        except CNIError as e:
            # Its rollback DEL, then one write: still in the record, lost.
            await self._undo_add(rec, new, ns, "the failed ADD")
            kept = begun.with_attachments(replace(lost(e), result=None)
                                          if a.ifname == att.ifname else a
                                          for a in begun.attachments)
            self.store.write(kept)
            return kept, e
        return done, result

    async def _undo_add(self, rec: SandboxRecord, att: Attachment, ns: Pinned | None,
                        what: str) -> None:
        """The rollback DEL of an ADD that did not finish (the spec requires it),
        in the namespace when there is one. A DEL that fails is only logged: the
        attachment stays lost, and its retry DELs first."""
        if ns is None:
            return
        try:
            await self._delete(rec.sandbox_id, att, ns, None, rec.owner)
        except CNIError as e:
            log.warning("sandbox %s: DEL after %s of %s/%s failed (retried with it): %s",
                        rec.sandbox_id, what, att.network, att.ifname, e)

    async def interrupted_repairs(self, rec: SandboxRecord, ns: Pinned | None) -> SandboxRecord:
        """Recovery of repairs a stop interrupted (an attachment "deleting" or
        "adding" with `repairing`: during the repair's DEL or its re-ADD): each
        DELeted (that ADD rolled back, or that DEL finished), and the attachment
        kept lost, as a failed ADD leaves it: retried with backoff, never
        dropped with the sandbox. The record as written (`rec` when it has none)."""
        pending = {a.ifname: a.repairing for a in rec.attachments
                   if a.phase is not Phase.READY and a.repairing is not None}
        if not pending:
            return rec
        for att in rec.attachments:
            if att.ifname in pending:
                log.error("sandbox %s: the repair of %s/%s was interrupted; the attachment is "
                          "lost: kept in the record and retried", rec.sandbox_id, att.network,
                          att.ifname)
                await self._undo_add(rec, att, ns, "the interrupted repair")
        now = time.time()
        kept = rec.with_attachments(
            replace(a, phase=Phase.READY, lost=was, repairing=None, result=None,
                    check=CheckState(CheckVerdict.LOST, now, was.reason,
                                     repair=f"failed: {was.reason}"))
            if (was := pending.get(a.ifname)) is not None else a
            for a in rec.attachments)
        self.store.write(kept)
        await self.store.commit()
        if self.events.on:
            self.events.emit(Change.LOST, kept.sandbox_id, kept.owner,
                             [(a, State.LOST) for a in kept.attachments if a.ifname in pending])
        return kept

    async def save(self, rec: SandboxRecord) -> None:
        """Write `rec` (the caller holds the sandbox's lock): it survives a killed
        agent at once, a power loss with the next intent's commit."""
        self.store.write(rec)

    def config_for(self, att: Attachment, entry: CachedAttachment | None) -> NetworkConfigList:
        return self._config_for(att, entry)

    # --- removing ---------------------------------------------------------------

    async def claim(self, sandbox_id: str, rec: SandboxRecord | None, entries: Entries,
                    netns: str = "", identity: NetnsId | None = None) -> SandboxRecord:
        """A record covering every attachment known of the sandbox, written.

        Cache entries no record mentions (another tool, an older run) are
        adopted in phase "deleting", so a crash while removing them is
        finished at the next start like any other interrupted removal. A disk
        that does not take the write does not stop the removal (DEL is
        idempotent; the entries stay until it succeeds, and say what to DEL).
        """
        base = rec or SandboxRecord(sandbox_id, netns, identity, ())
        known = {(a.network, a.ifname) for a in base.attachments}
        extra = [Attachment(e.network, e.ifname, e.config, e.cni_args, dict(e.capability_args),
                            Phase.DELETING)
                 for key, e in sorted(entries.items()) if key not in known]
        if not extra and rec is not None:
            return rec
        claimed = base.with_attachments((*base.attachments, *extra))
        try:
            self.store.write(claimed)
        except CacheError as e:
            log.warning("sandbox %s: removing %s without recording it first: %s", sandbox_id,
                        ", ".join(f"{a.network}/{a.ifname}" for a in extra), e)
        return claimed

    async def remove(
        self, rec: SandboxRecord, ifnames: Collection[str] | None, ns: Pinned | None,
        entries: Entries | None = None, *, unstarted: Collection[str] = (),
        replacing: Mapping[str, Attachment] | None = None,
    ) -> Removal:
        """DEL the attachments `ifnames` (all when None), last added first, in
        the pinned namespace (None: with an empty netns).

        Ready ones are marked "deleting" first. `unstarted` attachments never
        ran a plugin: they leave the record without a DEL. An attachment whose
        DEL failed stays, to be retried. One `replacing` names takes that
        attachment's place in the record once its DEL succeeded (a repair's
        re-ADD intent), in the same write. A disk that does not take the mark
        (full, read-only) does not stop the DELs: DEL is idempotent, and a
        network is worth more than its bookkeeping; what was not recorded is
        reported (`Removal.unrecorded`) and shown "deleting" until it is.
        """
        sid = rec.sandbox_id
        targets = [a for a in rec.attachments
                   if (ifnames is None or a.ifname in ifnames) and a.ifname not in unstarted]
        marking = [a.ifname for a in targets if a.phase is Phase.READY]
        missed: list[str] = []  # what the disk did not take, and is still not on it
        failure: CacheError | None = None
        unmarked = False
        if marking:
            rec = rec.with_phase(Phase.DELETING, marking)
            try:
                self.store.mark_deleting(rec, marking)
            except CacheError as e:
                self.store.unrecorded(sid, [a.ifname for a in targets])
                unmarked = True
                failure = e
                log.warning("sandbox %s: DEL of %s without its \"deleting\" mark, which the "
                            "disk did not take: %s", sid, ", ".join(marking), e)
        if entries is None:
            entries = (await self.view(sid))[1]
        errors: list[str] = []
        gone = set(unstarted)
        for att in reversed(targets):
            try:
                await self._delete(sid, att, ns, entries.get((att.network, att.ifname)), rec.owner)
            except EntryKept as e:  # released; only its entry is left
                gone.add(att.ifname)
                missed.append(f"the removal of the cache entry of {att.network}/{att.ifname}")
                failure = failure or e
            except CNIError as e:
                errors.append(f"{att.network}/{att.ifname}: {e}")
            else:
                gone.add(att.ifname)
        swap = {i: a for i, a in (replacing or {}).items() if i in gone}
        left = [swap.get(a.ifname, a) for a in rec.attachments
                if a.ifname not in gone or a.ifname in swap]
        kept = rec.with_attachments(left) if left else None
        written = True
        try:
            if kept is not None:
                self.store.write(kept)
            else:
                self.store.delete(sid)
                self._born.pop(sid, None)
        except CacheError as e:
            written = False
            self.store.unrecorded(sid, [a.ifname for a in targets])
            # The mark matters only now: a record written at the end says all of it.
            missed[:0] = ['the "deleting" mark'] if unmarked else []
            missed.append("the record's " + ("update" if kept is not None else "removal"))
            failure = failure or e
        unrecorded = ""
        if missed:
            unrecorded = f"not recorded: {_and(missed)} ({_cause(failure)})"
            log.warning("sandbox %s: %s; the next reaping pass finishes it once the disk allows",
                        sid, unrecorded)
        return Removal(kept, errors, unrecorded, written)

    def tell_removed(self, change: Change, rec: SandboxRecord, removal: Removal) -> None:
        """Tell the watchers what `removal` took out of `rec` (the record given
        to `remove`), once the journal holds it; call only when `events.on`.
        A removal that left some (a DEL failed) is a detach of the others. An
        attachment still "adding" was never told (a rollback): nor is its end."""
        if not removal.recorded:
            return  # the next reaping pass records it, and tells it
        left = {a.ifname for a in removal.left.attachments} if removal.left else set()
        if left and change is Change.TORN_DOWN:
            change = Change.DETACHED
        self.events.emit(change, rec.sandbox_id, rec.owner,
                         [(a, State.GONE) for a in rec.attachments
                          if a.ifname not in left and a.phase is not Phase.ADDING])

    async def _delete(self, sandbox_id: str, att: Attachment, ns: Pinned | None,
                      entry: CachedAttachment | None, owner: int) -> None:
        with log_fields(NETWORK=att.network, IFNAME=att.ifname):
            net = self._config_for(att, entry)
            rt = _conf(sandbox_id, att, ns)
            prev = _as_plugin_sees(entry.result, ns) if entry else None
            async with self.netlocks.use(att.network, self.lock_timeout):
                await self.runtime.delete(net, rt, prev_result=prev, use_cache=False)
            await self.guard.deleted(sandbox_id, owner, att, net,
                                     entry.result if entry else att.result)
            log.debug("sandbox %s: %s/%s deleted", sandbox_id, att.network, att.ifname)

    def _config_for(self, att: Attachment, entry: CachedAttachment | None) -> NetworkConfigList:
        """The list the ADD used (recorded, then cached), else the network's current one."""
        for data in (att.config, entry.config if entry else b""):
            if data and (net := self._parse(data, att.network)) is not None:
                return net
        current = self._current(att.network)
        if current is None:
            raise ConfigError(att.network, "neither the recorded nor a current config of this "
                                           "network is usable for its DEL")
        return current

    def _parse(self, data: bytes, source: str) -> NetworkConfigList | None:
        if data not in self._parsed:
            if len(self._parsed) >= _PARSED_LIMIT:
                self._parsed.clear()
            self._parsed[data] = parse_list_or_none(data, f"recorded config of {source}")
        return self._parsed[data]


def _lo_down(ns: Pinned, sandbox_id: str) -> None:
    try:
        if loopback_down(ns):
            log.info("sandbox %s: lo set down again, as the failed Setup found it", sandbox_id)
    except NetnsError as e:  # the Setup's own error is the one to report
        log.warning("sandbox %s: cannot set lo down again after the failed Setup: %s",
                    sandbox_id, e)


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _cause(e: BaseException | None) -> str:
    """The OS's words for a disk failure ("No space left on device")."""
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__
    if e is None:
        return "unknown cause"
    return e.strerror or str(e)


def _conf(sandbox_id: str, att: Attachment, ns: Pinned | None) -> RuntimeConf:
    """Plugins get the pinned handle as CNI_NETNS (or "" without a namespace)."""
    if ns is None:
        return RuntimeConf(sandbox_id, "", att.ifname, att.args, dict(att.capabilities))
    return RuntimeConf(sandbox_id, ns.plugin_path, att.ifname, att.args, dict(att.capabilities),
                       given_netns=ns.path)


def _as_plugin_sees(result: Mapping[str, Any] | None, ns: Pinned | None) -> dict[str, Any] | None:
    """A cached result (sandbox = the caller's path) as a prevResult whose sandbox
    matches CNI_NETNS: bridge's CHECK compares the two."""
    if result is None or ns is None:
        return None if result is None else dict(result)
    return with_sandbox(result, ns.plugin_path)


class _Claiming:
    """`Journal.claiming`'s block: a class, not @contextmanager (a generator
    and its wrapper on every ADD)."""

    __slots__ = ("_claims", "_mine", "_wanted")

    def __init__(self, claims: dict[str, tuple[str, str, str]],
                 wanted: dict[str, tuple[str, str, str]]) -> None:
        self._claims, self._wanted = claims, wanted
        self._mine: list[str] = []

    def __enter__(self) -> None:
        claims = self._claims
        for path, ident in self._wanted.items():
            held = claims.get(path)
            if held is not None and held != ident:
                raise CacheCollision(ident[0], ident[2])
        self._mine = [p for p in self._wanted if p not in claims]
        claims.update((p, self._wanted[p]) for p in self._mine)

    def __exit__(self, *exc: object) -> None:
        for path in self._mine:
            del self._claims[path]


class _Live:
    """`Journal.live_netns`'s block once there is a namespace to look at: a
    class, not @asynccontextmanager (an async generator, its wrapper and the
    loop's weak set entry, on every DEL)."""

    __slots__ = ("_confirm", "_entries", "_journal", "_pinned", "_rec")

    def __init__(self, journal: Journal, rec: SandboxRecord, entries: Entries, confirm: bool,
                 pinned: AbstractAsyncContextManager[Pinned | None]) -> None:
        self._journal, self._rec, self._entries = journal, rec, entries
        self._confirm, self._pinned = confirm, pinned

    async def __aenter__(self) -> Pinned | None:
        ns = await self._pinned.__aenter__()
        if ns is None:
            return None
        try:
            verdict, stronger = await identify(self._rec, self._entries, ns)
            if verdict is Identity.UNCONFIRMED:
                raise Unconfirmed(self._rec.netns)
            if stronger and self._confirm:
                self._journal._confirmed(self._rec, ns)
        except BaseException as e:  # as `async with` would: the pin let go of with the error
            await self._pinned.__aexit__(type(e), e, e.__traceback__)
            raise
        return ns if verdict is Identity.SAME else None

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._pinned.__aexit__(*exc)
