"""Who a sandbox belongs to, and how a caller's namespace reaches the agent.

Each sandbox records the uid that set it up (records before 0.2: root's).
Root sees and may do everything; any other caller (a member of the access
group) only its own sandboxes, and it names its namespace by a descriptor it
opened with its own rights, never by a path the root agent would open for it.
Reaping and GC go by liveness, not owners.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.errors import InvalidArgument
from cni_agent.node.blocking import UNANSWERED, PathWorker
from cni_agent.node.netns import Pinned
from cni_agent.sandboxes.records import SandboxRecord

ROOT = 0


def denied(sandbox_id: str, caller: int) -> AgentError:
    """The same words whether the sandbox is another's or does not exist."""
    return AgentError(ErrorKind.ACCESS_DENIED,
                      f"sandbox {sandbox_id} is not one of uid {caller}'s sandboxes")


def owns(caller: int, rec: SandboxRecord | None, entries: Mapping[Any, Any]) -> bool:
    """Whether `caller` may act on the sandbox: root always; another uid on its
    own record, or where nothing exists yet (a Setup of a new id)."""
    if caller == ROOT:
        return True
    if rec is None:
        return not entries  # cache entries without a record: another tool's, root's
    return rec.owner == caller


def require(sandbox_id: str, caller: int, rec: SandboxRecord | None,
            entries: Mapping[Any, Any]) -> None:
    if not owns(caller, rec, entries):
        raise denied(sandbox_id, caller)


@asynccontextmanager
async def callers_netns(paths: PathWorker, netns: str, netns_fd: int | None, caller: int
                        ) -> AsyncIterator[Pinned]:
    """The namespace an ADD runs in, pinned: the caller's descriptor, or (root
    only) the path, opened by the agent.

    With a descriptor, `netns` is the name the sandbox is recorded by (reaping
    and Show use it), so it must name that same namespace; a mismatch, or a
    path that cannot be opened, gets one answer, which says nothing about the
    path (a caller must not learn through the agent what it cannot open).
    """
    if netns_fd is None:
        if caller != ROOT:
            raise AgentError(ErrorKind.ACCESS_DENIED,
                             "only root may name a namespace by path: open it yourself and pass "
                             "the descriptor as option netns_fd (D-Bus type h)")
        async with paths.pinned(netns) as ns:
            yield ns
        return
    if not netns:
        raise InvalidArgument("netns", "must name the namespace of netns_fd (it is recorded by it)")
    async with paths.pinned_fd(netns_fd, netns) as ns:
        try:
            async with paths.pinned_if_netns(netns) as named:
                same = named is not None and named.identity.same(ns.identity)
        except (InvalidArgument, *UNANSWERED):
            same = False
        if not same:
            raise InvalidArgument("netns", "does not name the namespace of netns_fd")
        yield ns
