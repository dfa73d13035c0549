"""`cni-agent sandbox up|down NAME` (what cni-sandbox@NAME.service runs), through
the CLI and D-Bus, with the real bridge + host-local in real named namespaces."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import unique_name
from tests.daemon.conftest import plug
from tests.daemon.test_cli import cli
from tests.support.agent import Agent
from tests.support.net import addresses, allocations
from tests.support.plugins import Control, conflist, write_conf

pytestmark = pytest.mark.root


@pytest.fixture
def name() -> Iterator[str]:
    """A named netns that is removed however the test ends."""
    n = unique_name("sbx")
    yield n
    subprocess.run(["ip", "netns", "delete", n], capture_output=True)


def _ips(netns_path: str) -> list[str]:
    return [a for a in addresses(netns_path) if not a.startswith("127.")]


def test_up_puts_a_named_netns_on_the_default_network_and_down_removes_it(
    make_agent: Callable[..., Agent], bridge_chain: str, name: str, tmp_path: Path,
) -> None:
    agent = make_agent()
    path = f"/run/netns/{name}"
    out = cli(agent, "sandbox", "up", name, "--dir", str(tmp_path / "none"))
    assert out.returncode == 0, out.stderr
    assert f"NetworkNamespacePath={path}" in out.stdout
    [ip] = _ips(path)
    assert ip.startswith("10.215.0.") and ip.split("/")[0] in out.stdout
    assert agent.call("ListSandboxes")[0] == [name]
    # A repeated up (a unit restarted) is the same sandbox, not a second one.
    assert cli(agent, "sandbox", "up", name, "--dir", str(tmp_path / "none")).returncode == 0
    assert _ips(path) == [ip] and len(allocations(tmp_path / "ipam", "pods")) == 1
    out = cli(agent, "sandbox", "down", name)
    assert out.returncode == 0, out.stderr
    assert not os.path.exists(path)
    assert allocations(tmp_path / "ipam", "pods") == []
    assert agent.call("ListSandboxes")[0] == []
    # Down again: nothing to do, success.
    assert cli(agent, "sandbox", "down", name).returncode == 0


def test_the_yaml_file_chooses_networks_and_args(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, name: str,
    tmp_path: Path,
) -> None:
    write_conf(tmp_path / "net.d", "20-side.conflist",
               conflist("side", [plug(control)], "1.1.0"))
    agent = make_agent()
    specs = tmp_path / "sandboxes"
    specs.mkdir()
    (specs / f"{name}.yaml").write_text(
        "networks: [pods, 'side:side0']\nargs: {IgnoreUnknown: 1, ROLE: web}\n"
        "capabilities: {portMappings: []}\n")
    out = cli(agent, "sandbox", "up", name, "--dir", str(specs))
    assert out.returncode == 0, out.stderr
    adds = [r for r in control.records() if r["command"] == "ADD"]
    assert {r["env"]["CNI_IFNAME"] for r in adds} == {"eth0", "side0"}
    assert all("ROLE=web" in r["env"]["CNI_ARGS"] for r in adds)
    assert len(_ips(f"/run/netns/{name}")) == 1
    assert cli(agent, "sandbox", "down", name).returncode == 0
    assert allocations(tmp_path / "ipam", "pods") == []


def test_not_ready_fails_with_the_reason_and_leaves_nothing(
    make_agent: Callable[..., Agent], name: str, tmp_path: Path,
) -> None:
    agent = make_agent()  # no network configured
    out = cli(agent, "sandbox", "up", name, "--timeout", "1", "--dir", str(tmp_path))
    assert out.returncode == 3  # not ready
    assert "not ready after 1s" in out.stderr, out.stderr
    assert "no valid CNI network configuration" in out.stderr
    assert not os.path.exists(f"/run/netns/{name}")
    assert agent.call("ListSandboxes")[0] == []


def test_a_failing_setup_deletes_the_netns_it_created(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, name: str,
    tmp_path: Path,
) -> None:
    agent = make_agent()
    control.set("ADD", "fail", code=7, msg="no addresses left")
    out = cli(agent, "sandbox", "up", name, "--dir", str(tmp_path))
    assert out.returncode == 1 and "no addresses left" in out.stderr
    assert not os.path.exists(f"/run/netns/{name}")
    assert allocations(tmp_path / "ipam", "pods") == []


def test_bad_names_and_files_are_usage_errors_without_an_agent(name: str, tmp_path: Path) -> None:
    out = cli("unix:path=/nonexistent", "sandbox", "up", "../etc")
    assert out.returncode == 2 and "is not a sandbox name" in out.stderr
    (tmp_path / f"{name}.yaml").write_text("networks: pods\n")
    out = cli("unix:path=/nonexistent", "sandbox", "up", name, "--dir", str(tmp_path))
    assert out.returncode == 2 and f"{name}.yaml: networks: must be a list" in out.stderr
    (tmp_path / f"{name}.yaml").write_text("colour: blue\n")
    out = cli("unix:path=/nonexistent", "sandbox", "up", name, "--dir", str(tmp_path))
    assert out.returncode == 2 and "colour: unknown key" in out.stderr
    assert not os.path.exists(f"/run/netns/{name}")
