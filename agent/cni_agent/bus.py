"""One D-Bus connection, chosen by name: `system`, `session`, or an address.

Shared by the daemon and the CLI (the same `--bus` spellings on both sides).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from dbus_fast import BusType, Message
from dbus_fast.aio import MessageBus


class _Patient:
    """The connection's socket as dbus-fast's writer sees it.

    dbus-fast (1.84 and 5.2 alike) writes a message at once when nothing is
    queued, and a send the kernel cannot take now (EAGAIN: a burst of
    replies, such as the tarpit's Busy answers coming due together, faster
    than the bus reads them) ends the connection. Here such a send writes
    nothing, as a short write would: the writer then waits for the socket to
    be writable and goes on. (`sendmsg`, used only for messages carrying
    descriptors, is the socket's own: none of ours does.)
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def send(self, data: Any) -> int:
        try:
            return self._sock.send(data)
        except BlockingIOError:
            return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _Bus(MessageBus):
    """A connection that is finalized once, and whose failed sends nobody
    awaits are not logged as errors (`send`).

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

    def send(self, msg: Message) -> asyncio.Future[None]:  # type: ignore[override]
        """As dbus-fast's (its few lines: the future must have its callback
        before the write, which may fail and raise at once). A failed send
        nobody awaits (a reply, a signal: the connection broke) is then not
        logged as "Future exception was never retrieved" when collected, an
        ERROR with a traceback per message in the agent's log at a node's
        shutdown: the disconnect says it once."""
        if not msg.serial:
            msg.serial = self.next_serial()
        sent: asyncio.Future[None] = self._loop.create_future()
        sent.add_done_callback(_retrieved)
        assert self._writer is not None
        self._writer.schedule_write(msg, sent)
        return sent

    async def connect(self) -> MessageBus:
        await super().connect()
        writer = self._writer
        assert writer is not None and writer.sock is not None  # connected
        writer.sock = _Patient(writer.sock)  # type: ignore[assignment]  # what it uses of one
        # Its error too, when the connection broke and nobody waits for it.
        self._disconnect_future.add_done_callback(_retrieved)
        return self


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # marks it retrieved; whoever awaits it still gets it


async def connect(bus: str) -> MessageBus:
    """Unix fds negotiated: a caller passes its namespace as a descriptor (netns_fd)."""
    if bus == "system":
        return await _Bus(bus_type=BusType.SYSTEM, negotiate_unix_fd=True).connect()
    if bus == "session":
        return await _Bus(bus_type=BusType.SESSION, negotiate_unix_fd=True).connect()
    return await _Bus(bus_address=bus, negotiate_unix_fd=True).connect()
