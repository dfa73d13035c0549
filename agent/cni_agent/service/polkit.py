"""polkit: the delegation Fedora's privileged D-Bus services offer admins.

Asked only for callers that are neither root nor in `access.groups` (those
keep the fast path), over the bus and never blocking the loop. Without a
polkitd on the bus the answer is "no", as before polkit was asked at all.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dbus_fast import Message, MessageType, Variant

from cni_agent.api import AgentError, ErrorKind

log = logging.getLogger(__name__)

NAME = "org.freedesktop.PolicyKit1"
PATH = "/org/freedesktop/PolicyKit1/Authority"
INTERFACE = "org.freedesktop.PolicyKit1.Authority"

_ALLOW_USER_INTERACTION = 0x1
# A person typing a password may take a while, but not hold a call (and a
# stranger's place in its bound) for long; a non-interactive answer is quick.
_INTERACTIVE_TIMEOUT = 30.0
_TIMEOUT = 25.0
_ABSENT = {"org.freedesktop.DBus.Error.ServiceUnknown",
           "org.freedesktop.DBus.Error.NameHasNoOwner"}


class Polkit:
    def __init__(self, bus: Any) -> None:
        self.bus = bus
        self._asking: set[asyncio.Task[Any]] = set()
        self._stopping = False

    def stop(self) -> None:
        """A shutdown: no caller waits for polkit any more (they are answered
        ShuttingDown), nor does the drain wait for them."""
        self._stopping = True
        for task in self._asking:
            task.cancel()

    async def check(self, sender: str, action: str, interactive: bool) -> tuple[bool, str]:
        """Whether polkit authorizes `sender` for `action`, and if not, why."""
        if self._stopping:
            raise AgentError(ErrorKind.SHUTTING_DOWN, "cni-agent is shutting down")
        task = asyncio.ensure_future(self._check(sender, action, interactive))
        self._asking.add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and self._stopping:
                raise AgentError(ErrorKind.SHUTTING_DOWN, "cni-agent is shutting down; polkit's "
                                                          "answer is not awaited") from None
            task.cancel()  # our caller went away
            raise
        finally:
            self._asking.discard(task)

    async def _check(self, sender: str, action: str, interactive: bool) -> tuple[bool, str]:
        msg = Message(
            destination=NAME, path=PATH, interface=INTERFACE, member="CheckAuthorization",
            signature="(sa{sv})sa{ss}us",
            body=[["system-bus-name", {"name": Variant("s", sender)}], action, {},
                  _ALLOW_USER_INTERACTION if interactive else 0, ""],
        )
        try:
            async with asyncio.timeout(_INTERACTIVE_TIMEOUT if interactive else _TIMEOUT):
                reply = await self.bus.call(msg)
        except TimeoutError:
            log.warning("polkit did not answer for %s (%s)", sender, action)
            return False, "polkit did not answer in time"
        if reply is None:
            return False, "polkit did not answer"
        if reply.message_type is MessageType.ERROR:
            if reply.error_name in _ABSENT:
                return False, ""  # no polkit on this bus: today's rules alone
            log.warning("polkit refused to check %s for %s: %s %s", action, sender,
                        reply.error_name, reply.body)
            return False, f"polkit failed: {reply.error_name}"
        authorized, challenge, _details = reply.body[0]
        if authorized:
            return True, ""
        if challenge:
            return False, (f"polkit action {action} needs authentication; call with the "
                           "ALLOW_INTERACTIVE_AUTHORIZATION flag (busctl "
                           "--allow-interactive-authorization=yes) or ask an admin for a rule")
        return False, f"polkit does not authorize {action}"
