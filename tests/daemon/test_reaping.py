"""GC and reaping with the real bridge + host-local: the leaks after reboots and crashes."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.agent import Agent
from tests.support.net import addresses, allocations, delete_link
from tests.support.plugins import Control, conflist, ns_key, seen_netns, wait_for, write_conf
from tests.support.state import record, records, replace_latest

pytestmark = pytest.mark.root


def _netns_name(path: str) -> str:
    return Path(path).name


def _dels(control: Control) -> dict[str, list[int] | str]:
    """Sandbox → the namespace its DEL ran in (`ns_key`), "" for an empty netns."""
    return {r["env"]["CNI_CONTAINERID"]: seen_netns(r)
            for r in control.records() if r["command"] == "DEL"}


def test_reboot_reaps_deleted_and_reused_namespaces(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    agent = make_agent()
    live, gone, reused = netns_factory(), netns_factory(), netns_factory()
    for sid, ns in (("live", live), ("gone", gone), ("reused", reused)):
        agent.setup(sid, ns)
    assert len(allocations(tmp_path / "ipam", "pods")) == 3
    assert agent.stop() == 0
    # "Reboot": two namespaces vanish; one path comes back naming a new namespace.
    subprocess.run(["ip", "netns", "del", _netns_name(gone)], check=True)
    subprocess.run(["ip", "netns", "del", _netns_name(reused)], check=True)
    subprocess.run(["ip", "netns", "add", _netns_name(reused)], check=True)
    control.reset_records()
    agent.start()
    wait_for(lambda: agent.call("ListSandboxes")[0] == ["live"], timeout=15)
    dels = _dels(control)
    # Stale attachments are DELed with an empty netns: the reused path never reaches a plugin.
    assert dels == {"gone": "", "reused": ""}
    assert len(allocations(tmp_path / "ipam", "pods")) == 1
    assert addresses(reused) == []
    assert len(addresses(live)) == 1
    assert sorted(records(tmp_path / "state")) == ["live"]


def test_gc_runs_again_on_recovery(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    agent = make_agent()
    ns = netns_factory()
    agent.setup("during-outage", ns)
    # While healthy, a vanished namespace is not reaped by polling alone...
    subprocess.run(["ip", "netns", "del", _netns_name(ns)], check=True)
    control.reset_records()
    # ...but an outage and its recovery run GC (the origin change promised it).
    plugins = [{"type": "testplug", "control": str(control.path)}]
    write_conf(tmp_path / "net.d", "05-status.conflist", conflist("status-net", plugins, "1.1.0"))
    control.set("STATUS", "fail", code=50, msg="restarting")
    wait_for(lambda: agent.prop("NetworkReady") is False)
    control.clear("STATUS")
    wait_for(lambda: agent.prop("NetworkReady") is True)
    wait_for(lambda: agent.call("ListSandboxes")[0] == [], timeout=10)
    assert allocations(tmp_path / "ipam", "pods") == []
    assert _dels(control) == {"during-outage": ""}


def test_kill_9_during_setup_is_rolled_back_on_restart(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    agent = make_agent()
    control.set("ADD", "hang")  # bridge + host-local already ran when our plugin hangs
    setup = subprocess.Popen(
        ["busctl", f"--address={agent.bus.address}", "call", "org.cniagent.Agent1",
         "/org/cniagent/Agent1", "org.cniagent.Agent1", "Setup", "ssa{sv}", "crash", netns, "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: "ADD" in control.commands())
    assert len(allocations(tmp_path / "ipam", "pods")) == 1  # the leak libcni would leave
    assert agent.stop(signal.SIGKILL) == -signal.SIGKILL
    setup.wait(10)
    hung = next(r["pid"] for r in control.records() if r["command"] == "ADD")
    assert Path(f"/proc/{hung}").exists()  # outside systemd, nothing killed it yet
    control.clear("ADD")
    agent.start()
    # The new agent kills its predecessor's plugins before rolling back.
    wait_for(lambda: not Path(f"/proc/{hung}").exists() or
             Path(f"/proc/{hung}/stat").read_text().split(") ")[1][0] == "Z", timeout=10)
    assert "killed 1 plugin process(es) left by an earlier run" in agent.log()
    wait_for(lambda: allocations(tmp_path / "ipam", "pods") == [], timeout=15)
    assert addresses(netns) == []
    assert agent.call("ListSandboxes")[0] == []
    assert records(tmp_path / "state") == {}
    assert _dels(control) == {"crash": ns_key(netns)}  # the namespace still exists: DEL cleans it


def test_fallback_network_serves_until_a_real_config_appears(
    make_agent: Callable[..., Agent], netns: str, tmp_path: Path, testnet: Callable[..., Path],
    fallback_bridge: None,
) -> None:
    agent = make_agent(fallback_network=True)
    try:
        assert agent.call("WaitReady", "d", "10")[0] is True
        assert agent.prop("DefaultNetwork") == "cni-agent-fallback"
        result = agent.setup("fb", netns)
        address = result["attachments"][0]["result"]["ips"][0]["address"]
        assert address.startswith("10.234.0.") and addresses(netns) == [address]
        assert allocations(tmp_path / "state" / "fallback-ipam", "cni-agent-fallback") == [
            address.split("/")[0]]
        testnet("real")
        wait_for(lambda: agent.prop("DefaultNetwork") == "real")
        assert agent.prop("Networks") == ["real"]
        # The sandbox on the fallback network is still torn down with its cached config.
        agent.call("Teardown", "ssa{sv}", "fb", netns, "0")
        assert allocations(tmp_path / "state" / "fallback-ipam", "cni-agent-fallback") == []
    finally:
        delete_link("cniagent0")


def test_a_different_kernel_namespace_id_marks_the_sandbox_dead_though_the_inode_matches(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    """What the kernel does when it reuses an nsfs inode for a recreated namespace:
    (st_dev, st_ino) and even eth0 with its MAC match, only NS_GET_ID differs
    (here: the record's id is changed, the agent stopped meanwhile). The kernel's
    id decides: the sandbox is dead and DELed with an empty netns, its IP
    released (issue 12, item 4)."""
    agent = make_agent()
    agent.setup("pod", netns)
    state = tmp_path / "state"
    doc = record(state, "pod")
    assert doc is not None
    nsid = doc["netnsId"]["nsId"]
    if nsid is None:
        pytest.skip("this kernel has no NS_GET_ID (Linux < 6.11)")
    control.reset_records()
    agent.call("GarbageCollect", "as", "1", "pod")
    assert agent.call("ListSandboxes")[0] == ["pod"]  # the recorded id: the same namespace
    assert _dels(control) == {}
    doc["netnsId"]["nsId"] = nsid + 1_000_000  # dev, ino and boot kept as recorded
    assert agent.stop() == 0
    replace_latest(state, "pod", doc)
    agent.start()
    assert agent.call("WaitReady", "d", "10")[0] is True
    # The GC the network's readiness starts may be reaping it already (this
    # call then finds it in use and leaves it to that one): wait for the outcome.
    agent.call("GarbageCollect", "as", "1", "pod")
    wait_for(lambda: agent.call("ListSandboxes")[0] == [], timeout=10)
    assert _dels(control) == {"pod": ""}  # another namespace: DEL without it
    assert allocations(tmp_path / "ipam", "pods") == []
    assert addresses(netns) != []  # nothing ran in the namespace the path names now
