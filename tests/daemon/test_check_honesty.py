"""CHECK and repair say what happened (issue 36, item 5).

Drift is a plugin's own CHECK failure (a CNI error with a code). A CHECK
that times out is "failed-to-run": never drift, never repaired (before, it
was drift, and with check.repair the pod got another IP: 10.92.6.2 → .4). A
repair that cannot keep the address is reported, not done; one whose re-ADD
comes back with another address is "repaired-with-new-address", never "ok";
one whose re-ADD fails leaves the attachment "lost", kept in the record and
ADDed again with backoff until that succeeds (across restarts) or the
sandbox is torn down.

Real bridge + host-local, the test plugin last in the chain for the faults
(its control file makes CHECK hang or fail, and ADD fail), the agent on a
private bus, its signals read by a WatchSandboxes caller, its metrics over HTTP.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.conftest import bridge_plugins
from tests.daemon.test_cli import cli
from tests.daemon.test_drift import Monitor, attachment, metric, show
from tests.support.agent import Agent, Bus
from tests.support.net import addresses, allocations, link_exists
from tests.support.plugins import Control, conflist, wait_for, write_conf
from tests.support.state import record

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("drift_checks_turn")]
ERR = "org.cniagent.Agent1.Error."
SUBNET = "10.92.6.0/24"
REPAIRS = ("ok", "unverified", "new_address", "refused", "failed", "retry_ok", "retry_failed")


@pytest.fixture
def signals(system_bus: Bus) -> Iterator[Monitor]:
    m = Monitor(system_bus)
    yield m
    m.stop()


def pods(tmp_path: Path, control: Control, bridge: str, *, bridge_ips: bool = False,
         plugin_ips: bool = False) -> None:
    """bridge + host-local, then the test plugin. `bridge_ips`: bridge (whose
    host-local honours it) declares the ips capability, so a repair can ask for
    the same IP; `plugin_ips`: only the test plugin declares it (and ignores it),
    as a chain whose declaration does not reach its IPAM."""
    br, tail = bridge_plugins(tmp_path, control, bridge, SUBNET)
    if bridge_ips:
        br["capabilities"] = {"ips": True}
    if plugin_ips:
        tail["capabilities"] = {"ips": True}
    write_conf(tmp_path / "net.d", "10-pods.conflist", conflist("pods", [br, tail], "1.0.0"))


def start(make_agent: Callable[..., Agent], tmp_path: Path, **check: Any) -> Agent:
    """CHECK passes every second with repair on; CHECK's deadline 1 s."""
    return make_agent(check={"interval": 1, "repair": True, **check},
                      http={"listen": f"unix:{tmp_path / 'http.sock'}"},
                      timeouts={"ready": 2, "lock": 5, "check": 1})


def checked(agent: Agent, sid: str) -> dict[str, Any]:
    return dict(attachment(agent, sid).get("check") or {})


def state(agent: Agent, sid: str) -> str:
    return str(checked(agent, sid).get("state", ""))


def changes(signals: Monitor) -> list[str]:
    return [line for line in list(signals.lines) if "AttachmentCheckChanged" in line]


def adds(control: Control) -> int:
    return sum(1 for r in control.records() if r["command"] == "ADD")


def check_of(agent: Agent, sid: str = "web") -> dict[str, Any]:
    return dict(show(agent, sid)["check"])


def test_a_check_that_times_out_is_not_drift_and_is_never_repaired(
    make_agent: Callable[..., Agent], tmp_path: Path, control: Control, bridge_name: str,
    netns: str, signals: Monitor,
) -> None:
    # The test plugin declares ips: a repair would ask for the IP, and the
    # chain would give another (host-local never sees it). Nothing may repair.
    pods(tmp_path, control, bridge_name, plugin_ips=True)
    agent = start(make_agent, tmp_path)
    agent.setup("web", netns)
    [ip] = addresses(netns)
    wait_for(lambda: state(agent, "web") == "ok", timeout=5)  # the baseline
    control.set("CHECK", "hang", only=["testplug"])

    wait_for(lambda: state(agent, "web") == "failed-to-run", timeout=10)
    # Passes go on, each CHECK timing out: none is drift, none repairs.
    wait_for(lambda: metric(agent, "cni_agent_checks_total", result="failed_to_run") >= 3,
             timeout=20)
    check = check_of(agent)
    assert check["state"] == "failed-to-run" and check["repairs"] == 0, check
    assert "timed out" in check["reason"] and "testplug" in check["reason"]
    assert addresses(netns) == [ip] and allocations(tmp_path / "ipam", "pods") == \
        [ip.split("/")[0]]
    assert adds(control) == 1  # the Setup's (the test plugin records its own runs)
    assert metric(agent, "cni_agent_drift_total", network="pods") == 0
    assert all(metric(agent, "cni_agent_repairs_total", result=r) == 0 for r in REPAIRS)
    assert signals.drifted() == []
    [changed] = wait_for(lambda: changes(signals), timeout=3)
    assert "('web', 'pods', 'eth0', 'failed-to-run', 'plugin testplug CHECK" in changed
    shown = cli(agent, "show", "web").stdout
    assert "  check failed to run at " in shown and "timed out" in shown, shown
    out = cli(agent, "check", "web")
    assert out.returncode == 1 and "failed-to-run" in out.stdout, out.stdout
    # The cause gone, the next CHECK passes: back to ok, the same IP all along.
    control.clear("CHECK")
    wait_for(lambda: state(agent, "web") == "ok", timeout=10)
    assert addresses(netns) == [ip]
    assert len(wait_for(lambda: changes(signals)[1:], timeout=3)) == 1  # → ok


def test_a_repair_that_would_change_the_address_is_reported_not_done(
    make_agent: Callable[..., Agent], tmp_path: Path, control: Control, bridge_name: str,
    netns: str, signals: Monitor,
) -> None:
    pods(tmp_path, control, bridge_name)  # nothing declares ips: the IP cannot be asked for
    agent = start(make_agent, tmp_path)
    agent.setup("web", netns)
    [ip] = addresses(netns)
    wait_for(lambda: state(agent, "web") == "ok", timeout=5)
    control.set("CHECK", "fail", code=100, msg="rule gone", only=["testplug"])

    wait_for(lambda: check_of(agent)["repair"].startswith("refused"), timeout=10)
    wait_for(lambda: metric(agent, "cni_agent_checks_total", result="failed") >= 3, timeout=10)
    check = check_of(agent)
    assert check["state"] == "drifted" and check["repairs"] == 0
    assert "rule gone" in check["reason"]
    assert check["repair"] == ("refused: repair would change the address (network pods does "
                               "not declare the ips capability, so a new ADD could give the "
                               "sandbox another IP)")
    assert addresses(netns) == [ip] and adds(control) == 1
    assert metric(agent, "cni_agent_repairs_total", result="refused") == 1  # said once
    assert len(signals.drifted()) == 1
    # Two changes: the drift (the plugin's words), then the repair's outcome.
    drift, refused = [x for x in changes(signals) if "'drifted'" in x]
    assert "rule gone" in drift
    assert "repair would change the address: network pods does not declare the ips" in refused
    shown = cli(agent, "show", "web").stdout
    assert "drifted (CHECK failed at " in shown and "rule gone" in shown and \
        "refused: repair would change the address" in shown, shown
    out = cli(agent, "check", "web")
    assert out.returncode == 1 and "refused: repair would change the address" in out.stdout


@pytest.mark.parametrize("how", ["repair_new_address", "ips_declared_but_ignored"])
def test_a_repair_that_gives_another_address_is_never_ok(
    make_agent: Callable[..., Agent], tmp_path: Path, control: Control, bridge_name: str,
    netns: str, signals: Monitor, how: str,
) -> None:
    if how == "repair_new_address":  # the admin allows it: re-ADD without asking for the IP
        pods(tmp_path, control, bridge_name)
        agent = start(make_agent, tmp_path, repair_new_address=True)
    else:  # the re-ADD asks for the IP, and the chain gives another all the same
        pods(tmp_path, control, bridge_name, plugin_ips=True)
        agent = start(make_agent, tmp_path)
    agent.setup("web", netns)
    [before] = addresses(netns)
    wait_for(lambda: state(agent, "web") == "ok", timeout=5)
    control.set("CHECK", "fail", code=100, msg="rule gone", once=True, only=["testplug"])

    wait_for(lambda: state(agent, "web") == "repaired-with-new-address", timeout=10)
    [after] = addresses(netns)
    assert after != before
    check = check_of(agent)
    assert check["repairs"] == 1 and check["reason"] == \
        f"the address changed: {before} → {after}", check
    assert allocations(tmp_path / "ipam", "pods") == [after.split("/")[0]]
    assert metric(agent, "cni_agent_repairs_total", result="new_address") == 1
    assert metric(agent, "cni_agent_repairs_total", result="ok") == 0
    # Its CHECKs pass from then on; it is still said, not "ok".
    passes = metric(agent, "cni_agent_checks_total", result="ok")
    wait_for(lambda: metric(agent, "cni_agent_checks_total", result="ok") >= passes + 2,
             timeout=10)
    assert state(agent, "web") == "repaired-with-new-address"
    assert any(f"'repaired-with-new-address', 'the address changed: {before} → {after}'" in x
               for x in changes(signals)), changes(signals)
    # The sandbox event of the repair: its new address, ready again.
    [repaired] = [c for c in signals.changes() if c["change"] == "repaired"]
    assert repaired["sandbox"] == "web" and repaired["attachments"][0]["state"] == "ready"
    assert repaired["attachments"][0]["addresses"] == [after], repaired
    shown = cli(agent, "show", "web").stdout
    assert f"repaired with a new address (the address changed: {before} → {after})" in shown


def lose(agent: Agent, control: Control) -> dict[str, Any]:
    """Drift once, and make the repair's re-ADD fail: the attachment is lost.
    Show's attachment then (its retries, every second or more, each make Show
    answer NotFound for a moment: reads of Show wait for one that answers)."""
    control.set("ADD", "fail", code=11, msg="no room right now", only=["testplug"])
    control.set("CHECK", "fail", code=100, msg="rule gone", once=True, only=["testplug"])
    return dict(wait_for(lambda: (a := attachment(agent, "web")).get("check", {}).get("state")
                         == "lost" and a, timeout=10))


def test_a_failed_repair_is_kept_lost_and_retried_until_it_succeeds_across_a_restart(
    make_agent: Callable[..., Agent], tmp_path: Path, control: Control, bridge_name: str,
    netns: str, signals: Monitor,
) -> None:
    pods(tmp_path, control, bridge_name, bridge_ips=True)  # a repair keeps the IP
    agent = start(make_agent, tmp_path)
    agent.setup("web", netns)
    [ip] = addresses(netns)
    wait_for(lambda: state(agent, "web") == "ok", timeout=5)
    lost = lose(agent, control)

    check = lost["check"]
    assert lost["result"] == {} and check["attempts"] >= 1 and check["next_try"]
    assert "no room right now" in check["reason"] and check["lost_since"]
    assert not link_exists("eth0", netns)  # the repair's DEL, and the failed ADD rolled back
    assert allocations(tmp_path / "ipam", "pods") == []
    assert metric(agent, "cni_agent_attachments_lost") == 1
    assert metric(agent, "cni_agent_repairs_total", result="failed") == 1
    assert any("is lost: kept in the record and retried" in x and "ERROR" in x
               for x in agent.log().splitlines()), agent.log()[-3000:]
    assert any("'lost', 'plugin testplug ADD failed (code 11): no room right now'" in x
               for x in changes(signals)), changes(signals)
    # The sandbox event: lost, with the address it had (released meanwhile).
    [gone] = [c for c in signals.changes() if c["change"] == "lost"]
    assert gone["attachments"][0]["state"] == "lost" and \
        gone["attachments"][0]["addresses"] == [ip], gone
    wait_for(lambda: "pods  eth0  -  lost (removed by a repair whose ADD failed" in
             cli(agent, "show", "web").stdout, timeout=10)
    assert cli(agent, "check", "web").returncode == 1  # (CheckSandboxes waits for the lock)
    out = agent.gdbus("Check", "web", netns, "{}")
    assert ERR + "PluginFailed" in out.stderr and "pods/eth0 is lost" in out.stderr

    # Retried with backoff (here from 1 s: check.interval), failing while the cause lasts.
    wait_for(lambda: metric(agent, "cni_agent_repairs_total", result="retry_failed") >= 1,
             timeout=10)
    agent.stop()
    agent.start()  # the record keeps it lost, with its count and next try
    assert agent.call("WaitReady", "d", "10")[0] is True
    # (Its next try may be due at once: while an ADD runs, Show has nothing to show.)
    check = wait_for(lambda: (c := checked(agent, "web")).get("state") == "lost" and c,
                     timeout=10)
    assert check["attempts"] >= 2, check
    control.clear("ADD")  # the cause goes away

    wait_for(lambda: state(agent, "web") == "ok", timeout=30)
    assert addresses(netns) == [ip]  # asked for again, and given
    assert allocations(tmp_path / "ipam", "pods") == [ip.split("/")[0]]
    assert metric(agent, "cni_agent_attachments_lost") == 0
    assert metric(agent, "cni_agent_repairs_total", result="retry_ok") == 1
    assert "ADDed again after it was lost" in agent.log()
    agent.call("Teardown", "ssa{sv}", "web", netns, "0")
    assert allocations(tmp_path / "ipam", "pods") == []


def stop_mid_repair(agent: Agent, control: Control, verb: str, runs: int,
                    how: signal.Signals) -> None:
    """Make a drift repair whose `verb` (its DEL, or its re-ADD) never ends, and
    stop the agent with `how` while it runs (the plugin has run `verb` `runs` times)."""
    control.set(verb, "hang", only=["testplug"])
    control.set("CHECK", "fail", code=100, msg="rule gone", once=True, only=["testplug"])
    wait_for(lambda: [r["command"] for r in control.records()
                      if r.get("type") == "testplug"].count(verb) == runs, timeout=10)
    agent.stop(how)


def restarted_with_it_lost(agent: Agent) -> None:
    """The restart keeps the sandbox, its attachment lost (retried), and says so."""
    agent.start()
    assert agent.call("WaitReady", "d", "10")[0] is True
    # (Its retry is due at once: while that ADD runs, the sandbox is not listed.)
    wait_for(lambda: agent.call("ListSandboxes")[0] == ["web"], timeout=10)
    check = wait_for(lambda: (c := checked(agent, "web")).get("state") == "lost" and c,
                     timeout=10)
    assert check["attempts"] >= 1 and check["next_try"], check
    assert "the repair of pods/eth0 was interrupted" in agent.log()


def repaired_once_the_cause_goes(agent: Agent, control: Control, tmp_path: Path, netns: str,
                                 ip: str) -> None:
    """The retry ADDs it again, with its address; a Teardown releases it."""
    control.clear("ADD")
    wait_for(lambda: state(agent, "web") == "ok", timeout=30)
    assert addresses(netns) == [ip]
    assert allocations(tmp_path / "ipam", "pods") == [ip.split("/")[0]]
    agent.call("Teardown", "ssa{sv}", "web", netns, "0")
    assert allocations(tmp_path / "ipam", "pods") == []


def test_a_repair_killed_mid_add_is_kept_lost_not_dropped_and_repaired_after_the_restart(
    make_agent: Callable[..., Agent], tmp_path: Path, control: Control, bridge_name: str,
    netns: str,
) -> None:
    """The agent killed while a repair's re-ADD runs: the restart rolls that ADD
    back and keeps the attachment lost (retried), as a failed ADD would; the
    sandbox never leaves the record (it once did: recovery took the repair's
    intent for an unfinished Setup and dropped the sandbox with it)."""
    pods(tmp_path, control, bridge_name, bridge_ips=True)
    agent = start(make_agent, tmp_path)
    agent.setup("web", netns)
    [ip] = addresses(netns)
    wait_for(lambda: state(agent, "web") == "ok", timeout=5)
    stop_mid_repair(agent, control, "ADD", 2, signal.SIGKILL)  # the Setup's, the repair's
    control.set("ADD", "fail", code=11, msg="no room right now", only=["testplug"])
    restarted_with_it_lost(agent)
    repaired_once_the_cause_goes(agent, control, tmp_path, netns, ip)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "shut_down"])
def test_a_repair_stopped_mid_del_is_kept_lost_not_dropped_and_repaired_after_the_restart(
    make_agent: Callable[..., Agent], tmp_path: Path, control: Control, bridge_name: str,
    netns: str, how: signal.Signals,
) -> None:
    """The agent killed, or shut down, while a repair's DEL runs (the DEL every
    repair and every retry of a lost attachment starts with): the restart
    finishes that DEL and keeps the attachment lost (retried); the sandbox never
    leaves the record (it once did: recovery took the repair's DEL for a
    removal and dropped the sandbox with it, as a CI run saw once)."""
    pods(tmp_path, control, bridge_name, bridge_ips=True)
    agent = start(make_agent, tmp_path)
    agent.setup("web", netns)
    [ip] = addresses(netns)
    wait_for(lambda: state(agent, "web") == "ok", timeout=5)
    stop_mid_repair(agent, control, "DEL", 1, how)
    control.clear("DEL")
    control.set("ADD", "fail", code=11, msg="no room right now", only=["testplug"])
    restarted_with_it_lost(agent)
    assert not link_exists("eth0", netns)  # its DEL was finished
    repaired_once_the_cause_goes(agent, control, tmp_path, netns, ip)


def test_a_repair_killed_mid_add_whose_namespace_went_meanwhile_is_reaped_and_released(
    make_agent: Callable[..., Agent], tmp_path: Path, control: Control, bridge_name: str,
    netns: str,
) -> None:
    """The same kill, and the runtime deleted the namespace while the agent was
    down: the restart keeps nothing half-made and leaks no address."""
    pods(tmp_path, control, bridge_name, bridge_ips=True)
    agent = start(make_agent, tmp_path)
    agent.setup("web", netns)
    wait_for(lambda: state(agent, "web") == "ok", timeout=5)
    stop_mid_repair(agent, control, "ADD", 2, signal.SIGKILL)
    subprocess.run(["ip", "netns", "delete", Path(netns).name], check=True)
    control.clear("ADD")
    agent.start()
    assert agent.call("WaitReady", "d", "10")[0] is True
    wait_for(lambda: agent.call("ListSandboxes")[0] == [], timeout=10)
    wait_for(lambda: allocations(tmp_path / "ipam", "pods") == [], timeout=10)
    assert "the repair of pods/eth0 was interrupted" in agent.log()  # kept lost, then reaped


def test_teardown_of_a_sandbox_with_a_lost_attachment(
    make_agent: Callable[..., Agent], tmp_path: Path, control: Control, bridge_name: str,
    netns: str,
) -> None:
    pods(tmp_path, control, bridge_name, bridge_ips=True)
    agent = start(make_agent, tmp_path)
    agent.setup("web", netns)
    wait_for(lambda: state(agent, "web") == "ok", timeout=5)
    lose(agent, control)
    agent.call("Teardown", "ssa{sv}", "web", netns, "0")  # a DEL with its recorded config
    assert agent.call("ListSandboxes")[0] == []
    assert record(tmp_path / "state", "web") is None
    assert metric(agent, "cni_agent_attachments_lost") == 0
    assert ERR + "NotFound" in agent.gdbus("Show", "web").stderr
    tried = adds(control)
    time.sleep(3)  # the retries' backoff was 1 s: none comes for a sandbox that is gone
    assert adds(control) == tried and not link_exists("eth0", netns)
    assert allocations(tmp_path / "ipam", "pods") == []
    assert json.loads(agent.call("CheckSandboxes", "as", "0")[0]) == {"attachments": []}
