"""Who watches the sandboxes: the callers of WatchSandboxes, told by unicast.

Every signal naming a sandbox (`SandboxChanged`, `AttachmentDrifted`,
`AttachmentCheckChanged`) goes to each watcher that may Show that sandbox
(`Policy.may_show`, the rule Show applies), addressed to its unique bus
name: a broadcast could be received by any connection that asks, and names
every sandbox id. Nobody else receives them.

A watcher is a bus connection that called WatchSandboxes (at most
MAX_PER_UID per uid; a repeat from the same connection is one watcher); it
is dropped when its name leaves the bus (NameOwnerChanged, matched for that
name alone). With no watcher the sandboxes' events are off at their source
(`Events.pause`): nothing is built on the call path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from cni_agent.api import INTERFACE, OBJECT_PATH, AgentError, ErrorKind, wire_text
from cni_agent.sandboxes.checks import Outcome
from cni_agent.sandboxes.events import Events, SandboxEvent
from cni_agent.sandboxes.policy import Caller, Policy

log = logging.getLogger(__name__)

MAX_PER_UID = 4
DBUS_NAME = "org.freedesktop.DBus"
DBUS_PATH = "/org/freedesktop/DBus"
SANDBOX_CHANGED = "ssua(ssssas)"


def _left_rule(name: str) -> str:
    return (f"type='signal',sender='{DBUS_NAME}',path='{DBUS_PATH}',interface='{DBUS_NAME}',"
            f"member='NameOwnerChanged',arg0='{name}'")


@dataclass(frozen=True)
class Watcher:
    name: str  # its unique bus name
    caller: Caller  # as it was when it called WatchSandboxes


class Watchers:
    def __init__(self, events: Events, owner_of: Callable[[str], int | None]) -> None:
        self._events = events
        self._owner_of = owner_of  # a sandbox's recorded owner (None: no record)
        self._by_name: dict[str, Watcher] = {}
        self.bus: MessageBus | None = None  # set by the daemon once connected
        self._tasks: set[asyncio.Task[None]] = set()
        events.listen(self.publish)
        events.pause(True)

    def __len__(self) -> int:
        return len(self._by_name)

    # --- who -----------------------------------------------------------------------------

    async def add(self, name: str | None, caller: Caller) -> None:
        """WatchSandboxes of the connection `name`: from now on it is told."""
        if not name or self.bus is None:
            raise AgentError(ErrorKind.INVALID_ARGUMENT, "WatchSandboxes needs a bus connection "
                                                         "with a unique name")
        if name in self._by_name:
            return
        held = sum(1 for w in self._by_name.values() if w.caller.uid == caller.uid)
        if held >= MAX_PER_UID:
            raise AgentError(ErrorKind.BUSY, f"uid {caller.uid} already has {held} connections "
                                             f"watching the sandboxes, the most allowed "
                                             f"({MAX_PER_UID}); close one first")
        self._by_name[name] = Watcher(name, caller)
        self._events.pause(False)
        try:
            await self._dbus("AddMatch", _left_rule(name))
            # It may have left before the match was in: then no signal tells it.
            await self._dbus("GetNameOwner", name)
        except _Gone:
            self.drop(name)
        except BaseException:
            self.drop(name)
            raise
        log.debug("%s (uid %d) is watching the sandboxes now", name, caller.uid)

    def drop(self, name: str) -> None:
        if self._by_name.pop(name, None) is None:
            return
        if not self._by_name:
            self._events.pause(True)
        task = asyncio.get_running_loop().create_task(self._unmatch(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        log.debug("%s stopped watching the sandboxes", name)

    async def _unmatch(self, name: str) -> None:
        with contextlib.suppress(Exception):  # _Gone, or the bus itself
            await self._dbus("RemoveMatch", _left_rule(name))

    def on_signal(self, msg: Message) -> None:
        """Every signal the agent's connection receives (the gate passes them):
        a watcher's name that left the bus drops it."""
        if (msg.member == "NameOwnerChanged" and msg.sender == DBUS_NAME and self._by_name
                and len(msg.body) == 3 and msg.body[0] in self._by_name and not msg.body[2]):
            self.drop(msg.body[0])

    async def _dbus(self, member: str, arg: str) -> None:
        assert self.bus is not None
        reply = await self.bus.call(Message(destination=DBUS_NAME, path=DBUS_PATH,
                                            interface=DBUS_NAME, member=member, signature="s",
                                            body=[arg]))
        if reply is None or reply.message_type is MessageType.ERROR:
            raise _Gone(reply.error_name if reply is not None else "no reply")

    # --- telling -------------------------------------------------------------------------

    def _send(self, name: str, member: str, signature: str, body: list[Any]) -> None:
        if self.bus is None:
            return
        try:
            self.bus.send(Message(message_type=MessageType.SIGNAL, destination=name,
                                  path=OBJECT_PATH, interface=INTERFACE, member=member,
                                  signature=signature, body=body))
        except Exception as e:  # the connection is gone: nobody can be told
            log.info("%s not sent to %s: %s", member, name, e)

    def publish(self, event: SandboxEvent) -> None:
        """`SandboxChanged` to each watcher that may Show the sandbox, with the
        id as it knows it."""
        attachments = [[a.network, a.ifname, str(a.state), a.mac, list(a.addresses)]
                       for a in event.attachments]
        for w in list(self._by_name.values()):
            if Policy.may_show(w.caller, event.sandbox_id, event.owner):
                self._send(w.name, "SandboxChanged", SANDBOX_CHANGED,
                           [Policy.shown(w.caller, event.sandbox_id), str(event.change),
                            event.owner, attachments])

    def check(self, outcome: Outcome) -> None:
        """Checks listener: AttachmentDrifted on each pass → fail transition of
        the plugin's own CHECK, AttachmentCheckChanged on every change of an
        attachment's check state after its baseline and every repair's outcome;
        to the watchers that may Show the sandbox."""
        drifted = outcome.drifted and not outcome.repair
        changed = outcome.changed or bool(outcome.repair)
        if not self._by_name or not (drifted or changed):
            return
        sid = outcome.sandbox_id
        try:
            owner = self._owner_of(sid)
        except Exception:  # a damaged record: its cache entries are root's, or the id space's
            owner = None
        reason = wire_text(outcome.reason)
        for w in list(self._by_name.values()):
            if not Policy.may_show(w.caller, sid, owner, cached=True):
                continue
            shown = Policy.shown(w.caller, sid)
            if drifted:
                self._send(w.name, "AttachmentDrifted", "ssss",
                           [shown, outcome.network, outcome.ifname, reason])
            if changed:
                self._send(w.name, "AttachmentCheckChanged", "sssss",
                           [shown, outcome.network, outcome.ifname, str(outcome.verdict), reason])


class _Gone(Exception):
    """The bus answered a call of ours with an error (the name is not there)."""
