"""Callers own their sandboxes: a member of the access group reaches only
namespaces it can open itself, and only its own sandboxes.

A real user made by the test, in the configured group, runs the real CLI with
its own uid and groups (the system python and a readable copy of the source);
the bus is permissive, so the daemon's own checks decide.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.agent import Agent, Bus, as_member, member_cli, readable_source
from tests.support.net import addresses, allocations
from tests.support.plugins import wait_for
from tests.support.state import record

pytestmark = pytest.mark.root

ERR = "org.cniagent.Agent1.Error."


def cli(agent: Agent, user: str, *args: str) -> subprocess.CompletedProcess[str]:
    return member_cli(agent.bus.address, user, *args)


def own_netns(user: str) -> subprocess.Popen[str]:
    """A namespace the member made itself (a user namespace of its own around it)."""
    proc = subprocess.Popen([*as_member(user), "unshare", "-U", "-r", "-n", "sleep", "120"],
                            text=True)
    wait_for(lambda: os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net"),
             timeout=5)
    return proc


def root_netns() -> subprocess.Popen[str]:
    proc = subprocess.Popen(["unshare", "-n", "sleep", "120"], text=True)
    wait_for(lambda: os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net"),
             timeout=5)
    return proc


def links(pid: int) -> list[str]:
    out = subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", "-j", "link"],
                         capture_output=True, text=True, check=True)
    return [link["ifname"] for link in json.loads(out.stdout)]


@pytest.fixture
def member_agent(make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str,
                 member: str) -> Agent:
    return make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods"]})


def test_a_member_cannot_reach_a_namespace_it_cannot_open_itself(
    member_agent: Agent, member: str, tmp_path: Path,
) -> None:
    target = root_netns()
    try:
        path = f"/proc/{target.pid}/ns/net"
        # The CLI opens the path with the member's rights, as it must.
        out = cli(member_agent, member, "setup", "m1", path)
        assert out.returncode == 4 and "cannot open: Permission denied" in out.stderr, out
        # Straight to the bus, with the path only: the agent does not open it for it.
        out = member_agent.gdbus("Setup", "m1", path, "{}", user=member)
        assert ERR + "AccessDenied" in out.stderr and "netns_fd" in out.stderr, out.stderr
        out = member_agent.gdbus("Attach", "m1", path, "", "eth0", "{}", user=member)
        assert ERR + "AccessDenied" in out.stderr, out.stderr
        assert links(target.pid) == ["lo"]  # untouched
        assert allocations(tmp_path / "ipam", "pods") == []
        # Its own descriptor with another's path: the path is only a label (never
        # opened: issue 44, item 6), so the Setup is of the member's own namespace.
        mine = own_netns(member)
        try:
            probe = textwrap.dedent(f"""
                import asyncio, os, sys
                sys.path.insert(0, {str(readable_source())!r})
                from cni_agent.cli.client import AgentClient, SetupOptions
                from cni_agent.cli import client
                client.open_netns = lambda path, **kw: os.open("/proc/{mine.pid}/ns/net",
                                                               os.O_RDONLY)
                async def main():
                    c = await AgentClient.connect({member_agent.bus.address!r})
                    try:
                        await c.setup("m1", {path!r}, SetupOptions())
                        print("set up")
                        await c.teardown("m1", {path!r})
                        print("torn down")
                    except Exception as e:
                        print(e)
                asyncio.run(main())
            """)
            out = subprocess.run([*as_member(member), "/usr/bin/python3", "-I", "-c", probe],
                                 capture_output=True, text=True, timeout=60)
            assert out.stdout.split("\n")[:2] == ["set up", "torn down"], out
            assert links(target.pid) == ["lo"]
            assert allocations(tmp_path / "ipam", "pods") == []
        finally:
            mine.kill()
    finally:
        target.kill()


def test_a_member_sets_up_and_tears_down_its_own_namespace(
    member_agent: Agent, member: str, tmp_path: Path,
) -> None:
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        out = cli(member_agent, member, "setup", "m2", path)
        assert out.returncode == 0, out
        print(f"member: cni-agent setup m2 {path}\n{out.stdout}")
        assert "eth0" in links(mine.pid)
        assert len(allocations(tmp_path / "ipam", "pods")) == 1
        assert cli(member_agent, member, "list").stdout.split() == ["m2"]
        uid = pwd.getpwnam(member).pw_uid
        shown = json.loads(member_agent.call("Show", "s", f"cni-agent.u{uid}.m2")[0])
        assert shown["attachments"][0]["ifname"] == "eth0"
        assert json.loads(cli(member_agent, member, "show", "m2", "--json").stdout)["sandbox"] == "m2"
        # Its ids are its own: on disk (and to root) they carry its uid.
        rec = record(tmp_path / "state", f"cni-agent.u{uid}.m2")
        assert rec is not None
        assert rec["owner"] == uid and rec["sandbox"] == f"cni-agent.u{uid}.m2"
        assert member_agent.call("ListSandboxes")[0] == [f"cni-agent.u{uid}.m2"]
        # While a process is in its namespace, its Teardown needs it again
        # (issue 44, item 6): refused, nothing changed.
        out = cli(member_agent, member, "teardown", "m2")
        assert out.returncode == 2 and "netns_fd" in out.stderr and "still in use" in out.stderr, out
        assert "eth0" in links(mine.pid) and len(allocations(tmp_path / "ipam", "pods")) == 1
        out = cli(member_agent, member, "teardown", "m2", path)
        assert out.returncode == 0, out
        assert links(mine.pid) == ["lo"] and allocations(tmp_path / "ipam", "pods") == []
    finally:
        mine.kill()


def test_roots_sandboxes_are_not_a_members_to_see_or_touch(
    member_agent: Agent, member: str, netns: str, tmp_path: Path,
) -> None:
    """A member's ids are its own: naming root's sandbox reaches nothing of root's."""
    member_agent.setup("rootpod", netns)
    out = cli(member_agent, member, "show", "rootpod")
    assert out.returncode == 4 and "access denied" in out.stderr, out
    assert "rootpod is not one of uid" in out.stderr
    # Its Check passes root's namespace as its descriptor (issue 44, item 6):
    # refused for the namespace first, before any sandbox is looked at.
    out = cli(member_agent, member, "check", "rootpod", netns)
    assert out.returncode == 4 and "may only configure a network namespace" in out.stderr, out
    # The same words for an id that does not exist: nothing is given away.
    nothing = cli(member_agent, member, "show", "nosuchpod")
    assert nothing.stderr.replace("nosuchpod", "X") == \
        cli(member_agent, member, "show", "rootpod").stderr.replace("rootpod", "X")
    # Its Teardown and Detach of "rootpod" are of its own (nothing): root's stays.
    assert cli(member_agent, member, "teardown", "rootpod").returncode == 0
    out = member_agent.gdbus("Detach", "rootpod", "", "", "eth0", "{}", member=member)
    assert out.returncode == 0, out.stderr
    # A member's GC list speaks for its own sandboxes only.
    out = member_agent.gdbus("GarbageCollect", "@as []", member=member)
    assert out.returncode == 0, out.stderr
    assert cli(member_agent, member, "list").stdout.split() == []
    assert member_agent.call("ListSandboxes")[0] == ["rootpod"]
    assert len(addresses(netns)) == 1 and len(allocations(tmp_path / "ipam", "pods")) == 1
    assert json.loads(member_agent.call("Show", "s", "rootpod")[0])["state"] == "ready"


def test_callers_outside_the_group_are_bounded(
    make_agent: Callable[..., Agent], permissive_bus: Bus, member: str,
) -> None:
    agent = make_agent(bus=permissive_bus, access={"groups": [member]})  # no network: not ready
    probe = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {str(readable_source())!r})
        from dbus_fast import Message
        from cni_agent.bus import connect
        async def main():
            bus = await connect({agent.bus.address!r})
            def call(member, sig, body):
                return bus.call(Message(destination="org.cniagent.Agent1",
                    path="/org/cniagent/Agent1", interface="org.cniagent.Agent1",
                    member=member, signature=sig, body=body))
            big = await call("CNICall", "a{{ss}}s",
                             [{{"CNI_COMMAND": "STATUS"}}, '{{"x": "' + "a" * 70000 + '"}}'])
            print("big", big.error_name, big.body)
            waits = [asyncio.ensure_future(call("WaitReady", "d", [3.0])) for _ in range(9)]
            replies = await asyncio.gather(*waits)
            print("waits", sorted(str(r.error_name) for r in replies))
        asyncio.run(main())
    """)
    gid = grp.getgrnam("nogroup").gr_gid
    out = subprocess.run(["setpriv", "--reuid=nobody", f"--regid={gid}", "--clear-groups",
                          "/usr/bin/python3", "-I", "-c", probe],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out
    big, waits = out.stdout.splitlines()
    assert ERR + "InvalidArgument" in big and "65536 bytes" in big, big
    assert waits.split(" ", 1)[1] == str(sorted([ERR + "Busy"] + ["None"] * 8)), waits
