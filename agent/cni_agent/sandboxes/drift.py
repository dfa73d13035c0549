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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.errors import CNIError
from cni_agent.node.blocking import UNANSWERED
from cni_agent.node.locks import LockTimeout
from cni_agent.sandboxes.checks import Outcome, Yielded
from cni_agent.sandboxes.manager import SandboxManager, check_document
from cni_agent.sandboxes.order import Kind
from cni_agent.sandboxes.policy import ROOT, Caller, Policy, not_yours
from cni_agent.sandboxes.records import Phase

log = logging.getLogger(__name__)

JITTER = 0.1  # each interval is drawn from ±10% of check.interval
# Baselines wait for a quiet moment: a burst of pod start-ups (20 RunPodSandbox
# at once) must not share the node's CPU with 20 CHECK chains. They run once no
# ADD came for BASELINE_QUIET seconds, and at most BASELINE_MAX after the ADD.
BASELINE_QUIET = 1.0
BASELINE_MAX = 10.0


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

    @property
    def on(self) -> bool:
        return self.interval > 0

    def start(self) -> None:
        if self.on and self._task is None:
            self._task = asyncio.create_task(self._every(), name="cni-agent-check-passes")

    def trigger(self, why: str) -> None:
        """Run a pass now (firewalld reloaded or restarted); one already waiting absorbs it."""
        if self.on:
            self._why = why
            self._wake.set()

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
        tasks = [t for t in (self._task, self._baselines) if t is not None]
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
            batch, self._pending = list(self._pending), {}
            gate = asyncio.Semaphore(self.concurrency)

            await asyncio.gather(*(self._gated_baseline(sid, gate) for sid in batch))

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
                  background: bool = True) -> PassReport:
        """One pass over the ready sandboxes (those of `sandbox_ids` when given).

        `background`: yield to requests, skip busy sandboxes; else (a caller
        asked) wait for each lock like any request."""
        m = self.manager
        await m.reaper.recovered.wait()
        records, _ = await asyncio.to_thread(m.journal.store.all)
        if sandbox_ids is None:
            m.checks.retain({r.sandbox_id for r in records})
        wanted = None if sandbox_ids is None else set(sandbox_ids)
        sids = sorted(r.sandbox_id for r in records
                      if r.phase is Phase.READY and (wanted is None or r.sandbox_id in wanted))
        report = PassReport()
        gate = asyncio.Semaphore(self.concurrency)
        wait = 0.0 if background else m.timeouts.lock

        async def one(sid: str) -> None:
            async with gate:
                await self._sandbox(sid, report, wait=wait, background=background)

        log.debug("CHECK pass (%s) over %d sandbox(es)", why, len(sids))
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
        records, _ = await asyncio.to_thread(m.journal.store.all, Policy.own_prefix(caller))
        mine = {r.sandbox_id for r in records if caller.root or r.owner == caller.uid}
        for sid in sorted(asked - mine):
            if not caller.root:
                raise not_yours(sid, caller)
            raise AgentError(ErrorKind.NOT_FOUND, f"sandbox {sid} is not set up")
        wanted = asked or mine
        report = await self.run(wanted, why="asked", background=False)
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

    async def _sandbox(self, sid: str, report: PassReport, *, wait: float, background: bool,
                       unchecked_only: bool = False) -> None:
        m = self.manager
        kind = Kind.BACKGROUND if background else Kind.OTHER
        with m.order.arrive(sid, kind) as ticket:
            stop = ticket.superseded if background else None
            try:
                # Busy here is not a refusal: not tried, so not counted as one.
                if stop is not None and (stop.is_set() or m.locks.busy(sid)):
                    raise Yielded()
                async with m.locks.hold(sid, wait):
                    if stop is not None and stop.is_set():
                        raise Yielded()
                    rec, entries = await m.journal.view(sid)
                    if rec is None or rec.phase is not Phase.READY:
                        return
                    # A namespace that is gone or replaced is the reaper's, not ours.
                    async with m.journal.live_netns(rec, entries) as ns:
                        if ns is None:
                            return
                        report.outcomes.extend(await m.checks.run_locked(
                            rec, entries, ns, stop=stop, unchecked_only=unchecked_only))
            except (LockTimeout, Yielded):
                report.busy.append(sid)
            except UNANSWERED as e:
                report.errors.append(f"sandbox {sid}: not checked: {e}")
            except AgentError as e:
                report.errors.append(f"sandbox {sid}: not checked: {e.message}")
            except CNIError as e:  # its record could not be written: the next pass retries
                report.errors.append(f"sandbox {sid}: {e}")
