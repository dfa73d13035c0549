"""Address capacity per network (issue 47, item 2), with real parts: the real
bridge and host-local plugins, real namespaces, a private bus, the CLI as a
subprocess and /metrics over the agent's HTTP socket.

A /29 is filled sandbox by sandbox and emptied again: NetworkCapacity, the
CLI's `networks --json` and `cni_agent_ipam_addresses` follow each step; a
Setup on the full pool runs the plugin, fails with its PluginFailed and the
hint that the pool is full. Another IPAM is "unknown", static "none"; a
network of several ranges and range sets is counted range by range.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.conftest import plug
from tests.daemon.test_http import samples
from tests.support.agent import Agent
from tests.support.plugins import Control, conflist, write_conf
from tests.support.shim import run_shim, shim_conf

pytestmark = pytest.mark.root


def capacity(agent: Agent, network: str = "") -> dict[str, Any]:
    [text] = agent.call("NetworkCapacity", "s", network)
    return json.loads(text)  # type: ignore[no-any-return]


def cli_networks(agent: Agent, *args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "cni_agent", "networks", *args, "--bus",
                          agent.bus.address], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stderr == "", (out.returncode, out.stdout, out.stderr)
    return out


def metric(sock: Path, network: str) -> dict[tuple[str, str], float]:
    """cni_agent_ipam_addresses of `network`, by (range, state)."""
    found = {}
    for (name, labels), value in samples(sock).items():
        lab = dict(labels)
        if name == "cni_agent_ipam_addresses" and lab["network"] == network:
            found[(lab["range"], lab["state"])] = value
    return found


def ratio(sock: Path, network: str) -> float | None:
    return samples(sock).get(("cni_agent_ipam_pool_used_ratio", (("network", network),)))


def bridge(name: str, ipam: dict[str, Any], tmp_path: Path, gateway: bool = True
           ) -> dict[str, Any]:
    return {"type": "bridge", "bridge": name, "isGateway": gateway, "ipMasq": False,
            "ipam": {**ipam, "type": "host-local", "dataDir": str(tmp_path / "ipam")}}


def test_a_29_fills_to_no_free_address_and_back(
        make_agent: Callable[..., Agent], tmp_path: Path, bridge_name: str,
        netns_factory: Callable[[], str]) -> None:
    write_conf(tmp_path / "net.d", "10-cap.conflist", conflist(
        "cap", [bridge(bridge_name, {"subnet": "10.147.47.0/29"}, tmp_path)], "1.0.0"))
    sock = tmp_path / "metrics.sock"
    agent = make_agent(http={"listen": f"unix:{sock}"}, check={"interval": 0})

    def figures(used: int) -> None:
        """The same count through D-Bus, the CLI and /metrics."""
        doc = capacity(agent, "cap")
        assert (doc["capacity"], doc["size"], doc["used"], doc["free"]) == \
            ("known", 5, used, 5 - used), doc
        [rs] = doc["range_sets"]
        [rng] = rs["ranges"]
        assert rng == {"range": "10.147.47.0/29", "subnet": "10.147.47.0/29",
                       "range_start": "10.147.47.1", "range_end": "10.147.47.6",
                       "gateway": "10.147.47.1", "size": 5, "used": used, "free": 5 - used}
        assert rs["data_dir"] == str(tmp_path / "ipam" / "cap")
        assert capacity(agent) == doc  # "" is the default network
        [via_cli] = json.loads(cli_networks(agent, "--json").stdout)["networks"]
        assert via_cli == doc
        assert metric(sock, "cap") == {("10.147.47.0/29", "size"): 5,
                                       ("10.147.47.0/29", "used"): used,
                                       ("10.147.47.0/29", "free"): 5 - used}
        assert ratio(sock, "cap") == used / 5

    figures(0)
    sandboxes = [(f"cap-{i}", netns_factory()) for i in range(5)]
    for used, (sid, ns) in enumerate(sandboxes, 1):
        agent.setup(sid, ns, networks=[("cap", "eth0")])
        figures(used)
    text = cli_networks(agent).stdout.splitlines()
    assert text[0].split() == ["NETWORK", "IPAM", "RANGE", "SIZE", "USED", "FREE"]
    assert text[1].split() == ["cap", "host-local", "10.147.47.0/29", "5", "5", "0"]

    # Full: the next Setup still runs the chain, fails with the plugin's own
    # error, and the message says the pool is full; nothing is left leased.
    before = len(list((tmp_path / "ipam" / "cap").iterdir()))
    out = agent.gdbus("Setup", "cap-6", netns_factory(), "{}")
    assert out.returncode != 0
    assert "org.cniagent.Agent1.Error.PluginFailed" in out.stderr, out.stderr
    assert "no IP addresses available" in out.stderr, out.stderr
    assert ("hint: network cap's address pool is full (5 of 5 addresses of 10.147.47.0/29 in "
            "use; `cni-agent networks` shows it)") in out.stderr, out.stderr
    # Attach alike; a runtime's ADD through the shim gets the plugin's own
    # code and msg, the hint in its details.
    hint = ("network cap's address pool is full (5 of 5 addresses of 10.147.47.0/29 in use; "
            "`cni-agent networks` shows it)")
    out = agent.gdbus("Attach", "cap-7", netns_factory(), "cap", "eth0", "{}")
    assert "org.cniagent.Agent1.Error.PluginFailed" in out.stderr, out.stderr
    assert f"(hint: {hint})" in out.stderr, out.stderr
    reply = run_shim(agent.bus.address, "ADD", shim_conf("pods", "cap", "1.0.0"), cid="cap-8",
                     netns=netns_factory())
    assert reply.rc == 1 and "no IP addresses available" in reply.out["msg"], reply
    assert "hint" not in reply.out["msg"] and reply.out["details"].endswith(f"; hint: {hint}"), \
        reply
    assert len(list((tmp_path / "ipam" / "cap").iterdir())) == before
    figures(5)

    for left, (sid, ns) in zip(range(4, -1, -1), sandboxes, strict=True):
        agent.call("Teardown", "ssa{sv}", sid, ns, "0")
        figures(left)
    # Room again: the same Setup now succeeds, with no hint anywhere.
    doc = agent.setup("cap-6", sandboxes[0][1], networks=[("cap", "eth0")])
    assert doc["state"] == "ready"
    figures(1)


def test_a_setup_that_fails_on_a_pool_with_room_gets_no_hint(
        make_agent: Callable[..., Agent], tmp_path: Path, bridge_name: str, control: Control,
        netns: str) -> None:
    """The hint only where the agent knows the pool is full."""
    write_conf(tmp_path / "net.d", "10-cap.conflist", conflist(
        "cap", [bridge(bridge_name, {"subnet": "10.147.46.0/29"}, tmp_path), plug(control)],
        "1.0.0"))
    agent = make_agent(check={"interval": 0})
    control.set("ADD", "fail", code=11, msg="testplug refuses")
    out = agent.gdbus("Setup", "cap-room", netns, "{}")
    assert "org.cniagent.Agent1.Error.PluginFailed" in out.stderr, out.stderr
    assert "testplug refuses" in out.stderr and "hint" not in out.stderr, out.stderr
    assert capacity(agent)["used"] == 0


def test_other_ipams_are_unknown_and_static_has_no_pool(
        make_agent: Callable[..., Agent], tmp_path: Path, control: Control,
        bridge_name: str) -> None:
    d = tmp_path / "net.d"
    write_conf(d, "10-pods.conflist", conflist(
        "pods", [bridge(bridge_name, {"subnet": "10.147.45.0/29"}, tmp_path)], "1.0.0"))
    write_conf(d, "20-dhcp.conflist", conflist("dhcpnet", [
        {"type": "macvlan", "master": "lo", "ipam": {"type": "dhcp"}}], "1.0.0"))
    write_conf(d, "30-where.conflist", conflist("whereabouts", [
        {"type": "macvlan", "master": "lo",
         "ipam": {"type": "whereabouts", "range": "10.147.44.0/24"}}], "1.0.0"))
    write_conf(d, "40-static.conflist", conflist("staticnet", [
        {"type": "bridge", "bridge": "unused0", "ipam": {
            "type": "static", "addresses": [{"address": "10.147.43.2/24"}]}}], "1.0.0"))
    write_conf(d, "50-vendor.conflist", conflist("vendor", [plug(control)], "1.0.0"))
    write_conf(d, "60-ranges.conflist", conflist("percall", [
        {"type": "bridge", "bridge": "unused1", "capabilities": {"ipRanges": True},
         "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.147.42.0/24"}]]}}], "1.0.0"))
    agent = make_agent(check={"interval": 0})
    nets = agent.prop("Networks")
    assert nets == ["pods", "dhcpnet", "whereabouts", "staticnet", "vendor", "percall"], \
        agent.log()
    docs = {n: capacity(agent, n) for n in nets}
    assert docs["pods"]["capacity"] == "known"
    for name, ipam in (("dhcpnet", ["dhcp"]), ("whereabouts", ["whereabouts"]),
                       ("vendor", []), ("percall", ["host-local"])):
        doc = docs[name]
        assert (doc["capacity"], doc["ipam"]) == ("unknown", ipam), doc
        assert doc["reason"] and not {"size", "used", "free"} & set(doc), doc
    assert "dhcp keeps its addresses" in docs["dhcpnet"]["reason"]
    assert "ipRanges" in docs["percall"]["reason"]
    assert "testplug has no ipam section" in docs["vendor"]["reason"]
    assert docs["staticnet"] == {"network": "staticnet", "capacity": "none", "ipam": ["static"],
                                 "reason": "static IPAM: the config gives the addresses, "
                                           "there is no pool"}
    assert [d["network"] for d in json.loads(cli_networks(agent, "--json").stdout)["networks"]] \
        == nets
    lines = {line.split()[0]: line for line in cli_networks(agent).stdout.splitlines()[1:]}
    assert "unknown: IPAM dhcp keeps" in lines["dhcpnet"]
    assert "none: static IPAM" in lines["staticnet"]
    out = agent.gdbus("NetworkCapacity", "nosuch")
    assert "org.cniagent.Agent1.Error.NotFound" in out.stderr, out.stderr
    assert "network nosuch not found" in out.stderr


def test_several_ranges_and_range_sets_are_counted_range_by_range(
        make_agent: Callable[..., Agent], tmp_path: Path, bridge_name: str,
        netns_factory: Callable[[], str]) -> None:
    ipam = {"ranges": [[{"subnet": "10.147.48.0/29", "rangeStart": "10.147.48.2",
                         "rangeEnd": "10.147.48.3"}, {"subnet": "10.147.49.0/30"}],
                       [{"subnet": "fd00:147::/125"}]]}
    write_conf(tmp_path / "net.d", "10-multi.conflist", conflist(
        "multi", [bridge(bridge_name, ipam, tmp_path, gateway=False)], "1.0.0"))
    sock = tmp_path / "metrics.sock"
    agent = make_agent(http={"listen": f"unix:{sock}"}, check={"interval": 0})
    doc = capacity(agent)
    assert [[r["range"] for r in rs["ranges"]] for rs in doc["range_sets"]] == \
        [["10.147.48.2-10.147.48.3", "10.147.49.0/30"], ["fd00:147::/125"]]
    # Each attachment takes one address of every range set: the first set's 3
    # (2 + 1: the /30's gateway .1 is skipped) bound the network, not the v6 set's 6.
    assert [rs["size"] for rs in doc["range_sets"]] == [3, 6]
    assert (doc["size"], doc["used"], doc["free"]) == (3, 0, 3)
    sandboxes = [(f"multi-{i}", netns_factory()) for i in range(3)]
    for sid, ns in sandboxes:
        agent.setup(sid, ns)
    doc = capacity(agent)
    first, second = doc["range_sets"]
    assert [(r["used"], r["free"]) for r in first["ranges"]] == [(2, 0), (1, 0)]
    assert [(r["used"], r["free"]) for r in second["ranges"]] == [(3, 3)]
    assert (doc["size"], doc["used"], doc["free"]) == (3, 3, 0)
    m = metric(sock, "multi")
    assert m[("10.147.48.2-10.147.48.3", "used")] == 2
    assert m[("10.147.49.0/30", "free")] == 0
    assert m[("fd00:147::/125", "free")] == 3
    assert len(m) == 9  # 3 ranges x size, used, free: nothing else
    assert ratio(sock, "multi") == 1.0
    # A lease file of no current range (an older config's) counts nowhere.
    (tmp_path / "ipam" / "multi" / "10.147.50.9").write_text("old\r\neth0")
    assert capacity(agent)["range_sets"] == doc["range_sets"]
    for sid, ns in sandboxes:
        agent.call("Teardown", "ssa{sv}", sid, ns, "0")
    assert (capacity(agent)["used"], capacity(agent)["free"]) == (0, 3)


def test_a_stranger_reads_capacity_but_never_whose(
        make_agent: Callable[..., Agent], tmp_path: Path, bridge_name: str,
        netns: str) -> None:
    """Open to anyone, like the properties: counts only, no sandbox id."""
    write_conf(tmp_path / "net.d", "10-cap.conflist", conflist(
        "cap", [bridge(bridge_name, {"subnet": "10.147.41.0/29"}, tmp_path)], "1.0.0"))
    agent = make_agent(check={"interval": 0})
    agent.setup("secret-sandbox", netns)
    out = agent.busctl("--json=short", "call", "org.cniagent.Agent1", "/org/cniagent/Agent1",
                       "org.cniagent.Agent1", "NetworkCapacity", "s", "cap", user="nobody")
    [text] = json.loads(out.stdout)["data"]
    doc = json.loads(text)
    assert (doc["used"], doc["free"]) == (1, 4)
    assert "secret-sandbox" not in text
