"""Spec conformance through D-Bus: what libcni refuses, the agent refuses too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.agent import Agent
from tests.support.net import addresses, allocations
from tests.support.plugins import Control

pytestmark = pytest.mark.root

ERR = "org.cniagent.Agent1.Error."


def test_add_that_prints_nothing_fails_and_is_rolled_back(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    agent = make_agent()
    control.set("ADD", "exit", exit=0)  # exit status 0, nothing on stdout
    out = agent.gdbus("Setup", "empty-1", netns, "{}")
    assert ERR + "PluginFailed" in out.stderr, out.stderr
    assert "plugin testplug ADD: exited 0 but printed no result" in out.stderr
    # The whole chain was DELed, last first; host-local's address is released.
    assert control.commands() == ["ADD", "DEL"]
    assert allocations(tmp_path / "ipam", bridge_chain) == []
    assert addresses(netns) == []
    assert agent.call("ListSandboxes")[0] == []
    assert list((tmp_path / "state" / "results").iterdir()) == []
