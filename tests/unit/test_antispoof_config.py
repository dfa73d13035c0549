"""`antispoof` and `access.unprotected_networks` (issue 44, item 3): parsed and
checked by name, decided in one place (`Policy.spoofing`), and seen by
`cni-agent config check`; how a CNI result becomes a port's filter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cni_agent.cni.config import parse_list
from cni_agent.config import AgentConfig, ConfigFileError, load_config
from cni_agent.node.antispoof import PortFilter
from cni_agent.sandboxes.policy import ROOT, Caller, Policy, Role
from cni_agent.sandboxes.records import Attachment
from cni_agent.sandboxes.spoofguard import AntispoofFailed, port_filter, unfilterable
from tests.unit.test_config_command import agent_yaml, cli, needs_plugins, network


def _load(tmp_path: Path, text: str) -> AgentConfig:
    p = tmp_path / "agent.yaml"
    p.write_text(text)
    return load_config(str(p))


def test_defaults_filter_members_and_leave_nothing_unprotected() -> None:
    c = AgentConfig()
    assert c.antispoof == "members" and c.access.unprotected_networks == ()


def test_both_keys_are_read(tmp_path: Path) -> None:
    c = _load(tmp_path, "antispoof: all\naccess:\n  unprotected_networks: [vmnet, macvlan1]\n")
    assert c.antispoof == "all" and c.access.unprotected_networks == ("vmnet", "macvlan1")


@pytest.mark.parametrize(("text", "message"), [
    ("antispoof: none\n", "antispoof: must be one of members, all (there is no off: see "
                          "access.unprotected_networks), not 'none'"),
    ("antispoof: off\n", "antispoof: must be one of members, all (there is no off: see "
                         "access.unprotected_networks), not False"),  # YAML's off
    ("access:\n  unprotected_networks: vmnet\n", "access.unprotected_networks: must be a list"),
    ("access:\n  unprotected_networks: [1]\n", "access.unprotected_networks[0]: must be a string"),
])
def test_a_bad_value_is_refused_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigFileError) as err:
        _load(tmp_path, text)
    assert message in str(err.value)


MEMBER = Caller(1000, Role.MEMBER)
DELEGATE = Caller(1001, Role.DELEGATE)
CANNOT = "its first plugin is 'macvlan', and the agent filters spoofing only on ..."


@pytest.mark.parametrize(("caller", "network", "why", "allowed"), [
    (ROOT, "vmnet", CANNOT, True),  # root is never refused a network for it
    (MEMBER, "pods", "", True),  # filterable: filtered, allowed
    (MEMBER, "vmnet", CANNOT, False),
    (DELEGATE, "vmnet", CANNOT, False),  # polkit's delegates are members here
    (MEMBER, "open", CANNOT, True),  # the admin listed it
    (MEMBER, "open", "nftables is not available on this node: …", True),
    (MEMBER, "pods", "nftables is not available on this node: …", False),
])
def test_spoofing_policy(caller: Caller, network: str, why: str, allowed: bool) -> None:
    policy = Policy.of(["pods", "vmnet", "open"], unprotected_networks=["open"])
    if allowed:
        policy.spoofing(caller, network, why)
        return
    with pytest.raises(Exception) as err:
        policy.spoofing(caller, network, why)
    assert getattr(err.value, "kind", None) is not None and str(err.value.kind) == "AccessDenied"
    assert f"network {network} cannot be protected against address spoofing here ({why})" in \
        str(err.value)
    assert "access.unprotected_networks" in str(err.value)


def _net(first: dict[str, object]) -> bytes:
    return json.dumps({"cniVersion": "1.0.0", "name": "pods", "plugins": [first]}).encode()


BRIDGE = _net({"type": "bridge", "bridge": "cni9", "ipam": {"type": "host-local"}})
RESULT = {
    "cniVersion": "1.0.0",
    "interfaces": [{"name": "cni9", "mac": "aa:aa:aa:aa:aa:aa"},
                   {"name": "veth1234abcd", "mac": "bb:bb:bb:bb:bb:bb"},
                   {"name": "eth0", "mac": "0A:58:0A:00:00:02", "sandbox": "/proc/1/ns/net"},
                   {"name": "eth1", "mac": "cc:cc:cc:cc:cc:cc", "sandbox": "/proc/1/ns/net"}],
    "ips": [{"interface": 2, "address": "10.99.0.2/24"},
            {"interface": 2, "address": "fd00::2/64"},
            {"interface": 3, "address": "10.98.0.9/24"}],
}


def test_a_bridge_result_gives_the_host_veth_the_pods_mac_and_its_own_addresses() -> None:
    net = parse_list(BRIDGE)
    f = port_filter(Attachment("pods", "eth0", BRIDGE), net, RESULT)
    assert f == PortFilter("veth1234abcd", "0a:58:0a:00:00:02", ("10.99.0.2",), ("fd00::2",))
    dhcp = parse_list(_net({"type": "bridge", "bridge": "cni9", "ipam": {"type": "dhcp"}}))
    assert port_filter(Attachment("pods", "eth0", BRIDGE), dhcp, RESULT).dhcp


@pytest.mark.parametrize("damage", ["no interfaces", "two veths", "no mac", "no pod interface"])
def test_a_result_that_does_not_say_which_veth_makes_no_filter(damage: str) -> None:
    result = json.loads(json.dumps(RESULT))
    if damage == "no interfaces":
        del result["interfaces"]
    elif damage == "two veths":
        result["interfaces"].append({"name": "vethother"})
    elif damage == "no mac":
        del result["interfaces"][2]["mac"]
    else:
        result["interfaces"][2]["name"] = "net0"
    with pytest.raises(AntispoofFailed, match="pods/eth0: "):
        port_filter(Attachment("pods", "eth0", BRIDGE), parse_list(BRIDGE), result)


def test_only_a_bridge_first_plugin_is_filterable() -> None:
    assert unfilterable(parse_list(BRIDGE)) == ""
    why = unfilterable(parse_list(_net({"type": "macvlan", "master": "eth0"})))
    assert why.startswith("its first plugin is 'macvlan'")


@needs_plugins
def test_config_check_names_an_opened_network_members_would_be_refused(tmp_path: Path) -> None:
    cfg = agent_yaml(tmp_path, access={"networks": ["vlan", "pods"]})
    network(tmp_path, "10-pods.conflist", json.loads(BRIDGE))
    network(tmp_path, "20-vlan.conflist", {"cniVersion": "1.0.0", "name": "vlan", "plugins": [
        {"type": "macvlan", "master": "lo", "ipam": {"type": "host-local",
                                                     "subnet": "10.97.0.0/24"}}]})
    out = cli("config", "check", "--config", str(cfg))
    assert out.returncode == 1, out
    [line] = out.stdout.splitlines()
    assert line.startswith(str(tmp_path / "net.d" / "20-vlan.conflist"))
    assert "opens vlan to members, but its first plugin is 'macvlan', not bridge" in line
    cfg = agent_yaml(tmp_path, access={"networks": ["vlan", "pods"],
                                       "unprotected_networks": ["vlan"]})
    out = cli("config", "check", "--config", str(cfg))
    assert out.returncode == 0, out


@pytest.mark.skipif(not os.path.exists("/usr/sbin/nft"), reason="needs nftables")
def test_the_package_ships_what_the_filters_need() -> None:
    root = Path(__file__).resolve().parents[2]
    assert "libnftables1" in (root / "packaging" / "debian" / "control").read_text()
    assert "Requires:       nftables" in (root / "packaging" / "rpm" / "cni-agent.spec").read_text()
