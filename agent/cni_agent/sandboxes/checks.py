"""CHECK of a sandbox's attachments, judged against their baseline: drift.

One code path for every CHECK the agent runs — the D-Bus Check, the `check`
CLI, the scheduled and firewalld-triggered passes (drift.py) — always with
the sandbox's lock held by the caller.

A CHECK is only as good as its plugin: Debian 12's portmap 1.1.1 fails it
right after a good ADD on an IPv4-only network. So the baseline is the first
CHECK (run right after ADD when checks are on): an attachment that never
passed is "unsupported" (shown, counted, never repaired), and only a pass
followed by a failure is drift. With `repair`, a drifted attachment is
re-created — DEL, then ADD with its recorded config, args and capabilities,
asking for its IPs and MAC through the `ips`/`mac` capabilities — unless the
network cannot be asked for the same IP: then it is only reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from cni_agent.cni.cache import CachedAttachment
from cni_agent.cni.errors import CNIError
from cni_agent.cni.logctx import log_fields
from cni_agent.node.netns import Pinned
from cni_agent.sandboxes.journal import Entries, Journal
from cni_agent.sandboxes.records import Attachment, CheckState, CheckVerdict, Phase, SandboxRecord

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    """One attachment's CHECK, as metrics, the D-Bus signal and the CLI see it."""

    sandbox_id: str
    network: str
    ifname: str
    verdict: CheckVerdict
    reason: str = ""
    drifted: bool = False  # this CHECK is the pass → fail transition
    # Set on a repair's outcome (not a CHECK's): "ok" (re-created, its new CHECK
    # passes), "unverified" (re-created, its new CHECK fails), "failed", "refused".
    repair: str = ""
    error: CNIError | None = None  # the failure, for the D-Bus Check's reply

    @property
    def result(self) -> str:
        """`cni_agent_checks_total{result}`: ok, failed (after a pass), unsupported, disabled."""
        if self.verdict is CheckVerdict.DRIFTED:
            return "failed"
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
    def __init__(self, journal: Journal, *, repair: bool = False) -> None:
        self.journal = journal
        self.repair = repair
        self._listeners: list[Listener] = []
        # Last CHECK times, kept here: a pass that changes no verdict writes no record.
        self._last: dict[tuple[str, str], float] = {}

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def last_check(self, sandbox_id: str, att: Attachment) -> float:
        recorded = att.check.at if att.check else 0.0
        return max(recorded, self._last.get((sandbox_id, att.ifname), 0.0))

    def retain(self, sandbox_ids: set[str]) -> None:
        """Forget the CHECK times of sandboxes that are gone (each pass calls it)."""
        for key in [k for k in self._last if k[0] not in sandbox_ids]:
            del self._last[key]

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
            if att.phase is not Phase.READY or entry is None or (unchecked_only and att.check):
                continue
            with log_fields(SANDBOX_ID=rec.sandbox_id, NETWORK=att.network, IFNAME=att.ifname):
                outcome, rec = await self._one(rec, att, entry, ns, stop)
                wanted = self.repair if repair is None else repair
                if outcome.verdict is CheckVerdict.DRIFTED and wanted:
                    outcome, rec = await self._repair(rec, att, entry, ns, outcome)
            outcomes.append(outcome)
        return outcomes

    async def _one(self, rec: SandboxRecord, att: Attachment, entry: CachedAttachment,
                   ns: Pinned, stop: asyncio.Event | None = None) -> tuple[Outcome, SandboxRecord]:
        error: CNIError | None = None
        try:
            supported = await _unless(self.journal.check(att, entry, ns), stop)
        except CNIError as e:
            supported, error = True, e
        now = time.time()
        self._last[(rec.sandbox_id, att.ifname)] = now
        before = att.check
        passed = bool(before and before.passed)
        reason = str(error) if error else ""
        if not supported:
            verdict = CheckVerdict.DISABLED
        elif error is None:
            verdict, passed = CheckVerdict.OK, True
        else:
            verdict = CheckVerdict.DRIFTED if passed else CheckVerdict.UNSUPPORTED
        drifted = verdict is CheckVerdict.DRIFTED and (before is None
                                                       or before.verdict is not CheckVerdict.DRIFTED)
        state = CheckState(verdict, now, reason, passed, before.repairs if before else 0)
        if before is None or (before.verdict, before.reason, before.passed) != \
                (state.verdict, state.reason, state.passed):
            rec = rec.with_check(att.ifname, state)
            await self.journal.save(rec)
            self._log_change(rec.sandbox_id, att, before, state, drifted)
        outcome = Outcome(rec.sandbox_id, att.network, att.ifname, verdict, reason, drifted,
                          error=error)
        return self._announce(outcome), rec

    @staticmethod
    def _log_change(sid: str, att: Attachment, before: CheckState | None, state: CheckState,
                    drifted: bool) -> None:
        where = f"sandbox {sid}: {att.network}/{att.ifname}"
        if drifted:
            log.warning("%s drifted: its CHECK passed before and fails now: %s", where,
                        state.reason)
        elif state.verdict is CheckVerdict.UNSUPPORTED:
            log.info("%s: CHECK fails and never passed, so it proves nothing here (check "
                     "unsupported; not drift, never repaired): %s", where, state.reason)
        elif state.verdict is CheckVerdict.OK and before is not None and \
                before.verdict is CheckVerdict.DRIFTED:
            log.info("%s: CHECK passes again", where)

    # --- repair ---------------------------------------------------------------------

    def _keep(self, att: Attachment, entry: CachedAttachment) -> tuple[dict[str, Any] | None, str]:
        """The capabilities of the re-ADD (the recorded ones, plus the IPs and MAC
        it had), or None and why it cannot keep them."""
        net = self.journal.config_for(att, entry)
        declared = set().union(*(p.capabilities for p in net.plugins))
        caps = dict(att.capabilities)
        ips = _ips(entry.result)
        if ips:
            if "ips" not in declared:
                return None, (f"network {net.name} does not declare the ips capability, so a "
                              "new ADD could give the sandbox another IP")
            caps["ips"] = ips
        mac = _mac(entry.result, att.ifname)
        if mac and "mac" in declared:
            caps["mac"] = mac
        return caps, ""

    async def _repair(self, rec: SandboxRecord, att: Attachment, entry: CachedAttachment,
                      ns: Pinned, drift: Outcome) -> tuple[Outcome, SandboxRecord]:
        current = rec.attachment(att.ifname) or att
        caps, why = self._keep(current, entry)
        if caps is None:
            if not drift.drifted:  # said once, not at every pass
                return drift, rec
            log.warning("sandbox %s: %s/%s not repaired: %s", rec.sandbox_id,
                        att.network, att.ifname, why)
            return self._announce(replace(drift, repair="refused", reason=why)), rec
        try:
            rec, result = await self.journal.recreate(rec, current, entry, ns, caps)
        except CNIError as e:
            log.error("sandbox %s: repair of %s/%s failed, the attachment is removed: %s",
                      rec.sandbox_id, att.network, att.ifname, e)
            reread = await self.journal.view(rec.sandbox_id)
            return self._announce(replace(drift, repair="failed", reason=str(e))), \
                reread[0] or rec
        before, after = _ips(entry.result), _ips(result)
        log.warning("sandbox %s: %s/%s repaired (DEL, then ADD with its recorded args and "
                    "capabilities): IPs %s → %s", rec.sandbox_id, att.network, att.ifname,
                    ", ".join(before) or "none", ", ".join(after) or "none")
        _, entries = await self.journal.view(rec.sandbox_id)
        fresh = rec.attachment(att.ifname)
        new_entry = entries.get((att.network, att.ifname))
        if fresh is None or new_entry is None:
            return drift, rec
        repairs = (current.check.repairs if current.check else 0) + 1
        rec = rec.with_check(att.ifname, CheckState(CheckVerdict.UNSUPPORTED, time.time(),
                                                    repairs=repairs))
        # Its new baseline: the CHECK right after the new ADD.
        outcome, rec = await self._one(rec, rec.attachment(att.ifname) or fresh, new_entry, ns)
        verified = outcome.verdict is CheckVerdict.OK
        return self._announce(replace(outcome, repair="ok" if verified else "unverified")), rec

    def _announce(self, outcome: Outcome) -> Outcome:
        for listener in self._listeners:
            listener(outcome)
        return outcome
