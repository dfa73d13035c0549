"""Plugins misbehaving every way we know: the caller gets the right named error, the
agent stays up and ready, nothing is half set up, no process is left behind."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import NAME, Agent
from tests.support.plugins import Control, alive, wait_for
from tests.support.state import record

pytestmark = pytest.mark.root
ERR = "org.cniagent.Agent1.Error."


def _children(pid: int) -> list[int]:
    """Every descendant of pid (plugins run in their own process groups)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,stat="], capture_output=True, text=True)
    procs = [line.split() for line in out.stdout.splitlines()]
    found, frontier = [], {pid}
    while frontier:
        nxt = {int(p) for p, pp, _ in procs if int(pp) in frontier}
        found.extend(nxt)
        frontier = nxt
    return found


def assert_clean(agent: Agent, sandbox: str, control: Control, tmp: Path) -> None:
    """Still up and ready, nothing cached for the sandbox, no stray processes."""
    assert agent.proc is not None and agent.proc.poll() is None
    assert agent.prop("NetworkReady") is True
    assert sandbox not in agent.call("ListSandboxes")[0]
    assert record(tmp / "state", sandbox) is None
    wait_for(lambda: _children(agent.proc.pid) == [], timeout=5)  # type: ignore[union-attr]
    for rec in control.records(None):
        for pid in (rec.get("pid"), rec.get("child")):
            if pid:
                wait_for(lambda pid=pid: not alive(pid), timeout=5)


FAULTS: list[tuple[str, dict[str, Any], str, str]] = [
    ("hang", {"action": "hang"}, "Timeout", "timed out after 1s (process group killed)"),
    ("spawn-hang", {"action": "spawn-hang"}, "Timeout", "timed out after 1s"),
    ("crash", {"action": "crash", "signal": "SEGV"}, "PluginFailed", "killed by signal SIGSEGV"),
    ("exit", {"action": "exit", "exit": 3}, "PluginFailed", "exited with status 3 without an error"),
    ("garbage", {"action": "garbage"}, "PluginFailed", "output is not JSON"),
    ("huge", {"action": "huge", "bytes": 100 * 1024 * 1024}, "PluginFailed", "printed more than"),
]


@pytest.mark.parametrize(("name", "action", "error", "words"), FAULTS, ids=[f[0] for f in FAULTS])
def test_add_fault(make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
                   netns: str, tmp_path: Path, name: str, action: dict[str, Any], error: str,
                   words: str) -> None:
    testnet()
    # Hangs are cut at 1s; the others get time to misbehave fully even on a busy machine.
    limit = 1 if "hang" in name else 15
    agent = make_agent(timeouts={"add": limit, "del": limit})
    control.data["ADD"] = action
    control.write()
    out = agent.gdbus("Setup", f"f-{name}", netns, "{}")
    assert ERR + error in out.stderr and words in out.stderr, out.stderr
    # The failed ADD got its DEL (rolled back), and another sandbox works.
    assert "DEL" in control.commands()
    assert_clean(agent, f"f-{name}", control, tmp_path)
    control.clear("ADD")
    agent.setup("after", netns)


def test_del_fault_keeps_the_entry_and_the_agent_up(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, netns: str,
) -> None:
    testnet()
    agent = make_agent(timeouts={"del": 1})
    agent.setup("d1", netns)
    control.set("DEL", "hang")
    out = agent.gdbus("Teardown", "d1", netns, "{}")
    assert ERR + "PluginFailed" in out.stderr and "timed out after 1s" in out.stderr
    assert agent.call("ListSandboxes")[0] == ["d1"]  # nothing forgotten
    control.clear("DEL")
    agent.call("Teardown", "ssa{sv}", "d1", netns, "0")
    assert agent.call("ListSandboxes")[0] == []


def test_plugin_not_executable_or_vanished(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, netns: str,
    tmp_path: Path,
) -> None:
    testnet(version="1.0.0")
    agent = make_agent(monitor={"startup_interval": 0.05, "interval": 30})
    binary = tmp_path / "bin" / "testplug"
    saved = binary.read_bytes()
    # Vanishes between validation and exec: the watcher has not caught up yet.
    binary.unlink()
    out = agent.gdbus("Setup", "gone", netns, "{}")
    if ERR + "NotReady" not in out.stderr:
        assert ERR + "PluginFailed" in out.stderr and "no binary 'testplug'" in out.stderr
    wait_for(lambda: agent.prop("NetworkReady") is False)
    assert "no binary 'testplug'" in agent.prop("LastError")
    binary.write_bytes(saved)
    os.chmod(binary, 0o644)  # present but not executable
    time.sleep(0.3)
    out = agent.gdbus("Setup", "noexec", netns, "{}")
    assert ERR in out.stderr
    os.chmod(binary, 0o755)
    assert agent.call("WaitReady", "d", "5")[0] is True
    agent.setup("ok", netns)


def test_call_longer_than_the_callers_dbus_timeout(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, netns: str,
) -> None:
    testnet()
    agent = make_agent()
    control.set("ADD", "succeed", sleep=3)
    out = subprocess.run(
        ["busctl", f"--address={agent.bus.address}", "--timeout=1", "call", NAME,
         "/org/cniagent/Agent1", "org.cniagent.Agent1", "Setup", "ssa{sv}", "slow", netns, "0"],
        capture_output=True, text=True)
    assert out.returncode != 0 and "Connection timed out" in out.stderr
    # The agent finishes the work; the caller's retry gets the same result, no second ADD.
    wait_for(lambda: agent.call("ListSandboxes")[0] == ["slow"], timeout=10)
    control.clear("ADD")
    agent.setup("slow", netns)
    assert control.commands().count("ADD") == 1
