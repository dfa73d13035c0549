"""Callers outside the access group: bounded, and never a reason to hold the agent up.

A stranger (a user made by the test, or nobody) may read the agent's state;
it may not hold a shutdown up, make it wait for polkit, or flood it past its
rate without being slowed down.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.agent import Agent, Bus, as_user, readable_source

pytestmark = pytest.mark.root
ERR = "org.cniagent.Agent1.Error."


def stranger(address: str, body: str) -> subprocess.Popen[str]:
    """`body` (inside `async def main(bus, call)`) run as nobody, in the background."""
    code = textwrap.dedent("""
        import asyncio, sys, time
        sys.path.insert(0, {src!r})
        from dbus_fast import Message, MessageFlag, MessageType
        from cni_agent.bus import connect
        async def run():
            bus = await connect({address!r})
            async def call(member, sig="", body=(), iface="org.cniagent.Agent1", flags=0):
                reply = await bus.call(Message(destination="org.cniagent.Agent1",
                    path="/org/cniagent/Agent1", interface=iface, member=member,
                    signature=sig, body=list(body), flags=flags))
                return reply.error_name if reply.message_type is MessageType.ERROR else None
            await main(bus, call)
        """).format(src=str(readable_source()), address=address)
    code += textwrap.dedent(body) + "\nasyncio.run(run())\n"
    return subprocess.Popen([*as_user("nobody"), "/usr/bin/python3", "-I", "-c", code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def own_bus() -> Iterator[Bus]:
    """A permissive bus of this test's own (it plays polkit on it)."""
    bus = Bus("permissive")
    yield bus
    bus.stop()


def test_strangers_calls_never_hold_the_drain_up(
    make_agent: Callable[..., Agent], permissive_bus: Bus, testnet: Callable[..., Path],
) -> None:
    testnet()
    agent = make_agent(bus=permissive_bus, shutdown_drain=30)
    poller = stranger(agent.bus.address, """
        async def main(bus, call):
            while True:  # refused calls and reads, every 0.2 s, until the agent is gone
                await call("Setup", "ssa{sv}", ["x", "/run/netns/x", {}])
                await call("WaitReady", "d", [0.0])
                await asyncio.sleep(0.2)
        """)
    try:
        time.sleep(1)
        assert poller.poll() is None, poller.communicate()
        start = time.monotonic()
        assert agent.stop(timeout=60) == 0
        elapsed = time.monotonic() - start
        # Idle but for a stranger: the drain's quiet second, not shutdown_drain's 30 s.
        assert elapsed < 15, f"the drain waited {elapsed:.1f}s for a stranger's calls"
        assert "the drain ends after" in agent.log()
    finally:
        poller.kill()
        poller.communicate()


POLKIT_THAT_NEVER_ANSWERS = textwrap.dedent("""
    import asyncio, sys
    from dbus_fast.aio import MessageBus
    from dbus_fast.service import ServiceInterface, method
    class Authority(ServiceInterface):
        @method()
        async def CheckAuthorization(self, subject: "(sa{sv})", action_id: "s",
                                     details: "a{ss}", flags: "u", cancel: "s") -> "(bba{ss})":
            print("asked", action_id, flags, flush=True)
            await asyncio.sleep(3600)  # a person who never types the password
            return [False, False, {}]
    async def main():
        bus = await MessageBus(bus_address=sys.argv[1]).connect()
        bus.export("/org/freedesktop/PolicyKit1/Authority",
                   Authority("org.freedesktop.PolicyKit1.Authority"))
        await bus.request_name("org.freedesktop.PolicyKit1")
        print("ready", flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
    """)


def test_a_stranger_waiting_for_polkit_is_answered_at_shutdown(
    make_agent: Callable[..., Agent], own_bus: Bus, testnet: Callable[..., Path],
) -> None:
    """An interactive authorization nobody completes holds neither the caller
    nor the shutdown: SIGTERM answers it ShuttingDown and the agent exits."""
    testnet()
    polkitd = subprocess.Popen([sys.executable, "-c", POLKIT_THAT_NEVER_ANSWERS, own_bus.address],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert polkitd.stdout is not None and polkitd.stdout.readline().strip() == "ready"
        agent = make_agent(bus=own_bus, shutdown_drain=30)
        caller = stranger(agent.bus.address, """
            async def main(bus, call):
                flag = MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION
                t = time.monotonic()
                print(await call("Setup", "ssa{sv}", ["x", "/run/netns/x", {}], flags=flag),
                      round(time.monotonic() - t, 1), flush=True)
            """)
        # The agent asks polkit, interactively, and the caller waits for the answer.
        assert polkitd.stdout.readline().split() == ["asked", "org.cniagent.Agent1.manage", "1"]
        assert caller.poll() is None, caller.communicate()
        start = time.monotonic()
        assert agent.stop(timeout=60) == 0
        elapsed = time.monotonic() - start
        out, err = caller.communicate(timeout=30)
        assert out.split()[0] == ERR + "ShuttingDown", (out, err)
        assert elapsed < 15, f"shutdown waited {elapsed:.1f}s for polkit"
    finally:
        polkitd.kill()
        polkitd.communicate()


def test_a_strangers_flood_is_slowed_and_root_is_still_served(
    make_agent: Callable[..., Agent], permissive_bus: Bus, testnet: Callable[..., Path],
    netns: str,
) -> None:
    testnet()
    agent = make_agent(bus=permissive_bus)
    flood = stranger(agent.bus.address, """
        async def main(bus, call):
            async def one():
                return await call("Get", "ss", ["org.cniagent.Agent1", "NetworkReady"],
                                  iface="org.freedesktop.DBus.Properties")
            t = time.monotonic()
            answers = []
            for _ in range(10):
                answers += await asyncio.gather(*(one() for _ in range(60)))
            print(sum(a is None for a in answers), answers.count(
                "org.cniagent.Agent1.Error.Busy"), len(answers), round(time.monotonic() - t, 1))
        """)
    try:
        # Meanwhile root's calls are served as ever.
        for i in range(5):
            agent.setup(f"r{i}", netns, networks=[("testnet", f"e{i}")])
        out, err = flood.communicate(timeout=120)
        ok, busy, total, _seconds = out.split()
        assert int(total) == 600 and int(ok) + int(busy) == 600, (out, err)
        assert int(busy) > 0, out  # over its rate: Busy (after a while), never silence
        assert int(ok) >= 60, out  # its burst and rate are served
        assert len(agent.call("ListSandboxes")[0]) == 5
    finally:
        flood.kill()
