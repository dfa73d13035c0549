"""A synchronous D-Bus client for tests that make thousands of calls (hypothesis, soak).

A dbus-fast connection lives on an event loop in a background thread; calls
return the reply body or the error name and text, never raise.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from tests.support.agent import IFACE, NAME, PATH

T = TypeVar("T")
CLIENT_TIMEOUT = "client.Timeout"  # what a caller's own D-Bus timeout looks like here


class SyncClient:
    def __init__(self, address: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.bus: MessageBus = self._run(self._connect(address))

    @staticmethod
    async def _connect(address: str) -> MessageBus:
        return await MessageBus(bus_address=address).connect()  # needs the running loop

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, member: str, signature: str = "", body: list[Any] | None = None,
             interface: str = IFACE, timeout: float | None = None) -> tuple[str | None, Any]:
        """(None, body) on success, (error name, message) on failure; with `timeout`,
        (CLIENT_TIMEOUT, "") when no reply came in time (the call goes on in the agent)."""
        msg = Message(destination=NAME, path=PATH, interface=interface, member=member,
                      signature=signature, body=body or [])
        try:
            reply = self._run(asyncio.wait_for(self.bus.call(msg), timeout))
        except TimeoutError:
            return CLIENT_TIMEOUT, ""
        assert reply is not None
        if reply.message_type is MessageType.ERROR:
            text = reply.body[0] if reply.body else ""
            return reply.error_name, text
        return None, reply.body

    def close(self) -> None:
        self.bus.disconnect()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
