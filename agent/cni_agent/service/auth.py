"""Who may call: root, a member of `access.groups`, or whom polkit authorizes.

Checked here, in the daemon: the bus policy lets every caller reach the
interface, and a node agent must not rely on a policy file it does not
control anyway (a permissive bus, a custom dbus-daemon config).
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
from collections.abc import Sequence
from typing import Any

from dbus_fast import Message, MessageType

from cni_agent.api import AgentError, ErrorKind
from cni_agent.service.polkit import Polkit, action_for

log = logging.getLogger(__name__)

_CACHE_LIMIT = 512


def resolve_groups(names: Sequence[str]) -> frozenset[int]:
    gids = set()
    for name in names:
        try:
            gids.add(grp.getgrnam(name).gr_gid)
        except KeyError:
            log.info("access group %s does not exist on this node; ignoring it", name)
    return frozenset(gids)


class Authorizer:
    def __init__(self, bus: Any, groups: Sequence[str], polkit: Polkit | None = None) -> None:
        self.bus = bus
        self.polkit = polkit
        self.set_groups(groups)
        # Unique bus names are never reused, so caching per sender is safe.
        self._cache: dict[str, tuple[int, frozenset[int]]] = {}

    def set_groups(self, groups: Sequence[str]) -> None:
        """`access.groups`, at start and on a reload."""
        self.group_names = tuple(groups)
        self.gids = resolve_groups(groups)

    async def _credentials(self, sender: str) -> tuple[int, frozenset[int]]:
        if sender in self._cache:
            return self._cache[sender]
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
        else:  # older buses: the user's groups from the user database
            try:
                pw = pwd.getpwuid(uid)
                gids = frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid))
            except KeyError:
                gids = frozenset()
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[sender] = (uid, gids)
        return uid, gids

    async def identify(self, sender: str | None, what: str) -> tuple[int, bool]:
        """The caller's uid, and whether it is privileged (root or a member)."""
        if sender is None:
            raise AgentError(ErrorKind.ACCESS_DENIED, f"{what}: the caller is unknown")
        uid, gids = await self._credentials(sender)
        return uid, uid == 0 or bool(gids & self.gids)

    async def require(self, sender: str | None, what: str, interactive: bool = False) -> int:
        """The uid of a caller that may call method `what`; else AccessDenied.

        Root and members without asking anyone; any other caller if polkit
        authorizes it (`interactive`: the call allows an authentication
        dialog). Either way a caller that is not root then reaches only the
        namespaces it opened and the sandboxes it set up.
        """
        uid, privileged = await self.identify(sender, what)
        if privileged:
            return uid
        why = ""
        if self.polkit is not None and sender is not None:
            authorized, why = await self.polkit.check(sender, action_for(what), interactive)
            if authorized:
                return uid
        groups = " or ".join(self.group_names) or "(none configured)"
        raise AgentError(
            ErrorKind.ACCESS_DENIED,
            f"{what} requires root or membership in the {groups} group (caller uid {uid})"
            + (f"; {why}" if why else ""),
        )
