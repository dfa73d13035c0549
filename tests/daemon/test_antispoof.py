"""Members' attachments get anti-spoofing filters (issue 44, item 3), against a
live agent: real users, the CLI run as them, namespaces each member made
itself (unshare -U -r -n), a real bridge + host-local, real nftables, and
real traffic between the pods.
"""

from __future__ import annotations

import ctypes.util
import itertools
import json
import os
import pwd
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cni_agent.config import AgentConfig
from cni_agent.service.wiring import antispoof_table
from tests.daemon.conftest import bridge_plugins
from tests.daemon.test_drift import Monitor, StandIn
from tests.daemon.test_owners import cli, own_netns
from tests.support.agent import Agent, Bus
from tests.support.net import allocations, netns_name
from tests.support.plugins import Control, conflist, wait_for, write_conf
from tests.support.spoof import Pod, attack
from tests.support.stranger import Stranger, spec

pytestmark = pytest.mark.root


def table_of(agent: Agent) -> str:
    return antispoof_table(AgentConfig(state_dir=agent.config["state_dir"]))


_subnets = itertools.count()


@pytest.fixture
def bridge_chain(tmp_path: Path, control: Control, bridge_name: str) -> str:
    """conftest's "pods" on a subnet of its own: these tests send from the host to
    the pods, and other tests' bridges all hold 10.215.0.0/24 (the host's route
    would be any one of theirs)."""
    n = (os.getpid() + next(_subnets)) % 200 + 20
    write_conf(tmp_path / "net.d", "10-pods.conflist", conflist(
        "pods", bridge_plugins(tmp_path, control, bridge_name, f"172.30.{n}.0/24"), "1.0.0"))
    return "pods"


@pytest.fixture
def agents() -> list[Agent]:
    """The agents of a test (make_agent stops them and deletes their tables)."""
    return []


def start(make_agent: Callable[..., Agent], agents: list[Agent], bus: Bus, member: str,
          **config: Any) -> Agent:
    access = {"groups": [member], "networks": ["pods"], **config.pop("access", {})}
    agent = make_agent(bus=bus, access=access, **config)
    agents.append(agent)
    return agent


def ports(agent: Agent) -> dict[str, list[str]]:
    """The agent's table as nft shows it: each filtered veth and its chain's rules."""
    out = subprocess.run(["nft", "-j", "list", "table", "bridge", table_of(agent)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return {}
    found: dict[str, list[str]] = {}
    for item in json.loads(out.stdout)["nftables"]:
        for elem in item.get("map", {}).get("elem", ()):
            chain = subprocess.run(["nft", "list", "chain", "bridge", table_of(agent),
                                    elem[1]["jump"]["target"]], capture_output=True, text=True,
                                   check=True).stdout
            found[elem[0]] = [line.strip() for line in chain.splitlines() if " drop" in line]
    return found


def veth_mac_ip(result: dict[str, Any], bridge: str) -> tuple[str, str, str]:
    """The host veth, the pod's MAC and its IPv4 from a Setup's CNI result."""
    r = result["attachments"][0]["result"]
    ifaces = r["interfaces"]
    [veth] = [i["name"] for i in ifaces if not i.get("sandbox") and i["name"] != bridge]
    [pod] = [i for i in ifaces if i.get("sandbox") and i["name"] == "eth0"]
    return veth, pod["mac"], r["ips"][0]["address"].split("/")[0]


def member_setup(agent: Agent, member: str, sid: str, pid: int, *net: str) -> dict[str, Any]:
    args = ["--network", net[0]] if net else []
    out = cli(agent, member, "setup", sid, f"/proc/{pid}/ns/net", *args, "--json")
    assert out.returncode == 0, (out, agent.log()[-3000:])
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_a_members_bridge_attachment_is_filtered_from_setup_to_teardown(
    make_agent: Callable[..., Agent], agents: list[Agent], permissive_bus: Bus,
    bridge_chain: str, bridge_name: str, member: str, netns: str, tmp_path: Path,
) -> None:
    agent = start(make_agent, agents, permissive_bus, member)
    mine = own_netns(member)
    try:
        veth, mac, ip = veth_mac_ip(member_setup(agent, member, "vm1", mine.pid), bridge_name)
        rules = ports(agent)[veth]
        assert f"ether saddr != {mac} drop" in rules[0], rules
        assert any(f"arp saddr ip != {{ 0.0.0.0, {ip} }} drop" in r for r in rules), rules
        assert any(f"ip saddr != {ip} drop" in r for r in rules), rules
        # Root's pod on the same bridge: unfiltered by default (antispoof: members).
        root_veth, _, _ = veth_mac_ip(agent.setup("rootpod", netns), bridge_name)
        assert set(ports(agent)) == {veth}, root_veth
        assert cli(agent, member, "teardown", "vm1", f"/proc/{mine.pid}/ns/net").returncode == 0
        assert ports(agent) == {}
        assert len(allocations(tmp_path / "ipam", "pods")) == 1  # root's
    finally:
        mine.kill()


def test_antispoof_all_filters_roots_attachments_too(
    make_agent: Callable[..., Agent], agents: list[Agent], permissive_bus: Bus,
    bridge_chain: str, bridge_name: str, member: str, netns: str,
) -> None:
    agent = start(make_agent, agents, permissive_bus, member, antispoof="all")
    veth, mac, _ = veth_mac_ip(agent.setup("rootpod", netns), bridge_name)
    assert f"ether saddr != {mac} drop" in ports(agent)[veth][0]
    # Detach (the D-Bus DEL of one attachment) takes it away with the veth.
    agent.call("Detach", "ssssa{sv}", "rootpod", netns, "pods", "eth0", "0")
    assert ports(agent) == {}


def test_a_member_on_a_shared_bridge_cannot_take_a_root_pods_traffic(
    make_agent: Callable[..., Agent], agents: list[Agent], permissive_bus: Bus,
    bridge_chain: str, bridge_name: str, member: str, netns: str,
) -> None:
    """Issue 44's reproduction through the agent: root's pod A and a member's
    pod B on one bridge; B announces A's IP (gratuitous ARP), then takes A's
    MAC and IP, while the host sends 40 datagrams to A. With B's filters A
    gets all 40; with the filters gone (deleted as `nft flush ruleset` would)
    B takes them; the next CHECK pass restores the filters, reports drift,
    and A gets all 40 again."""
    agent = start(make_agent, agents, permissive_bus, member, check={"interval": 3600})
    _, _, a_ip = veth_mac_ip(agent.setup("rootpod", netns), bridge_name)
    a = Pod.named(netns_name(netns), "", a_ip)
    mine = own_netns(member)
    monitor = Monitor(permissive_bus)
    try:
        b_veth, b_mac, b_ip = veth_mac_ip(member_setup(agent, member, "vm1", mine.pid),
                                          bridge_name)
        b = Pod.of_pid(mine.pid, b_veth, b_ip)

        def undo() -> None:  # B as it was, and the host's neighbour entry for A forgotten
            b.run_ip("addr", "flush", "dev", "eth0", "to", f"{a_ip}/32")
            b.run_ip("link", "set", "dev", "eth0", "address", b_mac)
            subprocess.run(["ip", "neigh", "flush", "dev", bridge_name], check=False)

        for how in ("garp", "takeover"):
            tally = attack(a, b, how)
            assert (tally.to_a, tally.to_b) == (40, 0), (how, tally)
            undo()
        subprocess.run(["nft", "delete", "table", "bridge", table_of(agent)], check=True)
        tally = attack(a, b, "garp")
        assert tally.to_b >= 20 and tally.to_a < 40, tally  # without them, the spoof works
        undo()
        # A CHECK pass (asked for here; scheduled, or after a firewalld reload,
        # it is the same pass) finds the filter missing: drift, restored.
        agent.call("CheckSandboxes", "as", "0")
        assert b_veth in ports(agent)
        [signal] = wait_for(monitor.drifted, timeout=5)
        assert "anti-spoofing filter was missing (restored)" in signal, signal
        wait_for(lambda: "its anti-spoofing filter on" in agent.log(), timeout=5)
        tally = attack(a, b, "takeover")
        assert (tally.to_a, tally.to_b) == (40, 0), tally
    finally:
        monitor.stop()
        mine.kill()


def test_a_flushed_filter_is_restored_by_the_scheduled_pass(
    make_agent: Callable[..., Agent], agents: list[Agent], permissive_bus: Bus,
    bridge_chain: str, bridge_name: str, member: str,
) -> None:
    agent = start(make_agent, agents, permissive_bus, member, check={"interval": 1})
    mine = own_netns(member)
    try:
        veth, _, _ = veth_mac_ip(member_setup(agent, member, "vm1", mine.pid), bridge_name)
        before = ports(agent)[veth]
        subprocess.run(["nft", "flush", "chain", "bridge", table_of(agent), f"port-{veth}"],
                       check=True)
        assert ports(agent)[veth] == []
        wait_for(lambda: ports(agent).get(veth) == before, timeout=5)
        wait_for(lambda: "was altered (an nftables flush or reload?); restored" in agent.log(),
                 timeout=5)
    finally:
        mine.kill()


def test_a_network_the_agent_cannot_filter_reaches_members_only_when_unprotected(
    make_agent: Callable[..., Agent], agents: list[Agent], permissive_bus: Bus,
    testnet: Callable[..., Path], member: str,
) -> None:
    testnet("plain")  # the test plugin alone: no bridge to filter on
    agent = start(make_agent, agents, permissive_bus, member, access={"networks": ["plain"]})
    mine = own_netns(member)
    try:
        out = cli(agent, member, "setup", "vm1", f"/proc/{mine.pid}/ns/net")
        assert out.returncode == 4, out
        assert ("network plain cannot be protected against address spoofing here (its first "
                "plugin is 'testplug'") in out.stderr, out.stderr
        assert "access.unprotected_networks" in out.stderr
        assert agent.call("ListSandboxes")[0] == []
        agent.config["access"]["unprotected_networks"] = ["plain"]
        agent.write_config()
        agent.call("Reload")
        out = cli(agent, member, "setup", "vm1", f"/proc/{mine.pid}/ns/net")
        assert out.returncode == 0, out
        assert ports(agent) == {}
    finally:
        mine.kill()


def test_without_nftables_members_get_only_the_unprotected_networks(
    make_agent: Callable[..., Agent], agents: list[Agent], permissive_bus: Bus,
    bridge_chain: str, member: str, netns: str, tmp_path: Path,
) -> None:
    """libnftables unloadable for the agent alone (/dev/null mounted over it in
    a mount namespace of the agent's own): members are refused, saying why."""
    name = ctypes.util.find_library("nftables")
    assert name, "libnftables is not installed (tools/setup-system installs it)"
    lib = subprocess.run(["sh", "-c", f"ldconfig -p | awk '$1 == \"{name}\" {{print $NF}}'"],
                         capture_output=True, text=True, check=True).stdout.split()[0]
    agent = start(make_agent, agents, permissive_bus, member, start=False)
    agent.prefix = ["unshare", "-m", "--propagation", "slave", "sh", "-c",
                    f'mount --bind /dev/null {lib} && exec "$@"', "sh"]
    agent.start()
    assert agent.call("WaitReady", "d", "10")[0] is True
    mine = own_netns(member)
    try:
        out = cli(agent, member, "setup", "vm1", f"/proc/{mine.pid}/ns/net")
        assert out.returncode == 4, out
        assert "network pods cannot be protected against address spoofing here (nftables is " \
               "not available on this node: cannot load libnftables.so.1" in out.stderr, out.stderr
        assert allocations(tmp_path / "ipam", "pods") == []
        agent.setup("rootpod", netns)  # root is never refused a network for it
        agent.config["access"]["unprotected_networks"] = ["pods"]
        agent.write_config()
        agent.call("Reload")
        assert cli(agent, member, "setup", "vm1", f"/proc/{mine.pid}/ns/net").returncode == 0
        assert "anti-spoofing filters are unavailable" in agent.log()
    finally:
        mine.kill()


def test_a_filter_nftables_refuses_fails_the_setup_and_leaves_nothing(
    make_agent: Callable[..., Agent], agents: list[Agent], permissive_bus: Bus,
    bridge_chain: str, member: str, tmp_path: Path,
) -> None:
    """A table of the agent's name that is not the agent's shape (another tool
    made it: its `ports` is a set, not a map) makes every install fail: the
    member's Setup fails with that reason and is rolled back entirely."""
    agent = start(make_agent, agents, permissive_bus, member)
    t = table_of(agent)
    subprocess.run(["nft", "add", "table", "bridge", t], check=True)
    subprocess.run(["nft", "add", "set", "bridge", t, "ports", "{ type ifname; }"], check=True)
    mine = own_netns(member)
    try:
        out = cli(agent, member, "setup", "vm1", f"/proc/{mine.pid}/ns/net")
        assert out.returncode == 1, out
        assert out.stderr.startswith("cni-agent: plugin failed: pods/eth0: nftables refused its "
                                     "anti-spoofing filter on veth"), out.stderr
        assert out.stderr.rstrip().endswith("; the ADD is undone"), out.stderr
        assert agent.call("ListSandboxes")[0] == []
        assert allocations(tmp_path / "ipam", "pods") == []
        links = subprocess.run(["nsenter", "-t", str(mine.pid), "-n", "ip", "-j", "link"],
                               capture_output=True, text=True, check=True).stdout
        assert [x["ifname"] for x in json.loads(links)] == ["lo"]
    finally:
        mine.kill()


def test_reaping_a_dead_members_sandbox_removes_its_filter(
    make_agent: Callable[..., Agent], agents: list[Agent], permissive_bus: Bus,
    bridge_chain: str, bridge_name: str, member: str, tmp_path: Path,
) -> None:
    """The member's namespace dies (its veth with it): root's GC reaps the
    sandbox, and its filter goes with it."""
    agent = start(make_agent, agents, permissive_bus, member, check={"interval": 3600})
    mine = own_netns(member)
    veth, _, _ = veth_mac_ip(member_setup(agent, member, "vm1", mine.pid), bridge_name)
    assert veth in ports(agent)
    mine.kill()
    mine.wait()
    wait_for(lambda: not Path(f"/sys/class/net/{veth}").exists(), timeout=5)
    agent.call("GarbageCollect", "as", "0")
    assert agent.call("ListSandboxes")[0] == []
    assert ports(agent) == {}
    assert allocations(tmp_path / "ipam", "pods") == []


def test_with_checks_off_a_firewalld_reload_still_restores_a_filter(
    make_agent: Callable[..., Agent], agents: list[Agent], permissive_bus: Bus,
    bridge_chain: str, bridge_name: str, member: str,
) -> None:
    """check.interval 0 turns CHECK passes off, never the filters' check:
    firewalld's Reloaded signal has the filters looked at at once."""
    firewalld = StandIn(permissive_bus)
    agent = start(make_agent, agents, permissive_bus, member, check={"interval": 0})
    mine = own_netns(member)
    try:
        veth, _, _ = veth_mac_ip(member_setup(agent, member, "vm1", mine.pid), bridge_name)
        subprocess.run(["nft", "delete", "table", "bridge", table_of(agent)], check=True)
        firewalld.reload()
        wait_for(lambda: veth in ports(agent), timeout=5)
        wait_for(lambda: "was missing (an nftables flush or reload?); restored" in agent.log(),
                 timeout=5)
    finally:
        firewalld.stop()
        mine.kill()


def test_a_members_attach_is_filtered_and_refused_where_it_cannot_be(
    make_agent: Callable[..., Agent], agents: list[Agent], permissive_bus: Bus,
    bridge_chain: str, bridge_name: str, testnet: Callable[..., Path], member: str,
) -> None:
    """Attach (one more interface on a sandbox) goes the same way as Setup."""
    testnet("plain")
    agent = start(make_agent, agents, permissive_bus, member,
                  access={"networks": ["pods", "plain"]})
    mine = own_netns(member)
    caller = Stranger(permissive_bus.address, user=member, member=True)
    path = f"/proc/{mine.pid}/ns/net"

    def attach(network: str, ifname: str) -> dict[str, Any]:
        return caller.send(spec("Attach", "ssssa{sv}",
                                ["vm1", path, network, ifname, [["netns_fd", ["h", 0]]]],
                                fds=[path], timeout=30))

    try:
        done = attach("pods", "eth0")
        assert done["outcome"] == "return", done
        full = f"cni-agent.u{pwd.getpwnam(member).pw_uid}.vm1"
        veth, _, _ = veth_mac_ip(json.loads(agent.call("Show", "s", full)[0]), bridge_name)
        assert list(ports(agent)) == [veth]
        refused = attach("plain", "eth1")
        assert (refused["outcome"], refused["error"]) == (
            "error", "org.cniagent.Agent1.Error.AccessDenied"), refused
        assert refused["text"].startswith("network plain cannot be protected against address "
                                          "spoofing here"), refused
    finally:
        caller.close()
        mine.kill()
