"""A watcher of the agent's sandboxes, as a real D-Bus client: a dbus-fast
connection on a loop in a background thread that calls WatchSandboxes and
keeps every signal the agent sends it (unicast: nobody else receives them).

`follow=True` calls WatchSandboxes again each time the agent takes its name
(started after the watcher, or restarted), as `cni-agent events` does.
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
DBUS = "org.freedesktop.DBus"
SIGNALS = ("SandboxChanged", "AttachmentDrifted", "AttachmentCheckChanged")


class Watcher:
    def __init__(self, address: str, *, watch: bool = True, follow: bool = False) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.signals: list[tuple[str, list[Any]]] = []  # (member, body), in arrival order
        self.lock = threading.Lock()
        self.follow = follow
        self.bus: MessageBus = self._run(self._connect(address))
        self.name = str(self.bus.unique_name)
        if follow:
            self._run(self._dbus("AddMatch", f"type='signal',sender='{DBUS}',interface='{DBUS}',"
                                             f"member='NameOwnerChanged',arg0='{NAME}'"))
        if watch:
            err, text = self.watch()
            if err is not None and not (follow and err.endswith("ServiceUnknown")):
                raise AssertionError(f"WatchSandboxes: {err}: {text}")

    async def _connect(self, address: str) -> MessageBus:
        bus = await MessageBus(bus_address=address).connect()
        bus.add_message_handler(self._on_message)
        return bus

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _dbus(self, member: str, arg: str) -> Message | None:
        return await self.bus.call(Message(destination=DBUS, path="/org/freedesktop/DBus",
                                           interface=DBUS, member=member, signature="s",
                                           body=[arg]))

    async def _watch(self) -> tuple[str | None, str]:
        reply = await self.bus.call(Message(destination=NAME, path=PATH, interface=IFACE,
                                            member="WatchSandboxes"))
        assert reply is not None
        if reply.message_type is MessageType.ERROR:
            return reply.error_name, str(reply.body[0]) if reply.body else ""
        return None, ""

    def watch(self) -> tuple[str | None, str]:
        """WatchSandboxes: (None, "") or (error name, message)."""
        return self._run(self._watch())

    def _on_message(self, msg: Message) -> None:
        if msg.message_type is not MessageType.SIGNAL:
            return
        if msg.path == PATH and msg.interface == IFACE and msg.member in SIGNALS:
            with self.lock:
                self.signals.append((str(msg.member), list(msg.body)))
        elif self.follow and msg.member == "NameOwnerChanged" and msg.body[0] == NAME \
                and msg.body[2]:
            self.loop.create_task(self._watch())

    # --- what it received ------------------------------------------------------------

    def changes(self) -> list[dict[str, Any]]:
        """Each SandboxChanged, as {"sandbox", "change", "owner", "attachments":
        [{"network", "ifname", "state", "mac", "addresses"}]}."""
        with self.lock:
            bodies = [b for m, b in self.signals if m == "SandboxChanged"]
        return [{"sandbox": sid, "change": change, "owner": owner,
                 "attachments": [{"network": n, "ifname": i, "state": st, "mac": mac,
                                  "addresses": list(addrs)} for n, i, st, mac, addrs in atts]}
                for sid, change, owner, atts in bodies]

    @property
    def lines(self) -> list[str]:
        """The signals as `gdbus monitor` prints them: `PATH: IFACE.Member (args)`."""
        with self.lock:
            return [f"{PATH}: {IFACE}.{m} {tuple(b)!r}" for m, b in self.signals]

    def drifted(self) -> list[str]:
        return [line for line in self.lines if "AttachmentDrifted" in line]

    def stop(self) -> None:
        self.close()

    def close(self) -> None:
        self.bus.disconnect()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
