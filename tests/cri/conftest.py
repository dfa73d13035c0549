"""A Kubernetes node in miniature: the agent on a private system-like bus with a
real bridge + host-local + portmap network, and a private containerd 2.x whose
only CNI network is the conflist `cni-agent shim-config --runtime containerd`
prints. Pods are run over containerd's CRI socket, as kubelet runs them."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unique_name
from tests.cri.containerd import BIN, Containerd
from tests.cri.cri import CRI
from tests.cri.image import build_image
from tests.support.agent import Agent, Bus
from tests.support.net import allocations, delete_link
from tests.support.shim import SHIM

SUBNET = ipaddress.ip_network("10.247.0.0/24")  # no other test uses it
NETWORK = "podnet"  # the agent's network
POD_NETWORK = "pods"  # its name for containerd


class Node:
    def __init__(self, tmp: Path, bus: Bus, image: Path) -> None:
        self.tmp = tmp
        self.bridge = unique_name("cri")
        self.ipam = tmp / "ipam"
        self.agent = Agent(tmp / "agent", bus)
        self.agent.conf_dir.mkdir(parents=True)
        self.network_file = self.agent.conf_dir / f"10-{NETWORK}.conflist"
        # 1.0.0: Debian 12's reference plugins (1.1.1) take no 1.1.0 config.
        # containerd sees the shim's list, which is 1.1.0 all the same.
        self.network = json.dumps({"cniVersion": "1.0.0", "name": NETWORK, "plugins": [
            {"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
             "ipam": {"type": "host-local", "subnet": str(SUBNET), "dataDir": str(self.ipam)}},
            {"type": "portmap", "capabilities": {"portMappings": True}}]})
        self.network_file.write_text(self.network)
        self.image = image
        self.containerd = Containerd(tmp / "containerd", bus.address)

    def start(self) -> None:
        self.agent.start()
        assert self.agent.call("WaitReady", "d", "10")[0] is True, self.agent.log()
        # The file a user would write, by the README's recipe.
        (self.containerd.conf_dir / f"10-{POD_NETWORK}.conflist").write_text(
            self.cli("shim-config", "--runtime", "containerd", "--network", NETWORK,
                     "--name", POD_NETWORK))
        self.containerd.start()
        self.containerd.ctr("images", "import", str(self.image))

    @property
    def cri(self) -> CRI:
        return self.containerd.cri

    def cli(self, *args: str) -> str:
        p = subprocess.run([sys.executable, "-m", "cni_agent", "--bus", self.agent.bus.address, *args],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        return p.stdout

    def allocations(self) -> list[str]:
        """The addresses host-local holds for the agent's network."""
        return allocations(self.ipam, NETWORK)

    def restart_agent(self) -> None:
        assert self.agent.stop() == 0, self.agent.log()[-3000:]
        self.agent.start()
        assert self.agent.call("WaitReady", "d", "10")[0] is True, self.agent.log()

    def close(self) -> None:
        try:
            self.containerd.close()
        finally:
            self.agent.stop()
            delete_link(self.bridge)


def netns_addresses(netns: str, ifname: str = "eth0") -> list[str]:
    """IPv4 CIDRs on an interface inside a namespace given by path (containerd's
    are under its state dir, not /run/netns)."""
    p = subprocess.run(["nsenter", f"--net={netns}", "ip", "-j", "-4", "addr", "show", "dev", ifname],
                       capture_output=True, text=True)
    links: list[dict[str, Any]] = json.loads(p.stdout or "[]") if p.returncode == 0 else []
    return [f"{a['local']}/{a['prefixlen']}" for link in links for a in link.get("addr_info", [])]


@pytest.fixture(scope="session")
def cri_bus() -> Iterator[Bus]:
    bus = Bus("system")
    yield bus
    bus.stop()


@pytest.fixture(scope="session")
def pause_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert (BIN / "containerd").exists(), f"no containerd in {BIN}: run `make setup` (tools/setup-system)"
    assert SHIM.exists(), "no shim: run `make build/cni-agent-shim`"
    return build_image(tmp_path_factory.mktemp("pause"))


@pytest.fixture
def node(tmp_path: Path, cri_bus: Bus, pause_image: Path) -> Iterator[Node]:
    n = Node(tmp_path, cri_bus, pause_image)
    try:
        n.start()
        yield n
    finally:
        n.close()
