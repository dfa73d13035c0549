"""The namespace a caller's path named when it was checked is the one used
(issue 12, item 1): swapping the path afterwards reaches nothing else.

Real bridge + host-local through D-Bus. The swap is deterministic: the test
holds the sandbox's lock file, so the request waits after its check; once the
agent holds an fd of namespace A the caller's symlink is swapped to a victim
V (never the host's), and the lock is released.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.agent import Agent
from tests.support.net import addresses, allocations, link_exists
from tests.support.plugins import Control, ns_key, seen_netns
from tests.support.state import lose

pytestmark = pytest.mark.root


def _links(ns: str) -> list[tuple[str, tuple[str, ...]]]:
    out = subprocess.run(["ip", "-n", Path(ns).name, "-j", "link", "show"], check=True,
                         capture_output=True, text=True).stdout
    return sorted((link["ifname"], tuple(sorted(link["flags"]))) for link in json.loads(out))


@contextlib.contextmanager
def _holding(agent: Agent, sandbox_id: str) -> Iterator[None]:
    """Hold a sandbox's lock as another process would (the agent's protocol:
    unlink before unlocking)."""
    path = agent.tmp / "run" / "locks" / f"{sandbox_id}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        path.unlink()
        os.close(fd)


def _wait_pinned(agent: Agent, ns: str, timeout: float = 3.0) -> bool:
    """Whether the agent holds an fd of the namespace `ns` (the old code never did:
    give it the time to have checked the path)."""
    assert agent.proc is not None
    key, fds = ns_key(ns), Path(f"/proc/{agent.proc.pid}/fd")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for fd in fds.iterdir():
            with contextlib.suppress(OSError):
                if ns_key(str(fd)) == key:
                    return True
        time.sleep(0.01)
    return False


def _swap(link: Path, target: str) -> None:
    tmp = link.with_suffix(".new")
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _finish(proc: subprocess.Popen[str], agent: Agent) -> None:
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, (out, err, agent.log()[-3000:])


def test_setup_after_a_swap_runs_in_the_checked_namespace(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    agent = make_agent()
    a, victim = netns_factory(), netns_factory()
    link = tmp_path / "my-netns"
    link.symlink_to(a)
    untouched = _links(victim)
    with _holding(agent, "swap"):
        setup = agent.busctl_bg("Setup", "ssa{sv}", "swap", str(link), "0")
        pinned = _wait_pinned(agent, a)
        _swap(link, victim)
    _finish(setup, agent)
    [address] = addresses(a)
    assert _links(victim) == untouched  # no eth0, no veth, lo still down
    assert "UP" in dict(_links(a))["lo"]  # lo came up through the same handle
    # Every plugin was given the checked namespace; the cache and Show keep the path as given.
    assert {tuple(seen_netns(r)) for r in control.records() if r["command"] == "ADD"} == {
        tuple(ns_key(a))}
    [att] = json.loads(agent.call("Show", "s", "swap")[0])["attachments"]
    assert {i["sandbox"] for i in att["result"]["interfaces"] if i.get("sandbox")} == {str(link)}
    [entry] = (tmp_path / "state" / "results").iterdir()
    assert json.loads(entry.read_text())["netns"] == str(link)
    # The path names V now, not the recorded namespace: its DEL gets no netns.
    control.reset_records()
    agent.call("Teardown", "ssa{sv}", "swap", str(link), "0")
    assert [seen_netns(r) for r in control.records() if r["command"] == "DEL"] == [""]
    assert _links(victim) == untouched
    assert allocations(tmp_path / "ipam", "pods") == []
    assert address  # (A keeps its veth until A goes: an empty-netns DEL cannot reach it)
    assert pinned  # the swap really came after the check


def test_teardown_without_record_after_a_swap_runs_in_the_checked_namespace(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    agent = make_agent()
    a, victim = netns_factory(), netns_factory()
    agent.setup("norec", a)
    # Only the libcni cache entry is left, as another tool (or an older run) leaves it.
    assert agent.stop() == 0
    assert lose(tmp_path / "state", "norec")
    agent.start()
    assert agent.call("WaitReady", "d", "10")[0] is True
    # The victim has an eth0 of its own, which a DEL there would delete.
    subprocess.run(["ip", "-n", Path(victim).name, "link", "add", "eth0", "type", "veth",
                    "peer", "name", "peer0"], check=True)
    untouched = _links(victim)
    link = tmp_path / "my-netns"
    link.symlink_to(a)
    control.reset_records()
    with _holding(agent, "norec"):
        teardown = agent.busctl_bg("Teardown", "ssa{sv}", "norec", str(link), "0")
        pinned = _wait_pinned(agent, a)
        _swap(link, victim)
    _finish(teardown, agent)
    assert not link_exists("eth0", a)  # the DEL ran in A...
    assert _links(victim) == untouched  # ...and never in V
    assert {tuple(seen_netns(r)) for r in control.records() if r["command"] == "DEL"} == {
        tuple(ns_key(a))}
    assert allocations(tmp_path / "ipam", "pods") == []
    assert agent.call("ListSandboxes")[0] == []
    assert pinned


def test_teardown_without_record_and_a_missing_netns_still_dels(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    agent = make_agent()
    a = netns_factory()
    agent.setup("gone", a)
    assert agent.stop() == 0
    assert lose(tmp_path / "state", "gone")  # only its libcni cache entry is left
    agent.start()
    assert agent.call("WaitReady", "d", "10")[0] is True
    control.reset_records()
    agent.call("Teardown", "ssa{sv}", "gone", str(tmp_path / "no-such-netns"), "0")
    assert [seen_netns(r) for r in control.records() if r["command"] == "DEL"] == [""]
    assert allocations(tmp_path / "ipam", "pods") == []
