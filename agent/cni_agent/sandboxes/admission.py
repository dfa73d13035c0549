"""The counts behind the policy's bounds on callers that are not root, and
the host ports every sandbox holds.

How many sandboxes a uid holds (`access.max_sandboxes`) and which host ports
other sandboxes map (no sandbox, root's included, takes one: `HostPort`
conflicts) are read from the records — a member's own by their names, every
record only when a call asks for a port — plus the claims of the calls under
way, taken before the records are read: two concurrent calls can never both
pass. Root's calls without port mappings skip all of it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

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


class Admission:
    def __init__(self, store: SandboxStore) -> None:
        self.store = store
        self._claims: dict[str, _Claim] = {}  # sandbox → what its call under way will hold

    @asynccontextmanager
    async def admitted(self, caller: Caller, policy: Policy, sandbox_id: str,
                       capabilities: Mapping[str, Any], new_sandbox: bool) -> AsyncIterator[None]:
        """Hold a place for this call (its sandbox, if new and not root's, and
        its host ports) until it ends; Busy over the quota, InvalidArgument for
        a host port another sandbox maps or is about to. By then the call's
        record is on disk, or nothing is."""
        ports = port_mappings(capabilities)
        if caller.root and not ports:
            yield
            return
        claim = _Claim(caller.uid, new_sandbox and not caller.root, ports)
        for sid, other in self._claims.items():
            if sid != sandbox_id and (hit := first_conflict(ports, other.ports)):
                raise Policy.port_taken(caller, *hit, sid)
        if sandbox_id in self._claims:  # the sandbox's lock makes this impossible
            raise RuntimeError(f"two calls under way on {sandbox_id}")
        self._claims[sandbox_id] = claim
        try:
            await self._check(caller, policy, sandbox_id, claim)
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


def _mapped(rec: SandboxRecord) -> frozenset[HostPort]:
    return frozenset[HostPort]().union(*(held_ports(att.capabilities) for att in rec.attachments))
