"""Attach and Detach over D-Bus: one network at a time, on new and existing sandboxes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unique_name
from tests.daemon.conftest import plug
from tests.support.agent import Agent, options
from tests.support.net import addresses, allocations, delete_link
from tests.support.plugins import Control, conflist, write_conf

pytestmark = pytest.mark.root


@pytest.fixture
def two_networks(tmp_path: Path, control: Control) -> Iterator[Callable[..., None]]:
    """"red" and "blue": bridge + host-local each; "blue" ends with the test plugin."""
    bridges: list[str] = []

    def write(blue_extra: list[dict[str, Any]] | None = None) -> None:
        for i, name in enumerate(("red", "blue")):
            br = unique_name("cab")
            bridges.append(br)
            plugins: list[dict[str, Any]] = [
                {"type": "bridge", "bridge": br, "isGateway": True, "ipMasq": False,
                 "ipam": {"type": "host-local", "subnet": f"10.23{i}.0.0/24",
                          "dataDir": str(tmp_path / "ipam")}}]
            if name == "blue":
                plugins += blue_extra or [plug(control)]
            write_conf(tmp_path / "net.d", f"1{i}-{name}.conflist", conflist(name, plugins, "1.0.0"))

    yield write
    for br in bridges:
        delete_link(br)


def attach(agent: Agent, sid: str, netns: str, network: str, ifname: str,
           **kw: Any) -> dict[str, Any]:
    reply = agent.call("Attach", "ssssa{sv}", sid, netns, network, ifname, *options(), **kw)
    return json.loads(reply[0])  # type: ignore[no-any-return]


def test_attachments_are_added_and_removed_one_at_a_time(
    make_agent: Callable[..., Agent], two_networks: Callable[..., None], netns: str,
    tmp_path: Path,
) -> None:
    two_networks()
    agent = make_agent()
    red = attach(agent, "multi", netns, "red", "eth0")["attachments"][0]
    blue = attach(agent, "multi", netns, "blue", "net1")["attachments"][0]
    red_ip, blue_ip = (a["result"]["ips"][0]["address"] for a in (red, blue))
    assert (addresses(netns), addresses(netns, "net1")) == ([red_ip], [blue_ip])
    shown = json.loads(agent.call("Show", "s", "multi")[0])
    assert [(a["network"], a["ifname"]) for a in shown["attachments"]] == [
        ("red", "eth0"), ("blue", "net1")]
    # An identical repeat is the cached result; a different network on eth0 is refused.
    assert attach(agent, "multi", netns, "red", "eth0")["attachments"][0] == red
    out = agent.busctl("call", "org.cniagent.Agent1", "/org/cniagent/Agent1",
                       "org.cniagent.Agent1", "Attach", "ssssa{sv}", "multi", netns, "blue",
                       "eth0", "0", check=False)
    assert "InvalidArgument" in out.stderr or "already has eth0" in out.stderr, out.stderr

    agent.call("Detach", "ssssa{sv}", "multi", netns, "red", "eth0", "0")
    assert (addresses(netns), addresses(netns, "net1")) == ([], [blue_ip])
    assert allocations(tmp_path / "ipam", "red") == []
    assert allocations(tmp_path / "ipam", "blue") == [blue_ip.split("/")[0]]
    agent.call("Detach", "ssssa{sv}", "multi", netns, "red", "eth0", "0")  # again: nothing, ok
    # Detach naming another network than the one on net1 leaves it alone.
    agent.call("Detach", "ssssa{sv}", "multi", netns, "red", "net1", "0")
    assert addresses(netns, "net1") == [blue_ip]
    agent.call("Teardown", "ssa{sv}", "multi", netns, "0")
    assert addresses(netns, "net1") == [] and allocations(tmp_path / "ipam", "blue") == []
    assert agent.call("ListSandboxes")[0] == []


def test_attach_to_a_sandbox_made_by_setup_and_in_another_netns(
    make_agent: Callable[..., Agent], two_networks: Callable[..., None],
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    two_networks()
    agent = make_agent()
    first, other = netns_factory(), netns_factory()
    agent.setup("pod", first, networks=[("red", "eth0")])
    attach(agent, "pod", first, "blue", "net1")
    assert len(addresses(first)) == len(addresses(first, "net1")) == 1
    out = agent.busctl("call", "org.cniagent.Agent1", "/org/cniagent/Agent1",
                       "org.cniagent.Agent1", "Attach", "ssssa{sv}", "pod", other, "blue",
                       "net2", "0", check=False)
    assert out.returncode != 0 and f"is already set up in netns {first}" in out.stderr
    assert addresses(other) == []
    agent.call("Teardown", "ssa{sv}", "pod", first, "0")
    assert addresses(first) == addresses(first, "net1") == []
    assert allocations(tmp_path / "ipam", "red") == allocations(tmp_path / "ipam", "blue") == []


def test_a_failed_attach_is_rolled_back_and_leaves_the_others(
    make_agent: Callable[..., Agent], two_networks: Callable[..., None], netns: str,
    control: Control, tmp_path: Path,
) -> None:
    two_networks()
    agent = make_agent()
    red_ip = attach(agent, "pod", netns, "red", "eth0")["attachments"][0]["result"]["ips"][0]
    control.set("ADD", "fail", code=7, msg="no room at the inn")
    out = agent.busctl("call", "org.cniagent.Agent1", "/org/cniagent/Agent1",
                       "org.cniagent.Agent1", "Attach", "ssssa{sv}", "pod", netns, "blue",
                       "net1", "0", check=False)
    assert "PluginFailed" in out.stderr or "no room at the inn" in out.stderr, out.stderr
    assert addresses(netns) == [red_ip["address"]]
    assert allocations(tmp_path / "ipam", "blue") == []  # the bridge's ADD was undone
    assert "DEL" in control.commands()
    shown = json.loads(agent.call("Show", "s", "pod")[0])
    assert [(a["network"], a["ifname"]) for a in shown["attachments"]] == [("red", "eth0")]
    assert shown["state"] == "ready"
