"""CHECK of a sandbox's attachments, judged against their baseline: drift.

One code path for every CHECK the agent runs — the D-Bus Check, the `check`
CLI, the scheduled and firewalld-triggered passes (drift.py) — always with
the sandbox's lock held by the caller.

A CHECK is only as good as its plugin: Debian 12's portmap 1.1.1 fails it
right after a good ADD on an IPv4-only network. So the baseline is the first
CHECK (run right after ADD when checks are on): an attachment that never
passed is "unsupported" (shown, counted, never repaired), and only a pass
followed by the plugin's own failure (a CNI error with a code) is drift. A
CHECK that could not run — a timeout, a plugin that could not start or
crashed, the agent's own error — says nothing of the attachment: it is
"failed-to-run", never drift, never repaired.

With `repair`, a drifted attachment is re-created — DEL, then ADD with its
recorded config, args and capabilities, asking for its IPs and MAC through
the `ips`/`mac` capabilities. Where the network cannot be asked for the same
IP it is only reported ("repair would change the address"), unless the admin
allows that (`check.repair_new_address`). A re-ADD that returns another
address is "repaired-with-new-address", never "ok". A re-ADD that fails
leaves the attachment "lost": kept in the record and retried with backoff
(`retry_lost`, driven by drift.py) until an ADD succeeds or the sandbox goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from cni_agent.cni.cache import CachedAttachment
from cni_agent.cni.errors import CacheError, CNIError, PluginError
from cni_agent.cni.logctx import log_fields
from cni_agent.node.netns import Pinned
from cni_agent.sandboxes.events import Change, State
from cni_agent.sandboxes.journal import Entries, Journal
from cni_agent.sandboxes.records import (
    Attachment,
    CheckState,
    CheckVerdict,
    Lost,
    Phase,
    SandboxRecord,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    """One attachment's CHECK, as metrics, the D-Bus signals and the CLI see it."""

    sandbox_id: str
    network: str
    ifname: str
    verdict: CheckVerdict
    reason: str = ""
    drifted: bool = False  # this CHECK is the pass → fail transition
    # Set on a repair's outcome (not a CHECK's): "ok" (re-created, its new CHECK
    # passes), "unverified" (re-created, its new CHECK fails), "new_address"
    # (re-created with another address), "refused" (it would change the
    # address), "failed" (its re-ADD failed: lost), "retry_ok" and
    # "retry_failed" (a lost attachment's later ADDs).
    repair: str = ""
    # Its Show state changed from what an earlier CHECK or repair had said
    # (not the first CHECK, the baseline): AttachmentCheckChanged.
    changed: bool = False
    error: Exception | None = None  # the failure, for the D-Bus Check's reply

    @property
    def result(self) -> str:
        """`cni_agent_checks_total{result}`: ok, failed (after a pass), unsupported,
        disabled, failed_to_run."""
        if self.verdict is CheckVerdict.DRIFTED:
            return "failed"
        if self.verdict is CheckVerdict.FAILED_TO_RUN:
            return "failed_to_run"
        if self.verdict is CheckVerdict.NEW_ADDRESS:
            return "ok"
        return str(self.verdict)


Listener = Callable[[Outcome], None]


class Yielded(Exception):
    """A scheduled CHECK stopped because a request on its sandbox arrived."""


async def _unless(work: Awaitable[T], stop: asyncio.Event | None) -> T:
    """`work`, cancelled (its plugin killed: a CHECK changes nothing) when `stop` is set."""
    if stop is None:
        return await work
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise Yielded()
    return task.result()


def _ips(result: Mapping[str, Any] | None) -> list[str]:
    return [str(ip["address"]) for ip in (result or {}).get("ips") or ()
            if isinstance(ip, Mapping) and ip.get("address")]


def _mac(result: Mapping[str, Any] | None, ifname: str) -> str:
    for iface in (result or {}).get("interfaces") or ():
        if isinstance(iface, Mapping) and iface.get("name") == ifname and iface.get("sandbox"):
            return str(iface.get("mac") or "")
    return ""


class Checks:
    def __init__(self, journal: Journal, *, repair: bool = False, new_address: bool = False,
                 retry_base: float = 30.0, retry_max: float = 600.0) -> None:
        self.journal = journal
        self.repair = repair
        # check.repair_new_address: a repair that cannot ask for the address it
        # had re-ADDs all the same (and says so); else it is only reported.
        self.new_address = new_address
        self.retry_base = retry_base  # a lost attachment's first retry, doubling
        self.retry_max = retry_max
        self._listeners: list[Listener] = []
        # Last CHECK times, kept here: a pass that changes no verdict writes no record.
        self._last: dict[tuple[str, str], float] = {}
        # Called when an attachment is lost (drift.py wakes its retries).
        self.on_lost: Callable[[], None] = lambda: None

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def last_check(self, sandbox_id: str, att: Attachment) -> float:
        recorded = att.check.at if att.check else 0.0
        return max(recorded, self._last.get((sandbox_id, att.ifname), 0.0))

    def retain(self, sandbox_ids: set[str]) -> None:
        """Forget the CHECK times of sandboxes that are gone (each pass calls it)."""
        for key in [k for k in self._last if k[0] not in sandbox_ids]:
            del self._last[key]

    def retry_delay(self, attempts: int) -> float:
        """After `attempts` failed ADDs: the base, doubling, at most `retry_max`."""
        return float(min(self.retry_base * 2 ** max(0, min(attempts - 1, 20)), self.retry_max))

    async def run_locked(self, rec: SandboxRecord, entries: Entries, ns: Pinned,
                         repair: bool | None = None, stop: asyncio.Event | None = None,
                         unchecked_only: bool = False) -> list[Outcome]:
        """CHECK each ready attachment of `rec` in its (confirmed) namespace; the
        outcomes are recorded, logged and announced. The caller holds the lock.

        `stop` set while a CHECK runs: Yielded, that CHECK unrecorded (never
        while a record is written or a repair runs)."""
        outcomes: list[Outcome] = []
        for att in rec.attachments:
            entry = entries.get((att.network, att.ifname))
            if att.phase is not Phase.READY or att.lost or entry is None or \
                    (unchecked_only and att.check):
                continue
            with log_fields(SANDBOX_ID=rec.sandbox_id, NETWORK=att.network, IFNAME=att.ifname):
                outcome, rec = await self._one(rec, att, entry, ns, stop)
                wanted = self.repair if repair is None else repair
                if outcome.verdict is CheckVerdict.DRIFTED and wanted:
                    outcome, rec = await self._repair(rec, att, entry, ns, outcome)
            outcomes.append(outcome)
        return outcomes

    async def _one(self, rec: SandboxRecord, att: Attachment, entry: CachedAttachment,
                   ns: Pinned, stop: asyncio.Event | None = None, baseline: bool = False
                   ) -> tuple[Outcome, SandboxRecord]:
        """One CHECK, judged, recorded and announced. `baseline`: the CHECK
        right after a repair's ADD, whose state before is no real one."""
        error: Exception | None = None
        ran = True
        try:
            supported = await _unless(self.journal.check(att, entry, ns), stop)
        except PluginError as e:  # the plugin ran and said what it found
            supported, error = True, e
        except (CNIError, OSError) as e:  # it could not say: no verdict on the attachment
            supported, error, ran = True, e, False
        now = time.time()
        self._last[(rec.sandbox_id, att.ifname)] = now
        before = att.check
        passed = bool(before and before.passed)
        reason = str(error) if error else ""
        repair = ""
        if not supported:
            verdict = CheckVerdict.DISABLED
        elif error is None:
            verdict, passed = CheckVerdict.OK, True
            if before is not None and before.verdict is CheckVerdict.NEW_ADDRESS:
                # Said until it drifts: the address it was set up with is gone.
                verdict, reason, repair = before.verdict, before.reason, before.repair
        elif not ran:
            verdict = CheckVerdict.FAILED_TO_RUN
        else:
            verdict = CheckVerdict.DRIFTED if passed else CheckVerdict.UNSUPPORTED
        if before is not None and verdict is before.verdict and not repair:
            repair = before.repair  # e.g. "repair would change the address", while drifted
        drifted = verdict is CheckVerdict.DRIFTED and (before is None
                                                       or before.verdict is not CheckVerdict.DRIFTED)
        state = CheckState(verdict, now, reason, passed, before.repairs if before else 0, repair)
        if before is None or (before.verdict, before.reason, before.passed, before.repair) != \
                (state.verdict, state.reason, state.passed, state.repair):
            rec = rec.with_check(att.ifname, state)
            await self.journal.save(rec)
            self._log_change(rec.sandbox_id, att, before, state, drifted)
        outcome = Outcome(rec.sandbox_id, att.network, att.ifname, verdict, reason, drifted,
                          changed=not baseline and before is not None
                          and before.verdict is not verdict, error=error)
        return self._announce(outcome), rec

    @staticmethod
    def _log_change(sid: str, att: Attachment, before: CheckState | None, state: CheckState,
                    drifted: bool) -> None:
        where = f"sandbox {sid}: {att.network}/{att.ifname}"
        if drifted:
            log.warning("%s drifted: its CHECK passed before and fails now: %s", where,
                        state.reason)
        elif state.verdict is CheckVerdict.FAILED_TO_RUN:
            log.warning("%s: CHECK failed to run, so it says nothing of the attachment (not "
                        "drift, never repaired): %s", where, state.reason)
        elif state.verdict is CheckVerdict.UNSUPPORTED:
            log.info("%s: CHECK fails and never passed, so it proves nothing here (check "
                     "unsupported; not drift, never repaired): %s", where, state.reason)
        elif state.verdict is CheckVerdict.OK and before is not None and \
                before.verdict in (CheckVerdict.DRIFTED, CheckVerdict.FAILED_TO_RUN):
            log.info("%s: CHECK passes again", where)

    # --- repair ---------------------------------------------------------------------

    def _keep(self, att: Attachment, ips: Sequence[str], mac: str) -> tuple[dict[str, Any], str]:
        """The capabilities of a re-ADD (the recorded ones, plus the IPs and MAC
        it had, where the network takes them), and why it cannot ask for its IPs
        ("" when it can)."""
        net = self.journal.config_for(att, None)
        declared = set().union(*(p.capabilities for p in net.plugins))
        caps = dict(att.capabilities)
        why = ""
        if ips:
            if "ips" in declared:
                caps["ips"] = list(ips)
            else:
                why = (f"network {net.name} does not declare the ips capability, so a new ADD "
                       "could give the sandbox another IP")
        if mac and "mac" in declared:
            caps["mac"] = mac
        return caps, why

    async def _repair(self, rec: SandboxRecord, att: Attachment, entry: CachedAttachment,
                      ns: Pinned, drift: Outcome) -> tuple[Outcome, SandboxRecord]:
        current = rec.attachment(att.ifname) or att
        ips, mac = _ips(entry.result), _mac(entry.result, att.ifname)
        caps, why = self._keep(current, ips, mac)
        if why and not self.new_address:
            note = f"refused: repair would change the address ({why})"
            if current.check is not None and current.check.repair != note:
                rec = rec.with_check(att.ifname, replace(current.check, repair=note))
                await self.journal.save(rec)
            if not drift.drifted:  # said once, not at every pass
                return drift, rec
            log.warning("sandbox %s: %s/%s not repaired: repair would change the address: %s",
                        rec.sandbox_id, att.network, att.ifname, why)
            return self._announce(replace(drift, repair="refused",
                                          reason=f"repair would change the address: {why}")), rec
        now = time.time()

        def lost(e: CNIError) -> Attachment:
            prior = current.check or CheckState(CheckVerdict.DRIFTED, now)
            return replace(current, phase=Phase.READY, lost=Lost(
                now, str(e), 1, now + self.retry_delay(1), tuple(ips), mac),
                check=replace(prior, verdict=CheckVerdict.LOST, at=now, reason=str(e),
                              repair=f"failed: {e}"))

        rec, result = await self.journal.recreate(rec, current, entry, ns, caps, lost)
        if isinstance(result, CNIError):
            log.error("sandbox %s: repair of %s/%s failed, so the attachment is lost: kept in "
                      "the record and retried in %gs: %s", rec.sandbox_id, att.network,
                      att.ifname, self.retry_delay(1), result)
            self.on_lost()
            gone = rec.attachment(att.ifname)
            if self.journal.events.on and gone is not None:
                self.journal.events.emit(Change.LOST, rec.sandbox_id, rec.owner,
                                         [(gone, State.LOST)])
            return self._announce(replace(drift, verdict=CheckVerdict.LOST, reason=str(result),
                                          repair="failed", changed=True, drifted=False)), rec
        return await self._repaired(rec, current, ips, result, ns, "ok")

    async def retry_lost(self, rec: SandboxRecord, att: Attachment, ns: Pinned
                         ) -> tuple[Outcome, SandboxRecord]:
        """ADD a lost attachment again (DEL first: what a failed ADD left), asking
        for the addresses it had; the caller holds the sandbox's lock."""
        assert att.lost is not None
        was = att.lost
        now = time.time()
        attempts = was.attempts + 1

        def still_lost(e: CNIError) -> Attachment:
            prior = att.check or CheckState(CheckVerdict.LOST, now)
            return replace(att, phase=Phase.READY,
                           lost=replace(was, reason=str(e), attempts=attempts,
                                        next_try=now + self.retry_delay(attempts)),
                           check=replace(prior, verdict=CheckVerdict.LOST, at=now, reason=str(e)))

        with log_fields(SANDBOX_ID=rec.sandbox_id, NETWORK=att.network, IFNAME=att.ifname):
            try:
                # Lost already: whatever address it gets (asking for the old one).
                caps, _ = self._keep(att, was.ips, was.mac)
                rec, result = await self.journal.recreate(rec, att, None, ns, caps, still_lost)
            except CacheError:
                raise  # the disk: see Journal.recreate (nothing done, or reaping finishes it)
            except CNIError as e:  # no usable config: nothing changed; the same backoff
                rec = rec.with_attachments(still_lost(e) if a.ifname == att.ifname else a
                                           for a in rec.attachments)
                await self.journal.save(rec)
                result = e
            if isinstance(result, CNIError):
                log.warning("sandbox %s: %s/%s is still lost: ADD %d failed: %s; next try in %gs",
                            rec.sandbox_id, att.network, att.ifname, attempts, result,
                            self.retry_delay(attempts))
                return self._announce(Outcome(rec.sandbox_id, att.network, att.ifname,
                                              CheckVerdict.LOST, str(result),
                                              repair="retry_failed")), rec
            return await self._repaired(rec, att, list(was.ips), result, ns, "retry_ok")

    async def _repaired(self, rec: SandboxRecord, was: Attachment, ips: Sequence[str],
                        result: Mapping[str, Any], ns: Pinned, kind: str
                        ) -> tuple[Outcome, SandboxRecord]:
        """After a successful re-ADD: its new baseline CHECK, and what the repair did."""
        after = _ips(result)
        moved = sorted(ips) != sorted(after)
        change = f"{', '.join(ips) or 'none'} → {', '.join(after) or 'none'}"
        how = "repaired (DEL, then ADD with its recorded args and capabilities)" if kind == "ok" \
            else "ADDed again after it was lost"
        log.warning("sandbox %s: %s/%s %s: IPs %s%s", rec.sandbox_id, was.network, was.ifname,
                    how, change, " (another address)" if moved else "")
        _, entries = await self.journal.view(rec.sandbox_id)
        fresh = rec.attachment(was.ifname)
        new_entry = entries.get((was.network, was.ifname))
        if self.journal.events.on and fresh is not None:
            self.journal.events.emit(Change.REPAIRED, rec.sandbox_id, rec.owner,
                                     [(fresh, State.READY)], {fresh.ifname: result})
        if fresh is None or new_entry is None:
            return Outcome(rec.sandbox_id, was.network, was.ifname, CheckVerdict.OK), rec
        repairs = (was.check.repairs if was.check else 0) + 1
        rec = rec.with_check(was.ifname, CheckState(CheckVerdict.UNSUPPORTED, time.time(),
                                                    repairs=repairs))
        # Its new baseline: the CHECK right after the new ADD.
        outcome, rec = await self._one(rec, rec.attachment(was.ifname) or fresh, new_entry, ns,
                                       baseline=True)
        if moved:
            note = f"the address changed: {change}"
            checked = rec.attachment(was.ifname)
            if checked is not None and checked.check is not None:
                rec = rec.with_check(was.ifname, replace(
                    checked.check, verdict=CheckVerdict.NEW_ADDRESS, reason=note, repair=note))
                await self.journal.save(rec)
            outcome = replace(outcome, verdict=CheckVerdict.NEW_ADDRESS, reason=note,
                              repair="new_address")
        elif kind == "ok" and outcome.verdict is not CheckVerdict.OK:
            outcome = replace(outcome, repair="unverified")
        else:
            outcome = replace(outcome, repair=kind)
        return self._announce(replace(outcome, changed=True, error=None)), rec

    def announce(self, outcome: Outcome) -> Outcome:
        """An outcome found outside a CHECK (a missing anti-spoofing filter), to the listeners."""
        return self._announce(outcome)

    def _announce(self, outcome: Outcome) -> Outcome:
        for listener in self._listeners:
            listener(outcome)
        return outcome
