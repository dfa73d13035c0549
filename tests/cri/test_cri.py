"""A CRI runtime's CRI (containerd 2.x; CRI-O under `make test-crio`), through
the shim, as kubelet meets it: what `Status`, `RunPodSandbox`,
`PodSandboxStatus`, `StopPodSandbox` and `RemovePodSandbox` answer, and what
is left on the node (addresses, netns, DNAT rules).

containerd runs with `restrict_oom_score_adj = true` only where root lacks
CAP_SYS_RESOURCE, as on these VMs: there runc cannot give the sandbox the
oom_score_adj of -998 containerd asks for and every RunPodSandbox fails
("can't get final child's PID from pipe: EOF"). tests/cri/containerd.py
decides it from /proc/self/status. CRI-O runs no pod process
(`drop_infra_ctr`), so it has no such case.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.cri.conftest import SUBNET, Node, netns_addresses
from tests.cri.containerd import has_cap_sys_resource
from tests.cri.cri import Pod, PortMapping
from tests.support.plugins import Control, install_plugin
from tests.support.shim import run_shim

pytestmark = pytest.mark.root


def until(what: Callable[[], bool], timeout: float) -> float:
    """Poll `what` every 20 ms; the seconds it took to come true (fails past `timeout`)."""
    t0 = time.monotonic()
    while not what():
        elapsed = time.monotonic() - t0
        assert elapsed < timeout, f"not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def dnat_rules() -> str:
    """The host ports' NAT rules, as `iptables -t nat -S` lists them: the agent's
    portmap plugin's (containerd passes portMappings) or CRI-O's own KUBE-HP-*
    chains (CRI-O maps host ports itself and passes none to CNI)."""
    out = subprocess.run(["iptables", "-w", "-t", "nat", "-S"], capture_output=True, text=True,
                         check=True).stdout
    return "\n".join(line for line in out.splitlines() if "DNAT" in line or "--dport" in line)


def network_ready_follows(node: Node, fall: float, rise: float) -> tuple[float, float, float, float]:
    """The agent's network goes and comes back, then the agent stops and starts:
    the runtime's NetworkReady follows, false within `fall` s, true within
    `rise` (10 s after the agent's start). The seconds each took."""
    node.network_file.unlink()
    gone = until(lambda: not node.cri.network_ready(), fall)
    # What `kubectl describe node` would show: the agent's own reason.
    assert "network podnet not found" in node.cri.conditions()["NetworkReady"][1]
    node.network_file.write_text(node.network)
    back = until(node.cri.network_ready, rise)
    # The agent stops: the shim answers "not running" and NetworkReady drops.
    assert node.agent.stop() == 0
    stopped = until(lambda: not node.cri.network_ready(), fall)
    assert "cni-agent is not running" in node.cri.conditions()["NetworkReady"][1]
    node.agent.start()
    started = until(node.cri.network_ready, 10)
    return gone, back, stopped, started


@pytest.mark.runtimes("containerd")
def test_the_sandbox_gets_the_oom_score_this_node_allows(node: Node) -> None:
    # With CAP_SYS_RESOURCE containerd gives the pause process -998; without it
    # (restrict_oom_score_adj) no lower than its own, and the pod still runs.
    sandbox = node.cri.run(Pod("oom"))
    pid = node.cri.status(sandbox).pid
    adj = int(Path(f"/proc/{pid}/oom_score_adj").read_text())
    own = int(Path("/proc/self/oom_score_adj").read_text())
    assert adj == (-998 if has_cap_sys_resource() else max(own, -998)), adj
    node.cri.stop(sandbox)
    node.cri.remove(sandbox)


@pytest.mark.runtimes("containerd")
def test_network_ready_follows_the_agent(node: Node) -> None:
    assert node.cri.network_ready()
    # The agent's network goes, then the agent: containerd's STATUS (1.1.0 list) says so.
    gone, _, stopped, back = network_ready_follows(node, fall=1.0, rise=5)
    print(f"NetworkReady false {gone:.3f} s after the network went, {stopped:.3f} s after the "
          f"agent stopped; true {back:.3f} s after it started")


def test_a_pod_gets_its_address_from_the_agent(node: Node) -> None:
    sandbox = node.cri.run(Pod("web", namespace="shop"))
    status = node.cri.status(sandbox)
    assert status.ready and ipaddress.ip_address(status.ip) in SUBNET
    assert netns_addresses(status.netns) == [f"{status.ip}/{SUBNET.prefixlen}"]
    assert node.cli("list").split() == [sandbox]
    assert status.ip in node.cli("show", sandbox)
    assert node.allocations() == [status.ip]
    print(f"RunPodSandbox {sandbox[:12]}: PodSandboxStatus ip {status.ip}, netns {status.netns}")

    node.cri.stop(sandbox)
    assert node.allocations() == []  # host-local released it
    assert node.cli("list").split() == []
    assert not node.cri.status(sandbox).ready
    node.cri.remove(sandbox)  # containerd's second DEL: nothing left, still success
    assert node.cri.sandboxes() == []


def crio_nft_hostports() -> str:
    """CRI-O's host ports when it keeps them in nftables (its `crio-hostports`
    table, preferred to iptables where the `nft` tool is installed): the
    `hostports` map's elements, `tcp . PORT : IP . PORT`; "" without the table."""
    out = subprocess.run(["nft", "list", "map", "ip", "crio-hostports", "hostports"],
                         capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else ""


def host_port_mapped(port: int, ip: str, to: int) -> bool:
    """Whether host port `port` is DNATed to `ip`:`to`, in iptables or CRI-O's nftables map."""
    rules = dnat_rules()
    if f"--dport {port}" in rules and f"--to-destination {ip}:{to}" in rules:
        return True
    return re.search(rf"\b{port}\b[^,}}]*:\s*{re.escape(ip)} \. {to}\b",
                     crio_nft_hostports()) is not None


def test_port_mappings_reach_the_pod(node: Node) -> None:
    sandbox = node.cri.run(Pod("web", port_mappings=[PortMapping(80, 18247)]))
    ip = node.cri.status(sandbox).ip
    assert host_port_mapped(18247, ip, 80), (dnat_rules(), crio_nft_hostports())
    if node.runtime_name == "containerd":  # the agent's portmap made them
        rules = [r for r in dnat_rules().splitlines() if "--dport 18247" in r and "DNAT" in r]
        assert rules and all(f"--to-destination {ip}:80" in r for r in rules), dnat_rules()
    node.cri.stop(sandbox)
    assert not host_port_mapped(18247, ip, 80), (dnat_rules(), crio_nft_hostports())
    assert "--dport 18247" not in dnat_rules() and "18247" not in crio_nft_hostports()
    node.cri.remove(sandbox)


def test_the_agent_and_the_runtime_restart_between_run_and_stop(node: Node) -> None:
    sandbox = node.cri.run(Pod("web", port_mappings=[PortMapping(80, 18248)]))
    ip = node.cri.status(sandbox).ip
    node.restart_agent()
    assert node.cli("list").split() == [sandbox]  # its record outlived the agent
    node.runtime.stop()
    node.runtime.start()
    until(node.cri.network_ready, 5)
    status = node.cri.status(sandbox)
    assert status.ready and status.ip == ip
    assert netns_addresses(status.netns) == [f"{ip}/{SUBNET.prefixlen}"]
    node.cri.stop(sandbox)
    assert node.allocations() == [] and node.cli("list").split() == []
    assert "--dport 18248" not in dnat_rules()
    node.cri.remove(sandbox)


def test_a_stop_while_the_agent_is_down_succeeds_and_the_address_goes_once_it_is_back(
        node: Node) -> None:
    """The runtime's StopPodSandbox while the agent is stopped: the shim queues
    the DEL (queueWhenDown, in the conflist shim-config wrote) and the stop
    succeeds at once, instead of failing until the agent is back; the agent
    runs the DEL when it starts (issue 47, item 4)."""
    sandbox = node.cri.run(Pod("web", port_mappings=[PortMapping(80, 18249)]))
    ip = node.cri.status(sandbox).ip
    assert json.loads(node.shim_conflist())["plugins"][0]["queueWhenDown"] is True
    assert node.agent.stop() == 0
    node.cri.stop(sandbox)
    assert not node.cri.status(sandbox).ready
    queue = Path(node.agent.config["state_dir"]) / "queue"
    assert [p.suffix for p in queue.glob("*.del")] == [".del"]
    assert node.allocations() == [ip]  # until the agent is back (docs/runtimes.md)
    node.agent.start()
    until(lambda: node.allocations() == [], 30)
    until(lambda: not list(queue.glob("*.del*")), 10)
    assert node.cli("list").split() == []
    assert "--dport 18249" not in dnat_rules()
    node.cri.remove(sandbox)
    assert node.cri.sandboxes() == []


def test_twenty_pods_at_once(node: Node) -> None:
    pods = [Pod(f"pod-{i}") for i in range(20)]
    with ThreadPoolExecutor(len(pods)) as pool:
        t0 = time.monotonic()
        sandboxes = list(pool.map(node.cri.run, pods))
        ran = time.monotonic() - t0
        ips = {node.cri.status(s).ip for s in sandboxes}
        assert len(ips) == 20 and all(ipaddress.ip_address(ip) in SUBNET for ip in ips)
        assert sorted(node.cli("list").split()) == sorted(sandboxes)
        assert sorted(node.allocations()) == sorted(ips)
        t0 = time.monotonic()
        list(pool.map(node.cri.stop, sandboxes))
        stopped = time.monotonic() - t0
        list(pool.map(node.cri.remove, sandboxes))
    assert node.allocations() == [] and node.cli("list").split() == []
    print(f"20 RunPodSandbox at once: {ran:.2f} s; 20 StopPodSandbox: {stopped:.2f} s")


@pytest.mark.runtimes("crio")
def test_crio_network_ready_follows_the_agent_at_its_own_poll(node: Node) -> None:
    # CRI-O reports its own last STATUS poll: every 5 s, and only because the
    # drop-in `shim-config --runtime crio --drop-in` prints (installed by the
    # fixture as a user would) sets cni_status_grace_period to 1s; a failure
    # is reported at the first poll after the grace: 5-10 s.
    until(node.cri.network_ready, 10)
    gone, back, stopped, started = network_ready_follows(node, fall=15, rise=10)
    print(f"CRI-O NetworkReady false {gone:.1f} s after the network went, true {back:.1f} s after "
          f"it came back; false {stopped:.1f} s after the agent stopped, true {started:.1f} s "
          "after it started")


def test_pod_annotations_and_cgroup_path_reach_a_plugin_that_declares_them(
        make_node: Callable[..., Node], tmp_path: Path) -> None:
    # The shim's list declares what the agent network's plugins declare
    # (shim-config reads the network), so the runtime passes them on.
    control = Control(tmp_path / "podinfo.json")
    node = make_node(first_plugins=[{
        "type": "testplug", "control": str(control.path),
        "capabilities": {"io.kubernetes.cri.pod-annotations": True, "cgroupPath": True}}])
    install_plugin(node.agent.tmp / "bin", "testplug")
    node.start()
    declared = node.cli("shim-config", "--runtime", node.runtime_name, "--network", "podnet",
                        "--config", str(node.agent.config_path))
    assert '"io.kubernetes.cri.pod-annotations": true' in declared, declared
    cgroup = f"/{node.pod_network}"  # as kubelet's /kubepods/…/pod<uid>, cgroupfs
    try:
        sandbox = node.cri.run(Pod("annotated", annotations={"example.com/team": "payments"},
                                   cgroup_parent=cgroup))
        [add] = [r for r in control.records() if r["command"] == "ADD"]
        runtime_config = add["stdin"].get("runtimeConfig", {})
        annotations = runtime_config.get("io.kubernetes.cri.pod-annotations", {})
        assert annotations.get("example.com/team") == "payments", runtime_config
        assert runtime_config.get("cgroupPath", "").startswith(cgroup), runtime_config
        node.cri.stop(sandbox)
        node.cri.remove(sandbox)
    finally:
        # Empty once the pod is gone: one per controller (v1), or one (v2).
        for d in [*Path("/sys/fs/cgroup").glob(f"*{cgroup}"), Path(f"/sys/fs/cgroup{cgroup}")]:
            if d.is_dir():
                d.rmdir()
    print(f"{node.runtime_name}: the plugin got runtimeConfig keys {sorted(runtime_config)}")


@pytest.mark.runtimes("crio")
def test_crio_gc_at_start_up_with_no_pods_releases_what_only_the_agent_knows(
        make_node: Callable[..., Node], netns: str) -> None:
    # CRI-O's state was wiped (or the node rebooted into a fresh one) while the
    # agent kept an attachment made through CRI-O's network: CRI-O starts with
    # no pods and sends GC with cni.dev/valid-attachments null.
    node = make_node()
    node.start(runtime=False)
    conf = json.loads(node.shim_conflist())
    plugin = {"cniVersion": conf["cniVersion"], "name": conf["name"], **conf["plugins"][0]}
    add = run_shim(node.agent.bus.address, "ADD", plugin, cid="orphan", netns=netns)
    assert add.rc == 0, add
    assert node.cli("list").split() == ["orphan"] and len(node.allocations()) == 1
    node.start_runtime()
    until(lambda: node.cli("list").split() == [], 20)
    assert node.allocations() == [] and netns_addresses(netns) == []
    assert "failed to GC" not in node.runtime.log(), node.runtime.log()
