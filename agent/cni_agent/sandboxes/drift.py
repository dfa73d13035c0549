"""CHECK passes over every ready attachment: on a schedule, on events, on demand.

Nothing else notices when another tool flushes portmap's DNAT chain or a
firewalld reload drops the firewall plugin's rules: the pod keeps running
with a dead port. A pass CHECKs each ready sandbox through `Checks` (the D-Bus
Check's own path) under the sandbox's lock, a bounded number at once.

A pass never holds up a request: it takes a sandbox's lock only when free,
and a request arriving on that sandbox while its CHECK runs stops the CHECK
(its plugin killed; a CHECK changes nothing) and gets the lock at once. The
sandbox is looked at again in the next pass. Passes are spread by jitter so
nodes that started together do not CHECK in step.

Attachments a failed repair left lost are ADDed again here, each when its
backoff is over (`Checks.retry_lost`), whether CHECK passes run or not, from
their records: across restarts too.

Each full pass also checks that members' anti-spoofing filters are all in
place (`Guard.reconcile`: one listing of the agent's nftables table): a
missing or altered one is drift (AttachmentDrifted, the drift metric, a
warning) and is installed again at once, as after an `nft flush ruleset`.
That check also runs once recovery is over, and — with CHECK passes off —
every GUARD_INTERVAL and on firewalld's triggers: filters have no off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.errors import CNIError
from cni_agent.node.blocking import UNANSWERED
from cni_agent.node.locks import LockTimeout
from cni_agent.node.netns import Pinned
from cni_agent.sandboxes.checks import Outcome, Yielded
from cni_agent.sandboxes.journal import Entries
from cni_agent.sandboxes.manager import SandboxManager, check_document
from cni_agent.sandboxes.order import Kind
from cni_agent.sandboxes.policy import OWNED_PREFIX, ROOT, Caller, Policy, not_yours
from cni_agent.sandboxes.records import CheckVerdict, Phase, SandboxRecord

log = logging.getLogger(__name__)

JITTER = 0.1  # each interval is drawn from ±10% of check.interval
# Baselines wait for a quiet moment: a burst of pod start-ups (20 RunPodSandbox
# at once) must not share the node's CPU with 20 CHECK chains. They run once no
# ADD came for BASELINE_QUIET seconds, and at most BASELINE_MAX after the ADD.
BASELINE_QUIET = 1.0
BASELINE_MAX = 10.0
GUARD_INTERVAL = 60.0  # the filters' presence check, when no CHECK pass runs


@dataclass
class PassReport:
    outcomes: list[Outcome] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)  # in use: the next pass looks again
    errors: list[str] = field(default_factory=list)


class DriftPasses:
    def __init__(self, manager: SandboxManager, *, interval: float = 300.0,
                 concurrency: int = 4, uniform: Callable[[float, float], float] = random.uniform
                 ) -> None:
        self.manager = manager
        self.interval = interval  # 0: no scheduled, triggered or baseline CHECKs
        self.concurrency = max(1, concurrency)
        self._uniform = uniform
        self._wake = asyncio.Event()
        self._why = ""
        self._task: asyncio.Task[None] | None = None
        self._pending: dict[str, float] = {}  # sandbox → when its ADD ended
        self._last_add = 0.0
        self._baselines: asyncio.Task[None] | None = None
        self._lost_task: asyncio.Task[None] | None = None
        self._lost_wake = asyncio.Event()
        manager.checks.on_lost = self._lost_wake.set
        self._guard_task: asyncio.Task[None] | None = None
        self._guard_wake = asyncio.Event()
        self._guard_why = ""

    @property
    def on(self) -> bool:
        return self.interval > 0

    def start(self) -> None:
        if self.on and self._task is None:
            self._task = asyncio.create_task(self._every(), name="cni-agent-check-passes")
        if self._lost_task is None:  # what an earlier run lost, and what is lost from now
            self._lost_task = asyncio.create_task(self._retry_lost(), name="cni-agent-lost-retries")
        if self._guard_task is None:
            self._guard_task = asyncio.create_task(self._guards(), name="cni-agent-filter-checks")

    def trigger(self, why: str) -> None:
        """Run a pass now (firewalld reloaded or restarted); one already waiting absorbs it."""
        if self.on:
            self._why = why
            self._wake.set()
        else:  # the filters' check alone
            self._guard_why = why
            self._guard_wake.set()

    def baseline(self, sandbox_id: str) -> None:
        """The CHECK right after ADD (in the next quiet moment): the baseline
        later CHECKs are judged by."""
        if not self.on:
            return
        now = asyncio.get_running_loop().time()
        self._pending.setdefault(sandbox_id, now)
        self._last_add = now
        if self._baselines is None or self._baselines.done():
            self._baselines = asyncio.create_task(self._run_baselines(),
                                                  name="cni-agent-baseline-checks")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._baselines, self._lost_task, self._guard_task)
                 if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run_baselines(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            now = loop.time()
            due = min(self._last_add + BASELINE_QUIET, min(self._pending.values()) + BASELINE_MAX)
            if due > now:
                await asyncio.sleep(due - now)
                continue
            # A sandbox gone, or whose CHECK a runtime ran meanwhile (CRI-O
            # CHECKs every pod right after its ADD: that was the baseline),
            # needs none: decided from memory, without its lock or namespace.
            batch = [sid for sid in self._pending if self._unchecked(sid)]
            self._pending = {}
            gate = asyncio.Semaphore(self.concurrency)

            await asyncio.gather(*(self._gated_baseline(sid, gate) for sid in batch))

    def _unchecked(self, sandbox_id: str) -> bool:
        try:
            rec = self.manager.journal.store.read(sandbox_id)
        except CNIError:
            return True  # damaged: the pass sees to it
        return rec is not None and any(a.check is None for a in rec.attachments
                                       if a.phase is Phase.READY and a.lost is None)

    async def _gated_baseline(self, sandbox_id: str, gate: asyncio.Semaphore) -> None:
        async with gate:
            await self._baseline(sandbox_id)

    async def _baseline(self, sandbox_id: str) -> None:
        report = PassReport()
        try:
            await self._sandbox(sandbox_id, report, wait=0.0, background=True, unchecked_only=True)
        except Exception:  # the next pass takes it
            log.exception("baseline CHECK of %s failed", sandbox_id)

    async def _every(self) -> None:
        await self.manager.reaper.recovered.wait()
        while True:
            delay = self.interval * self._uniform(1 - JITTER, 1 + JITTER)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
            why, self._why = (self._why or "scheduled"), ""
            self._wake.clear()
            try:
                report = await self.run(why=why)
            except Exception:  # a pass that broke must not end all later ones
                log.exception("CHECK pass failed; the next one runs in about %gs", self.interval)
                continue
            for err in report.errors:
                log.warning("check: %s", err)

    async def run(self, sandbox_ids: Collection[str] | None = None, *, why: str = "scheduled",
                  background: bool = True, records: list[SandboxRecord] | None = None
                  ) -> PassReport:
        """One pass over the ready sandboxes (those of `sandbox_ids` when given),
        as `records` lists them (read here when not given).

        `background`: yield to requests, skip busy sandboxes; else (a caller
        asked) wait for each lock like any request."""
        m = self.manager
        await m.reaper.recovered.wait()
        if records is None:
            records = m.journal.store.all()[0]
        if sandbox_ids is None:
            m.checks.retain({r.sandbox_id for r in records})
        wanted = None if sandbox_ids is None else set(sandbox_ids)
        # A caller's pass also waits for a sandbox mid-operation (a Setup, a
        # lost attachment's retry) and looks at it once that is over, as any
        # request would; a background pass leaves it for next time.
        sids = sorted(r.sandbox_id for r in records
                      if (r.phase is Phase.READY or not background)
                      and (wanted is None or r.sandbox_id in wanted))
        report = PassReport()
        gate = asyncio.Semaphore(self.concurrency)
        wait = 0.0 if background else m.timeouts.lock

        async def one(sid: str) -> None:
            async with gate:
                await self._sandbox(sid, report, wait=wait, background=background)

        log.debug("CHECK pass (%s) over %d sandbox(es)", why, len(sids))
        # The filters of the pass's sandboxes (of all, on a full pass): one listing.
        await self.filters_pass([r for r in records if wanted is None or r.sandbox_id in wanted],
                                report)
        await asyncio.gather(*(one(s) for s in sids))
        drifted = [o for o in report.outcomes if o.drifted]
        if drifted or report.busy:
            log.info("CHECK pass (%s): %d attachment(s) checked, %d drifted, %d sandbox(es) "
                     "busy (looked at next time)", why, len(report.outcomes), len(drifted),
                     len(report.busy))
        return report

    async def check_now(self, sandbox_ids: Collection[str], caller: Caller = ROOT
                        ) -> list[dict[str, Any]]:
        """A pass asked for (the `check` CLI): the listed sandboxes (all when
        none; a caller other than root: only its own, read by their names),
        then each attachment's check state as Show reports it."""
        m = self.manager
        asked = {m.own_id(caller, sid, field="sandbox_ids") for sid in sandbox_ids}
        await m.reaper.recovered.wait()
        records, _ = m.journal.store.all(Policy.own_prefix(caller))
        mine = {r.sandbox_id for r in records if Policy.owns(caller, r.owner)}
        for sid in sorted(asked - mine):
            if not caller.root:
                raise not_yours(sid, caller)
            raise AgentError(ErrorKind.NOT_FOUND, f"sandbox {sid} is not set up")
        wanted = asked or mine
        report = await self.run(wanted, why="asked", background=False, records=records)
        if report.errors:
            raise AgentError(ErrorKind.PLUGIN_FAILED, report.errors[0])
        drifted = {(o.sandbox_id, o.ifname) for o in report.outcomes if o.drifted}
        out: list[dict[str, Any]] = []
        for sid in sorted(wanted):
            rec, _ = await m.journal.view(sid, repair=False)
            for att in rec.attachments if rec else ():
                out.append({"sandbox": Policy.shown(caller, sid), "network": att.network,
                            "ifname": att.ifname,
                            **check_document(att, m.checks.last_check(sid, att)),
                            "drifted_now": (sid, att.ifname) in drifted})
        return out

    # --- anti-spoofing filters ------------------------------------------------------------

    async def filters_pass(self, records: list[SandboxRecord] | None = None,
                           report: PassReport | None = None) -> PassReport:
        """Every filter that should be there is (each restored one: drift)."""
        m = self.manager
        report = report if report is not None else PassReport()
        if m.journal.guard.mode != "all" and not m.journal.store.ids(OWNED_PREFIX):
            # No record a filter is for (root's only, `antispoof: members`): no
            # nftables call, so a node only root uses never loads libnftables
            # (its context and cache cost ~5 MiB; measured by `footprint`), and
            # one the members have left lets it go.
            await m.journal.guard.idle()
            return report
        if records is None:
            records = m.journal.store.all()[0]

        def current(sid: str) -> SandboxRecord | None:
            try:
                return m.journal.store.read(sid)
            except CNIError:
                return None

        found = await m.journal.guard.reconcile(
            records, lambda att: m.journal.config_for(att, None), current)
        for sid, att, why in found.restored:
            report.outcomes.append(m.checks.announce(Outcome(
                sid, att.network, att.ifname, CheckVerdict.DRIFTED,
                f"its anti-spoofing filter was {why} (restored)", drifted=True)))
        report.errors.extend(found.errors)
        return report

    async def _guards(self) -> None:
        """The filters' check once recovery is over; then, with CHECK passes
        off, every GUARD_INTERVAL and when firewalld asks."""
        await self.manager.reaper.recovered.wait()
        why = "start-up"
        while True:
            try:
                report = await self.filters_pass()
                for err in report.errors:
                    log.warning("anti-spoofing filters (%s): %s", why, err)
            except Exception:  # one that broke must not end all later ones
                log.exception("the anti-spoofing filters' check failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._guard_wake.wait(),
                                       None if self.on else GUARD_INTERVAL)
            self._guard_wake.clear()
            why, self._guard_why = (self._guard_why or "scheduled"), ""

    # --- lost attachments --------------------------------------------------------------

    async def _retry_lost(self) -> None:
        """ADD each lost attachment again once its backoff is over; sleep until
        the next one is due, or a repair loses one."""
        await self.manager.reaper.recovered.wait()
        while True:
            self._lost_wake.clear()
            try:
                due = await self.retry_lost_due()
            except Exception:  # a round that broke must not end all later ones
                log.exception("retrying lost attachments failed")
                due = time.time() + self.manager.checks.retry_base
            delay = None if due is None else max(0.0, due - time.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost_wake.wait(), delay)

    async def retry_lost_due(self) -> float | None:
        """One round: retry the lost attachments whose time has come; when the
        next one is due (epoch seconds), None when none is lost."""
        due, soonest = await self._lost_schedule()
        later = [await self._retry_sandbox(sid) for sid in due]
        if not due:
            return soonest
        # Their next tries, as the retries recorded them; one still due was not
        # looked at (busy: in a second; it failed: after the first backoff).
        again, soonest = await self._lost_schedule()
        return time.time() + min(later) if again else soonest

    async def _lost_schedule(self) -> tuple[list[str], float | None]:
        """The sandboxes with a lost attachment due now, and when the next one
        not due yet is (None: none)."""
        records = self.manager.journal.store.records()
        now = time.time()
        due: set[str] = set()
        later: list[float] = []
        for r in records:
            for a in r.attachments:
                if a.lost is None or r.phase is not Phase.READY:
                    continue
                if a.lost.next_try <= now:
                    due.add(r.sandbox_id)
                else:
                    later.append(a.lost.next_try)
        return sorted(due), min(later, default=None)

    async def _retry_sandbox(self, sid: str) -> float:
        """Retry the due lost attachments of one sandbox, if its lock is free
        (a request on it goes first); when to look again if they are still due."""
        m = self.manager
        try:
            async with self._ready(sid, wait=0.0, background=True) as held:
                if held is not None:
                    rec, _, ns, _ = held
                    now = time.time()
                    for att in rec.attachments:
                        current = rec.attachment(att.ifname)
                        if current is not None and current.lost is not None and \
                                current.lost.next_try <= now:
                            _, rec = await m.checks.retry_lost(rec, current, ns)
            return 1.0
        except (LockTimeout, Yielded):
            return 1.0
        except (*UNANSWERED, AgentError, CNIError) as e:
            log.warning("lost attachments of sandbox %s not retried now (again in %gs): %s",
                        sid, m.checks.retry_base, e)
            return m.checks.retry_base

    @contextlib.asynccontextmanager
    async def _ready(self, sid: str, *, wait: float, background: bool
                     ) -> AsyncIterator[tuple[SandboxRecord, Entries, Pinned,
                                              asyncio.Event | None] | None]:
        """The sandbox under its lock, if it is ready and its namespace is the
        recorded one: its record, cache entries, namespace and (`background`)
        the event that a request on it arrived; else None.

        `background`: Yielded at once if it is busy or a request arrived (not
        tried, so not a refusal); else wait for its lock like any request."""
        m = self.manager
        kind = Kind.BACKGROUND if background else Kind.OTHER
        with m.order.arrive(sid, kind) as ticket:
            stop = ticket.superseded if background else None
            if stop is not None and (stop.is_set() or m.locks.busy(sid)):
                raise Yielded()
            async with m.locks.hold(sid, wait):
                if stop is not None and stop.is_set():
                    raise Yielded()
                rec, entries = await m.journal.view(sid)
                if rec is None or rec.phase is not Phase.READY:
                    yield None  # torn down (or being): nothing to do
                    return
                # A namespace that is gone or replaced is the reaper's, not ours.
                async with m.journal.live_netns(rec, entries) as ns:
                    yield None if ns is None else (rec, entries, ns, stop)

    async def _sandbox(self, sid: str, report: PassReport, *, wait: float, background: bool,
                       unchecked_only: bool = False) -> None:
        try:
            async with self._ready(sid, wait=wait, background=background) as held:
                if held is not None:
                    rec, entries, ns, stop = held
                    report.outcomes.extend(await self.manager.checks.run_locked(
                        rec, entries, ns, stop=stop, unchecked_only=unchecked_only))
        except (LockTimeout, Yielded):
            report.busy.append(sid)
        except UNANSWERED as e:
            report.errors.append(f"sandbox {sid}: not checked: {e}")
        except AgentError as e:
            report.errors.append(f"sandbox {sid}: not checked: {e.message}")
        except CNIError as e:  # its record could not be written: the next pass retries
            report.errors.append(f"sandbox {sid}: {e}")
