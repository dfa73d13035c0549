"""One D-Bus connection, chosen by name: `system`, `session`, or an address.

Shared by the daemon and the CLI (the same `--bus` spellings on both sides).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from dbus_fast import BusType
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
    awaits are not logged as errors.

    dbus-fast (1.84 and 5.2 alike) finalizes a connection again whenever a send
    fails after it broke (the reply to a call that was in flight when the bus
    went away), and each time removes the loop's reader and writer of the fd
    number its socket had. By then that number may belong to another file: a
    plugin's pidfd, whose exit is then never seen — the plugin's reaper waits
    forever and the agent never exits.
    """

    def _finalize(self, err: Exception | None = None) -> None:
        # Every failed write ends here (dbus-fast sets the error on the send's
        # future, then finalizes). Nobody awaits a reply's or a signal's send,
        # and asyncio would log each such error when collected ("Future
        # exception was never retrieved"): an ERROR with a traceback per
        # message lost with the connection, at every node shutdown that stops
        # the bus first.
        if self._writer is not None:
            _retrieve(self._writer.fut)
        if self._disconnected:
            return
        super()._finalize(err)
        _retrieve(self._disconnect_future)  # its error too, when nobody waits for it

    async def connect(self) -> MessageBus:
        await super().connect()
        writer = self._writer
        assert writer is not None and writer.sock is not None  # connected
        writer.sock = _Patient(writer.sock)  # type: ignore[assignment]  # what it uses of one
        return self


def _retrieve(fut: asyncio.Future[Any] | None) -> None:
    """Mark a failed future's error retrieved; whoever awaits it still gets it."""
    if fut is not None and fut.done() and not fut.cancelled():
        fut.exception()


async def connect(bus: str) -> MessageBus:
    """Unix fds negotiated: a caller passes its namespace as a descriptor (netns_fd)."""
    if bus == "system":
        return await _Bus(bus_type=BusType.SYSTEM, negotiate_unix_fd=True).connect()
    if bus == "session":
        return await _Bus(bus_type=BusType.SESSION, negotiate_unix_fd=True).connect()
    return await _Bus(bus_address=bus, negotiate_unix_fd=True).connect()
