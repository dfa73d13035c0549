"""Setup/Show/Check/Teardown over D-Bus with the reference plugins in real namespaces."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unique_name
from tests.daemon.conftest import plug
from tests.support.agent import Agent, options
from tests.support.net import addresses, allocations, delete_link
from tests.support.plugins import Control, conflist, write_conf
from tests.support.state import records

pytestmark = pytest.mark.root


@pytest.fixture
def bridge_conf(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Bridge + host-local networks with their own bridge, subnet and IPAM dir."""
    bridges: list[str] = []

    def write(name: str, subnet: str, filename: str | None = None,
              extra: list[dict[str, Any]] | None = None, version: str = "0.4.0") -> str:
        br = unique_name("cab")
        bridges.append(br)
        plugins = [{"type": "bridge", "bridge": br, "isGateway": True, "ipMasq": False,
                    "ipam": {"type": "host-local", "subnet": subnet,
                             "dataDir": str(tmp_path / "ipam")}}, *(extra or [])]
        write_conf(tmp_path / "net.d", filename or f"10-{name}.conflist",
                   conflist(name, plugins, version))
        return name

    yield write
    for br in bridges:
        delete_link(br)


def test_setup_show_check_teardown_with_bridge_and_host_local(
    make_agent: Callable[..., Agent], bridge_conf: Callable[..., str], netns: str, tmp_path: Path
) -> None:
    bridge_conf("podnet", "10.211.0.0/24")
    agent = make_agent()
    assert agent.prop("NetworkReady") is True
    assert agent.prop("DefaultNetwork") == "podnet"

    result = agent.setup("sbx-a", netns)
    assert result["sandbox"] == "sbx-a"
    [att] = result["attachments"]
    assert (att["network"], att["ifname"]) == ("podnet", "eth0")
    address = att["result"]["ips"][0]["address"]
    assert addresses(netns) == [address]
    assert allocations(tmp_path / "ipam", "podnet") == [address.split("/")[0]]
    assert "UP" in subprocess.run(["ip", "-n", Path(netns).name, "link", "show", "lo"],
                                  capture_output=True, text=True).stdout

    shown = json.loads(agent.call("Show", "s", "sbx-a")[0])
    # Show adds each attachment's check state to Setup's document.
    assert {a.pop("check")["state"] for a in shown["attachments"]} <= {"unchecked", "ok"}
    assert shown == result
    assert agent.call("ListSandboxes")[0] == ["sbx-a"]
    agent.call("Check", "ssa{sv}", "sbx-a", netns, "0")

    agent.call("Teardown", "ssa{sv}", "sbx-a", netns, "0")
    assert allocations(tmp_path / "ipam", "podnet") == []
    assert addresses(netns) == []
    assert agent.call("ListSandboxes")[0] == []
    assert list((tmp_path / "state" / "results").iterdir()) == []
    # Tearing down again, or an unknown sandbox, succeeds.
    agent.call("Teardown", "ssa{sv}", "sbx-a", "", "0")
    agent.call("Teardown", "ssa{sv}", "never-seen", "", "0")


def test_two_networks_on_one_sandbox_and_port_mappings(
    make_agent: Callable[..., Agent], bridge_conf: Callable[..., str], netns: str, tmp_path: Path
) -> None:
    bridge_conf("first", "10.212.0.0/24", extra=[
        {"type": "portmap", "capabilities": {"portMappings": True}, "snat": False}])
    bridge_conf("second", "10.213.0.0/24")
    agent = make_agent()
    agent.call("WaitReady", "d", "5")
    caps = {"portMappings": [{"hostPort": 18123, "containerPort": 80, "protocol": "tcp"}]}
    result = agent.setup("sbx-two", netns, networks=[("first", "eth0"), ("second", "net1")],
                         capabilities=caps)
    assert [a["network"] for a in result["attachments"]] == ["first", "second"]
    assert addresses(netns, "net1")[0].startswith("10.213.0.")
    nat = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True).stdout
    assert "--dport 18123" in nat and "sbx-two" in nat  # portmap got the capability
    agent.call("Teardown", "ssa{sv}", "sbx-two", netns, "0")
    nat = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True).stdout
    assert "--dport 18123" not in nat
    assert allocations(tmp_path / "ipam", "first") == allocations(tmp_path / "ipam", "second") == []


def test_args_pass_through_and_pod_adds_kubernetes_args(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns_factory: Callable[[], str],
) -> None:
    testnet()
    agent = make_agent()
    agent.setup("plain", netns_factory(), args={"IP": "10.9.9.9", "FOO": "a=b"})
    agent.setup("pod", netns_factory(), args={"X": "1"},
                pod={"namespace": "default", "name": "web", "uid": "u-42"})
    adds = [r for r in control.records() if r["command"] == "ADD"]
    by_id = {r["env"]["CNI_CONTAINERID"]: r["env"]["CNI_ARGS"] for r in adds}
    assert by_id["plain"] == "IP=10.9.9.9;FOO=a=b"
    assert by_id["pod"] == ("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;"
                            "K8S_POD_INFRA_CONTAINER_ID=pod;K8S_POD_UID=u-42;X=1")


def test_identical_repeat_returns_cached_result_without_plugins(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, netns: str,
    netns_factory: Callable[[], str],
) -> None:
    testnet()
    agent = make_agent()
    first = agent.setup("rep", netns, args={"A": "1"})
    adds = control.commands().count("ADD")
    assert agent.setup("rep", netns, args={"A": "1"}) == first
    assert control.commands().count("ADD") == adds
    other = netns_factory()
    out = agent.gdbus("Setup", "rep", other, "{}")
    assert "org.cniagent.Agent1.Error.InvalidArgument" in out.stderr
    assert "already set up in netns" in out.stderr
    out = agent.gdbus("Setup", "rep", netns, "{'args': <{'A': '2'}>}")
    assert "already set up with different" in out.stderr


def test_failed_setup_rolls_back_everything(
    make_agent: Callable[..., Agent], bridge_conf: Callable[..., str], testnet: Callable[..., Path],
    control: Control, netns: str, tmp_path: Path,
) -> None:
    bridge_conf("good", "10.214.0.0/24")
    testnet("bad")
    control.set("ADD", "fail", code=11, msg="no leases left")
    agent = make_agent()
    out = agent.gdbus("Setup", "half", netns, "{'networks': <[('good', 'eth0'), ('bad', 'net1')]>}")
    assert "org.cniagent.Agent1.Error.PluginFailed" in out.stderr
    assert "plugin testplug ADD failed (code 11): no leases left" in out.stderr
    # The good network's address was released; the failing one got its DEL too.
    assert allocations(tmp_path / "ipam", "good") == []
    assert addresses(netns) == []
    dels = [r for r in control.records() if r["command"] == "DEL"]
    assert [r["env"]["CNI_IFNAME"] for r in dels] == ["net1"]
    assert list((tmp_path / "state" / "results").iterdir()) == []
    assert records(tmp_path / "state") == {}
    assert agent.call("ListSandboxes")[0] == []


def test_failed_del_keeps_the_cache_entry_and_says_so(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, netns: str,
) -> None:
    testnet()
    agent = make_agent()
    agent.setup("keep", netns)
    control.set("DEL", "fail", code=5, msg="cannot reach daemon")
    out = agent.gdbus("Teardown", "keep", netns, "{}")
    assert "org.cniagent.Agent1.Error.PluginFailed" in out.stderr
    assert "cache entries are kept" in out.stderr and "cannot reach daemon" in out.stderr
    assert agent.call("ListSandboxes")[0] == ["keep"]
    control.clear("DEL")
    agent.call("Teardown", "ssa{sv}", "keep", netns, "0")
    assert agent.call("ListSandboxes")[0] == []


def test_pod_cidrs_reach_plugins_as_ip_ranges_and_persist(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns_factory: Callable[[], str],
) -> None:
    testnet(plugins=[plug(control, capabilities={"ipRanges": True})])
    agent = make_agent(pod_cidrs=["10.244.1.0/24"])
    assert agent.prop("PodCIDRs") == ["10.244.1.0/24"]
    agent.call("SetPodCIDRs", "as", "2", "10.244.7.0/24", "fd00:7::/64")
    assert agent.prop("PodCIDRs") == ["10.244.7.0/24", "fd00:7::/64"]
    agent.setup("ranges", netns_factory())
    add = next(r for r in control.records() if r["command"] == "ADD")
    assert add["stdin"]["runtimeConfig"]["ipRanges"] == [
        [{"subnet": "10.244.7.0/24"}], [{"subnet": "fd00:7::/64"}]]
    # A caller's own ipRanges win.
    mine = [[{"subnet": "192.168.5.0/24"}]]
    agent.setup("own", netns_factory(), capabilities={"ipRanges": mine})
    add = [r for r in control.records() if r["command"] == "ADD"][-1]
    assert add["stdin"]["runtimeConfig"]["ipRanges"] == mine
    bad = agent.gdbus("SetPodCIDRs", "['not-a-cidr']")
    assert "InvalidArgument" in bad.stderr and "cidrs" in bad.stderr
    assert agent.stop() == 0
    agent.start()
    assert agent.prop("PodCIDRs") == ["10.244.7.0/24", "fd00:7::/64"]


def test_garbage_collect_dels_everything_not_listed(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns_factory: Callable[[], str],
) -> None:
    testnet()
    testnet("shared", "60-shared.conflist")  # a network the agent was not given for GC
    agent = make_agent(gc={"networks": ["testnet"]})
    for sid in ("keep1", "drop1", "drop2"):
        agent.setup(sid, netns_factory())
    control.reset_records()
    agent.call("GarbageCollect", "as", "1", "keep1")
    assert agent.call("ListSandboxes")[0] == ["keep1"]
    dels = sorted(r["env"]["CNI_CONTAINERID"] for r in control.records() if r["command"] == "DEL")
    assert dels == ["drop1", "drop2"]
    # The GC verb only goes to the network declared the agent's own.
    [gc] = [r for r in control.records() if r["command"] == "GC"]
    assert gc["stdin"]["name"] == "testnet"
    assert gc["stdin"]["cni.dev/valid-attachments"] == [{"containerID": "keep1", "ifname": "eth0"}]


def test_gc_verb_is_sent_to_no_network_by_default(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns_factory: Callable[[], str],
) -> None:
    testnet()
    agent = make_agent()
    agent.setup("live", netns_factory())
    agent.setup("gone", netns_factory())
    control.reset_records()
    agent.call("GarbageCollect", "as", "1", "live")
    # Reaping its own stale attachment by DEL stays on; the verb is not sent.
    # (the STATUS poll may run meanwhile; it is not what this test is about)
    sent = [(r["command"], r["env"]["CNI_CONTAINERID"]) for r in control.records()
            if r["command"] in ("DEL", "GC")]
    assert sent == [("DEL", "gone")]


def test_unknown_option_and_wrong_option_type_name_the_field(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], netns: str
) -> None:
    testnet()
    agent = make_agent()
    out = agent.gdbus("Setup", "x", netns, "{'colour': <'blue'>}")
    assert "InvalidArgument" in out.stderr and "unknown key 'colour'" in out.stderr
    out = agent.gdbus("Setup", "x", netns, "{'networks': <['testnet']>}")
    assert "InvalidArgument" in out.stderr and "options.networks" in out.stderr
    out = agent.busctl("call", "org.cniagent.Agent1", "/org/cniagent/Agent1", "org.cniagent.Agent1",
                       "Setup", "ssa{sv}", "x", netns, *options(capabilities="[1, 2]"), check=False)
    assert "options.capabilities: must be a JSON object" in out.stderr


def test_args_a_plugin_rejects_fail_setup_cleanly(
    make_agent: Callable[..., Agent], bridge_conf: Callable[..., str], netns: str, tmp_path: Path
) -> None:
    """bridge rejects unknown CNI_ARGS (no IgnoreUnknown): the ADD fails with the plugin's
    words, and the rollback DEL, which would fail the same way, still cleans up."""
    bridge_conf("strict", "10.219.0.0/24")
    agent = make_agent()
    out = agent.gdbus("Setup", "strict", netns, "{'args': <{'IP': '10.219.0.77'}>}")
    assert "org.cniagent.Agent1.Error.PluginFailed" in out.stderr
    assert 'plugin bridge ADD failed (code 999): ARGS: unknown args ["IP=10.219.0.77"]' in out.stderr
    assert "cleanup failed" not in out.stderr
    assert agent.call("ListSandboxes")[0] == []
    assert allocations(tmp_path / "ipam", "strict") == []
    assert addresses(netns) == []
    # With IgnoreUnknown (what pod metadata adds) the same args are fine.
    result = agent.setup("strict", netns, args={"IgnoreUnknown": "1", "IP": "10.219.0.77"})
    assert result["attachments"][0]["result"]["ips"][0]["address"] == "10.219.0.77/24"
    agent.call("Teardown", "ssa{sv}", "strict", netns, "0")
    assert allocations(tmp_path / "ipam", "strict") == []
