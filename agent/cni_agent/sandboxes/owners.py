"""How a caller's network namespace reaches the agent (who may: `policy`).

Root names a namespace by path, which the agent opens. Any other caller
passes a descriptor it opened with its own rights, and the namespace must be
one its uid is privileged over (`Policy.netns`): nsfs files are
world-readable, so holding a descriptor proves nothing. Its namespace is that
descriptor alone: the path it gives, if any, is a label (shown, recorded), and
the agent never opens, stats or later uses it — a path on a mount that never
answers (a member can make one in its own mount namespace) would hold one of
root's few path threads forever. Later calls on its sandbox (Teardown,
Detach, Check) pass the descriptor again; the agent keeps none, and reaches a
member's namespace otherwise only through a process inside it
(`blocking.process_held`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from cni_agent.cni.errors import InvalidArgument
from cni_agent.node.blocking import PathWorker
from cni_agent.node.netns import Pinned
from cni_agent.sandboxes.policy import Caller, Policy
from cni_agent.sandboxes.records import SandboxRecord


def callers_netns(paths: PathWorker, netns: str, netns_fd: int | None, caller: Caller
                  ) -> AbstractAsyncContextManager[Pinned]:
    """The namespace an ADD runs in, pinned: the caller's descriptor (`netns`
    its label, never opened), or (root only) the path, opened by the agent."""
    if netns_fd is None:
        Policy.named_by_path(caller)
        return paths.pinned(netns)  # itself: no generator around it (root's every ADD)
    return _by_descriptor(paths, netns, netns_fd, caller)


@asynccontextmanager
async def _by_descriptor(paths: PathWorker, netns: str, netns_fd: int, caller: Caller
                         ) -> AsyncIterator[Pinned]:
    validate_label(netns)
    async with descriptor(paths, netns_fd, netns, caller) as ns:
        if caller.root:
            # Root's sandboxes are found again by their path (reaping, Check):
            # it must name this namespace. Root's path, on root's path threads.
            if not netns:
                raise InvalidArgument("netns", "must name the namespace of netns_fd (root's "
                                               "sandboxes are found again by it)")
            await paths.run(paths.names(netns, ns), "netns", netns)
        yield ns


def descriptor(paths: PathWorker, netns_fd: int, label: str, caller: Caller
               ) -> AbstractAsyncContextManager[Pinned]:
    """A caller's own descriptor, verified and pinned: a namespace of a user
    namespace its uid owns (`Policy.netns`; root's any)."""
    def vet(owners: tuple[int, ...] | None) -> None:
        Policy.netns(caller, owners)

    return paths.pinned_fd(netns_fd, label, vet)


def validate_label(netns: str) -> None:
    """A descriptor's label: "" or an absolute path, as root's paths are."""
    if netns and ("\x00" in netns or len(netns) > 4096 or not netns.startswith("/")):
        raise InvalidArgument("netns", "must be empty or an absolute path")


def same_namespace(caller: Caller, rec: SandboxRecord, given: Pinned) -> None:
    """A descriptor passed for an existing sandbox must be its namespace:
    InvalidArgument(netns_fd) otherwise, nothing done."""
    if rec.netns_id is None or not rec.netns_id.same(given.identity):
        raise not_its_namespace(caller, rec.sandbox_id)


def not_its_namespace(caller: Caller, sandbox_id: str) -> InvalidArgument:
    return InvalidArgument("netns_fd", f"is not the network namespace sandbox "
                                       f"{Policy.shown(caller, sandbox_id)} was set up in")


class StillAlive(InvalidArgument):
    """A member's removal without its descriptor while its namespace lives.

    Refused, nothing done: a DEL without the namespace releases the address
    while the interface keeps it inside (unfiltered once the DEL removed the
    anti-spoofing filters), and the next sandbox would be given the same one.
    """

    def __init__(self, sandbox_id: str) -> None:
        super().__init__("netns_fd", f"the network namespace of sandbox {sandbox_id} is still "
                                     "in use: pass it again as option netns_fd (cni-agent "
                                     "teardown ID NETNS does), or end its processes first")


def refuse_alive(caller: Caller, rec: SandboxRecord | None, given: Pinned | None,
                 live: Pinned | None) -> None:
    """A member's Teardown or Detach of its sandbox without its descriptor,
    while a process is in the namespace (`live` found, not `given`): StillAlive.
    Root may: it reached the namespace itself, and the DEL runs in it."""
    if caller.root or rec is None or not rec.by_descriptor or live is None or live is given:
        return
    raise StillAlive(Policy.shown(caller, rec.sandbox_id))
