"""The readiness listener when the bus connection broke under it (a node shutdown
stops dbus alongside the agent): no exception, the state kept, nothing lost for
the other listeners."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import signal
import time
from pathlib import Path

import pytest
from dbus_fast import Message

from cni_agent.api import OBJECT_PATH
from cni_agent.bus import connect
from cni_agent.readiness.monitor import NetworkState
from cni_agent.service.auth import Authorizer
from cni_agent.service.dbus_service import AgentInterface
from tests.support.agent import Bus
from tests.unit.test_orchestration import Node

pytestmark = pytest.mark.root


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].startswith("Z")
    except FileNotFoundError:
        return True


def test_a_state_change_on_a_broken_connection_is_kept_and_does_not_raise(tmp_path: Path) -> None:
    unretrieved: list[str] = []

    async def scenario() -> None:
        # The sends that failed must not end as "Future exception was never
        # retrieved" errors in the agent's log when they are collected.
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: unretrieved.append(context["message"]))
        bus = Bus("system")
        node = Node(tmp_path)
        await node.start()
        conn = await connect(bus.address)  # the agent's own kind of connection
        iface = AgentInterface(node.manager, node.core.monitor, node.core.pod_cidrs,
                               Authorizer(conn, ()), lambda: asyncio.sleep(0),
                               shim=node.core.shim)
        conn.export(OBJECT_PATH, iface)
        seen: list[NetworkState] = []
        node.core.monitor.subscribe(iface.on_state)
        node.core.monitor.subscribe(seen.append)
        try:
            os.kill(bus.pid, signal.SIGKILL)
            # Blocking on purpose: the connection's reader must not notice first,
            # as it does not when the change comes in the same loop iteration.
            deadline = time.monotonic() + 5
            while not _dead(bus.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            state = node.core.monitor.state
            changed = dataclasses.replace(state, ready=not state.ready, status="gone")
            iface.on_state(changed)  # must not raise
            assert iface.NetworkReady == changed.ready  # type: ignore[comparison-overlap]
            assert iface.Status == "gone"  # type: ignore[comparison-overlap]
            # Through the monitor: every listener after the failing one still hears it.
            node.core.monitor.begin_shutdown()
            assert seen and seen[-1].ready is False
        finally:
            conn.disconnect()
            bus.stop()
            await node.stop()

    asyncio.run(scenario())
    gc.collect()  # the connection, its writer and what it failed to send
    assert unretrieved == []


def test_a_send_after_the_bus_broke_leaves_the_fd_number_s_new_owner_alone() -> None:
    """A reply sent after the connection broke must not remove the loop's reader
    of whatever file reuses the socket's fd number (a plugin's pidfd in the
    agent: its exit was then never seen, and the agent never exited)."""

    async def scenario() -> None:
        bus = Bus("system")
        try:
            conn = await connect(bus.address)
            fd = conn._fd
            os.kill(bus.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.wait_for_disconnect(), 5)
            # The socket's number now names another file, as a pidfd opened next would.
            r, w = os.pipe()
            os.dup2(r, fd)
            loop = asyncio.get_running_loop()
            readable = asyncio.Event()
            loop.add_reader(fd, readable.set)
            try:
                sent = conn.send(Message(destination="org.freedesktop.DBus",
                                         path="/org/freedesktop/DBus",
                                         interface="org.freedesktop.DBus", member="GetId"))
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(sent, 1)
                os.write(w, b"x")
                await asyncio.wait_for(readable.wait(), 2)  # the reader is still there
            finally:
                loop.remove_reader(fd)
                for n in (fd, r, w):
                    with contextlib.suppress(OSError):
                        os.close(n)
        finally:
            bus.stop()

    asyncio.run(scenario())
