"""The readiness listener when the bus connection broke under it (a node shutdown
stops dbus alongside the agent): no exception, the state kept, nothing lost for
the other listeners."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
from dbus_fast.aio import MessageBus

from cni_agent.auth import Authorizer
from cni_agent.dbus_service import OBJECT_PATH, AgentInterface
from cni_agent.monitor import NetworkState
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
    async def scenario() -> None:
        bus = Bus("system")
        node = Node(tmp_path)
        await node.start()
        conn = await MessageBus(bus_address=bus.address).connect()
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
