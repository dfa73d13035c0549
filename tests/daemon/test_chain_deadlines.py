"""timeouts.add, del and check bound a whole chain, with real plugins in a real netns.

Three copies of the test plugin each take 1.5 s, well within a 2 s timeout
each, but 4.5 s together: the chain fails with Timeout when its 2 s are
spent, not after three times that; the ADD's rollback runs with a deadline
of its own and leaves nothing behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.conftest import bridge_plugins, plug
from tests.support.agent import Agent
from tests.support.net import addresses, allocations, link_exists
from tests.support.plugins import Control, alive, conflist, install_plugin, wait_for, write_conf
from tests.support.state import record

pytestmark = pytest.mark.root

ERR = "org.cniagent.Agent1.Error."
SLOW = ("testplug", "testplug2", "testplug3")
STEP = 1.5  # each plugin's time in the verb
LIMIT = 2  # timeouts.add / del / check: more than one step, less than two


def slow_chain(tmp_path: Path, control: Control, name: str = "slow",
               first: list[dict[str, Any]] | None = None, version: str = "1.1.0") -> str:
    for t in SLOW[1:]:
        install_plugin(tmp_path / "bin", t)
    write_conf(tmp_path / "net.d", f"10-{name}.conflist",
               conflist(name, [*(first or []), *(plug(control, t) for t in SLOW)], version))
    return name


def timed(agent: Agent, method: str, *args: str) -> tuple[float, str]:
    start = time.monotonic()
    out = agent.gdbus(method, *args)
    return time.monotonic() - start, out.stderr


def runs(control: Control, verb: str, phase: str = "start") -> list[dict[str, Any]]:
    return [r for r in control.records(phase) if r["command"] == verb]


def test_add_chain_times_out_as_a_whole_and_is_rolled_back(
    make_agent: Callable[..., Agent], control: Control, netns: str, tmp_path: Path,
    bridge_name: str,
) -> None:
    # bridge + host-local first: the rollback has a veth and an address to undo.
    net = slow_chain(tmp_path, control, "pods", bridge_plugins(tmp_path, control, bridge_name)[:1],
                     "1.0.0")
    agent = make_agent(timeouts={"add": LIMIT, "del": 10})
    control.set("ADD", "succeed", sleep=STEP)

    took, err = timed(agent, "Setup", "slow-add", netns, "{}")

    assert ERR + "Timeout" in err, err
    assert "plugin testplug2 ADD: timed out after" in err
    assert f"the ADD chain of network {net} ran out of its {LIMIT}s (timeouts.add)" in err
    # Bounded by the chain's deadline plus its rollback, not by three times timeouts.add.
    assert LIMIT <= took < 2 * LIMIT, took
    # testplug3 never started; testplug2 was killed in its ADD (a start, no end).
    assert [r["type"] for r in runs(control, "ADD")] == ["testplug", "testplug2"]
    assert [r["type"] for r in runs(control, "ADD", "end")] == ["testplug"]
    killed = runs(control, "ADD")[1]["pid"]
    wait_for(lambda: not alive(killed), timeout=5)
    # The rollback got its own deadline: every plugin's DEL ran to the end, last first.
    assert [r["type"] for r in runs(control, "DEL", "end")] == list(reversed(SLOW))
    assert all(r["exit"] == 0 for r in runs(control, "DEL", "end"))
    # Nothing left: no address, no veth, no allocation, no cache entry, no record.
    assert addresses(netns) == [] and not link_exists("eth0", netns)
    assert allocations(tmp_path / "ipam", net) == []
    assert list((tmp_path / "state" / "results").iterdir()) == []
    assert record(tmp_path / "state", "slow-add") is None
    assert agent.call("ListSandboxes")[0] == []
    assert agent.prop("NetworkReady") is True
    # Once the plugins are quick again, the same sandbox sets up.
    control.clear("ADD")
    agent.setup("slow-add", netns)
    assert [a.startswith("10.215.0.") for a in addresses(netns)] == [True]


def test_del_chain_times_out_as_a_whole_and_keeps_the_entry(
    make_agent: Callable[..., Agent], control: Control, netns: str, tmp_path: Path,
) -> None:
    slow_chain(tmp_path, control)
    agent = make_agent(timeouts={"del": LIMIT})
    agent.setup("slow-del", netns, args={"K": "V"})
    control.set("DEL", "succeed", sleep=STEP)

    took, err = timed(agent, "Teardown", "slow-del", netns, "{}")

    assert ERR + "PluginFailed" in err and "incomplete" in err, err
    assert "plugin testplug2 DEL: timed out after" in err
    assert "the DEL chain of network slow ran out of its 2s (timeouts.del)" in err
    assert LIMIT <= took < 2 * LIMIT, took
    # One try only: a timed-out DEL is not sent again with IgnoreUnknown.
    assert [r["type"] for r in runs(control, "DEL")] == ["testplug3", "testplug2"]
    assert all(r["env"]["CNI_ARGS"] == "K=V" for r in runs(control, "DEL"))
    wait_for(lambda: not alive(runs(control, "DEL")[1]["pid"]), timeout=5)
    assert agent.call("ListSandboxes")[0] == ["slow-del"]  # kept for the retry
    control.clear("DEL")
    agent.call("Teardown", "ssa{sv}", "slow-del", netns, "0")
    assert agent.call("ListSandboxes")[0] == []


def test_check_chain_times_out_as_a_whole(
    make_agent: Callable[..., Agent], control: Control, netns: str, tmp_path: Path,
) -> None:
    slow_chain(tmp_path, control)
    # No baseline CHECK after the Setup: only the Check below runs the chain.
    agent = make_agent(timeouts={"check": LIMIT}, check={"interval": 0})
    agent.setup("slow-check", netns)
    control.set("CHECK", "succeed", sleep=STEP)

    took, err = timed(agent, "Check", "slow-check", netns, "{}")

    assert ERR + "Timeout" in err, err
    assert "the CHECK chain of network slow ran out of its 2s (timeouts.check)" in err
    assert LIMIT <= took < 2 * LIMIT, took
    assert [r["type"] for r in runs(control, "CHECK")] == ["testplug", "testplug2"]
    assert agent.call("ListSandboxes")[0] == ["slow-check"]  # a failed CHECK changes nothing
