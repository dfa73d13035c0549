"""The counts behind the policy's bounds on callers that are not root, and
the host ports every sandbox holds.

How many sandboxes a uid holds (`access.max_sandboxes`), how many
attachments (`access.max_attachments`), how many of a network's addresses
all non-root callers hold (`access.members_share`, where its pool size is
known: `cni.pool`) and which host ports other sandboxes map (no sandbox,
root's included, takes one: `HostPort` conflicts) are read from the records
— a member's own by their names, every record only when a call asks for a
port or joins a network of known pool size — plus the claims of the calls
under way, taken before the records are read: two concurrent calls can never
both pass. An attachment is counted once by (sandbox, ifname), whether a
record, a claim or both hold it. Root's calls without port mappings skip all
of it; root's with them claim their ports only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from cni_agent.cni.config import NetworkConfigList
from cni_agent.cni.pool import Pool, pool_of
from cni_agent.sandboxes.policy import (
    Caller,
    HostPort,
    Policy,
    first_conflict,
    held_ports,
    port_mappings,
)
from cni_agent.sandboxes.records import SandboxRecord
from cni_agent.sandboxes.store import SandboxStore


@dataclass(frozen=True)
class _Claim:
    uid: int
    new_sandbox: bool  # counted against the uid's access.max_sandboxes
    ports: frozenset[HostPort]
    # (ifname, network) of each attachment the call adds (none for root's calls).
    attaching: frozenset[tuple[str, str]] = frozenset()


_NOTHING: AbstractAsyncContextManager[None] = nullcontext()  # reentrant: shared


class Admission:
    def __init__(self, store: SandboxStore) -> None:
        self.store = store
        self._claims: dict[str, _Claim] = {}  # sandbox → what its call under way will hold

    def admitted(self, caller: Caller, policy: Policy, sandbox_id: str,
                 capabilities: Mapping[str, Any], new_sandbox: bool,
                 attaching: Sequence[tuple[str, NetworkConfigList]] = ()
                 ) -> AbstractAsyncContextManager[None]:
        """Hold a place for this call (its sandbox, if new and not root's, its
        attachments `attaching` (ifname, network), not root's, and its host
        ports) until it ends; Busy over a quota or a network's members' share,
        InvalidArgument for a host port another sandbox maps or is about to.
        By then the call's record is on disk, or nothing is.

        Root's call without host ports holds nothing: a shared empty block,
        not an async generator (its wrapper and the loop's weak set entry)
        on every one of root's calls."""
        ports = port_mappings(capabilities)
        if caller.root and not ports:
            return _NOTHING
        return self._admitted(caller, policy, sandbox_id, ports, new_sandbox, attaching)

    @asynccontextmanager
    async def _admitted(self, caller: Caller, policy: Policy, sandbox_id: str,
                        ports: frozenset[HostPort], new_sandbox: bool,
                        attaching: Sequence[tuple[str, NetworkConfigList]]
                        ) -> AsyncIterator[None]:
        claim = _Claim(caller.uid, new_sandbox and not caller.root, ports,
                       frozenset() if caller.root else
                       frozenset((ifname, net.name) for ifname, net in attaching))
        for sid, other in self._claims.items():
            if sid != sandbox_id and (hit := first_conflict(ports, other.ports)):
                raise Policy.port_taken(caller, *hit, sid)
        if sandbox_id in self._claims:  # the sandbox's lock makes this impossible
            raise RuntimeError(f"two calls under way on {sandbox_id}")
        self._claims[sandbox_id] = claim
        try:
            await self._check(caller, policy, sandbox_id, claim)
            self._check_attachments(caller, policy, sandbox_id, claim,
                                    {net.name: pool_of(net) for _, net in attaching}
                                    if claim.attaching else {})
            yield
        finally:
            del self._claims[sandbox_id]

    async def _check(self, caller: Caller, policy: Policy, sandbox_id: str, claim: _Claim) -> None:
        if claim.new_sandbox:
            held = set(self.store.ids(Policy.own_prefix(caller)))
            held |= {sid for sid, c in self._claims.items() if c.uid == caller.uid and c.new_sandbox}
            held.discard(sandbox_id)
            policy.quota(caller, len(held))
        if claim.ports:
            for rec in self.store.records():
                if rec.sandbox_id != sandbox_id and (
                        hit := first_conflict(claim.ports, _mapped(rec))):
                    raise Policy.port_taken(caller, *hit, rec.sandbox_id)

    def _check_attachments(self, caller: Caller, policy: Policy, sandbox_id: str, claim: _Claim,
                           pools: Mapping[str, Pool | None]) -> None:
        """`access.max_attachments` for the caller's uid, then
        `access.members_share` for each network of known pool size it joins."""
        if not claim.attaching:
            return
        adding = {(sandbox_id, ifname) for ifname, _ in claim.attaching}
        mine = set(_held(self.store.records(Policy.own_prefix(caller))))
        mine |= {(sid, ifname) for sid, c in self._claims.items()
                 if sid != sandbox_id and c.uid == caller.uid for ifname, _ in c.attaching}
        policy.attachments(caller, len(mine - adding), len(adding))
        for name, pool in sorted(pools.items()):
            if pool is not None:
                joining = {(sandbox_id, ifname) for ifname, net in claim.attaching if net == name}
                held = self._members_on(name, sandbox_id) - joining
                policy.addresses(caller, name, pool, len(held), len(joining))

    def _members_on(self, network: str, sandbox_id: str) -> set[tuple[str, str]]:
        """(sandbox, ifname) of every attachment on `network` callers that are
        not root hold or are adding (other than this call's)."""
        members = (rec for rec in self.store.records() if rec.owner != 0)
        held = set(_held(members, network))
        for sid, c in self._claims.items():  # root's claims attach nothing
            if sid != sandbox_id:
                held |= {(sid, ifname) for ifname, net in c.attaching if net == network}
        return held


def _held(records: Iterable[SandboxRecord], network: str = "") -> Iterable[tuple[str, str]]:
    """(sandbox, ifname) of every attachment (on `network`, unless ""),
    whatever its phase: one not yet added or being removed may hold its
    address all the same."""
    for rec in records:
        for att in rec.attachments:
            if not network or att.network == network:
                yield rec.sandbox_id, att.ifname


def _mapped(rec: SandboxRecord) -> frozenset[HostPort]:
    return frozenset[HostPort]().union(*(held_ports(att.capabilities) for att in rec.attachments))
