"""Plugin dirs and binaries a non-root user could replace are refused (issue 12, item 2)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.agent import Agent
from tests.support.net import addresses
from tests.support.plugins import Control, install_plugin, wait_for

pytestmark = pytest.mark.root

ERR = "org.cniagent.Agent1.Error."


def _plant(directory: Path, name: str, marker: Path) -> Path:
    """A plugin that would leave `marker` if anything ever ran it."""
    directory.mkdir(exist_ok=True)
    planted = directory / name
    planted.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    os.chmod(planted, 0o755)
    return planted


def test_planted_ipam_in_a_world_writable_dir_never_runs(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    ww = tmp_path / "ww"
    marker = tmp_path / "planted-ran"
    _plant(ww, "host-local", marker)
    os.chmod(ww, 0o777)
    # Listed before the real plugins: bridge would find this host-local first.
    agent = make_agent(plugin_dirs=[str(ww), str(tmp_path / "bin"), "/usr/lib/cni"])
    why = f"plugin directory {ww} not used: {ww} is writable by non-root users (mode drwxrwxrwx)"
    assert why in agent.prop("Status")
    assert agent.prop("LastError") == ""  # ready: the real host-local serves

    att = agent.setup("trust-1", netns)["attachments"][0]
    assert addresses(netns) == [att["result"]["ips"][0]["address"]]
    assert not marker.exists()
    [add] = control.records()
    assert add["env"]["CNI_PATH"] == f"{tmp_path / 'bin'}:/usr/lib/cni"
    agent.call("Teardown", "ssa{sv}", "trust-1", netns, "0")
    assert not marker.exists()
    # Logged once per change, not per poll (interval 0.2 s here).
    time.sleep(0.6)
    assert agent.log().count(f"plugin directory {ww} left out of CNI_PATH") == 1

    os.chmod(ww, 0o755)  # fixed: used again, without a restart
    wait_for(lambda: f"plugin directory {ww}" not in agent.prop("Status"))
    assert f"plugin directory {ww} is trusted again" in agent.log()


def test_a_dir_whose_parent_is_world_writable_is_refused(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path, netns: str,
) -> None:
    parent = tmp_path / "open"
    bindir = parent / "bin"
    install_plugin(bindir, "testplug")
    os.chmod(parent, 0o777)
    agent = make_agent(plugin_dirs=[str(bindir), "/usr/lib/cni"])
    testnet()
    reason = f"{parent} is writable by non-root users (mode drwxrwxrwx)"
    refused = f"refusing to run {bindir / 'testplug'}: {reason}"
    wait_for(lambda: refused in agent.prop("LastError"))
    assert agent.prop("NetworkReady") is False and refused in agent.prop("Status")
    out = agent.gdbus("Setup", "trust-2", netns, "{}")
    assert ERR + "NotReady" in out.stderr and reason in out.stderr
    os.chmod(parent, 0o1777)  # sticky: nobody else can replace the root-owned bin in it
    wait_for(lambda: agent.prop("NetworkReady") is True)


def test_a_group_writable_binary_is_refused_by_name(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path, netns: str,
) -> None:
    testnet(version="1.0.0")
    agent = make_agent()
    agent.setup("trust-3", netns)
    binary = tmp_path / "bin" / "testplug"
    os.chmod(binary, 0o775)
    reason = f"refusing to run {binary}: {binary} is writable by non-root users (mode -rwxrwxr-x)"
    # Checked at every run, not only by the monitor: the DEL is refused too.
    out = agent.gdbus("Teardown", "trust-3", netns, "{}")
    assert ERR + "PluginFailed" in out.stderr and reason in out.stderr, out.stderr
    wait_for(lambda: agent.prop("NetworkReady") is False)
    assert reason in agent.prop("LastError")
    out = agent.gdbus("Setup", "trust-4", netns, "{}")
    assert ERR + "NotReady" in out.stderr and reason in out.stderr
    os.chmod(binary, 0o755)
    wait_for(lambda: agent.prop("NetworkReady") is True)
    agent.call("Teardown", "ssa{sv}", "trust-3", netns, "0")
    assert agent.call("ListSandboxes")[0] == []
