"""A private system-like bus per session; agents as real subprocesses."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cni_agent.config import AgentConfig
from cni_agent.service.wiring import antispoof_table
from tests.conftest import machine_wide, unique_name
from tests.support.agent import Agent, Bus
from tests.support.net import delete_link
from tests.support.plugins import Control, conflist, install_plugin, write_conf
from tests.support.shim import WAYS, Way

pytestmark = pytest.mark.root


@pytest.fixture
def member() -> Iterator[str]:
    """A user of its own, in a group of its own that the agent may be configured with."""
    name = unique_name("cnim")[:30]
    subprocess.run(["groupadd", name], check=True)
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    "-g", name, name], check=True)
    yield name
    subprocess.run(["pkill", "-KILL", "-u", name], check=False)
    subprocess.run(["userdel", name], check=False)
    subprocess.run(["groupdel", name], check=False)


@pytest.fixture(params=WAYS)
def way(request: pytest.FixtureRequest, tmp_path: Path) -> Way:
    """The test once with the shim over the agent's socket, once over the bus
    (its fallback): the same cases must get the same answers."""
    return Way(request.param, tmp_path / "no-agent-here.sock")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can reach (tmp_path is root's alone): the agent's
    runtime_dir when another user connects to its socket."""
    d = Path(tempfile.mkdtemp(prefix="cni-agent-run-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def drift_checks_turn() -> Iterator[None]:
    """test_drift and test_check_honesty take turns (`make test` runs files in
    parallel): run beside each other, test_drift's portmap CHECKs were seen
    to flip (a flushed chain's "drifted" back to "ok"), not yet explained."""
    with machine_wide("drift-checks"):
        yield


@pytest.fixture(scope="session")
def system_bus() -> Iterator[Bus]:
    bus = Bus("system")
    yield bus
    bus.stop()


@pytest.fixture(scope="session")
def permissive_bus() -> Iterator[Bus]:
    bus = Bus("permissive")
    yield bus
    bus.stop()


def plug(control: Control, ptype: str = "testplug", **extra: Any) -> dict[str, Any]:
    return {"type": ptype, "control": str(control.path), **extra}


@pytest.fixture
def make_agent(tmp_path: Path, system_bus: Bus) -> Iterator[Callable[..., Agent]]:
    """Start agents on the session's bus; all are stopped (SIGKILL if stuck) at the end."""
    started: list[Agent] = []

    def make(bus: Bus | None = None, start: bool = True, **config: Any) -> Agent:
        agent = Agent(tmp_path, bus or system_bus, **config)
        install_plugin(tmp_path / "bin", "testplug")
        started.append(agent)
        if start:
            agent.start()
            if any(agent.conf_dir.glob("*.conf*")):  # a network is configured: wait for it
                assert agent.call("WaitReady", "d", "10")[0] is True, agent.log()
        return agent

    yield make
    for agent in started:
        agent.stop()
        # Its anti-spoofing table (members' filters) outlives it in the kernel.
        subprocess.run(["nft", "delete", "table", "bridge",
                        antispoof_table(AgentConfig(state_dir=agent.config["state_dir"]))],
                       capture_output=True, check=False)


@pytest.fixture
def testnet(tmp_path: Path, control: Control) -> Callable[..., Path]:
    """Write a test-plugin network into the agent's conf dir."""

    def write(name: str = "testnet", filename: str | None = None, version: str = "1.1.0",
              plugins: list[dict[str, Any]] | None = None) -> Path:
        data = conflist(name, plugins or [plug(control)], version)
        return write_conf(tmp_path / "net.d", filename or f"50-{name}.conflist", data)

    return write


def bridge_plugins(tmp_path: Path, control: Control, bridge: str,
                   subnet: str = "10.215.0.0/24") -> list[dict[str, Any]]:
    """bridge + host-local, then our recording plugin (which passes prevResult on)."""
    return [
        {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
         "ipam": {"type": "host-local", "subnet": subnet, "dataDir": str(tmp_path / "ipam")}},
        plug(control),
    ]


@pytest.fixture
def bridge_name() -> Iterator[str]:
    br = unique_name("cab")
    yield br
    delete_link(br)


@pytest.fixture
def bridge_chain(tmp_path: Path, control: Control, bridge_name: str) -> str:
    """The network "pods": real bridge + host-local (1.0.0), then the test plugin."""
    write_conf(tmp_path / "net.d", "10-pods.conflist",
               conflist("pods", bridge_plugins(tmp_path, control, bridge_name), "1.0.0"))
    return "pods"
