"""One D-Bus connection, chosen by name: `system`, `session`, or an address.

Shared by the daemon and the CLI (the same `--bus` spellings on both sides).
"""

from __future__ import annotations

from dbus_fast import BusType
from dbus_fast.aio import MessageBus


class _Bus(MessageBus):
    """A connection that is finalized once.

    dbus-fast (1.84 and 5.2 alike) finalizes a connection again whenever a send
    fails after it broke (the reply to a call that was in flight when the bus
    went away), and each time removes the loop's reader and writer of the fd
    number its socket had. By then that number may belong to another file: a
    plugin's pidfd, whose exit is then never seen — the plugin's reaper waits
    forever and the agent never exits.
    """

    def _finalize(self, err: Exception | None = None) -> None:
        if self._disconnected:
            return
        super()._finalize(err)


async def connect(bus: str) -> MessageBus:
    """Unix fds negotiated: a caller passes its namespace as a descriptor (netns_fd)."""
    if bus == "system":
        return await _Bus(bus_type=BusType.SYSTEM, negotiate_unix_fd=True).connect()
    if bus == "session":
        return await _Bus(bus_type=BusType.SESSION, negotiate_unix_fd=True).connect()
    return await _Bus(bus_address=bus, negotiate_unix_fd=True).connect()
