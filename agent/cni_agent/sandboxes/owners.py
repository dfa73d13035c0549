"""How a caller's network namespace reaches the agent (who may: `policy`).

Root names a namespace by path, which the agent opens. Any other caller
passes a descriptor it opened with its own rights, and the namespace must be
one its uid is privileged over (`Policy.netns`): nsfs files are
world-readable, so holding a descriptor proves nothing. The path is then only
the name the sandbox is recorded by, and must name the same namespace.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from cni_agent.cni.errors import InvalidArgument
from cni_agent.node.blocking import PathWorker
from cni_agent.node.netns import Pinned
from cni_agent.sandboxes.policy import Caller, Policy


@asynccontextmanager
async def callers_netns(paths: PathWorker, netns: str, netns_fd: int | None, caller: Caller
                        ) -> AsyncIterator[Pinned]:
    """The namespace an ADD runs in, pinned: the caller's descriptor, or (root
    only) the path, opened by the agent.

    With a descriptor, `netns` is the name the sandbox is recorded by (reaping
    and Show use it), so it must name that same namespace; a mismatch, or a
    path that cannot be opened, gets one answer, which says nothing about the
    path (a caller must not learn through the agent what it cannot open).
    """
    if netns_fd is None:
        Policy.named_by_path(caller)
        async with paths.pinned(netns) as ns:
            yield ns
        return
    if not netns:
        raise InvalidArgument("netns", "must name the namespace of netns_fd (it is recorded by it)")

    def vet(owners: tuple[int, ...] | None) -> None:
        Policy.netns(caller, owners)

    async with paths.pinned_fd(netns_fd, netns, vet) as ns:
        # Checked on a path thread together with the intent's commit, before
        # anything is recorded under the path or any plugin runs (one thread
        # hop for both: `Journal.begin_add`).
        ns.unverified = paths.names(netns, ns)
        yield ns
