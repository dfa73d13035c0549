"""firewalld as a neighbour: its reloads and restarts trigger a CHECK pass.

`firewall-cmd --reload` (the `Reloaded` signal) and a restart (a new owner of
its bus name) drop the runtime rules the `firewall` plugin added for each
pod, and nothing would tell. A pass right after finds them (drift.py).
Signals are taken only from the current owner of the name, so another
process cannot make us run passes by sending a look-alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

log = logging.getLogger(__name__)

FIREWALLD = "org.fedoraproject.FirewallD1"
_DBUS = "org.freedesktop.DBus"
RULES = (
    f"type='signal',sender='{FIREWALLD}',interface='{FIREWALLD}',member='Reloaded'",
    f"type='signal',sender='{_DBUS}',interface='{_DBUS}',member='NameOwnerChanged',"
    f"arg0='{FIREWALLD}'",
)


class FirewalldWatch:
    def __init__(self, bus: MessageBus, trigger: Callable[[str], None]) -> None:
        self.bus = bus
        self.trigger = trigger
        self.owner = ""  # firewalld's unique name, "" while it is not running

    async def start(self) -> None:
        """Subscribe; a bus that refuses is logged, never fatal (no firewalld, no trigger)."""
        self.bus.add_message_handler(self._on_message)
        for rule in RULES:
            reply = await self.bus.call(Message(destination=_DBUS, path="/org/freedesktop/DBus",
                                                interface=_DBUS, member="AddMatch",
                                                signature="s", body=[rule]))
            if reply is None or reply.message_type is MessageType.ERROR:
                log.warning("cannot watch firewalld (AddMatch refused: %s); its reloads will "
                            "not trigger CHECKs", reply.body if reply else "no reply")
                return
        reply = await self.bus.call(Message(destination=_DBUS, path="/org/freedesktop/DBus",
                                            interface=_DBUS, member="GetNameOwner",
                                            signature="s", body=[FIREWALLD]))
        if reply is not None and reply.message_type is MessageType.METHOD_RETURN:
            self.owner = str(reply.body[0])

    def stop(self) -> None:
        self.bus.remove_message_handler(self._on_message)

    def _on_message(self, msg: Message) -> None:
        if msg.message_type is not MessageType.SIGNAL:
            return
        if msg.interface == _DBUS and msg.member == "NameOwnerChanged" and \
                msg.sender == _DBUS and msg.body and msg.body[0] == FIREWALLD:
            self.owner = str(msg.body[2])
            if self.owner:
                log.info("firewalld (re)started: a CHECK pass runs now")
                self.trigger("firewalld started")
        elif msg.interface == FIREWALLD and msg.member == "Reloaded" and self.owner and \
                msg.sender == self.owner:
            log.info("firewalld reloaded: a CHECK pass runs now")
            self.trigger("firewalld reloaded")
