"""Drift: CHECK of every attachment on a schedule and after firewalld reloads,
reported (journal, metrics, Show, a D-Bus signal) and repaired on request.

Real bridge + host-local + portmap, real namespaces, the agent on a private
bus; the signal is read by a real client (a WatchSandboxes caller). Debian 12's
portmap 1.1.1 fails CHECK right after ADD on IPv4-only networks, so the drift
cases use the 1.9.1 plugins tools/setup-system caches (skipped without them).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unique_name
from tests.daemon.test_cli import cli
from tests.daemon.test_http import samples
from tests.support.agent import Agent, Bus
from tests.support.net import addresses, allocations, delete_link, netns_name
from tests.support.plugins import Control, conflist, wait_for, write_conf
from tests.support.watch import Watcher

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("drift_checks_turn")]

PLUGINS_191 = Path("/var/cache/cni-agent-tests/cni-plugins-1.9.1")
needs_191 = pytest.mark.skipif(not (PLUGINS_191 / "portmap").exists(),
                               reason="CNI plugins 1.9.1 not cached (tools/setup-system)")
PORT = {"portMappings": [{"hostPort": 18431, "containerPort": 80, "protocol": "tcp"}]}
STAND_IN = Path(__file__).resolve().parents[1] / "support" / "firewalld_standin.py"


@pytest.fixture
def bridge() -> Iterator[str]:
    br = unique_name("cdr")
    yield br
    delete_link(br)


def pods_net(tmp_path: Path, bridge: str, portmap: bool = True, ips: bool = False) -> None:
    br: dict[str, Any] = {
        "type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
        "ipam": {"type": "host-local", "subnet": "10.216.0.0/24",
                 "dataDir": str(tmp_path / "ipam")}}
    if ips:
        br["capabilities"] = {"ips": True}
    plugins = [br]
    if portmap:
        plugins.append({"type": "portmap", "capabilities": {"portMappings": True}, "snat": False})
    write_conf(tmp_path / "net.d", "10-pods.conflist", conflist("pods", plugins, "1.0.0"))


def start(tmp_path: Path, bus: Bus, plugins: str = "/usr/lib/cni", **check: Any) -> Agent:
    sock = tmp_path / "http.sock"
    agent = Agent(tmp_path, bus, plugin_dirs=[plugins], check={"interval": 1, **check},
                  http={"listen": f"unix:{sock}"})
    agent.start()
    assert agent.call("WaitReady", "d", "10")[0] is True, agent.log()
    return agent


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for a in started:
        a.stop()


def show(agent: Agent, sid: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(agent.call("Show", "s", sid)[0])
    return doc["attachments"][0]


def attachment(agent: Agent, sid: str) -> dict[str, Any]:
    """Show's attachment; {} while a repair (or a lost one's retry) runs:
    between its DEL and its ADD the sandbox has no cached attachment to show,
    as during a Setup."""
    out = agent.busctl("--json=short", "call", "org.cniagent.Agent1", "/org/cniagent/Agent1",
                       "org.cniagent.Agent1", "Show", "s", sid, check=False)
    if out.returncode != 0:
        return {}
    return dict(json.loads(json.loads(out.stdout)["data"][0])["attachments"][0])


def repairs(agent: Agent, sid: str) -> int:
    """Show's repair count; -1 while the repair runs."""
    shown = attachment(agent, sid)
    return int(shown["check"]["repairs"]) if shown else -1


def state(agent: Agent, sid: str) -> str:
    return str(show(agent, sid)["check"]["state"])


def metric(agent: Agent, name: str, **labels: str) -> float:
    return samples(agent.tmp / "http.sock").get((name, tuple(sorted(labels.items()))), 0.0)


def dnat_chains(sid: str, network: str = "pods") -> list[str]:
    """portmap's per-container DNAT chains of this network's sandbox `sid` (the
    jump's comment names both: other files' sandboxes may share the id)."""
    nat = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True,
                         check=True).stdout
    tag = f'name: \\"{network}\\" id: \\"{sid}\\"'
    return sorted({m for line in nat.splitlines() if tag in line
                   for m in re.findall(r"CNI-DN-[0-9a-f]+", line)})


def dport_rules() -> list[str]:
    nat = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True,
                         check=True).stdout
    return [line for line in nat.splitlines() if "--dport 18431" in line and "DNAT" in line]


class Monitor(Watcher):
    """A watcher of the agent's sandboxes: what a real client receives. Since
    interface revision 5 the check signals are unicast to the callers of
    WatchSandboxes (`gdbus monitor` no longer sees them); it watches again
    whenever the agent (re)takes its name."""

    def __init__(self, bus: Bus) -> None:
        super().__init__(bus.address, follow=True)


@pytest.fixture
def monitor(system_bus: Bus) -> Iterator[Monitor]:
    m = Monitor(system_bus)
    yield m
    m.stop()


# --- drift of a flushed portmap chain (1.9.1) ----------------------------------------


@needs_191
def test_a_flushed_portmap_chain_is_drift_reported_within_the_interval(
    tmp_path: Path, system_bus: Bus, bridge: str, netns: str, agents: list[Agent],
    monitor: Monitor,
) -> None:
    pods_net(tmp_path, bridge)
    agent = start(tmp_path, system_bus, str(PLUGINS_191))
    agents.append(agent)
    agent.setup("web", netns, capabilities=PORT)
    # The baseline: the CHECK right after ADD passes with portmap 1.9.1.
    wait_for(lambda: state(agent, "web") == "ok", timeout=15)
    [chain] = dnat_chains("web")
    flushed = time.time()
    subprocess.run(["iptables", "-t", "nat", "-F", chain], check=True)  # another tool
    wait_for(lambda: state(agent, "web") == "drifted", timeout=10)
    check = show(agent, "web")["check"]
    # Found by the scheduled pass within check.interval (1 s, +10% jitter), by
    # the time the agent itself gives that CHECK (whole seconds: +1 s), plus the
    # CHECK's own run: not by how soon this test's polling looked.
    found = datetime.fromisoformat(check["last_check"].replace("Z", "+00:00")).timestamp()
    assert found - flushed < 1 * 1.1 + 1 + 1, (found, flushed)
    assert "could not check ipv4 dnat" in check["reason"], check
    assert check["last_check"].endswith("Z")
    signal = wait_for(monitor.drifted, timeout=3)
    assert len(signal) == 1 and "('web', 'pods', 'eth0', 'plugin portmap CHECK failed" in \
        signal[0], signal
    assert metric(agent, "cni_agent_drift_total", network="pods") == 1
    assert metric(agent, "cni_agent_checks_total", result="failed") >= 1
    assert metric(agent, "cni_agent_checks_total", result="ok") >= 1
    warning = [x for x in agent.log().splitlines() if "drifted" in x and "WARNING" in x]
    assert len(warning) == 1, agent.log()
    assert "SANDBOX_ID=web" in warning[0] and "NETWORK=pods" in warning[0] and \
        "IFNAME=eth0" in warning[0] and "could not check ipv4 dnat" in warning[0]
    # Still drifted at the next passes: said once, not repaired (repair is off).
    time.sleep(2.5)
    assert len(monitor.drifted()) == 1 and metric(agent, "cni_agent_drift_total",
                                                  network="pods") == 1
    assert dport_rules() == []
    # The verdict is in the record: a restarted agent still shows it.
    agent.stop()
    agent.config["check"] = {"interval": 0}
    agent.start()
    after = show(agent, "web")["check"]
    assert after["state"] == "drifted" and after["reason"] == check["reason"]
    agent.call("Teardown", "ssa{sv}", "web", netns, "0")
    assert dnat_chains("web") == []  # portmap's DEL took its chain and the jump to it


@needs_191
def test_repair_recreates_the_attachment_with_the_same_ip(
    tmp_path: Path, system_bus: Bus, bridge: str, netns: str, agents: list[Agent],
    monitor: Monitor,
) -> None:
    pods_net(tmp_path, bridge, ips=True)
    agent = start(tmp_path, system_bus, str(PLUGINS_191), repair=True)
    agents.append(agent)
    agent.setup("web", netns, capabilities=PORT)
    ip = addresses(netns)
    wait_for(lambda: state(agent, "web") == "ok", timeout=15)
    subprocess.run(["iptables", "-t", "nat", "-F", dnat_chains("web")[0]], check=True)
    wait_for(lambda: repairs(agent, "web") == 1, timeout=6)
    assert state(agent, "web") == "ok"
    assert addresses(netns) == ip and len(ip) == 1  # the same IP, kept through DEL + ADD
    assert allocations(tmp_path / "ipam", "pods") == [ip[0].split("/")[0]]
    assert len(dport_rules()) >= 1  # portmap's DNAT is back
    assert json.loads(agent.call("Show", "s", "web")[0])["attachments"][0]["result"]["ips"][0][
        "address"] == ip[0]
    assert len(wait_for(monitor.drifted, timeout=3)) == 1
    assert metric(agent, "cni_agent_repairs_total", result="ok") == 1
    assert any("repaired" in x and "WARNING" in x for x in agent.log().splitlines())
    agent.call("Teardown", "ssa{sv}", "web", netns, "0")
    assert allocations(tmp_path / "ipam", "pods") == [] and dport_rules() == []


@needs_191
def test_without_the_ips_capability_a_drift_is_reported_not_repaired(
    tmp_path: Path, system_bus: Bus, bridge: str, netns: str, agents: list[Agent],
) -> None:
    pods_net(tmp_path, bridge, ips=False)
    agent = start(tmp_path, system_bus, str(PLUGINS_191), repair=True)
    agents.append(agent)
    agent.setup("web", netns, capabilities=PORT)
    wait_for(lambda: state(agent, "web") == "ok", timeout=15)
    subprocess.run(["iptables", "-t", "nat", "-F", dnat_chains("web")[0]], check=True)
    wait_for(lambda: state(agent, "web") == "drifted", timeout=15)
    time.sleep(2.5)
    assert show(agent, "web")["check"]["repairs"] == 0 and dport_rules() == []
    refused = [x for x in agent.log().splitlines() if "not repaired" in x]
    assert len(refused) == 1 and "ips capability" in refused[0], agent.log()
    assert metric(agent, "cni_agent_repairs_total", result="refused") == 1
    agent.call("Teardown", "ssa{sv}", "web", netns, "0")
    assert dnat_chains("web") == []


def pod_forward_rules(ip: str) -> list[str]:
    """The firewall plugin's (iptables backend) rules for one pod in CNI-FORWARD."""
    out = subprocess.run(["iptables", "-S", "CNI-FORWARD"], capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if f"{ip}/32" in line]


def test_dropped_firewall_plugin_rules_are_drift_and_repaired_with_the_same_ip(
    tmp_path: Path, system_bus: Bus, bridge: str, netns: str, agents: list[Agent],
    monitor: Monitor,
) -> None:
    # Debian 12's own firewall plugin (1.1.1): its CHECK passes right after ADD.
    write_conf(tmp_path / "net.d", "10-pods.conflist", conflist("pods", [
        {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
         "capabilities": {"ips": True},
         "ipam": {"type": "host-local", "subnet": "10.218.0.0/24",
                  "dataDir": str(tmp_path / "ipam")}},
        {"type": "firewall", "backend": "iptables"}], "1.0.0"))
    agent = start(tmp_path, system_bus, "/usr/lib/cni", repair=True)
    agents.append(agent)
    agent.setup("fw", netns)
    [cidr] = addresses(netns)
    ip = cidr.split("/")[0]
    wait_for(lambda: state(agent, "fw") == "ok", timeout=15)
    rules = pod_forward_rules(ip)
    assert len(rules) == 2
    # What a firewalld reload does to the runtime rules the plugin added (only this
    # pod's: CNI-FORWARD is the host's).
    for rule in rules:
        subprocess.run(["iptables", "-D", *rule.split()[1:]], check=True)
    wait_for(lambda: repairs(agent, "fw") == 1, timeout=6)
    assert state(agent, "fw") == "ok" and addresses(netns) == [cidr]
    assert sorted(pod_forward_rules(ip)) == sorted(rules)  # the plugin's rules are back
    [signal] = wait_for(monitor.drifted, timeout=3)
    assert "('fw', 'pods', 'eth0', 'plugin firewall CHECK failed" in signal
    assert "expected rule" in signal
    agent.call("Teardown", "ssa{sv}", "fw", netns, "0")
    assert pod_forward_rules(ip) == [] and allocations(tmp_path / "ipam", "pods") == []


# --- a CHECK that never passed proves nothing (portmap 1.1.1) --------------------------


def test_portmap_1_1_1_is_check_unsupported_and_never_repaired(
    tmp_path: Path, system_bus: Bus, bridge: str, netns: str, agents: list[Agent],
    monitor: Monitor,
) -> None:
    pods_net(tmp_path, bridge, ips=True)
    agent = start(tmp_path, system_bus, "/usr/lib/cni", repair=True)  # Debian 12: 1.1.1
    agents.append(agent)
    agent.setup("web", netns, capabilities=PORT)
    wait_for(lambda: state(agent, "web") == "unsupported", timeout=15)
    assert "could not check ipv6 dnat" in show(agent, "web")["check"]["reason"]
    subprocess.run(["iptables", "-t", "nat", "-F", dnat_chains("web")[0]], check=True)
    time.sleep(3)  # passes run; the failing CHECK is no evidence: nothing is re-created
    check = show(agent, "web")["check"]
    assert check["state"] == "unsupported" and check["repairs"] == 0
    assert monitor.drifted() == []
    assert metric(agent, "cni_agent_drift_total", network="pods") == 0
    assert metric(agent, "cni_agent_checks_total", result="unsupported") >= 3
    assert not any("repaired (DEL" in x or " drifted: " in x for x in agent.log().splitlines())
    assert agent.log().count("ADD of pods") == 2  # bridge and portmap, once
    agent.call("Teardown", "ssa{sv}", "web", netns, "0")
    assert dnat_chains("web") == []


# --- firewalld triggers a pass --------------------------------------------------------


class StandIn:
    """A small dbus-fast service owning org.fedoraproject.FirewallD1 on the test bus."""

    def __init__(self, bus: Bus) -> None:
        self.proc = subprocess.Popen([sys.executable, str(STAND_IN), bus.address],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "owned"

    def reload(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("reload\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "sent"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_firewalld_reloaded_or_restarted_runs_a_pass_at_once(
    tmp_path: Path, permissive_bus: Bus, bridge: str, netns: str, agents: list[Agent],
) -> None:
    # A bus whose policy lets the stand-in own firewalld's name (the system-like one does not).
    pods_net(tmp_path, bridge, portmap=False)
    firewalld = StandIn(permissive_bus)
    try:
        # No scheduled pass in the test's time: only firewalld can trigger one.
        agent = start(tmp_path, permissive_bus, "/usr/lib/cni", interval=3600)
        agents.append(agent)
        agent.setup("web", netns)
        wait_for(lambda: state(agent, "web") == "ok", timeout=15)
        [ip] = addresses(netns)
        # What a reload does to the firewall plugin's rules, done to the pod's address.
        subprocess.run(["ip", "-n", netns_name(netns), "addr", "del", ip, "dev", "eth0"],
                       check=True)
        time.sleep(1.5)
        assert state(agent, "web") == "ok"  # nothing looked
        firewalld.reload()
        # check.interval is an hour: any pass now is the one the reload triggered.
        wait_for(lambda: state(agent, "web") == "drifted", timeout=10)
        assert "firewalld reloaded" in agent.log()
        # A restart of firewalld (a new owner of its name) triggers one too.
        subprocess.run(["ip", "-n", netns_name(netns), "addr", "add", ip, "dev", "eth0"],
                       check=True)
        firewalld.stop()
        firewalld = StandIn(permissive_bus)
        wait_for(lambda: state(agent, "web") == "ok", timeout=10)
    finally:
        firewalld.stop()


def test_check_interval_0_runs_no_check(
    tmp_path: Path, system_bus: Bus, bridge: str, netns: str, agents: list[Agent],
) -> None:
    pods_net(tmp_path, bridge, portmap=False)
    agent = start(tmp_path, system_bus, "/usr/lib/cni", interval=0)
    agents.append(agent)
    agent.setup("web", netns)
    time.sleep(1.5)
    assert state(agent, "web") == "unchecked"
    assert metric(agent, "cni_agent_checks_total", result="ok") == 0


# --- a pass never holds up a request ----------------------------------------------------


def test_a_slow_scheduled_check_yields_to_teardown_and_gc_at_once(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns_factory: Callable[[], str],
) -> None:
    testnet()
    agent = make_agent(check={"interval": 1})
    agent.setup("a", netns_factory())
    agent.setup("b", netns_factory())
    before = len(control.records(None))
    control.set("CHECK", "succeed", sleep=30)  # a CHECK plugin that hangs
    wait_for(lambda: [r for r in control.records(None)[before:] if r["command"] == "CHECK"],
             timeout=5)
    start = time.monotonic()
    agent.call("Teardown", "ssa{sv}", "a", "", "0")
    agent.call("GarbageCollect", "as", "0")  # b is not listed: reaped, not "busy"
    # Far less than the CHECK's 30 s: neither waited for it (each stopped it).
    assert time.monotonic() - start < 15, "a request waited for a scheduled CHECK"
    assert agent.call("ListSandboxes")[0] == []
    late = [r for r in control.records(None)[before:] if r["command"] == "CHECK"]
    assert not [r for r in late if r["phase"] == "end"]  # killed, never finished


# --- the check CLI ----------------------------------------------------------------------


def test_the_check_cli_reports_drift_and_exits_1(
    tmp_path: Path, system_bus: Bus, bridge: str, netns_factory: Callable[[], str],
    agents: list[Agent],
) -> None:
    pods_net(tmp_path, bridge, portmap=False)
    agent = start(tmp_path, system_bus, "/usr/lib/cni", interval=3600)  # no pass meanwhile
    agents.append(agent)
    good, bad = netns_factory(), netns_factory()
    agent.setup("good", good)
    agent.setup("bad", bad)
    wait_for(lambda: state(agent, "good") == state(agent, "bad") == "ok", timeout=15)
    out = cli(agent, "check")
    assert out.returncode == 0, out.stderr
    [ip] = addresses(bad)
    subprocess.run(["ip", "-n", netns_name(bad), "addr", "del", ip, "dev", "eth0"], check=True)
    out = cli(agent, "check")
    assert out.returncode == 1 and out.stderr == "", (out.stdout, out.stderr)
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["SANDBOX", "NETWORK", "IFNAME", "CHECK", "LAST", "CHECK", "REASON"]
    assert lines[1].split()[:4] == ["bad", "pods", "eth0", "drifted"] and "bridge" in lines[1]
    assert lines[2].split()[:4] == ["good", "pods", "eth0", "ok"]
    rows = json.loads(cli(agent, "check", "good", "--json").stdout)["attachments"]
    assert [(r["sandbox"], r["state"], r["drifted_now"]) for r in rows] == [("good", "ok", False)]
    assert state(agent, "bad") == "drifted"  # what the CLI found is what Show says
    # `show` says so too, in its text; a sandbox that has not drifted, nothing more.
    shown = cli(agent, "show", "bad").stdout.splitlines()
    assert len(shown) == 1 and shown[0].startswith("pods  eth0  ") and "  drifted (CHECK failed at " \
        in shown[0] and "bridge" in shown[0], shown
    assert cli(agent, "show", "good").stdout.splitlines() == [f"pods  eth0  {addresses(good)[0]}"]
    assert cli(agent, "check", "nosuch").returncode == 1
