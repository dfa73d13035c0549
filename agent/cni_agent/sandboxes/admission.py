"""The counts behind the policy's bounds on callers that are not root.

How many sandboxes a uid holds (`access.max_sandboxes`) and which host ports
other sandboxes map (a member never takes one) are read from the records —
a member's own by their names, every record only when it asks for a port —
plus the claims of the calls under way, taken before the records are read:
two concurrent calls can never both pass. Root's calls skip all of it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from cni_agent.cni.errors import InvalidArgument
from cni_agent.sandboxes.policy import Caller, Policy, denied, host_ports
from cni_agent.sandboxes.records import SandboxRecord
from cni_agent.sandboxes.store import SandboxStore


@dataclass(frozen=True)
class _Claim:
    uid: int
    new_sandbox: bool
    ports: frozenset[tuple[int, str]]


class Admission:
    def __init__(self, store: SandboxStore) -> None:
        self.store = store
        self._claims: dict[str, _Claim] = {}  # sandbox → what its call under way will hold

    @asynccontextmanager
    async def admitted(self, caller: Caller, policy: Policy, sandbox_id: str,
                       capabilities: Mapping[str, Any], new_sandbox: bool) -> AsyncIterator[None]:
        """Hold a place for this call (its sandbox, if new, and its host ports)
        until it ends; Busy over the quota, AccessDenied for a port another
        sandbox maps. By then the call's record is on disk, or nothing is."""
        if caller.root:
            yield
            return
        ports = frozenset(host_ports(capabilities))
        claim = _Claim(caller.uid, new_sandbox, ports)
        for sid, other in self._claims.items():
            if sid != sandbox_id and (taken := ports & other.ports):
                raise _port_taken(min(taken))
        if sandbox_id in self._claims:  # the sandbox's lock makes this impossible
            raise RuntimeError(f"two calls under way on {sandbox_id}")
        self._claims[sandbox_id] = claim
        try:
            await self._check(caller, policy, sandbox_id, claim)
            yield
        finally:
            del self._claims[sandbox_id]

    async def _check(self, caller: Caller, policy: Policy, sandbox_id: str, claim: _Claim) -> None:
        prefix = Policy.own_prefix(caller)
        if claim.new_sandbox:
            held = set(self.store.ids(prefix))
            held |= {sid for sid, c in self._claims.items() if c.uid == caller.uid and c.new_sandbox}
            held.discard(sandbox_id)
            policy.quota(caller, len(held))
        if claim.ports:
            for rec in self.store.records():
                if rec.sandbox_id != sandbox_id and (taken := claim.ports & _mapped(rec)):
                    raise _port_taken(min(taken))


def _mapped(rec: SandboxRecord) -> set[tuple[int, str]]:
    out: set[tuple[int, str]] = set()
    for att in rec.attachments:
        try:
            out |= host_ports(att.capabilities)
        except InvalidArgument:  # a root caller's malformed entry maps nothing a plugin accepted
            continue
    return out


def _port_taken(port: tuple[int, str]) -> Exception:
    return denied(f"host port {port[0]}/{port[1]} is mapped by another sandbox")
