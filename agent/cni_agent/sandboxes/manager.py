"""Setup, Teardown and Check of sandboxes: validate → order → lock → journal.

No D-Bus here. Every request is fully validated before anything changes and
takes its place in the sandbox's order on arrival (`order`: a later Teardown
wins over an earlier Setup that has not started). No operation runs before
start-up recovery is over. A failed Setup is rolled back (DEL of everything
added, the failing one included), so no sandbox is ever left half set up; the
journal's write-ahead record covers a kill -9 at any instant.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.args import (
    PodMeta,
    build_cni_args,
    validate_container_id,
    validate_ifname,
    validate_network_name,
)
from cni_agent.cni.cache import CachedAttachment
from cni_agent.cni.config import NetworkConfigList
from cni_agent.cni.errors import CNIError, InvalidArgument, NoCachedResult, PluginError
from cni_agent.cni.logctx import log_fields
from cni_agent.node.blocking import UNANSWERED, Given
from cni_agent.node.locks import SandboxLocks
from cni_agent.node.netns import NetnsError, NetnsId, Pinned
from cni_agent.readiness.monitor import Monitor
from cni_agent.readiness.podcidrs import PodCIDRs
from cni_agent.sandboxes.admission import Admission
from cni_agent.sandboxes.capacity import STRANGER_MAX_AGE, Capacities
from cni_agent.sandboxes.checks import Checks
from cni_agent.sandboxes.errors import Hinted, classified, classify
from cni_agent.sandboxes.events import Change, State
from cni_agent.sandboxes.gc import Reaper
from cni_agent.sandboxes.journal import Journal, Removal, is_recorded
from cni_agent.sandboxes.order import Kind, Ticket
from cni_agent.sandboxes.owners import (
    callers_netns,
    descriptor,
    not_its_namespace,
    refuse_alive,
    same_namespace,
    validate_label,
)
from cni_agent.sandboxes.policy import ROOT, Caller, Policy
from cni_agent.sandboxes.records import Attachment, CheckVerdict, Phase, SandboxRecord

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
    netns_fd: int | None = None  # the caller's own descriptor of `netns` (owners.py)
    caller: Caller = ROOT


@dataclass(frozen=True)
class Timeouts:
    lock: float = 60.0
    ready: float = 30.0


# What Show reports besides the contract's keys: whether an operation is under way
# (or was interrupted: a failed Teardown keeps its entries for the next attempt).
STATES = {Phase.READY: "ready", Phase.ADDING: "setting-up", Phase.DELETING: "tearing-down"}


async def _nothing(sandbox_id: str) -> None:
    return None


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


def _digest(attachments: Sequence[Attachment], capabilities: Mapping[str, Any]) -> str:
    """Identifies a request (the caller's capabilities, not the pod CIDRs added to them)."""
    doc = [[a.network, a.ifname, [list(kv) for kv in a.args], dict(capabilities)]
           for a in attachments]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class SandboxManager:
    def __init__(
        self,
        journal: Journal,
        monitor: Monitor,
        locks: SandboxLocks,
        reaper: Reaper,
        pod_cidrs: PodCIDRs,
        timeouts: Timeouts | None = None,
        checks: Checks | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.journal = journal
        # What callers that are not root may use (`access.*`; a reload replaces it).
        self.policy = policy or Policy()
        self.admission = Admission(journal.store)
        self.checks = checks or Checks(journal)
        self.monitor = monitor
        self.locks = locks
        self.reaper = reaper
        self.pod_cidrs = pod_cidrs
        self.timeouts = timeouts or Timeouts()
        self.order = reaper.order  # one order per sandbox, reaping included
        # Networks' address capacity, read only when asked (and after a failed ADD).
        self.capacity = Capacities()
        # Set by the daemon's shutdown: False once the drain period is over.
        self.accepting = True
        self.draining = False
        # Called with a sandbox's id once a Setup or Attach of it succeeded and
        # its lock is free again (drift.py: the baseline CHECK).
        self.on_set_up: Callable[[str], None] = lambda sandbox_id: None
        # The sandbox ids with a DEL that cni-agent-shim queued while no agent
        # ran (service/queued.py), and what runs them: a call for one of them
        # runs those first (`queued_first`). Empty once the queue is drained.
        self.queued_ids: Collection[str] = ()
        self.run_queued: Callable[[str], Awaitable[None]] = _nothing

    async def queued_first(self, sandbox_id: str) -> None:
        if sandbox_id in self.queued_ids:
            await self.run_queued(sandbox_id)

    # --- shared steps -----------------------------------------------------------

    async def recovered(self, deadline: float | None = None) -> None:
        """Until start-up recovery is over (records are read only then); Busy at
        `deadline` (loop time; default: `timeouts.lock` from now)."""
        if not self.reaper.recovered.is_set():
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self.timeouts.lock
            try:
                async with asyncio.timeout_at(deadline):
                    await self.reaper.recovered.wait()
            except TimeoutError:
                raise AgentError(ErrorKind.BUSY, "start-up recovery is still running after "
                                                 f"{self.timeouts.lock:g}s") from None

    def locked(self, ticket: Ticket) -> AbstractAsyncContextManager[None]:
        """Recovery over, then the sandbox's lock, within one `timeouts.lock` budget."""
        return _Locked(self, ticket)

    def gate(self) -> None:
        if not self.accepting:
            raise AgentError(ErrorKind.SHUTTING_DOWN,
                             "cni-agent is shutting down and no longer accepts new requests")

    async def wait_ready(self, ticket: Ticket) -> None:
        """Wait for readiness, unless a later Teardown makes this request moot."""
        if not self.draining and self.monitor.ready:
            return
        if not self.draining:
            ready = asyncio.ensure_future(self.monitor.wait_ready(self.timeouts.ready))
            moot = asyncio.ensure_future(ticket.superseded.wait())
            try:
                await asyncio.wait((ready, moot), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (ready, moot):
                    t.cancel()
            if moot.done() and not moot.cancelled():
                ticket.start()  # raises Cancelled
            if ready.done() and not ready.cancelled() and ready.result():
                return
        if self.draining:
            # Readiness is already reported false; the network itself may still work.
            if self.monitor.healthy:
                return
            raise AgentError(ErrorKind.SHUTTING_DOWN, "cni-agent is shutting down")
        reason = self.monitor.state.last_error or "network not ready"
        raise AgentError(ErrorKind.NOT_READY,
                         f"network not ready after {self.timeouts.ready:g}s: {reason}")

    def capabilities_for(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The caller's capabilities, with the node's pod CIDRs as ipRanges unless given."""
        caps = dict(given)
        if "ipRanges" not in caps and self.pod_cidrs.ranges():
            caps["ipRanges"] = self.pod_cidrs.ranges()
        return caps

    def resolve(self, req: NetworkRequest) -> NetworkConfigList:
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

    async def network_capacity(self, network: str, caller: Caller = ROOT) -> dict[str, Any]:
        """NetworkCapacity: the address capacity of `network` ("" = the default):
        read now (shared with a read under way) for root and members; for any
        other caller, possibly a reading up to STRANGER_MAX_AGE old, so that
        strangers together cost at most one read per network and second."""
        with classified():
            if network:
                validate_network_name(network)
            net = self.resolve(NetworkRequest(network))
            self.capacity.forget({n.name for n in self.monitor.networks()})
            return await self.capacity.of(net, 0.0 if caller.privileged else STRANGER_MAX_AGE)

    # --- Setup --------------------------------------------------------------------

    def own_id(self, caller: Caller, sandbox_id: str, creating: bool = False,
               field: str = "sandbox_id") -> str:
        """The sandbox `caller` means by `sandbox_id` (validated): its own id
        space (`Policy.qualify`); root may not create in a member's."""
        validate_container_id(sandbox_id, field)
        if creating and caller.root:
            Policy.check_new_id(sandbox_id, field)
        return self.policy.qualify(caller, sandbox_id, field)

    def validate(self, req: SetupRequest) -> None:
        """Everything but the netns that can be checked before waiting or locking."""
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
        self.policy.capabilities(req.caller, req.capabilities, req.args)
        self.policy.arguments(req.caller, req.args, req.pod)

    async def setup(self, req: SetupRequest) -> dict[str, Any]:
        with classified():
            sid = self.own_id(req.caller, req.sandbox_id, creating=True)
        with log_fields(SANDBOX_ID=sid):
            await self.queued_first(sid)
            try:
                with classified():
                    doc = await self._setup(replace(req, sandbox_id=sid))
            except AgentError as err:
                if err.kind is ErrorKind.CANCELLED:
                    log.info("%s", err.message)
                raise
        return shown(req.caller, doc)

    async def _setup(self, req: SetupRequest) -> dict[str, Any]:
        self.gate()
        self.validate(req)
        # Opened once, here, and only used through this handle from now on.
        async with callers_netns(self.journal.paths, req.netns, req.netns_fd, req.caller) as ns:
            doc = await self._setup_in(req, ns)
        self.on_set_up(req.sandbox_id)
        return doc

    async def may_use(self, caller: Caller, net: NetworkConfigList) -> None:
        """The policy on `caller` using `net` (Setup and Attach alike): opened to
        it, and filterable against spoofing unless the admin said otherwise.
        Root is refused neither: its calls make no nftables probe."""
        self.policy.network(caller, net.name)
        if not caller.root:
            self.policy.spoofing(caller, net.name, await self.journal.guard.why_unprotected(net))

    async def _setup_in(self, req: SetupRequest, ns: Pinned) -> dict[str, Any]:
        with self.order.arrive(req.sandbox_id, Kind.ADD) as ticket:
            await self.wait_ready(ticket)
            requests = req.networks or (NetworkRequest(),)
            nets = [self.resolve(r) for r in requests]
            for net in nets:
                await self.may_use(req.caller, net)
            Policy.once_per_sandbox(req.caller, req.sandbox_id, [net.name for net in nets])
            args = tuple(build_cni_args(req.args, req.pod, req.sandbox_id))
            caps = self.capabilities_for(req.capabilities)
            new = tuple(Attachment(net.name, r.ifname, net.bytes, args, caps)
                        for net, r in zip(nets, requests, strict=True))
            digest = _digest(new, req.capabilities)
            with log_fields(**_single(new)):
                async with self.locked(ticket):
                    rec, entries = await self.journal.view(req.sandbox_id)
                    Policy.sandbox(req.caller, req.sandbox_id, rec.owner if rec else None,
                                   foreign=bool(entries))
                    if rec is not None:
                        settled = await self.settle(rec, entries, req.netns, ns.identity, ns)
                        if settled is not rec:
                            rec, entries = await self.journal.view(req.sandbox_id)
                    if rec is not None:
                        return await self._repeat(rec, digest, entries)
                    if any((a.network, a.ifname) in entries for a in new):
                        raise AgentError(ErrorKind.INVALID_ARGUMENT,
                                         f"sandbox {req.sandbox_id} has cached attachments from another "
                                         "tool or an older run; tear it down first")
                    async with self.admission.admitted(
                            req.caller, self.policy, req.sandbox_id, req.capabilities,
                            new_sandbox=True,
                            attaching=[(a.ifname, net) for a, net in zip(new, nets, strict=True)]):
                        return await self._add_all(
                            SandboxRecord(req.sandbox_id, req.netns, ns.identity, (), digest,
                                          owner=req.caller.uid), new, nets, ns)

    async def settle(self, rec: SandboxRecord, entries: Mapping[tuple[str, str], CachedAttachment],
                      netns: str, identity: NetnsId, given: Pinned | None = None
                      ) -> SandboxRecord | None:
        """Before a Setup: undo what an earlier run left unfinished, and reap the
        sandbox if its namespace died (the id is being reused). What is left is
        live. `given`: the call's namespace (a member's is looked for there first)."""
        async with self.journal.live_netns(rec, entries, given=given) as live:
            return await self._settle_in(rec, live, netns, identity)

    async def _settle_in(self, rec: SandboxRecord, live: Pinned | None, netns: str,
                         identity: NetnsId) -> SandboxRecord | None:
        unfinished = [a.ifname for a in rec.attachments if a.phase is not Phase.READY]
        if not live:
            unfinished = [a.ifname for a in rec.attachments]
            log.info("sandbox %s: its netns %s is gone; removing its attachments before the new "
                     "Setup", rec.sandbox_id, rec.netns)
        if unfinished:
            removal = await self.journal.remove(rec, unfinished, live)
            if self.journal.events.on:
                self.journal.tell_removed(Change.REAPED, rec, removal)
            if removal.errors:
                raise AgentError(ErrorKind.PLUGIN_FAILED,
                                 f"sandbox {rec.sandbox_id} has attachments left by an earlier "
                                 f"operation that cannot be removed: {removal.errors[0]}")
            if removal.unrecorded:
                raise AgentError(ErrorKind.STATE_ERROR,
                                 f"sandbox {rec.sandbox_id}: the attachments an earlier operation "
                                 f"left are removed, but {removal.unrecorded}")
            if removal.left is None:
                return None
            rec = removal.left
        if rec.netns != netns or not rec.netns_id or not rec.netns_id.same(identity):
            raise AgentError(ErrorKind.INVALID_ARGUMENT,
                             f"sandbox {rec.sandbox_id} is already set up in netns {rec.netns}")
        return rec

    async def _repeat(self, rec: SandboxRecord, digest: str,
                      entries: Mapping[tuple[str, str], CachedAttachment]) -> dict[str, Any]:
        if rec.request != digest:
            raise AgentError(ErrorKind.INVALID_ARGUMENT,
                             f"sandbox {rec.sandbox_id} is already set up with different "
                             "networks or options; tear it down first")
        for a in rec.attachments:
            if a.lost is not None:  # not what that Setup answered: say so, not a part of it
                raise lost_error(rec.sandbox_id, a)
        return self._document(rec, entries)

    async def _add_all(self, rec: SandboxRecord, new: Sequence[Attachment],
                       nets: Sequence[NetworkConfigList], ns: Pinned) -> dict[str, Any]:
        def failed(att: Attachment, e: CNIError) -> None:
            log.warning("setup of %s failed on %s/%s, rolling back: %s",
                        rec.sandbox_id, att.network, att.ifname, e,
                        extra={"NETWORK": att.network, "IFNAME": att.ifname})

        results = await self.add_new(rec, new, nets, ns, loopback=True, failed=failed)
        if self.journal.events.on:  # all ready, in the journal: told before the reply
            self.journal.events.emit(Change.SET_UP, rec.sandbox_id, rec.owner,
                                     [(a, State.READY) for a in new],
                                     {a.ifname: r for a, r in zip(new, results, strict=True)})
        done = [CachedAttachment(rec.sandbox_id, net.name, att.ifname, rec.netns, net.bytes,
                                 result=result)
                for net, att, result in zip(nets, new, results, strict=True)]
        log.info("sandbox %s set up (%d attachment(s))", rec.sandbox_id, len(done))
        return result_document(rec.sandbox_id, done, [(a.network, a.ifname) for a in new])

    async def add_new(self, rec: SandboxRecord, new: Sequence[Attachment],
                      nets: Sequence[NetworkConfigList], ns: Pinned, *, loopback: bool,
                      failed: Callable[[Attachment, CNIError], None]) -> list[dict[str, Any]]:
        """Add `new` to `rec` (Setup's attachments, or Attach's one): their
        intent written (with `loopback`, a new sandbox: `lo` brought up first),
        then each ADD chain, the last one's cache write making all ready; the
        results. A failed ADD is reported to `failed`, then rolled back: DEL of
        what was attempted, the failing one included (the spec requires it),
        and `lo` as this call found it."""
        with self.journal.claiming(rec.sandbox_id, new):
            try:
                rec, lo = await self.journal.begin_add(rec, new, ns, loopback=loopback)
            except NetnsError as e:  # nothing was written, nothing to undo
                raise AgentError(ErrorKind.PLUGIN_FAILED, f"cannot bring up lo: {e}") from e
            results: list[dict[str, Any]] = []
            ifnames = [a.ifname for a in new]
            for i, (net, att) in enumerate(zip(nets, new, strict=True)):
                try:
                    rec, result = await self.journal.add(
                        rec, att, net, ns, ready=ifnames if i == len(new) - 1 else ())
                    results.append(result)
                except CNIError as e:
                    failed(att, e)
                    undo = await self.journal.remove(rec, ifnames[: i + 1], ns,
                                                     unstarted=ifnames[i + 1:])
                    if lo:  # this call brought lo up: the namespace as it found it
                        await self.journal.loopback_down(rec.sandbox_id, ns)
                    # The plugin's own failure on a pool the agent knows is full:
                    # say so (read now, after the rollback; nothing on success).
                    hint = await self.capacity.full(net) if isinstance(e, PluginError) else ""
                    raise rollback_error(e, undo, hint) from e
            return results

    # --- Teardown -------------------------------------------------------------------

    async def teardown(self, sandbox_id: str, netns: str = "", caller: Caller = ROOT,
                       netns_fd: int | None = None) -> None:
        with classified():
            sid = self.own_id(caller, sandbox_id)
        with log_fields(SANDBOX_ID=sid):
            await self.queued_first(sid)
            with classified():
                await self._teardown(sid, netns, caller, netns_fd)

    def given_netns(self, netns: str, netns_fd: int | None, caller: Caller
                    ) -> AbstractAsyncContextManager[Pinned | None]:
        """A removal's namespace as its caller gives it, pinned on arrival: a
        descriptor (anyone's; `netns` its label), or a path root gave (opened
        now, before any wait); else none. Another caller's path is never
        opened: its sandbox's record says which namespace it is."""
        validate_removal_netns(netns)
        if netns_fd is not None:
            return descriptor(self.journal.paths, netns_fd, netns, caller)
        if netns and caller.root:
            return self.journal.paths.pinned_if_netns(netns)
        return Given()

    async def _teardown(self, sandbox_id: str, netns: str, caller: Caller,
                        netns_fd: int | None = None) -> None:
        with self.order.arrive(sandbox_id, Kind.REMOVE) as ticket:
            # Used only when no record says where the sandbox is, or (a
            # descriptor) when it is the recorded namespace.
            given_cm = self.given_netns(netns, netns_fd, caller)
            async with unless_hung(given_cm) as given, self.locked(ticket):
                rec, entries = await self.journal.view(sandbox_id)
                if rec is None and not entries:
                    return  # nothing known: success, as DEL of nothing is
                Policy.holds(caller, sandbox_id, rec.owner if rec else None, bool(entries))
                if rec is not None and netns_fd is not None and given is not None:
                    same_namespace(caller, rec, given)
                # Where the DELs run: the recorded namespace if it still is the
                # one; without a record (another tool's entries) the caller's;
                # else none — an empty netns, which DEL must tolerate.
                ns_cm = self.journal.live_netns(rec, entries, given=given) if rec \
                    else Given(given)
                async with unless_hung(ns_cm) as ns:
                    refuse_alive(caller, rec, given, ns)
                    claimed = await self.journal.claim(sandbox_id, rec, entries, netns,
                                                       ns.identity if ns else None)
                    with log_fields(**_single(claimed.attachments)):
                        removal = await self.journal.remove(claimed, None, ns, entries)
                        if self.journal.events.on:
                            self.journal.tell_removed(Change.TORN_DOWN, claimed, removal)
                        if removal.errors:
                            raise AgentError(ErrorKind.PLUGIN_FAILED,
                                             f"teardown of {sandbox_id} incomplete, its cache "
                                             "entries are kept: " + "; ".join(removal.errors)
                                             + (f" ({removal.unrecorded})"
                                                if removal.unrecorded else ""))
                        if removal.unrecorded:
                            raise unrecorded_error(f"teardown of {sandbox_id}", removal)
                        log.info("sandbox %s torn down", sandbox_id)

    # --- Check, Show, List ------------------------------------------------------------

    async def check(self, sandbox_id: str, netns: str, caller: Caller = ROOT,
                    netns_fd: int | None = None) -> None:
        with classified():
            sid = self.own_id(caller, sandbox_id)
        with log_fields(SANDBOX_ID=sid):
            await self.queued_first(sid)
            with classified():
                await self._check(sid, netns, caller, netns_fd)

    async def _check(self, sandbox_id: str, netns: str, caller: Caller,
                     netns_fd: int | None = None) -> None:
        self.gate()
        if netns_fd is None:
            # A member's namespace is its descriptor: no path of its is opened.
            Policy.named_by_path(caller)
            cm: AbstractAsyncContextManager[Pinned] = self.journal.paths.pinned(netns)
        else:
            validate_label(netns)
            cm = descriptor(self.journal.paths, netns_fd, netns, caller)
        async with cm as ns:
            await self._check_in(sandbox_id, ns, caller)

    async def _check_in(self, sandbox_id: str, ns: Pinned, caller: Caller = ROOT) -> None:
        with self.order.arrive(sandbox_id, Kind.OTHER) as ticket:
            async with self.locked(ticket):
                rec, entries = await self.journal.view(sandbox_id)
                Policy.holds(caller, sandbox_id, rec.owner if rec else None, bool(entries))
                if rec is None or rec.phase is not Phase.READY:
                    raise AgentError(ErrorKind.NOT_FOUND, f"sandbox {sandbox_id} is not set up")
                if not await in_recorded(rec, entries, ns):
                    if not caller.root:  # its descriptor: its label says nothing
                        raise not_its_namespace(caller, sandbox_id)
                    raise AgentError(ErrorKind.INVALID_ARGUMENT,
                                     f"sandbox {sandbox_id} is set up in netns {rec.netns}, "
                                     f"not {ns.path}")
                for a in rec.attachments:
                    if a.lost is not None:
                        raise lost_error(sandbox_id, a)
                    if (a.network, a.ifname) not in entries:
                        raise NoCachedResult(f"sandbox {sandbox_id}: no cached result for "
                                             f"{a.network}/{a.ifname}")
                # The scheduled passes' path: the outcome is recorded (and judged
                # against the baseline) whoever asked; the caller gets the first failure.
                for outcome in await self.checks.run_locked(rec, entries, ns, repair=False):
                    if outcome.error is not None:
                        raise outcome.error

    def _document(self, rec: SandboxRecord | None,
                  entries: Mapping[tuple[str, str], CachedAttachment],
                  with_checks: bool = False) -> dict[str, Any]:
        order = [(a.network, a.ifname) for a in rec.attachments] if rec else []
        sid = rec.sandbox_id if rec else next(iter(entries.values())).container_id
        # A lost attachment (its repair's re-ADD failed) has no cache entry: it
        # is shown all the same, with an empty result, in its place.
        lost = [CachedAttachment(sid, a.network, a.ifname, rec.netns, a.config, result={})
                for a in rec.attachments if a.lost is not None
                and (a.network, a.ifname) not in entries] if rec else []
        doc = result_document(sid, [*entries.values(), *lost], order,
                              rec.phase if rec else Phase.READY)
        if rec is not None and with_checks:  # Show's, not Setup's (a repeat returns Setup's)
            for item in doc["attachments"]:
                att = rec.attachment(item["ifname"])
                if att is not None and att.network == item["network"]:
                    item["check"] = check_document(att, self.checks.last_check(sid, att))
        return doc

    async def show(self, sandbox_id: str, caller: Caller = ROOT) -> dict[str, Any]:
        with classified():
            sid = self.own_id(caller, sandbox_id)
            await self.queued_first(sid)
            await self.recovered()
            # No lock here: a damaged record is reported, and left to be set aside
            # by the next operation or reaping pass that holds the sandbox's lock.
            rec, entries = await self.journal.view(sid, repair=False)
        Policy.holds(caller, sid, rec.owner if rec else None, bool(entries))
        if not entries and not (rec and any(a.lost for a in rec.attachments)):
            raise AgentError(ErrorKind.NOT_FOUND, f"sandbox {sandbox_id} has no cached attachments")
        doc = self._document(rec, entries, with_checks=True)
        if rec is None and (damaged := self.journal.store.damaged(sid)):
            doc["damaged_record"] = damaged
        return shown(caller, doc)

    async def list(self, caller: Caller = ROOT) -> list[str]:
        await self.recovered()
        # A caller that is not root sees its own records only (by name).
        records = self.journal.store.records(Policy.own_prefix(caller))
        if not caller.root:
            return sorted(Policy.shown(caller, r.sandbox_id) for r in records
                          if r.phase is Phase.READY and Policy.owns(caller, r.owner))
        ids = {r.sandbox_id for r in records if r.phase is Phase.READY}
        ids.update(cid for _, cid, _ in self.journal.runtime.cache.keys())
        return sorted(ids)

    # --- node-wide ------------------------------------------------------------------------

    async def garbage_collect(self, valid_ids: Sequence[str], caller: Caller = ROOT) -> None:
        """Reap what `valid_ids` does not list (and anything dead). A caller that
        is not root speaks for its own sandboxes only, and its GC touches no
        other (decided under each sandbox's lock, `Reaper.collect`)."""
        with classified():
            self.gate()
            valid = {self.own_id(caller, sid, field="valid_sandbox_ids") for sid in valid_ids}
            report = await self.reaper.collect(valid, caller=caller)
        if report.errors:
            # Only the disk's refusals: the DELs ran, the bookkeeping waits for it.
            kind = ErrorKind.STATE_ERROR if len(report.unrecorded) == len(report.errors) \
                else ErrorKind.PLUGIN_FAILED
            raise AgentError(kind, f"garbage collection finished with {len(report.errors)} "
                                   "error(s): " + report.errors[0])


def shown(caller: Caller, doc: dict[str, Any]) -> dict[str, Any]:
    """A result document with the sandbox id as `caller` knows it."""
    doc["sandbox"] = Policy.shown(caller, doc["sandbox"])
    return doc


def check_document(att: Attachment, last: float) -> dict[str, Any]:
    """Show's "check" of an attachment: its verdict, the last CHECK's time and
    message, its repairs and what the last one did; for a lost one, its ADDs
    that failed and when the next is due."""
    state = att.check
    doc: dict[str, Any] = {
        "state": str(state.verdict) if state else "unchecked",
        "last_check": _iso(last) if last else "",
        "reason": state.reason if state else "",
        "repairs": state.repairs if state else 0,
        "repair": state.repair if state else "",
    }
    if att.lost is not None:
        doc.update(state=str(CheckVerdict.LOST), reason=att.lost.reason,
                   lost_since=_iso(att.lost.since), attempts=att.lost.attempts,
                   next_try=_iso(att.lost.next_try))
    return doc


def lost_error(sandbox_id: str, att: Attachment) -> AgentError:
    """A CHECK of a lost attachment: there is nothing to CHECK; say why and until when."""
    assert att.lost is not None
    return AgentError(ErrorKind.PLUGIN_FAILED,
                      f"sandbox {sandbox_id}: {att.network}/{att.ifname} is lost: a repair "
                      f"removed it and its ADD failed ({att.lost.attempts} time(s), last: "
                      f"{att.lost.reason}); it is ADDed again at {_iso(att.lost.next_try)}")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


async def in_recorded(rec: SandboxRecord, entries: Mapping[tuple[str, str], CachedAttachment],
                      ns: Pinned) -> bool:
    """Whether a Check's namespace is the sandbox's: by its identity, and for
    root's (named by path) by the path too. A member's label proves nothing."""
    if not rec.by_descriptor and rec.netns != ns.path:
        return False
    return await is_recorded(rec, entries, ns)


def validate_removal_netns(netns: str) -> None:
    """A removal's netns: "" (gone) or an absolute path, checked only when used."""
    if netns and ("\x00" in netns or len(netns) > 4096 or not netns.startswith("/")):
        raise InvalidArgument("netns", "must be empty or an absolute path")


def _single(new: Sequence[Attachment]) -> dict[str, str]:
    """NETWORK and IFNAME for all lines about a one-network sandbox (each
    attachment's own lines carry its fields in any case)."""
    return {"NETWORK": new[0].network, "IFNAME": new[0].ifname} if len(new) == 1 else {}


def rollback_error(e: BaseException, undo: Removal, hint: str = "") -> AgentError:
    """A failed ADD's error, after its rollback; says so when the rollback failed
    too, and adds `hint` (the network's pool is full) when there is one."""
    err = classify(e)
    message = err.message
    if undo.errors:
        message += f" (cleanup failed, retried at the next GC: {undo.errors[0]})"
    elif undo.unrecorded:
        message += f" (rolled back; {undo.unrecorded}: the next reaping pass finishes it)"
    elif not hint:
        return err
    return Hinted(err.kind, message, hint) if hint else AgentError(err.kind, message)


def unrecorded_error(what: str, removal: Removal) -> AgentError:
    """A removal whose DELs all succeeded, but whose bookkeeping the disk did not take."""
    return AgentError(ErrorKind.STATE_ERROR,
                      f"{what}: the DELs succeeded and the network is released, but "
                      f"{removal.unrecorded}; the next reaping pass finishes it once the disk "
                      "allows")


class _Locked:
    """`SandboxManager.locked`'s block: a class, not @asynccontextmanager (an
    async generator, its wrapper and the loop's weak set entry for it, on
    every call)."""

    __slots__ = ("_hold", "_m", "_ticket")

    def __init__(self, m: SandboxManager, ticket: Ticket) -> None:
        self._m, self._ticket = m, ticket

    async def __aenter__(self) -> None:
        m, ticket = self._m, self._ticket
        deadline = asyncio.get_running_loop().time() + m.timeouts.lock
        await m.recovered(deadline)
        hold = m.locks.hold(ticket.sandbox_id, m.timeouts.lock, deadline)
        await hold.__aenter__()
        try:
            ticket.start()
        except BaseException as e:  # released again, as leaving the block would
            await hold.__aexit__(type(e), e, e.__traceback__)
            raise
        self._hold = hold

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._hold.__aexit__(*exc)


class unless_hung:  # a block, named as the function it replaced
    """`cm`'s namespace, or None when its path does not answer: a Teardown must
    be able to finish (with an empty netns) even then. A class, not
    @asynccontextmanager (an async generator, its wrapper and the loop's weak
    set entry for it, twice per DEL)."""

    __slots__ = ("_cm", "_entered")

    def __init__(self, cm: AbstractAsyncContextManager[Pinned | None]) -> None:
        self._cm = cm
        self._entered = False

    async def __aenter__(self) -> Pinned | None:
        try:
            ns = await self._cm.__aenter__()
        except UNANSWERED as e:
            log.warning("tearing down with an empty netns: %s", e)
            return None
        self._entered = True
        return ns

    async def __aexit__(self, *exc: Any) -> bool | None:
        if not self._entered:
            return None
        return await self._cm.__aexit__(*exc)
