"""Setup, Teardown and Check of sandboxes: validate → wait ready → lock → runtime.

No D-Bus here. Every request is fully validated before anything changes; a
failed Setup is rolled back (DEL of everything added, the failing one
included) so no sandbox is ever left half set up; the write-ahead record
(see `records`) covers a kill -9 at any instant.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import Any

from cni_agent.cni.args import (
    PodMeta,
    build_cni_args,
    validate_container_id,
    validate_ifname,
    validate_network_name,
)
from cni_agent.cni.cache import CachedAttachment
from cni_agent.cni.config import NetworkConfigList, parse_list_or_none
from cni_agent.cni.errors import CNIError, ConfigError, InvalidArgument
from cni_agent.cni.runtime import CNIRuntime, RuntimeConf, cached_config
from cni_agent.errors import AgentError, ErrorKind, classify
from cni_agent.gc import Reaper, record_netns, rollback
from cni_agent.locks import RWLock, SandboxLocks
from cni_agent.monitor import Monitor
from cni_agent.netns import NetnsError, bring_up_loopback, check_netns, netns_identity
from cni_agent.podcidrs import PodCIDRs
from cni_agent.records import AttachmentIntent, Phase, SandboxRecord, SandboxStore

log = logging.getLogger(__name__)

DEFAULT_IFNAME = "eth0"
MAX_NETWORKS = 32


@dataclass(frozen=True)
class NetworkRequest:
    network: str = ""  # "" = the default network
    ifname: str = DEFAULT_IFNAME


@dataclass(frozen=True)
class SetupRequest:
    sandbox_id: str
    netns: str
    networks: tuple[NetworkRequest, ...] = ()
    args: tuple[tuple[str, str], ...] = ()
    pod: PodMeta | None = None
    capabilities: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Timeouts:
    lock: float = 60.0
    ready: float = 30.0


# What Show reports besides the contract's keys: whether an operation is under way
# (or was interrupted: a failed Teardown keeps its entries for the next attempt).
STATES = {Phase.READY: "ready", Phase.ADDING: "setting-up", Phase.DELETING: "tearing-down"}


def result_document(sandbox_id: str, entries: Sequence[CachedAttachment],
                    order: Sequence[tuple[str, str]] = (),
                    phase: Phase = Phase.READY) -> dict[str, Any]:
    """The contract's result JSON: attachments in Setup order, each in its network's version."""
    rank = {key: i for i, key in enumerate(order)}
    ordered = sorted(entries, key=lambda e: (rank.get((e.network, e.ifname), len(rank)), e.path))
    return {
        "sandbox": sandbox_id,
        "state": STATES[phase],
        "attachments": [
            {"network": e.network, "ifname": e.ifname, "result": dict(e.result or {})}
            for e in ordered
        ],
    }


def _digest(attachments: Sequence[AttachmentIntent], capabilities: Mapping[str, Any]) -> str:
    """Identifies a request (the caller's capabilities, not the pod CIDRs added to them)."""
    doc = [[a.network, a.ifname, [list(kv) for kv in a.args], dict(capabilities)]
           for a in attachments]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class SandboxManager:
    def __init__(
        self,
        runtime: CNIRuntime,
        monitor: Monitor,
        store: SandboxStore,
        locks: SandboxLocks,
        gc_lock: RWLock,
        reaper: Reaper,
        pod_cidrs: PodCIDRs,
        timeouts: Timeouts | None = None,
    ) -> None:
        self.runtime = runtime
        self.monitor = monitor
        self.store = store
        self.locks = locks
        self.gc_lock = gc_lock
        self.reaper = reaper
        self.pod_cidrs = pod_cidrs
        self.timeouts = timeouts or Timeouts()
        # Set by the daemon's shutdown: False once the drain period is over.
        self.accepting = True
        self.draining = False

    # --- shared steps -----------------------------------------------------------

    async def _locked(self, stack: AsyncExitStack, sandbox_id: str) -> None:
        await stack.enter_async_context(self.gc_lock.read(self.timeouts.lock))
        await stack.enter_async_context(self.locks.hold(sandbox_id, self.timeouts.lock))

    def _gate(self) -> None:
        if not self.accepting:
            raise AgentError(ErrorKind.SHUTTING_DOWN,
                             "cni-agent is shutting down and no longer accepts new requests")

    async def _wait_ready(self) -> None:
        if not self.draining and await self.monitor.wait_ready(self.timeouts.ready):
            return
        if self.draining:
            # Readiness is already reported false; the network itself may still work.
            if self.monitor.healthy:
                return
            raise AgentError(ErrorKind.SHUTTING_DOWN, "cni-agent is shutting down")
        reason = self.monitor.state.last_error or "network not ready"
        raise AgentError(ErrorKind.NOT_READY,
                         f"network not ready after {self.timeouts.ready:g}s: {reason}")

    def _resolve(self, req: NetworkRequest) -> NetworkConfigList:
        if not req.network:
            net = self.monitor.default()
            if net is None:
                raise AgentError(ErrorKind.NOT_READY, "no default network")
            return net
        net = self.monitor.network(req.network)
        if net is None:
            known = ", ".join(n.name for n in self.monitor.networks()) or "none"
            raise AgentError(ErrorKind.NOT_FOUND,
                             f"network {req.network} not found (valid networks: {known})")
        return net

    # --- Setup --------------------------------------------------------------------

    def validate(self, req: SetupRequest) -> tuple[int, int]:
        """Everything that can be checked before waiting or locking."""
        validate_container_id(req.sandbox_id)
        identity = check_netns(req.netns)
        if len(req.networks) > MAX_NETWORKS:
            raise InvalidArgument("networks", f"more than {MAX_NETWORKS} networks")
        seen: set[str] = set()
        for n in req.networks:
            if n.network:
                validate_network_name(n.network, "networks")
            validate_ifname(n.ifname, "networks")
            if n.ifname in seen:
                raise InvalidArgument("networks", f"interface {n.ifname} is requested twice")
            seen.add(n.ifname)
        build_cni_args(req.args, req.pod, req.sandbox_id)
        if not isinstance(req.capabilities, Mapping):
            raise InvalidArgument("capabilities", "must be a JSON object")
        return identity

    async def setup(self, req: SetupRequest) -> dict[str, Any]:
        try:
            return await self._setup(req)
        except Exception as e:
            raise classify(e) from e

    async def _setup(self, req: SetupRequest) -> dict[str, Any]:
        self._gate()
        identity = self.validate(req)
        await self._wait_ready()
        requests = req.networks or (NetworkRequest(),)
        nets = [self._resolve(r) for r in requests]
        args = tuple(build_cni_args(req.args, req.pod, req.sandbox_id))
        caps = dict(req.capabilities)
        if "ipRanges" not in caps and self.pod_cidrs.ranges():
            caps["ipRanges"] = self.pod_cidrs.ranges()
        intents = tuple(
            AttachmentIntent(net.name, r.ifname, net.bytes, args, caps)
            for net, r in zip(nets, requests, strict=True)
        )
        digest = _digest(intents, req.capabilities)
        async with AsyncExitStack() as stack:
            await self._locked(stack, req.sandbox_id)
            existing, foreign = await asyncio.to_thread(self._lookup, req.sandbox_id, intents)
            if existing is not None:
                if existing.phase is Phase.READY:
                    return await self._repeat(existing, req.netns, identity, digest)
                # Left half-done by a crash or a failed rollback: finish undoing it first.
                errors = await rollback(self.runtime, self.store, existing)
                if errors:
                    raise AgentError(ErrorKind.PLUGIN_FAILED,
                                     f"sandbox {req.sandbox_id} has an unfinished earlier "
                                     f"operation that cannot be undone: {errors[0]}")
            elif foreign:
                raise AgentError(ErrorKind.INVALID_ARGUMENT,
                                 f"sandbox {req.sandbox_id} has cached attachments from another "
                                 "tool or an older run; tear it down first")
            record = SandboxRecord(req.sandbox_id, req.netns, identity, Phase.ADDING, intents, digest)
            await asyncio.to_thread(self.store.write, record)  # the write-ahead intent
            return await self._add_all(record, nets)

    async def _repeat(self, rec: SandboxRecord, netns: str, identity: tuple[int, int],
                      digest: str) -> dict[str, Any]:
        if rec.netns != netns or rec.netns_id != identity:
            raise AgentError(ErrorKind.INVALID_ARGUMENT,
                             f"sandbox {rec.sandbox_id} is already set up in netns {rec.netns}")
        if rec.request != digest:
            raise AgentError(ErrorKind.INVALID_ARGUMENT,
                             f"sandbox {rec.sandbox_id} is already set up with different "
                             "networks or options; tear it down first")
        return await self.show(rec.sandbox_id)

    async def _add_all(self, rec: SandboxRecord, nets: list[NetworkConfigList]) -> dict[str, Any]:
        try:
            await bring_up_loopback(rec.netns)
        except NetnsError as e:
            await asyncio.to_thread(self.store.delete, rec.sandbox_id)
            raise AgentError(ErrorKind.PLUGIN_FAILED, f"cannot bring up lo: {e}") from e
        done: list[CachedAttachment] = []
        for i, (net, intent) in enumerate(zip(nets, rec.attachments, strict=True)):
            rt = RuntimeConf(rec.sandbox_id, rec.netns, intent.ifname, intent.args,
                             dict(intent.capabilities))
            try:
                result = await self.runtime.add(net, rt)
            except CNIError as e:
                log.warning("setup of %s failed on %s/%s, rolling back: %s",
                            rec.sandbox_id, net.name, intent.ifname, e,
                            extra={"SANDBOX_ID": rec.sandbox_id, "NETWORK": net.name})
                # DEL what was attempted, the failing one included (the spec requires it).
                attempted = replace(rec, attachments=rec.attachments[: i + 1])
                undo = await rollback(self.runtime, self.store, attempted)
                err = classify(e)
                if undo:
                    err = AgentError(err.kind, f"{err.message} (cleanup failed, retried at the next "
                                               f"GC: {undo[0]})")
                raise err from e
            done.append(CachedAttachment(rec.sandbox_id, net.name, intent.ifname, rec.netns,
                                         net.bytes, result=result))
        await asyncio.to_thread(self.store.write, rec.with_phase(Phase.READY))
        log.info("sandbox %s set up (%d attachment(s))", rec.sandbox_id, len(done),
                 extra={"SANDBOX_ID": rec.sandbox_id})
        return result_document(rec.sandbox_id, done, [(a.network, a.ifname) for a in rec.attachments])

    # --- Teardown -------------------------------------------------------------------

    async def teardown(self, sandbox_id: str, netns: str = "") -> None:
        try:
            await self._teardown(sandbox_id, netns)
        except Exception as e:
            raise classify(e) from e

    async def _teardown(self, sandbox_id: str, netns: str) -> None:
        validate_container_id(sandbox_id)
        if netns and ("\x00" in netns or len(netns) > 4096 or not netns.startswith("/")):
            raise InvalidArgument("netns", "must be empty or an absolute path")
        async with AsyncExitStack() as stack:
            await self._locked(stack, sandbox_id)
            rec, entries = await asyncio.to_thread(self._cached_of, sandbox_id)
            if rec is None and not entries:
                return  # nothing known: success, as DEL of nothing is
            intents = self._teardown_plan(sandbox_id, rec, entries)
            if rec is not None:
                marked = SandboxRecord(rec.sandbox_id, rec.netns, rec.netns_id, Phase.DELETING,
                                       intents, rec.request)
            else:
                marked = SandboxRecord(sandbox_id, netns, netns_identity(netns) if netns else None,
                                       Phase.DELETING, intents)
            await asyncio.to_thread(self.store.write, marked)
            errors = await rollback(self.runtime, self.store, marked)
            if errors:
                raise AgentError(ErrorKind.PLUGIN_FAILED,
                                 f"teardown of {sandbox_id} incomplete, its cache entries are kept: "
                                 + "; ".join(errors))
            log.info("sandbox %s torn down", sandbox_id, extra={"SANDBOX_ID": sandbox_id})

    def _lookup(self, sandbox_id: str, intents: Sequence[AttachmentIntent]
                ) -> tuple[SandboxRecord | None, bool]:
        """The sandbox's record, and whether a requested attachment is cached without one
        (direct lookups: no directory scan, which would grow with the node)."""
        rec = self.store.read(sandbox_id)
        foreign = rec is None and any(
            os.path.exists(self.runtime.cache.path(a.network, sandbox_id, a.ifname))
            for a in intents)
        return rec, foreign

    def _cached_of(self, sandbox_id: str) -> tuple[SandboxRecord | None, list[CachedAttachment]]:
        """The record and cache entries of a sandbox: its record says where (no
        directory scan, which grows with the node); without a record, scan like libcni."""
        rec = self.store.read(sandbox_id)
        if rec is None:
            return None, self.runtime.cache.for_container(sandbox_id)
        entries = []
        for a in rec.attachments:
            try:
                entry = self.runtime.cache.read(a.network, sandbox_id, a.ifname)
            except CNIError:
                continue  # unreadable: the record's own config is used for its DEL
            if entry is not None:
                entries.append(entry)
        return rec, entries

    def _teardown_plan(self, sandbox_id: str, rec: SandboxRecord | None,
                       entries: list[CachedAttachment]) -> tuple[AttachmentIntent, ...]:
        """Every attachment to DEL, in Setup order: the record's, plus any cached only."""
        plan = list(rec.attachments) if rec else []
        known = {(a.network, a.ifname) for a in plan}
        for e in entries:
            if (e.network, e.ifname) not in known:
                plan.append(AttachmentIntent(e.network, e.ifname, e.config, e.cni_args,
                                             dict(e.capability_args)))
        # Prefer the cached config and args (the ones the ADD really used).
        by_key = {(e.network, e.ifname): e for e in entries}
        out = []
        for a in plan:
            cached = by_key.get((a.network, a.ifname))
            if cached is not None and cached_config(cached) is not None:
                a = AttachmentIntent(a.network, a.ifname, cached.config, cached.cni_args,
                                     dict(cached.capability_args))
            elif parse_list_or_none(a.config) is None:
                current = self.monitor.network(a.network)
                if current is not None:
                    a = AttachmentIntent(a.network, a.ifname, current.bytes, a.args, a.capabilities)
            out.append(a)
        return tuple(out)

    # --- Check, Show, List ------------------------------------------------------------

    async def check(self, sandbox_id: str, netns: str) -> None:
        try:
            await self._check(sandbox_id, netns)
        except Exception as e:
            raise classify(e) from e

    async def _check(self, sandbox_id: str, netns: str) -> None:
        self._gate()
        validate_container_id(sandbox_id)
        check_netns(netns)
        async with AsyncExitStack() as stack:
            await self._locked(stack, sandbox_id)
            rec, entries = await asyncio.to_thread(self._cached_of, sandbox_id)
            if rec is None or rec.phase is not Phase.READY:
                raise AgentError(ErrorKind.NOT_FOUND, f"sandbox {sandbox_id} is not set up")
            if rec.netns != netns or record_netns(rec) != netns:
                raise AgentError(ErrorKind.INVALID_ARGUMENT,
                                 f"sandbox {sandbox_id} is set up in netns {rec.netns}, not {netns}")
            by_key = {(e.network, e.ifname): e for e in entries}
            for a in rec.attachments:
                entry = by_key.get((a.network, a.ifname))
                if entry is None:
                    raise AgentError(ErrorKind.NOT_FOUND,
                                     f"sandbox {sandbox_id}: no cached result for {a.network}/{a.ifname}")
                net = cached_config(entry)
                if net is None:
                    raise ConfigError(entry.path, "cached config is unreadable")
                await self.runtime.check(net, RuntimeConf.from_cache(entry, netns=netns))

    async def show(self, sandbox_id: str) -> dict[str, Any]:
        try:
            validate_container_id(sandbox_id)
            rec, entries = await asyncio.to_thread(self._cached_of, sandbox_id)
        except Exception as e:
            raise classify(e) from e
        if not entries:
            raise AgentError(ErrorKind.NOT_FOUND, f"sandbox {sandbox_id} has no cached attachments")
        order = [(a.network, a.ifname) for a in rec.attachments] if rec else []
        return result_document(sandbox_id, entries, order, rec.phase if rec else Phase.READY)

    async def list(self) -> list[str]:
        def scan() -> list[str]:
            ids = {r.sandbox_id for r in self.store.all()[0] if r.phase is Phase.READY}
            ids.update(e.container_id for e in self.runtime.cache.all())
            return sorted(ids)

        return await asyncio.to_thread(scan)

    # --- node-wide ------------------------------------------------------------------------

    async def garbage_collect(self, valid_ids: Sequence[str]) -> None:
        try:
            self._gate()
            for sid in valid_ids:
                validate_container_id(sid, "valid_sandbox_ids")
            report = await self.reaper.collect(set(valid_ids))
        except Exception as e:
            raise classify(e) from e
        if report.errors:
            raise AgentError(ErrorKind.PLUGIN_FAILED,
                             f"garbage collection finished with {len(report.errors)} error(s): "
                             + report.errors[0])

