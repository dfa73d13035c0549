"""The node's pod CIDRs: a value SetPodCIDRs saved overrides the config's
`pod_cidrs`, and the node's owner can always see that and undo it.

Real agent, real CLI and busctl on the private bus, the test plugin recording
the ipRanges each ADD is given.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.conftest import plug
from tests.daemon.test_cli import cli, ok
from tests.support.agent import Agent, Bus, as_user_python, member_cli
from tests.support.plugins import Control, wait_for

pytestmark = pytest.mark.root

ERR = "org.cniagent.Agent1.Error."
SAVED_NOTE = "(saved by SetPodCIDRs; overrides pod_cidrs in the configuration)"


def config_show(agent: Agent) -> str:
    return ok(cli("", "config", "show", "--config", str(agent.config_path)))


def ranges_of_last_add(control: Control) -> object:
    add = [r for r in control.records() if r["command"] == "ADD"][-1]
    return add["stdin"]["runtimeConfig"].get("ipRanges")


def test_a_saved_value_overrides_the_config_visibly_until_reset(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns_factory: Callable[[], str],
) -> None:
    testnet(plugins=[plug(control, capabilities={"ipRanges": True})])
    agent = make_agent(pod_cidrs=["10.244.1.0/24"])
    saved_file = Path(agent.config["state_dir"]) / "pod-cidrs.json"
    assert ok(cli(agent, "pod-cidrs")).splitlines() == [
        "Pod CIDRs: 10.244.1.0/24", "Source:    configuration (pod_cidrs)"]
    assert agent.prop("PodCIDRsSource") == "config"
    assert "# pod_cidrs in effect" not in config_show(agent)

    # kubelet's POD_CIDR_CHANGE, as the CLI sends it: saved, and said to override.
    out = ok(cli(agent, "pod-cidrs", "10.244.7.0/24", "fd00:7::/64"))
    assert out.splitlines()[0] == "Pod CIDRs: 10.244.7.0/24, fd00:7::/64"
    assert "saved by SetPodCIDRs; overrides pod_cidrs" in out and "--reset" in out
    assert json.loads(saved_file.read_text()) == {"cidrs": ["10.244.7.0/24", "fd00:7::/64"]}
    status = ok(cli(agent, "status"))
    assert f"Pod CIDRs: 10.244.7.0/24, fd00:7::/64 {SAVED_NOTE}" in status.splitlines()
    doc = json.loads(ok(cli(agent, "status", "--json")))
    assert doc["pod_cidrs"] == ["10.244.7.0/24", "fd00:7::/64"] and doc["pod_cidrs_source"] == "saved"
    shown = config_show(agent)
    assert "pod_cidrs: [10.244.1.0/24]" in shown  # the config's own value, with its origin
    assert (f"# pod_cidrs in effect: [10.244.7.0/24, 'fd00:7::/64'], saved by SetPodCIDRs in "
            f"{saved_file}: it overrides the line above") in shown
    as_json = json.loads(ok(cli("", "config", "show", "--json", "--config", str(agent.config_path))))
    assert as_json["pod_cidrs_saved"] == {"file": str(saved_file),
                                          "value": ["10.244.7.0/24", "fd00:7::/64"]}
    assert "overrides pod_cidrs in the configuration (10.244.1.0/24)" in agent.log()

    # Across a restart: still the saved value, and the log says so again.
    assert agent.stop() == 0
    agent.config["pod_cidrs"] = ["10.244.2.0/24"]  # an admin edits the config meanwhile
    agent.start()
    assert agent.prop("PodCIDRs") == ["10.244.7.0/24", "fd00:7::/64"]
    assert agent.prop("PodCIDRsSource") == "saved"
    assert agent.log().count("overrides pod_cidrs in the configuration (10.244.2.0/24)") == 1
    agent.setup("before-reset", netns_factory())
    assert ranges_of_last_add(control) == [[{"subnet": "10.244.7.0/24"}], [{"subnet": "fd00:7::/64"}]]

    # A reload with another config value: it cannot take effect, and the log says why.
    agent.config["pod_cidrs"] = ["10.244.3.0/24"]
    agent.write_config()
    agent.call("Reload")
    assert agent.prop("PodCIDRs") == ["10.244.7.0/24", "fd00:7::/64"]
    assert "overrides pod_cidrs in the configuration (10.244.3.0/24)" in agent.log()

    # Reset: the file is gone, the config's value (as reloaded) is in effect at
    # once, for the next ADD too, and across a restart.
    out = ok(cli(agent, "pod-cidrs", "--reset"))
    assert out.splitlines() == ["Pod CIDRs: 10.244.3.0/24", "Source:    configuration (pod_cidrs)"]
    assert not saved_file.exists()
    assert agent.prop("PodCIDRsSource") == "config"
    assert "# pod_cidrs in effect" not in config_show(agent)
    assert json.loads(ok(cli(agent, "pod-cidrs", "--json"))) == {
        "pod_cidrs": ["10.244.3.0/24"], "source": "config"}
    agent.setup("after-reset", netns_factory())
    assert ranges_of_last_add(control) == [[{"subnet": "10.244.3.0/24"}]]
    assert agent.stop() == 0
    agent.start()
    assert agent.prop("PodCIDRs") == ["10.244.3.0/24"] and agent.prop("PodCIDRsSource") == "config"
    # A reset with nothing saved changes nothing and succeeds.
    ok(cli(agent, "pod-cidrs", "--reset"))
    assert agent.prop("PodCIDRs") == ["10.244.3.0/24"]


def test_without_a_saved_value_a_reload_changes_the_pod_cidrs_at_once(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], system_bus: Bus,
) -> None:
    testnet()
    agent = make_agent(pod_cidrs=["10.244.1.0/24"])
    monitor = subprocess.Popen(
        ["stdbuf", "-oL", "gdbus", "monitor", "--address", system_bus.address,
         "--dest", "org.cniagent.Agent1"], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.3)  # its match rule is in
        agent.config["pod_cidrs"] = ["10.244.9.0/24"]
        agent.write_config()
        agent.call("Reload")
        assert agent.prop("PodCIDRs") == ["10.244.9.0/24"]
        assert "reload: pod_cidrs is now" in agent.log()
        assert "takes effect at the next restart" not in agent.log()
        agent.call("SetPodCIDRs", "as", "1", "10.244.8.0/24")
        agent.call("ResetPodCIDRs")
    finally:
        time.sleep(0.3)
        monitor.terminate()
        lines, _ = monitor.communicate(timeout=10)
    changes = [ln for ln in lines.splitlines() if "PodCIDRs" in ln]
    # Each change announced, with where the value now comes from.
    assert len(changes) == 3, lines
    assert "['10.244.9.0/24']" in changes[0] and "'PodCIDRsSource': <'config'>" in changes[0]
    assert "['10.244.8.0/24']" in changes[1] and "'PodCIDRsSource': <'saved'>" in changes[1]
    assert "['10.244.9.0/24']" in changes[2] and "'PodCIDRsSource': <'config'>" in changes[2]


def test_a_file_zeroed_by_a_power_cut_is_ignored_said_and_reset(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path],
) -> None:
    testnet()
    agent = make_agent(start=False, pod_cidrs=["10.244.1.0/24"])
    saved_file = Path(agent.config["state_dir"]) / "pod-cidrs.json"
    saved_file.parent.mkdir(parents=True, exist_ok=True)
    saved_file.write_bytes(b"")
    agent.start()
    assert agent.prop("PodCIDRs") == ["10.244.1.0/24"] and agent.prop("PodCIDRsSource") == "config"
    assert f"{saved_file}: unreadable" in agent.log() and "configured pod_cidrs are used" in agent.log()
    shown = config_show(agent)
    assert f"# pod_cidrs: {saved_file}: unreadable" in shown
    assert "the agent ignores that file and uses the line above" in shown
    ok(cli(agent, "pod-cidrs", "--reset"))
    assert not saved_file.exists()
    assert "# pod_cidrs:" not in config_show(agent)


def test_only_root_may_change_or_reset_the_nodes_pod_cidrs(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], permissive_bus: Bus,
    member: str,
) -> None:
    testnet()
    agent = make_agent(bus=permissive_bus, pod_cidrs=["10.244.1.0/24"])
    agent.call("SetPodCIDRs", "as", "1", "10.244.7.0/24")
    out = agent.gdbus("ResetPodCIDRs", user="nobody")
    assert ERR + "AccessDenied" in out.stderr, out.stderr
    denied = subprocess.run([*as_user_python("nobody"), "--bus", agent.bus.address, "pod-cidrs",
                             "--reset"], capture_output=True, text=True, timeout=60)
    assert denied.returncode == 4 and "access denied" in denied.stderr, denied
    assert agent.prop("PodCIDRs") == ["10.244.7.0/24"] and agent.prop("PodCIDRsSource") == "saved"
    # Anyone may read where they come from; the node's ranges are root's alone,
    # a member of the access group's too (they are every pod's addresses).
    assert agent.prop("PodCIDRsSource", user="nobody") == "saved"
    agent.config["access"] = {"groups": [member]}
    agent.write_config()
    agent.call("Reload")
    for args in (["--reset"], ["10.99.0.0/24"]):
        out = member_cli(agent.bus.address, member, "pod-cidrs", *args)
        assert out.returncode == 4 and "changes the whole node: root's" in out.stderr, out
    out = agent.gdbus("Reload", member=member)
    assert ERR + "AccessDenied" in out.stderr and "root's" in out.stderr, out.stderr
    assert agent.prop("PodCIDRs") == ["10.244.7.0/24"] and agent.prop("PodCIDRsSource") == "saved"
    agent.call("ResetPodCIDRs")
    wait_for(lambda: agent.prop("PodCIDRsSource") == "config", timeout=5)
    assert agent.prop("PodCIDRs") == ["10.244.1.0/24"]


@pytest.mark.parametrize(("args", "message"), [
    (["banana"], "'banana' is not a CIDR"),
    (["--reset", "10.244.1.0/24"], "give CIDRs or --reset, not both"),
])
def test_bad_pod_cidrs_arguments_are_usage_errors(args: list[str], message: str) -> None:
    out = subprocess.run([sys.executable, "-m", "cni_agent", "pod-cidrs", *args,
                          "--bus", "unix:path=/nonexistent"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and message in out.stderr, out


def test_a_kill_9_right_after_a_set_or_a_reset_keeps_what_was_answered(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path],
) -> None:
    """The answer a caller got is what a restart finds: both changes are on disk
    before SetPodCIDRs and ResetPodCIDRs reply."""
    testnet()
    agent = make_agent(pod_cidrs=["10.244.1.0/24"])
    agent.call("SetPodCIDRs", "as", "1", "10.244.7.0/24")
    agent.stop(signal.SIGKILL)
    agent.start()
    assert agent.prop("PodCIDRs") == ["10.244.7.0/24"] and agent.prop("PodCIDRsSource") == "saved"
    agent.call("ResetPodCIDRs")
    agent.stop(signal.SIGKILL)
    agent.start()
    assert agent.prop("PodCIDRs") == ["10.244.1.0/24"] and agent.prop("PodCIDRsSource") == "config"
