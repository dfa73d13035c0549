"""Garbage collection and reaping: the leaks users hit after crashes and reboots.

Three jobs, all under the node-wide GC lock (exclusive of every ADD and DEL):
- finish what a killed agent left half-done (records not "ready" are rolled
  back with DEL, using the exact config bytes recorded before the first ADD);
- DEL cached attachments whose sandbox is gone: its namespace was deleted, or
  its path now names another namespace (the reboot case), or — on demand —
  the runtime says it is not valid. Such DELs get an empty netns: a reused
  path must never reach a plugin;
- send the GC verb with the live attachments (CNI >= 1.1.0).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

from cni_agent.cni.cache import CachedAttachment
from cni_agent.cni.config import NetworkConfigList, parse_list
from cni_agent.cni.errors import CNIError
from cni_agent.cni.runtime import CNIRuntime, RuntimeConf, cached_config, netns_if_present
from cni_agent.locks import RWLock
from cni_agent.netns import netns_identity
from cni_agent.records import Phase, SandboxRecord, SandboxStore

log = logging.getLogger(__name__)


@dataclass
class GCReport:
    rolled_back: list[str] = field(default_factory=list)
    deleted: list[tuple[str, str, str]] = field(default_factory=list)  # network, sandbox, ifname
    errors: list[str] = field(default_factory=list)


def record_netns(rec: SandboxRecord | None) -> str:
    """The record's netns path if it still names the namespace recorded at ADD, else ""."""
    if rec is None or not rec.netns or rec.netns_id is None:
        return ""
    return rec.netns if netns_identity(rec.netns) == rec.netns_id else ""


async def rollback(runtime: CNIRuntime, store: SandboxStore, rec: SandboxRecord) -> list[str]:
    """DEL every attachment of a record (reverse order); drop it when all succeeded.

    Returns the errors; on any error the record stays (phase "deleting" or
    "adding") with only the attachments still to remove, for the next attempt.
    """
    netns = record_netns(rec)
    errors: list[str] = []
    remaining = []
    for intent in reversed(rec.attachments):
        rt = RuntimeConf(rec.sandbox_id, netns, intent.ifname, intent.args, dict(intent.capabilities))
        try:
            net = parse_list(intent.config, f"record of {rec.sandbox_id}")
            await _delete(runtime, net, rt)
        except CNIError as e:
            errors.append(f"{intent.network}/{intent.ifname}: {e}")
            remaining.append(intent)
    if remaining:
        kept = replace(rec, attachments=tuple(reversed(remaining)))
        await asyncio.to_thread(store.write, kept)
    else:
        await asyncio.to_thread(store.delete, rec.sandbox_id)
    return errors


async def _delete(runtime: CNIRuntime, net: NetworkConfigList, rt: RuntimeConf) -> None:
    """DEL; if it fails while the args carry keys the plugin may not know, once more
    with IgnoreUnknown=1.

    A plugin that rejected the caller's CNI_ARGS on ADD ("unknown args") rejects
    them on every DEL too, which would leave the sandbox impossible to clean up.
    The DEL does not need those args; IgnoreUnknown is the spec's way to say so.
    """
    try:
        await runtime.delete(net, rt)
    except CNIError:
        if not rt.args or any(k == "IgnoreUnknown" for k, _ in rt.args):
            raise
        relaxed = RuntimeConf(rt.container_id, rt.netns, rt.ifname,
                              (("IgnoreUnknown", "1"), *rt.args), rt.capability_args)
        await runtime.delete(net, relaxed)
        log.info("DEL of %s/%s succeeded only with IgnoreUnknown=1 added to its args",
                 rt.container_id, rt.ifname, extra={"SANDBOX_ID": rt.container_id})


class Reaper:
    def __init__(
        self,
        runtime: CNIRuntime,
        store: SandboxStore,
        gc_lock: RWLock,
        networks: Callable[[], Sequence[NetworkConfigList]],
        lock_timeout: float | None = None,
    ) -> None:
        self.runtime = runtime
        self.store = store
        self.gc_lock = gc_lock
        self._networks = networks
        self._lock_timeout = lock_timeout

    async def recover(self) -> GCReport:
        """Start-up: finish or undo what a killed agent left half-done."""
        async with self.gc_lock.write(self._lock_timeout):
            report = GCReport()
            await self._finish_incomplete(report)
            return report

    async def collect(self, valid_ids: Collection[str] | None = None) -> GCReport:
        """Reap stale attachments and send GC; `valid_ids` overrides liveness detection."""
        async with self.gc_lock.write(self._lock_timeout):
            report = GCReport()
            await self._finish_incomplete(report)
            await self._reap(report, None if valid_ids is None else set(valid_ids))
            for err in report.errors:
                log.warning("gc: %s", err)
            if report.deleted or report.rolled_back:
                log.info("gc: removed %d stale attachment(s), rolled back %d sandbox(es)",
                         len(report.deleted), len(report.rolled_back))
            return report

    async def _finish_incomplete(self, report: GCReport) -> None:
        records, bad = await asyncio.to_thread(self.store.all)
        for sid in bad:
            report.errors.append(f"sandbox record {sid} is unreadable; left in place")
        for rec in records:
            if rec.phase is Phase.READY:
                continue
            errors = await rollback(self.runtime, self.store, rec)
            if errors:
                report.errors.extend(f"sandbox {rec.sandbox_id}: {e}" for e in errors)
            else:
                report.rolled_back.append(rec.sandbox_id)
                log.info("rolled back sandbox %s (interrupted while %s)", rec.sandbox_id, rec.phase)

    async def _reap(self, report: GCReport, valid_ids: set[str] | None) -> None:
        records = {r.sandbox_id: r for r in (await asyncio.to_thread(self.store.all))[0]}
        entries = await asyncio.to_thread(self.runtime.cache.all)

        def netns_for(entry: CachedAttachment) -> str:
            rec = records.get(entry.container_id)
            # Written by another tool: no identity recorded, the path must still be a netns.
            return record_netns(rec) if rec is not None else netns_if_present(entry)

        def live(entry: CachedAttachment) -> bool:
            if valid_ids is not None:
                return entry.container_id in valid_ids
            rec = records.get(entry.container_id)
            return (rec is None or rec.phase is Phase.READY) and bool(netns_for(entry))

        configured = {n.name: n for n in self._networks()}
        by_network: dict[str, list[CachedAttachment]] = {}
        for entry in entries:
            by_network.setdefault(entry.network, []).append(entry)
        for name in sorted(set(configured) | set(by_network)):
            cached = by_network.get(name, [])
            # A network gone from conf_dir is still DELed with the config its entries stored.
            net = configured.get(name) or next(filter(None, map(cached_config, cached)), None)
            if net is None:
                report.errors.append(f"network {name}: no usable config to DEL its stale attachments")
                continue
            valid = [(e.container_id, e.ifname) for e in cached if live(e)]
            result = await self.runtime.gc(net, valid, netns_for=netns_for, entries=cached)
            report.deleted.extend((name, cid, ifname) for cid, ifname in result.deleted)
            report.errors.extend(f"network {name}: {e}" for e in result.errors)
        deleted = {(net, cid, ifname) for net, cid, ifname in report.deleted}
        remaining = {(e.network, e.container_id, e.ifname) for e in entries} - deleted
        await self._prune_records(records, remaining)

    async def _prune_records(self, records: dict[str, SandboxRecord],
                             cached: set[tuple[str, str, str]]) -> None:
        """Drop attachments whose cache entries GC removed; drop empty records."""
        for rec in records.values():
            if rec.phase is not Phase.READY:
                continue
            kept = tuple(a for a in rec.attachments
                         if (a.network, rec.sandbox_id, a.ifname) in cached)
            if kept == rec.attachments:
                continue
            if kept:
                await asyncio.to_thread(self.store.write, replace(rec, attachments=kept))
            else:
                await asyncio.to_thread(self.store.delete, rec.sandbox_id)

