"""ADD, DEL and CHECK of one attachment: what a CNI runtime does, one network
and interface at a time (through the shim, or the D-Bus Attach/Detach).

The same steps as Setup and Teardown — validate, take a place in the
sandbox's order, its lock, the journal's write-ahead record, rollback — for
one (network, ifname) of a sandbox that may already have others. A Teardown
still removes them all; a Setup repeat of a sandbox built this way is refused
(it is not the request that built it).

An attachment remembers its `origin` (the runtime's network name for shim
calls, "" otherwise): a runtime's DEL and GC only ever touch what its own
network made.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.args import (
    build_cni_args,
    validate_container_id,
    validate_ifname,
    validate_network_name,
)
from cni_agent.cni.cache import CachedAttachment
from cni_agent.cni.config import NetworkConfigList
from cni_agent.cni.errors import CNIError, InvalidArgument, NoCachedResult
from cni_agent.cni.logctx import log_fields
from cni_agent.node.netns import Pinned
from cni_agent.sandboxes.errors import classified
from cni_agent.sandboxes.events import Change, State
from cni_agent.sandboxes.manager import (
    DEFAULT_IFNAME,
    NetworkRequest,
    SandboxManager,
    in_recorded,
    lost_error,
    shown,
    unless_hung,
    unrecorded_error,
)
from cni_agent.sandboxes.order import Kind
from cni_agent.sandboxes.owners import callers_netns, refuse_alive, same_namespace
from cni_agent.sandboxes.policy import ROOT, Caller, Policy
from cni_agent.sandboxes.records import Attachment, Phase, SandboxRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttachRequest:
    sandbox_id: str
    netns: str
    network: str = ""  # "" = the default network
    ifname: str = DEFAULT_IFNAME
    args: tuple[tuple[str, str], ...] = ()
    capabilities: Mapping[str, Any] = field(default_factory=dict)
    origin: str = ""
    netns_fd: int | None = None  # the caller's own descriptor of `netns` (owners.py)
    caller: Caller = ROOT


def attachment_document(sandbox_id: str, network: str, ifname: str,
                        result: Mapping[str, Any]) -> dict[str, Any]:
    """Setup's result JSON, for the one attachment."""
    return {"sandbox": sandbox_id, "state": "ready",
            "attachments": [{"network": network, "ifname": ifname, "result": dict(result)}]}


def _validate(sandbox_id: str, network: str, ifname: str, origin: str) -> None:
    """The request's names (the sandbox id: `SandboxManager.own_id`)."""
    if network:
        validate_network_name(network)
    validate_ifname(ifname)
    if origin:
        validate_network_name(origin, "origin")


def _mine(a: Attachment, network: str, origin: str) -> bool:
    """Whether a removal or check naming `network` ("" = any) from `origin` means `a`."""
    return (not network or a.network == network) and (not origin or a.origin == origin)


def _through(network: str, origin: str) -> str:
    """How an attachment or a call came: a runtime's network (shim) and the agent's."""
    if origin:
        return f"runtime network {origin!r} (agent network {network!r})" if network else \
            f"runtime network {origin!r}"
    return f"agent network {network!r}" if network else "any network"


class Attachments:
    def __init__(self, manager: SandboxManager) -> None:
        self.m = manager

    @property
    def accepting(self) -> bool:
        """Whether new ADDs are served: also during a shutdown's drain."""
        return self.m.accepting

    # --- ADD ------------------------------------------------------------------------

    async def attach(self, req: AttachRequest) -> dict[str, Any]:
        with classified():
            req = replace(req, sandbox_id=self.m.own_id(req.caller, req.sandbox_id, creating=True))
        with log_fields(SANDBOX_ID=req.sandbox_id, IFNAME=req.ifname):
            await self.m.queued_first(req.sandbox_id)
            with classified():
                doc = await self._attach(req)
        self.m.on_set_up(req.sandbox_id)
        return shown(req.caller, doc)

    async def _attach(self, req: AttachRequest) -> dict[str, Any]:
        m = self.m
        m.gate()
        _validate(req.sandbox_id, req.network, req.ifname, req.origin)
        args = tuple(build_cni_args(req.args, None, req.sandbox_id))
        if not isinstance(req.capabilities, Mapping):
            raise InvalidArgument("capabilities", "must be a JSON object")
        m.policy.capabilities(req.caller, req.capabilities, req.args)
        m.policy.arguments(req.caller, req.args)
        async with callers_netns(m.journal.paths, req.netns, req.netns_fd, req.caller) as ns:
            with m.order.arrive(req.sandbox_id, Kind.ADD, frozenset({req.ifname})) as ticket:
                await m.wait_ready(ticket)
                net = m.resolve(NetworkRequest(req.network, req.ifname))
                await m.may_use(req.caller, net)
                att = Attachment(net.name, req.ifname, net.bytes, args,
                                 m.capabilities_for(req.capabilities), origin=req.origin)
                with log_fields(NETWORK=net.name):
                    async with m.locked(ticket):
                        return await self._attach_locked(req, att, net, ns)

    async def _attach_locked(self, req: AttachRequest, att: Attachment, net: NetworkConfigList,
                             ns: Pinned) -> dict[str, Any]:
        m = self.m
        rec, entries = await m.journal.view(req.sandbox_id)
        Policy.sandbox(req.caller, req.sandbox_id, rec.owner if rec else None,
                       foreign=bool(entries))
        if rec is not None:
            settled = await m.settle(rec, entries, req.netns, ns.identity, ns)
            if settled is not rec:
                rec, entries = await m.journal.view(req.sandbox_id)
        existing = rec.attachment(att.ifname) if rec is not None else None
        if existing is not None:
            return self._repeat(req.sandbox_id, existing, att, entries)
        if (att.network, att.ifname) in entries:
            raise AgentError(ErrorKind.INVALID_ARGUMENT,
                             f"sandbox {req.sandbox_id} has a cached {att.network}/{att.ifname} "
                             "from another tool or an older run; DEL it first")
        if rec is not None:  # a second interface on a network it has: not for members
            Policy.once_per_sandbox(req.caller, req.sandbox_id,
                                    [*(a.network for a in rec.attachments), att.network],
                                    field="network")
        new = rec is None
        if rec is None:
            rec = SandboxRecord(req.sandbox_id, req.netns, ns.identity, (), owner=req.caller.uid)
        def failed(att: Attachment, e: CNIError) -> None:
            log.warning("ADD of %s/%s for %s failed, rolling back: %s", att.network,
                        att.ifname, req.sandbox_id, e)

        async with m.admission.admitted(req.caller, m.policy, req.sandbox_id, req.capabilities,
                                        new_sandbox=new, attaching=[(att.ifname, net)]):
            # A new sandbox: lo first, before an intent exists (nothing to undo).
            [result] = await m.add_new(rec, [att], [net], ns, loopback=new, failed=failed)
            if m.journal.events.on:
                m.journal.events.emit(Change.ATTACHED, rec.sandbox_id, rec.owner,
                                      [(att, State.READY)], {att.ifname: result})
        log.info("sandbox %s: %s/%s attached", req.sandbox_id, att.network, att.ifname)
        return attachment_document(req.sandbox_id, att.network, att.ifname, result)

    @staticmethod
    def _repeat(sandbox_id: str, existing: Attachment, new: Attachment,
                entries: Mapping[tuple[str, str], CachedAttachment]) -> dict[str, Any]:
        same = (existing.network, existing.args, dict(existing.capabilities), existing.origin) == \
            (new.network, new.args, dict(new.capabilities), new.origin)
        entry = entries.get((existing.network, existing.ifname))
        if same and existing.lost is not None:
            raise lost_error(sandbox_id, existing)
        if not same or existing.phase is not Phase.READY or entry is None:
            raise AgentError(ErrorKind.INVALID_ARGUMENT,
                             f"sandbox {sandbox_id} already has {existing.ifname} on network "
                             f"{existing.network}; DEL it first")
        return attachment_document(sandbox_id, entry.network, entry.ifname, entry.result or {})

    # --- DEL ------------------------------------------------------------------------

    async def detach(self, sandbox_id: str, netns: str, network: str, ifname: str,
                     origin: str = "", caller: Caller = ROOT, netns_fd: int | None = None
                     ) -> None:
        """DEL one attachment. Nothing attached there, or its netns gone: success."""
        with classified():
            sid = self.m.own_id(caller, sandbox_id)
        with log_fields(SANDBOX_ID=sid, IFNAME=ifname):
            await self.m.queued_first(sid)
            with classified():
                await self._detach(sid, netns, network, ifname, origin, caller, netns_fd)

    async def _detach(self, sandbox_id: str, netns: str, network: str, ifname: str,
                      origin: str, caller: Caller, netns_fd: int | None = None) -> None:
        m = self.m
        _validate(sandbox_id, network, ifname, origin)
        with m.order.arrive(sandbox_id, Kind.REMOVE, frozenset({ifname})) as ticket:
            given_cm = m.given_netns(netns, netns_fd, caller)  # as Teardown's
            async with unless_hung(given_cm) as given, m.locked(ticket):
                rec, entries = await m.journal.view(sandbox_id)
                if rec is not None or entries:
                    Policy.holds(caller, sandbox_id, rec.owner if rec else None, bool(entries))
                if rec is not None and netns_fd is not None and given is not None:
                    same_namespace(caller, rec, given)
                recorded = rec.attachment(ifname) if rec is not None else None
                if rec is not None and recorded is not None:
                    if not _mine(recorded, network, origin):
                        # Most often a runtime's conflist renamed since the ADD: say
                        # both names. Reaping frees it once its namespace is gone.
                        log.warning("DEL of %s on %s from %s: it was made through %s; nothing "
                                    "to do (was the runtime's network renamed since?)", ifname,
                                    sandbox_id, _through(network, origin),
                                    _through(recorded.network, recorded.origin))
                        return
                    async with unless_hung(m.journal.live_netns(rec, entries,
                                                                given=given)) as ns:
                        refuse_alive(caller, rec, given, ns)
                        await self._remove(rec, ifname, ns, entries)
                    return
                # No record of it: a cache entry of another tool is removed like
                # Teardown removes one, with the caller's netns.
                foreign = {k: e for k, e in entries.items()
                           if k[1] == ifname and (not network or k[0] == network)}
                if not foreign or origin:
                    return  # nothing of ours there: DEL of nothing succeeds
                claimed = await m.journal.claim(sandbox_id, rec, foreign, netns,
                                                given.identity if given else None)
                await self._remove(claimed, ifname, given, entries)

    async def _remove(self, rec: SandboxRecord, ifname: str, ns: Pinned | None,
                      entries: Mapping[tuple[str, str], CachedAttachment]) -> None:
        removal = await self.m.journal.remove(rec, [ifname], ns, entries)
        if self.m.journal.events.on:
            self.m.journal.tell_removed(Change.DETACHED, rec, removal)
        if removal.errors:
            raise AgentError(ErrorKind.PLUGIN_FAILED,
                             f"DEL of {ifname} of {rec.sandbox_id} incomplete, its cache entry "
                             f"is kept: {removal.errors[0]}")
        if removal.unrecorded:
            raise unrecorded_error(f"DEL of {ifname} of {rec.sandbox_id}", removal)
        log.info("sandbox %s: %s removed", rec.sandbox_id, ifname)

    # --- CHECK ----------------------------------------------------------------------

    async def check(self, sandbox_id: str, netns: str, network: str, ifname: str,
                    origin: str = "") -> None:
        with log_fields(SANDBOX_ID=sandbox_id, IFNAME=ifname):
            await self.m.queued_first(sandbox_id)
            with classified():
                m = self.m
                m.gate()
                validate_container_id(sandbox_id)
                _validate(sandbox_id, network, ifname, origin)
                async with m.journal.paths.pinned(netns) as ns:
                    with m.order.arrive(sandbox_id, Kind.OTHER, frozenset({ifname})) as ticket:
                        async with m.locked(ticket):
                            await self._check_locked(sandbox_id, ns, network, ifname, origin)

    async def _check_locked(self, sandbox_id: str, ns: Pinned, network: str, ifname: str,
                            origin: str) -> None:
        rec, entries = await self.m.journal.view(sandbox_id)
        att = rec.attachment(ifname) if rec is not None else None
        if rec is None or att is None or att.phase is not Phase.READY or \
                not _mine(att, network, origin):
            raise AgentError(ErrorKind.NOT_FOUND,
                             f"sandbox {sandbox_id} has no {ifname}"
                             + (f" on network {network}" if network else ""))
        if not await in_recorded(rec, entries, ns):
            raise AgentError(ErrorKind.INVALID_ARGUMENT,
                             f"sandbox {sandbox_id} is set up in netns {rec.netns}, not {ns.path}")
        entry = entries.get((att.network, att.ifname))
        if att.lost is not None:
            raise lost_error(sandbox_id, att)
        if entry is None:
            raise NoCachedResult(f"sandbox {sandbox_id}: no cached result for "
                                 f"{att.network}/{att.ifname}")
        # The one CHECK path (checks.py): the outcome is recorded and judged.
        only = {(att.network, att.ifname): entry}
        for outcome in await self.m.checks.run_locked(rec, only, ns, repair=False):
            if outcome.error is not None:
                raise outcome.error

    # --- a runtime's GC -------------------------------------------------------------

    async def collect(self, origin: str, valid: Collection[tuple[str, str]]) -> list[str]:
        """DEL the attachments made through `origin` whose (sandbox, ifname) the
        runtime no longer lists; nothing else. Returns the errors."""
        with classified():
            self.m.gate()
            validate_network_name(origin, "name")
            report = await self.m.reaper.release(origin, frozenset(valid))
        return report.errors
