"""podman, unmodified, on a conflist whose plugin is cni-agent-shim: the
container gets its address from the agent, and `podman rm -f` releases it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import unique_name
from tests.support.agent import Agent, Bus
from tests.support.net import addresses, allocations, delete_link
from tests.support.plugins import conflist, write_conf
from tests.support.podman import Podman

pytestmark = pytest.mark.root


@pytest.fixture
def podman(system_bus: Bus, tmp_path: Path) -> Iterator[Podman]:
    # podman refuses a runroot longer than 50 characters: not under tmp_path.
    # The shim on the socket of the agent make_agent starts (its runtime_dir).
    p = Podman(Path(tempfile.mkdtemp(prefix="cni-agent-podman-")), system_bus.address,
               tmp_path / "run" / "shim.sock")
    yield p
    p.close()


def cli(agent: Agent, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "cni_agent", "--bus", agent.bus.address, *args],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_podman_container_gets_its_address_from_the_agent(
    make_agent: Callable[..., Agent], podman: Podman, tmp_path: Path,
) -> None:
    bridge = unique_name("capm")
    write_conf(tmp_path / "net.d", "10-podnet.conflist", conflist("podnet", [
        {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
         "ipam": {"type": "host-local", "subnet": "10.238.0.0/24",
                  "dataDir": str(tmp_path / "ipam")}}], "1.0.0"))
    agent = make_agent()
    # The conflist a user would paste: what `cni-agent shim-config` prints.
    (podman.net_dir / "pods.conflist").write_text(
        cli(agent, "shim-config", "--runtime", "podman", "--network", "podnet", "--name", "pods",
            "--config", str(agent.config_path)))
    try:
        cid = podman("run", "-d", "--name", "web", "--network", "pods",
                     "--rootfs", str(podman.rootfs), "/bin/sleep", "600").stdout.strip()
        netns = podman("inspect", "-f", "{{.NetworkSettings.SandboxKey}}", "web").stdout.strip()
        inside = podman("exec", "web", "ip", "-4", "-o", "addr", "show", "eth0").stdout
        [address] = addresses(netns)
        assert address.split("/")[0] in inside
        assert cli(agent, "list").split() == [cid]
        shown = json.loads(agent.call("Show", "s", cid)[0])
        assert shown["attachments"][0]["result"]["ips"][0]["address"] == address
        assert allocations(tmp_path / "ipam", "podnet") == [address.split("/")[0]]

        podman("rm", "--force", "--time", "0", "web")
        assert cli(agent, "list").split() == []
        assert allocations(tmp_path / "ipam", "podnet") == []
        assert not os.path.exists(netns)
    finally:
        podman.close()
        delete_link(bridge)


def test_a_podman_container_joins_a_namespace_the_agent_set_up(
    make_agent: Callable[..., Agent], podman: Podman, tmp_path: Path,
) -> None:
    """podman 5's way (it has no CNI backend, docs/runtimes.md): `cni-agent sandbox
    up NAME`, then `podman run --network ns:/run/netns/NAME`; podman 4 joins the
    same way, and publishes no ports of its own there."""
    bridge, name = unique_name("capn"), unique_name("cpns")
    write_conf(tmp_path / "net.d", "10-podnet.conflist", conflist("podnet", [
        {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
         "ipam": {"type": "host-local", "subnet": "10.239.0.0/24",
                  "dataDir": str(tmp_path / "ipam")}}], "1.0.0"))
    agent = make_agent()
    netns = f"/run/netns/{name}"
    try:
        cli(agent, "sandbox", "up", name, "--dir", str(tmp_path / "sandboxes"))
        [address] = addresses(netns)
        podman("run", "-d", "--name", "web", "--network", f"ns:{netns}",
               "--rootfs", str(podman.rootfs), "/bin/sleep", "600")
        inside = podman("exec", "web", "ip", "-4", "-o", "addr", "show", "eth0").stdout
        assert address.split("/")[0] in inside
        published = podman("run", "--rm", "-p", "18080:80", "--network", f"ns:{netns}",
                           "--rootfs", str(podman.rootfs), "/bin/true", check=False)
        assert published.returncode != 0, published.stdout
        podman("rm", "--force", "--time", "0", "web")
        assert addresses(netns) == [address]  # podman leaves the agent's network alone
        cli(agent, "sandbox", "down", name)
        assert not os.path.exists(netns) and allocations(tmp_path / "ipam", "podnet") == []
    finally:
        subprocess.run([sys.executable, "-m", "cni_agent", "--bus", agent.bus.address, "sandbox",
                        "down", name], capture_output=True, timeout=30)
        delete_link(bridge)
