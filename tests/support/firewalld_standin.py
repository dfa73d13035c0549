"""A stand-in for firewalld on a test bus: owns org.fedoraproject.FirewallD1 and
emits its `Reloaded` signal on "reload" from stdin (answers "sent").

Usage: python firewalld_standin.py BUS_ADDRESS; prints "owned" once it owns the name.
"""

from __future__ import annotations

import asyncio
import sys

from dbus_fast import Message
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, signal

NAME = "org.fedoraproject.FirewallD1"


class FirewallD1(ServiceInterface):
    def __init__(self) -> None:
        super().__init__(NAME)

    # No return annotation: the signal has no arguments (dbus-fast 1.84, Debian's,
    # refuses "-> None"; 5.x takes either).
    @signal()
    def Reloaded(self):  # type: ignore[no-untyped-def]
        return None


async def main(address: str) -> None:
    bus = await MessageBus(bus_address=address).connect()
    iface = FirewallD1()
    bus.export("/org/fedoraproject/FirewallD1", iface)
    await bus.request_name(NAME)
    print("owned", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        if line.strip() == "reload":
            iface.Reloaded()
            # A round trip to the bus: the signal is on the wire before we answer.
            await bus.call(Message(destination="org.freedesktop.DBus",
                                   path="/org/freedesktop/DBus",
                                   interface="org.freedesktop.DBus.Peer", member="Ping"))
            print("sent", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
