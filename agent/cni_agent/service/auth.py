"""Who is calling: the caller's role from its credentials (the bus's, or the
shim socket's SO_PEERCRED), and polkit.

Checked here, in the daemon: the bus policy lets every caller reach the
interface, and a node agent must not rely on a policy file it does not
control anyway (a permissive bus, a custom dbus-daemon config). What each
role may do is `sandboxes.policy`'s to say; this module only finds the role
(root, a member of `access.groups`, or a stranger) and, where the policy
lets polkit decide, asks it.
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import pwd
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from dbus_fast import Message, MessageType

from cni_agent.api import AgentError, ErrorKind
from cni_agent.sandboxes.policy import ACTIONS, ROOT, Caller, Policy, Role, Scope
from cni_agent.service.polkit import Polkit

log = logging.getLogger(__name__)

_CACHE_LIMIT = 1024


def resolve_groups(names: Sequence[str]) -> frozenset[int]:
    gids = set()
    for name in names:
        try:
            gids.add(grp.getgrnam(name).gr_gid)
        except KeyError:
            log.info("access group %s does not exist on this node; ignoring it", name)
    return frozenset(gids)


def groups_of_user(uid: int) -> frozenset[int]:
    """A user's groups from the user database: where the transport does not
    say which groups the caller's process has (older buses and kernels)."""
    try:
        pw = pwd.getpwuid(uid)
        return frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid))
    except KeyError:
        return frozenset()


class Authorizer:
    def __init__(self, bus: Any, groups: Sequence[str], polkit: Polkit | None = None) -> None:
        self.bus = bus
        self.polkit = polkit
        self.set_groups(groups)
        # Unique bus names are never reused, so caching per sender is safe;
        # the oldest go first (a flood of connections cannot evict everyone).
        self._cache: OrderedDict[str, tuple[int, frozenset[int]]] = OrderedDict()
        self._asking: dict[str, asyncio.Task[tuple[int, frozenset[int]]]] = {}
        # Senders polkit authorized once: their budgets are the members' from
        # then on (`known`), as polkit's delegates count as members.
        self._delegates: OrderedDict[str, None] = OrderedDict()

    def set_groups(self, groups: Sequence[str]) -> None:
        """`access.groups`, at start and on a reload."""
        self.group_names = tuple(groups)
        self.gids = resolve_groups(groups)

    def known(self, sender: str | None) -> Caller | None:
        """The caller, if its credentials were read before (no bus call): a
        DELEGATE if polkit authorized this sender before (for its budgets;
        each call is still authorized on its own)."""
        creds = self._cache.get(sender) if sender is not None else None
        if creds is None:
            return None
        caller = self.caller(*creds)
        if caller.role is Role.STRANGER and sender in self._delegates:
            return Caller(caller.uid, Role.DELEGATE)
        return caller

    def caller(self, uid: int, gids: frozenset[int]) -> Caller:
        """Who a process of `uid` with groups `gids` is to us, on any transport."""
        if uid == 0:
            return ROOT  # immutable: the one made once
        return Caller(uid, Role.MEMBER if gids & self.gids else Role.STRANGER)

    def lookup(self, sender: str) -> asyncio.Task[tuple[int, frozenset[int]]]:
        """Read a sender's credentials: one bus call per sender, however many
        wait for its answer (the gate holds a sender's messages until then)."""
        task = self._asking.get(sender)
        if task is None:
            task = self._asking[sender] = asyncio.ensure_future(self._read_credentials(sender))
            task.add_done_callback(lambda t: (self._asking.pop(sender, None),
                                              t.cancelled() or t.exception()))
        return task

    async def _credentials(self, sender: str) -> tuple[int, frozenset[int]]:
        if sender in self._cache:
            return self._cache[sender]
        return await asyncio.shield(self.lookup(sender))

    async def _read_credentials(self, sender: str) -> tuple[int, frozenset[int]]:
        reply = await self.bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="GetConnectionCredentials",
            signature="s", body=[sender],
        ))
        if reply is None or reply.message_type is not MessageType.METHOD_RETURN:
            raise AgentError(ErrorKind.ACCESS_DENIED, "cannot determine the caller's credentials")
        creds = reply.body[0]
        uid = int(creds["UnixUserID"].value)
        if "UnixGroupIDs" in creds:
            gids = frozenset(int(g) for g in creds["UnixGroupIDs"].value)
        else:  # older buses
            gids = groups_of_user(uid)
        while len(self._cache) >= _CACHE_LIMIT:
            self._cache.popitem(last=False)
        self._cache[sender] = (uid, gids)
        return uid, gids

    async def credentials(self, sender: str | None, what: str) -> tuple[int, frozenset[int]]:
        """The uid and groups of the caller of method `what`, from the bus."""
        if sender is None:
            raise AgentError(ErrorKind.ACCESS_DENIED, f"{what}: the caller is unknown")
        return await self._credentials(sender)

    async def authorize(self, caller: Caller, sender: str | None, method: str, scope: Scope,
                        interactive: bool = False) -> Caller:
        """`caller`, if the policy lets it call `method`; else a delegate, if
        polkit authorizes the scope's action; else AccessDenied."""
        if Policy.permits(caller, scope):
            return caller
        why = ""
        action = ACTIONS.get(scope)
        if action is not None and self.polkit is not None and sender is not None:
            authorized, why = await self.polkit.check(sender, action, interactive)
            if authorized:
                self._delegates[sender] = None
                while len(self._delegates) > _CACHE_LIMIT:
                    self._delegates.popitem(last=False)
                return Caller(caller.uid, Role.DELEGATE)
        reason = Policy.refusal(caller, method, scope, self.group_names)
        raise AgentError(ErrorKind.ACCESS_DENIED, reason + (f"; {why}" if why else ""))
