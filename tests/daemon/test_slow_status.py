"""A slow STATUS of one network holds back no other verdict, seen on D-Bus.

The issue's case: a default network and a second one whose STATUS takes 4 s;
removing the default's config file must turn NetworkReady false at once, not
after the slow poll.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.conftest import plug
from tests.support.agent import Agent
from tests.support.plugins import Control, install_plugin, wait_for

pytestmark = pytest.mark.root

SLOW = 4.0


def test_removing_the_default_turns_network_ready_false_while_a_slow_status_runs(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path,
) -> None:
    slow = Control(tmp_path / "slow.json")
    slow.set("STATUS", "succeed", sleep=SLOW)
    install_plugin(tmp_path / "bin", "slowplug")
    default = testnet("testnet", "10-testnet.conflist")
    testnet("slow", "20-slow.conflist", plugins=[plug(slow, "slowplug")])
    agent = make_agent(default_network="testnet")

    def fresh_slow() -> set[int]:
        """The slow STATUS runs in flight that began less than 1 s ago: at
        least SLOW - 1 s of theirs is left."""
        recs = slow.records(None)
        ended = {r["pid"] for r in recs if r["phase"] == "end"}
        return {r["pid"] for r in recs if r["phase"] == "start" and r["command"] == "STATUS"
                and r["pid"] not in ended and time.time() - r["start"] < 1}

    def in_flight() -> set[int]:
        recs = slow.records(None)
        ended = {r["pid"] for r in recs if r["phase"] == "end"}
        return {r["pid"] for r in recs
                if r["phase"] == "start" and r["command"] == "STATUS" and r["pid"] not in ended}

    running = wait_for(fresh_slow, timeout=SLOW + 3)
    assert agent.prop("NetworkReady") is True

    default.unlink()
    # "At once" is "while that slow STATUS still runs", which the plugin's own
    # records prove; how long the wait took is this machine's load.
    wait_for(lambda: agent.prop("NetworkReady") is False, timeout=SLOW)
    assert running & in_flight(), "the verdict waited for the slow STATUS"
    assert agent.prop("LastError").startswith("default network testnet not found")
