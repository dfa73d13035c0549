"""A Kubernetes node in miniature: the agent on a private system-like bus with a
real bridge + host-local + portmap network, and a private CRI runtime whose
only CNI network is the conflist `cni-agent shim-config --runtime RUNTIME`
prints. Pods are run over the runtime's CRI socket, as kubelet runs them.

The runtime is containerd 2.x (tools/setup-system caches it; `make test`), or
CRI-O with CNI_AGENT_CRI_RUNTIME=crio (`make test-crio CRIO_SRC=DIR`, which
builds it: CI machines reach no source repository). A test that only one
runtime can run is marked `@pytest.mark.runtimes(NAME)` and is deselected,
not skipped, under the other.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unique_name
from tests.cri.containerd import BIN, Containerd
from tests.cri.cri import CRI
from tests.cri.crio import CRIO, CRIO_DIR
from tests.cri.image import build_image
from tests.cri.runtime import Runtime
from tests.support.agent import Agent, Bus
from tests.support.net import allocations, delete_link
from tests.support.shim import SHIM

RUNTIMES = ("containerd", "crio")
RUNTIME = os.environ.get("CNI_AGENT_CRI_RUNTIME", "containerd")
SUBNET = ipaddress.ip_network("10.247.0.0/24")  # no other test uses it
NETWORK = "podnet"  # the agent's network


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "runtimes(*names): only under these CRI runtimes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    assert RUNTIME in RUNTIMES, f"CNI_AGENT_CRI_RUNTIME={RUNTIME!r}: one of {RUNTIMES}"
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("runtimes")
        here = item.path.is_relative_to(Path(__file__).parent)
        (drop if here and marker is not None and RUNTIME not in marker.args else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class Node:
    def __init__(self, tmp: Path, bus: Bus, image: Path,
                 first_plugins: list[dict[str, Any]] | None = None) -> None:
        """`first_plugins`: plugins put before bridge in the agent's network."""
        self.tmp = tmp
        self.runtime_name = RUNTIME
        self.bridge = unique_name("cri")
        self.ipam = tmp / "ipam"
        # The runtime's network name, unique: libcni's cache (/var/lib/cni) is
        # the machine's, and CRI-O's GC DELs every entry of its network there.
        self.pod_network = unique_name("pods")
        self.agent = Agent(tmp / "agent", bus)
        self.agent.conf_dir.mkdir(parents=True)
        self.network_file = self.agent.conf_dir / f"10-{NETWORK}.conflist"
        # 1.0.0: Debian 12's reference plugins (1.1.1) take no 1.1.0 config.
        # The runtime sees the shim's list, which is 1.1.0 all the same.
        self.network = json.dumps({"cniVersion": "1.0.0", "name": NETWORK, "plugins": [
            *(first_plugins or []),
            {"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
             "ipam": {"type": "host-local", "subnet": str(SUBNET), "dataDir": str(self.ipam)}},
            {"type": "portmap", "capabilities": {"portMappings": True}}]})
        self.network_file.write_text(self.network)
        self.image = image
        self.runtime: Runtime
        # Its own short directory: the runtime's unix sockets' paths are
        # limited to 104 bytes (containerd's check), and tmp_path under
        # make test's workers is long.
        top = Path(tempfile.mkdtemp(prefix=f"cri-{RUNTIME}-"))
        if RUNTIME == "crio":
            self.runtime = CRIO(top, bus.address,
                                self.cli("shim-config", "--runtime", "crio", "--drop-in"),
                                shim_socket=self.agent.shim_socket)
        else:
            self.runtime = Containerd(top, bus.address,
                                      shim_socket=self.agent.shim_socket)

    def start(self, runtime: bool = True) -> None:
        self.agent.start()
        assert self.agent.call("WaitReady", "d", "10")[0] is True, self.agent.log()
        # The file a user would write, by docs/runtimes.md's recipe.
        (self.runtime.conf_dir / f"10-{self.pod_network}.conflist").write_text(self.shim_conflist())
        if runtime:
            self.start_runtime()

    def start_runtime(self) -> None:
        self.runtime.start()
        self.runtime.load_image(self.image)

    def shim_conflist(self) -> str:
        return self.cli("shim-config", "--runtime", RUNTIME, "--network", NETWORK,
                        "--name", self.pod_network, "--config", str(self.agent.config_path))

    @property
    def cri(self) -> CRI:
        return self.runtime.cri

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
            self.runtime.close()
        finally:
            self.agent.stop()
            delete_link(self.bridge)


def netns_addresses(netns: str, ifname: str = "eth0") -> list[str]:
    """IPv4 CIDRs on an interface inside a namespace given by path (the
    runtimes' are under their state dirs, not /run/netns)."""
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
    if RUNTIME == "crio":
        assert (CRIO_DIR / "crio").exists(), \
            f"no crio in {CRIO_DIR}: run `make test-crio CRIO_SRC=DIR` (tools/build-crio)"
    else:
        assert (BIN / "containerd").exists(), \
            f"no containerd in {BIN}: run `make setup` (tools/setup-system)"
    assert SHIM.exists(), "no shim: run `make build/cni-agent-shim`"
    return build_image(tmp_path_factory.mktemp("pause"))


@pytest.fixture
def make_node(tmp_path: Path, cri_bus: Bus, pause_image: Path) -> Iterator[Any]:
    """Node(**kw) made, and closed at the end; start() is the test's."""
    made: list[Node] = []

    def make(**kw: Any) -> Node:
        n = Node(tmp_path, cri_bus, pause_image, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


@pytest.fixture
def node(make_node: Any) -> Node:
    n: Node = make_node()
    n.start()
    return n
