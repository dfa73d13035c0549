"""Sequences no single call shows, through D-Bus with the real bridge + host-local.

Each is one of the ways the agent used to break its promise ("nothing left
half set up; nothing leaks"): a Teardown overtaken by a Setup still waiting
for readiness, a pending GC freezing the node, an id reused after its netns
died, calls during start-up recovery, two agents on one state dir.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.conftest import bridge_plugins
from tests.support.agent import IFACE, NAME, PATH, Agent, Bus
from tests.support.net import addresses, allocations, link_exists
from tests.support.plugins import Control, conflist, wait_for, write_conf
from tests.support.state import record

pytestmark = pytest.mark.root

ERR = "org.cniagent.Agent1.Error."


def _veths(bridge: str) -> int:
    out = subprocess.run(["ip", "-j", "link", "show", "master", bridge], capture_output=True,
                         text=True)
    return len(json.loads(out.stdout or "[]")) if out.returncode == 0 else 0


def test_teardown_after_a_timed_out_setup_wins(
    make_agent: Callable[..., Agent], control: Control, netns: str, tmp_path: Path,
    bridge_name: str,
) -> None:
    # No network yet: a Setup waits for readiness (up to timeouts.ready)...
    agent = make_agent(timeouts={"ready": 30, "lock": 5})
    setup = agent.busctl_bg("Setup", "ssa{sv}", "late", netns, "0", timeout=1)
    _, err = setup.communicate(timeout=20)
    assert setup.returncode != 0 and "timed out" in err.lower(), err  # ...its caller gave up
    # ...and cleaned up, as runtimes do: the Teardown finds nothing and succeeds.
    agent.call("Teardown", "ssa{sv}", "late", netns, "0")
    control.reset_records()
    write_conf(tmp_path / "net.d", "10-pods.conflist",
               conflist("pods", bridge_plugins(tmp_path, control, bridge_name), "1.0.0"))
    assert agent.call("WaitReady", "d", "10")[0] is True
    time.sleep(1)  # the waiting Setup, if it were still alive, runs now
    assert "ADD" not in control.commands()
    assert allocations(tmp_path / "ipam", "pods") == []
    assert agent.call("ListSandboxes")[0] == []
    assert addresses(netns) == [] and not link_exists("eth0", netns)
    assert _veths(bridge_name) == 0
    assert "a later Teardown of it arrived before this request started" in agent.log()


def test_another_sandboxs_setup_succeeds_while_a_gc_waits_behind_a_slow_add(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    agent = make_agent(timeouts={"lock": 1, "ready": 5, "add": 30})
    control.set("ADD", "succeed", sleep=3)  # every ADD of the chain's last plugin is slow
    slow = agent.busctl_bg("Setup", "ssa{sv}", "slow", netns_factory(), "0", timeout=30)
    wait_for(lambda: "ADD" in control.commands())
    gc = agent.busctl_bg("GarbageCollect", "as", "2", "slow", "other", timeout=30)
    time.sleep(0.3)  # the GC is pending behind the slow ADD
    # Far longer than timeouts.lock (1 s) behind the slow ADD: a node-wide GC lock
    # made this fail with Busy; now nobody waits for the GC.
    other = netns_factory()
    result = agent.setup("other", other)
    address = result["attachments"][0]["result"]["ips"][0]["address"]
    assert addresses(other) == [address]
    _, err = slow.communicate(timeout=30)
    assert slow.returncode == 0, err
    _, err = gc.communicate(timeout=30)
    assert gc.returncode == 0, err
    assert sorted(agent.call("ListSandboxes")[0]) == ["other", "slow"]
    assert len(allocations(tmp_path / "ipam", "pods")) == 2


def test_id_reused_after_its_netns_died_is_set_up_again(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    agent = make_agent()
    first, second = netns_factory(), netns_factory()
    old = agent.setup("pod", first)["attachments"][0]["result"]["ips"][0]["address"]
    subprocess.run(["ip", "netns", "del", Path(first).name], check=True)  # the container exited
    control.reset_records()
    new = agent.setup("pod", second)["attachments"][0]["result"]["ips"][0]["address"]
    assert addresses(second) == [new]
    # The dead attachment was reaped (DEL with an empty netns) and its IP released.
    dels = [r["env"]["CNI_NETNS"] for r in control.records() if r["command"] == "DEL"]
    assert dels == [""]
    assert allocations(tmp_path / "ipam", "pods") == [new.split("/")[0]]
    assert old != new or len(allocations(tmp_path / "ipam", "pods")) == 1
    assert json.loads(agent.call("Show", "s", "pod")[0])["state"] == "ready"


def test_calls_at_start_up_wait_for_recovery(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    agent = make_agent()
    crashed, other = netns_factory(), netns_factory()
    control.set("ADD", "hang")  # bridge + host-local ran; the agent dies in the chain
    hung = agent.busctl_bg("Setup", "ssa{sv}", "crashed", crashed, "0", timeout=30)
    wait_for(lambda: "ADD" in control.commands())
    assert agent.stop(signal.SIGKILL) == -signal.SIGKILL
    hung.wait(10)
    control.clear("ADD")
    control.set("DEL", "succeed", sleep=1.5)  # recovery's DEL takes a while
    control.reset_records()
    agent.start(wait=False)
    # The moment the name is on the bus (bus activation would deliver queued calls now):
    wait_for(lambda: NAME in agent.busctl("list", "--acquired", check=False).stdout, timeout=20)
    calls: dict[str, Any] = {}

    def call(sid: str, ns: str) -> None:
        calls[sid] = agent.busctl("--json=short", "call", NAME, PATH, IFACE, "Setup", "ssa{sv}",
                                  sid, ns, "0", check=False)

    threads = [threading.Thread(target=call, args=a) for a in (("crashed", crashed), ("other", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(c.returncode == 0 for c in calls.values()), {k: c.stderr for k, c in calls.items()}
    recs = control.records(None)
    recovery_del = next(r for r in recs if r["phase"] == "end" and r["command"] == "DEL")
    first_add = min(r["start"] for r in recs if r["phase"] == "start" and r["command"] == "ADD")
    assert recovery_del["env"]["CNI_CONTAINERID"] == "crashed"
    assert recovery_del["end"] <= first_add  # no call ran before recovery was over
    assert len(allocations(tmp_path / "ipam", "pods")) == 2
    assert sorted(agent.call("ListSandboxes")[0]) == ["crashed", "other"]


def test_second_agent_on_the_same_state_dir_refuses_to_start(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path, permissive_bus: Bus,
) -> None:
    first = make_agent(timeouts={"add": 20, "lock": 5, "ready": 5})
    control.set("ADD", "hang")
    inflight = first.busctl_bg("Setup", "ssa{sv}", "inflight", netns, "0", timeout=30)
    wait_for(lambda: "ADD" in control.commands())
    plugin = next(r["pid"] for r in control.records() if r["command"] == "ADD")
    state = tmp_path / "state"
    assert (record(state, "inflight") or {}).get("phase") == "adding"
    # Another bus, same state dir (an operator's mistake, a test, a second unit).
    second = Agent(tmp_path / "second", permissive_bus, state_dir=str(tmp_path / "state"),
                   conf_dir=str(tmp_path / "net.d"))
    (tmp_path / "second").mkdir()
    second.write_config()
    out = subprocess.run([sys.executable, "-m", "cni_agent", "run", "--config",
                          str(second.config_path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out
    assert first.proc is not None
    assert out.stderr.splitlines()[-1] == (
        f"cni-agent: {tmp_path / 'state'} is in use by another cni-agent (pid {first.proc.pid}); "
        "two agents on one state_dir would undo each other's work")
    # The first agent's work is untouched: its plugin still runs, its record is in flight.
    assert Path(f"/proc/{plugin}").exists()
    assert (record(state, "inflight") or {}).get("phase") == "adding"
    assert first.proc.poll() is None
    inflight.kill()
    control.clear("ADD")
