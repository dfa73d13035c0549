"""The runtime against Debian's reference plugins in real network namespaces."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cni_agent.cni.config import NetworkConfigList, load_dir, parse_list
from cni_agent.cni.errors import PluginError
from cni_agent.cni.runtime import CNIRuntime, RuntimeConf
from tests.conftest import unique_name
from tests.support.net import addresses, allocations, delete_link, link_exists
from tests.support.plugins import REFERENCE_PLUGIN_DIR

pytestmark = pytest.mark.root
TESTDATA = Path(__file__).resolve().parents[1] / "data" / "net.d"
DEFAULT_IPAM_DIR = Path("/var/lib/cni/networks")


@pytest.fixture
def runtime(tmp_path: Path) -> CNIRuntime:
    return CNIRuntime([REFERENCE_PLUGIN_DIR], str(tmp_path / "state"))


@pytest.fixture
def bridge() -> Iterator[str]:
    name = unique_name("cab")
    yield name
    delete_link(name)


def bridge_net(bridge: str, data_dir: Path, version: str = "0.4.0", subnet: str = "10.201.0.0/24",
               extra: list[dict[str, Any]] | None = None) -> NetworkConfigList:
    doc = {
        "cniVersion": version, "name": f"br-{bridge}",
        "plugins": [{
            "type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
            "ipam": {"type": "host-local", "subnet": subnet, "dataDir": str(data_dir)},
        }, *(extra or [])],
    }
    return parse_list(json.dumps(doc).encode(), "test.conflist")


async def test_add_gives_the_netns_an_address_and_del_releases_it(
    runtime: CNIRuntime, netns: str, bridge: str, tmp_path: Path
) -> None:
    data = tmp_path / "ipam"
    net = bridge_net(bridge, data)
    await runtime.validate(net)
    rt = RuntimeConf("sbx-ref1", netns, "eth0")
    result = await runtime.add(net, rt)
    address = result["ips"][0]["address"]
    assert address.startswith("10.201.0.")
    assert addresses(netns) == [address]
    assert allocations(data, net.name) == [address.split("/")[0]]
    assert runtime.cache.read(net.name, "sbx-ref1", "eth0") is not None

    assert await runtime.check(net, rt) is True

    await runtime.delete(net, rt)
    assert allocations(data, net.name) == []
    assert not link_exists("eth0", netns)
    assert runtime.cache.read(net.name, "sbx-ref1", "eth0") is None


async def test_del_with_the_netns_gone_still_releases_the_ip(
    runtime: CNIRuntime, netns_factory: Any, bridge: str, tmp_path: Path
) -> None:
    import subprocess

    data = tmp_path / "ipam"
    net = bridge_net(bridge, data, version="1.0.0")
    ns = netns_factory()
    await runtime.add(net, RuntimeConf("sbx-gone", ns, "eth0"))
    subprocess.run(["ip", "netns", "del", ns.rsplit("/", 1)[1]], check=True)
    await runtime.delete(net, RuntimeConf("sbx-gone", "", "eth0"))
    assert allocations(data, net.name) == []
    assert runtime.cache.for_container("sbx-gone") == []


async def test_two_attachments_with_tuning_and_ptp(
    runtime: CNIRuntime, netns: str, bridge: str, tmp_path: Path
) -> None:
    data = tmp_path / "ipam"
    tuning = {"type": "tuning", "sysctl": {"net.ipv4.conf.eth0.arp_notify": "1"}}
    net = bridge_net(bridge, data, extra=[tuning])
    ptp = parse_list(json.dumps({
        "cniVersion": "1.0.0", "name": "ptp-x",
        "plugins": [{"type": "ptp", "ipMasq": False,
                     "ipam": {"type": "host-local", "subnet": "10.202.0.0/24", "dataDir": str(data)}}],
    }).encode(), "ptp.conflist")
    await runtime.add(net, RuntimeConf("sbx-two", netns, "eth0"))
    await runtime.add(ptp, RuntimeConf("sbx-two", netns, "net1"))
    assert addresses(netns, "net1")[0].startswith("10.202.0.")
    assert sorted(a.network for a in runtime.cache.for_container("sbx-two")) == [net.name, "ptp-x"]
    await runtime.delete(ptp, RuntimeConf("sbx-two", netns, "net1"))
    await runtime.delete(net, RuntimeConf("sbx-two", netns, "eth0"))
    assert allocations(data, "ptp-x") == [] and allocations(data, net.name) == []


async def test_failed_add_leaves_an_error_naming_the_plugin(
    runtime: CNIRuntime, netns: str, bridge: str, tmp_path: Path
) -> None:
    net = bridge_net(bridge, tmp_path / "ipam", subnet="not-a-subnet")
    with pytest.raises(PluginError) as e:
        await runtime.add(net, RuntimeConf("sbx-bad", netns, "eth0"))
    assert e.value.plugin == "bridge" and e.value.verb == "ADD"
    assert runtime.cache.for_container("sbx-bad") == []


@pytest.fixture
def users_conf_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "net.d"
    shutil.copytree(TESTDATA, d)
    yield d
    delete_link("cni0")


async def test_podman_config_as_it_is(runtime: CNIRuntime, users_conf_dir: Path, netns: str) -> None:
    """The podman report's config: ADD, CHECK (0.4.0: "Mac doesn't match" there), DEL."""
    net = next(n for n in load_dir(str(users_conf_dir)).networks if n.name == "bridge-firewall")
    await runtime.validate(net)
    rt = RuntimeConf("sbx-podman", netns, "eth0")
    result = await runtime.add(net, rt)
    address = result["ips"][0]["address"]
    assert address.startswith("10.85.") and addresses(netns) == [address]
    assert address.split("/")[0] in allocations(DEFAULT_IPAM_DIR, net.name)
    assert await runtime.check(net, rt) is True
    await runtime.delete(net, rt)
    assert address.split("/")[0] not in allocations(DEFAULT_IPAM_DIR, net.name)
    assert runtime.cache.for_container(rt.container_id) == []


async def test_crio_config_as_it_is(runtime: CNIRuntime, users_conf_dir: Path, netns: str) -> None:
    """The CRI-O report's config (bridge + portmap + firewall, portMappings capability).

    With isDefaultGateway and a 0.0.0.0/0 IPAM route, Debian's bridge 1.1.1 adds
    the default route twice and fails with "file exists"; newer plugins accept it.
    Either way no address may leak: a working address, or a named error after
    which DEL releases the allocation.
    """
    net = next(n for n in load_dir(str(users_conf_dir)).networks if n.name == "bridge-firewalld")
    await runtime.validate(net)
    caps = {"portMappings": [{"hostPort": 18080, "containerPort": 80, "protocol": "tcp"}]}
    rt = RuntimeConf("sbx-crio", netns, "eth0", capability_args=caps)
    try:
        result = await runtime.add(net, rt)
    except PluginError as e:
        assert (e.plugin, e.verb) == ("bridge", "ADD")
        assert "file exists" in e.msg
        assert runtime.cache.for_container(rt.container_id) == []
        try:
            await runtime.delete(net, rt)
        except PluginError as d:
            # bridge 1.1.1 cannot undo the ipMasq rule it never created; it
            # releases the IPAM allocation before failing.
            assert (d.plugin, d.verb) == ("bridge", "DEL") and "does not exist" in d.msg
    else:
        assert addresses(netns) == [result["ips"][0]["address"]]
        assert await runtime.check(net, rt) is True
        await runtime.delete(net, rt)
    assert allocations(DEFAULT_IPAM_DIR, net.name) == []
    assert runtime.cache.for_container(rt.container_id) == []
