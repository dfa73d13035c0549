"""polkit: an admin's rule lets a caller outside the group manage its own
sandboxes; without a rule, or without polkitd, nothing changes.

A real polkitd (Debian's) runs on the test's bus with our action file and a
rules file naming one user made by the test; two users run the real CLI with
their own uids. Root and group members never ask polkit (the other tests).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import machine_wide, unique_name
from tests.daemon.test_owners import cli, own_netns
from tests.support.agent import REPO, Agent, Bus
from tests.support.net import allocations
from tests.support.plugins import wait_for

pytestmark = pytest.mark.root

POLKITD = Path("/usr/lib/polkit-1/polkitd")
ACTIONS = Path("/usr/share/polkit-1/actions/org.cniagent.Agent1.policy")
RULES_DIR = Path("/etc/polkit-1/rules.d")


def make_user(name: str) -> str:
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    "-U", name], check=True)
    return name


@pytest.fixture
def users() -> Iterator[tuple[str, str]]:
    """A user an admin's polkit rule grants manage and inspect, and one it does not."""
    names = (make_user(unique_name("cnipk")[:30]), make_user(unique_name("cnipx")[:30]))
    yield names
    for name in names:
        subprocess.run(["pkill", "-KILL", "-u", name], check=False)
        subprocess.run(["userdel", name], check=False)
        subprocess.run(["groupdel", name], check=False)


@pytest.fixture
def polkit(users: tuple[str, str]) -> Iterator[Callable[[Bus], subprocess.Popen[bytes]]]:
    # The DEB's tests install and purge the same action file (and a rule).
    with machine_wide("installed"):
        yield from _polkit(users)


def _polkit(users: tuple[str, str]) -> Iterator[Callable[[Bus], subprocess.Popen[bytes]]]:
    """Our action file where polkitd reads it, an admin's rule for the first user,
    and a polkitd started on a given bus."""
    assert POLKITD.exists(), "polkitd missing: make setup installs it"
    copied = not ACTIONS.exists()  # the package may have put it there already
    if copied:
        shutil.copy(REPO / "packaging" / "polkit" / "org.cniagent.Agent1.policy", ACTIONS)
    rules = RULES_DIR / f"40-cni-agent-test-{os.getpid()}.rules"
    rules.write_text(
        "polkit.addRule(function(action, subject) {\n"
        f'    if (action.id.indexOf("org.cniagent.Agent1.") == 0 && subject.user == "{users[0]}")\n'
        "        return polkit.Result.YES;\n"
        "});\n")
    rules.chmod(0o644)
    started: list[subprocess.Popen[bytes]] = []

    def start(bus: Bus) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([str(POLKITD), "--no-debug"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL,
                                env={**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": bus.address})
        started.append(proc)
        wait_for(lambda: "org.freedesktop.PolicyKit1" in subprocess.run(
            ["busctl", f"--address={bus.address}", "list", "--acquired"], capture_output=True,
            text=True).stdout, timeout=10)
        return proc

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(10)
    rules.unlink()
    if copied:
        ACTIONS.unlink()


def test_a_polkit_rule_delegates_setup_to_a_user_outside_the_group(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str,
    users: tuple[str, str], polkit: Callable[[Bus], subprocess.Popen[bytes]], tmp_path: Path,
) -> None:
    granted, other = users
    polkitd = polkit(permissive_bus)
    # access.groups: cni-agent; neither user is in it. The network is opened to
    # callers that are not root (a polkit-authorized one is still not root).
    agent = make_agent(bus=permissive_bus, access={"networks": ["pods"]})
    mine = own_netns(granted)
    theirs = own_netns(other)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        out = cli(agent, granted, "setup", "pk1", path)
        assert out.returncode == 0, out
        assert len(allocations(tmp_path / "ipam", "pods")) == 1
        # inspect: its own sandboxes only, as for any caller that is not root.
        assert cli(agent, granted, "list").stdout.split() == ["pk1"]
        agent.setup("rootpod", f"/proc/{theirs.pid}/ns/net")
        shown = cli(agent, granted, "show", "rootpod")
        assert shown.returncode != 0 and "is not one of uid" in shown.stderr, shown
        # The other user: no rule, and auth_admin_keep needs a password it cannot give here.
        refused = cli(agent, other, "setup", "pk2", f"/proc/{theirs.pid}/ns/net")
        assert refused.returncode != 0, refused
        assert "org.cniagent.Agent1.manage needs authentication" in refused.stderr, refused
        assert cli(agent, other, "list").returncode != 0  # inspect is not granted either
        assert cli(agent, granted, "teardown", "pk1", path).returncode == 0
        assert len(allocations(tmp_path / "ipam", "pods")) == 1  # root's pod only

        # Without polkitd on the bus: today's rules alone, the rule means nothing.
        polkitd.terminate()
        polkitd.wait(10)
        wait_for(lambda: "org.freedesktop.PolicyKit1" not in subprocess.run(
            ["busctl", f"--address={permissive_bus.address}", "list"], capture_output=True,
            text=True).stdout, timeout=10)
        start = time.monotonic()
        out = cli(agent, granted, "setup", "pk3", path)
        assert out.returncode != 0 and "access denied" in out.stderr, out
        assert "polkit" not in out.stderr
        assert time.monotonic() - start < 20  # answered, not hung on a missing polkit
        assert cli(agent, granted, "list").stdout.split() == []
    finally:
        mine.kill()
        theirs.kill()
