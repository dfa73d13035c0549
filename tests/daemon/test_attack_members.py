"""A member of the access group aimed at what is not its own: root's host ports,
another member's sandboxes, and its own bounds across a kill -9 of the agent.

Real users made by the test, the CLI run as them, real bridge + host-local
and namespaces each member made itself (unshare -U -r -n).
"""

from __future__ import annotations

import json
import pwd
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import unique_name
from tests.daemon.test_owners import cli, own_netns
from tests.support.agent import Agent, Bus
from tests.support.net import allocations

pytestmark = pytest.mark.root


@pytest.fixture
def second_member(member: str) -> Iterator[str]:
    """Another user in the same access group as `member`."""
    name = unique_name("cnin")[:30]
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    "-g", member, name], check=True)
    yield name
    subprocess.run(["pkill", "-KILL", "-u", name], check=False)
    subprocess.run(["userdel", name], check=False)


def test_a_member_never_maps_a_host_port_a_root_sandbox_maps(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str, member: str,
    netns: str, tmp_path: Path,
) -> None:
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods"],
                                                   "capabilities": ["portMappings"],
                                                   "host_ports": ["18080"]})
    ports = {"portMappings": [{"hostPort": 18080, "containerPort": 80, "protocol": "TCP"}]}
    agent.setup("rootpod", netns, capabilities=ports)
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        # The same port (root wrote "TCP", the member "tcp"): refused, nothing allocated.
        same = {"portMappings": [{"hostPort": 18080, "containerPort": 22, "protocol": "tcp"}]}
        out = cli(agent, member, "setup", "vm1", path, "--capabilities", json.dumps(same))
        assert out.returncode == 2 and "host port 18080/tcp is already mapped by another " \
            "sandbox" in out.stderr, out
        assert len(allocations(tmp_path / "ipam", "pods")) == 1  # root's alone
        # Another port, or the same number over udp, is the member's to map.
        udp = {"portMappings": [{"hostPort": 18080, "containerPort": 22, "protocol": "udp"}]}
        assert cli(agent, member, "setup", "vm1", path, "--capabilities",
                   json.dumps(udp)).returncode == 0
        assert cli(agent, member, "teardown", "vm1", path).returncode == 0
        # Once root's sandbox is gone, its port is free.
        agent.call("Teardown", "ssa{sv}", "rootpod", netns, "0")
        out = cli(agent, member, "setup", "vm1", path, "--capabilities", json.dumps(same))
        assert out.returncode == 0, out
        assert cli(agent, member, "teardown", "vm1", path).returncode == 0
    finally:
        mine.kill()


def test_a_member_reaches_nothing_of_another_members_sandboxes(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str, member: str,
    second_member: str, tmp_path: Path,
) -> None:
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods"]})
    alice, bob = member, second_member
    a_uid = pwd.getpwnam(alice).pw_uid
    hers = own_netns(alice)
    try:
        assert cli(agent, alice, "setup", "vm1", f"/proc/{hers.pid}/ns/net").returncode == 0
        full = f"cni-agent.u{a_uid}.vm1"
        # Bob names it as alice knows it, and as root knows it: neither is his.
        for name in ("vm1", full):
            out = cli(agent, bob, "show", name)
            assert out.returncode == 4 and "is not one of uid" in out.stderr, (name, out)
            assert cli(agent, bob, "teardown", name).returncode == 0  # his own: nothing
            out = agent.gdbus("Detach", name, "", "", "eth0", "{}", member=bob)
            assert out.returncode == 0, out.stderr
        # His GC with an empty list speaks for his sandboxes only.
        assert agent.gdbus("GarbageCollect", "@as []", member=bob).returncode == 0
        assert cli(agent, bob, "list").stdout.split() == []
        assert agent.call("ListSandboxes")[0] == [full]
        assert json.loads(agent.call("Show", "s", full)[0])["state"] == "ready"
        assert len(allocations(tmp_path / "ipam", "pods")) == 1
        assert cli(agent, alice, "teardown", "vm1", f"/proc/{hers.pid}/ns/net").returncode == 0
    finally:
        hers.kill()


def test_a_members_sandboxes_and_quota_outlive_a_kill_9_of_the_agent(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str, member: str,
    tmp_path: Path,
) -> None:
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods"],
                                                   "max_sandboxes": 1})
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        assert cli(agent, member, "setup", "vm1", path).returncode == 0
        assert agent.stop(signal.SIGKILL) == -signal.SIGKILL
        agent.start()
        assert agent.call("WaitReady", "d", "10")[0] is True
        # Still its own, and still counted: no second sandbox past the quota.
        assert cli(agent, member, "list").stdout.split() == ["vm1"]
        out = cli(agent, member, "setup", "vm2", path, "--network", "pods:eth1")
        assert out.returncode == 1 and "access.max_sandboxes allows (1)" in out.stderr, out
        shown = json.loads(cli(agent, member, "show", "vm1", "--json").stdout)
        assert shown["sandbox"] == "vm1" and shown["state"] == "ready", shown
        assert cli(agent, member, "teardown", "vm1", path).returncode == 0
        assert agent.call("ListSandboxes")[0] == []
        assert allocations(tmp_path / "ipam", "pods") == []
    finally:
        mine.kill()
