"""Host ports as a grant (issue 44, item 2), against a live agent as the
attacks were made: real users, their own namespaces, a real bridge +
host-local + portmap chain and the DNAT rules portmap writes.

Reproduced before the fix: a member's `"protocol": "6"` took a port root
maps over TCP (a second DNAT beside root's); a root mapping made after a
member's was not checked at all (the member's jump came first, so root's
port went to the member's sandbox); opening `portMappings` opened every
port from 1024 up.
"""

from __future__ import annotations

import json
import pwd
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unique_name
from tests.daemon.conftest import plug
from tests.daemon.test_owners import cli, own_netns
from tests.support.agent import Agent, Bus
from tests.support.net import allocations, delete_link
from tests.support.plugins import Control, conflist, write_conf
from tests.support.shim import run_shim, shim_conf

pytestmark = pytest.mark.root

ERR = "org.cniagent.Agent1.Error."
GRANT = "18620-18639"


@pytest.fixture
def portmap_chain(tmp_path: Path, control: Control) -> Iterator[str]:
    """The network "portnet": bridge + host-local, portmap (iptables), the
    recording plugin. Not "pods": portmap names a sandbox's DNAT chain after
    its network and id, and test_drift's "pods"/"web" may run beside this file
    (one's DEL removed the other's chain: a CI run saw root's DNAT vanish)."""
    br = unique_name("cap")
    write_conf(tmp_path / "net.d", "10-portnet.conflist", conflist("portnet", [
        {"type": "bridge", "bridge": br, "isGateway": True, "ipMasq": False,
         "ipam": {"type": "host-local", "subnet": "10.231.0.0/24",
                  "dataDir": str(tmp_path / "ipam")}},
        {"type": "portmap", "capabilities": {"portMappings": True}, "snat": False},
        plug(control)], "1.0.0"))
    yield "portnet"
    delete_link(br)


def ports(port: int, protocol: str = "tcp", container_port: int = 80) -> dict[str, Any]:
    return {"portMappings": [{"hostPort": port, "containerPort": container_port,
                              "protocol": protocol}]}


def dnat(port: int) -> list[tuple[str, str]]:
    """(sandbox id, destination) of each DNAT portmap wrote for host `port`: its
    per-container chain's rules, the chain's jump naming the sandbox."""
    nat = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    owner = {}
    for line in nat:
        jump = re.search(r"-j (CNI-DN-[0-9a-f]+)", line)
        sid = re.search(r'id: \\"([^"\\]+)\\"', line)
        if line.startswith("-A CNI-HOSTPORT-DNAT") and jump and sid:
            owner[jump.group(1)] = sid.group(1)
    found = []
    for line in nat:
        chain = re.match(r"-A (CNI-DN-[0-9a-f]+) ", line)
        to = re.search(r"--to-destination (\S+)", line)
        if chain and to and f"--dport {port} " in f"{line} " and chain.group(1) in owner:
            found.append((owner[chain.group(1)], to.group(1)))
    return sorted(found)


def address(doc: dict[str, Any]) -> str:
    return str(doc["attachments"][0]["result"]["ips"][0]["address"]).split("/")[0]


def member_agent(make_agent: Callable[..., Agent], bus: Bus, member: str, **access: Any) -> Agent:
    return make_agent(bus=bus, access={"groups": [member], "networks": ["portnet"],
                                       "capabilities": ["portMappings"], **access})


def test_a_members_protocol_number_never_takes_a_port_root_maps(
    make_agent: Callable[..., Agent], permissive_bus: Bus, portmap_chain: str, member: str,
    netns: str, tmp_path: Path,
) -> None:
    agent = member_agent(make_agent, permissive_bus, member, host_ports=[GRANT])
    web = agent.setup("web", netns, capabilities=ports(18621, "TCP"))
    assert dnat(18621) == [("web", f"{address(web)}:80")]
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        # "6" is TCP to iptables: the same port, refused, nothing allocated or mapped.
        for protocol in ("6", "tcp", "Tcp"):
            out = cli(agent, member, "setup", "vm1", path, "--capabilities",
                      json.dumps(ports(18621, protocol, 22)))
            assert out.returncode == 2, out
            assert "invalid argument: capabilities: host port 18621/tcp is already mapped by " \
                   "another sandbox" in out.stderr and "web" not in out.stderr, out
        assert dnat(18621) == [("web", f"{address(web)}:80")]
        assert allocations(tmp_path / "ipam", "portnet") == [address(web)]
        # An unknown protocol is no protocol: refused before anything is compared.
        out = cli(agent, member, "setup", "vm1", path, "--capabilities",
                  json.dumps(ports(18622, "icmp")))
        assert out.returncode == 2 and "'icmp' is not one of tcp, udp, sctp" in out.stderr, out
        # The same number over UDP ("17") is another port: the member's to map.
        out = cli(agent, member, "setup", "vm1", path, "--capabilities",
                  json.dumps(ports(18621, "17", 22)))
        assert out.returncode == 0, out
        assert cli(agent, member, "teardown", "vm1", path).returncode == 0
    finally:
        mine.kill()
    agent.call("Teardown", "ssa{sv}", "web", netns, "0")
    assert dnat(18621) == []


def test_root_never_takes_a_port_another_sandbox_maps_whichever_way_it_comes(
    make_agent: Callable[..., Agent], permissive_bus: Bus, portmap_chain: str, member: str,
    netns_factory: Callable[[], str], control: Control, tmp_path: Path,
) -> None:
    agent = member_agent(make_agent, permissive_bus, member, host_ports=[GRANT])
    vm1 = f"cni-agent.u{pwd.getpwnam(member).pw_uid}.vm1"
    mine = own_netns(member)
    try:
        out = cli(agent, member, "setup", "vm1", f"/proc/{mine.pid}/ns/net", "--json",
                  "--capabilities", json.dumps(ports(18623, "6")))
        assert out.returncode == 0, out
        held = [(vm1, f"{address(json.loads(out.stdout))}:80")]
        assert dnat(18623) == held
        adds = control.commands().count("ADD")
        # Root's Setup, on every address or on one: refused, naming the member's sandbox.
        for caps in (ports(18623, "TCP"), {"portMappings": [
                {"hostPort": 18623, "containerPort": 80, "protocol": "tcp",
                 "hostIP": "127.0.0.1"}]}):
            out = agent.gdbus("Setup", "web", netns_factory(),
                              f"{{'capabilities': <{json.dumps(json.dumps(caps))}>}}")
            assert ERR + "InvalidArgument" in out.stderr, out.stderr
            assert f"is already mapped by sandbox {vm1}" in out.stderr, out.stderr
        # Root's Attach over D-Bus, and a runtime's ADD through the shim: the same.
        out = agent.gdbus("Attach", "web", netns_factory(), "portnet", "eth0",
                          f"{{'capabilities': <{json.dumps(json.dumps(ports(18623)))}>}}")
        assert ERR + "InvalidArgument" in out.stderr and vm1 in out.stderr, out.stderr
        shim = run_shim(agent.bus.address, "ADD",
                        shim_conf("k8s-portnet", "portnet", "1.0.0", runtimeConfig=ports(18623)),
                        cid="ctr1", netns=netns_factory())
        assert shim.rc != 0 and shim.code == 7, shim
        assert f"host port 18623/tcp is already mapped by sandbox {vm1}" in shim.out["msg"], shim
        assert control.commands().count("ADD") == adds  # no plugin ran for any of them
        assert dnat(18623) == held
        assert agent.call("ListSandboxes")[0] == [vm1]
    finally:
        cli(agent, member, "teardown", "vm1", f"/proc/{mine.pid}/ns/net")
        mine.kill()
    # Root against root: its second sandbox never takes its first's port.
    web = agent.setup("web", netns_factory(), capabilities=ports(18624))
    out = agent.gdbus("Setup", "api", netns_factory(),
                      f"{{'capabilities': <{json.dumps(json.dumps(ports(18624, '6')))}>}}")
    assert ERR + "InvalidArgument" in out.stderr and "mapped by sandbox web" in out.stderr, out
    assert dnat(18624) == [("web", f"{address(web)}:80")]
    agent.call("Teardown", "ssa{sv}", "web", "", "0")
    api = agent.setup("api", netns_factory(), capabilities=ports(18624, "6"))  # free again
    assert dnat(18624) == [("api", f"{address(api)}:80")]
    agent.call("Teardown", "ssa{sv}", "api", "", "0")


def test_a_member_maps_only_host_ports_inside_access_host_ports(
    make_agent: Callable[..., Agent], permissive_bus: Bus, portmap_chain: str, member: str,
    tmp_path: Path,
) -> None:
    agent = member_agent(make_agent, permissive_bus, member, host_ports=[GRANT, "18650"])
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        for port in (18640, 18619, 18651, 1024):  # outside the grant, ≥ 1024 all the same
            out = cli(agent, member, "setup", "vm1", path, "--capabilities",
                      json.dumps(ports(port)))
            assert out.returncode == 4, out
            assert f"access denied: host port {port}/tcp is not in a range open to callers " \
                   f"that are not root (access.host_ports: {GRANT}, 18650)" in out.stderr, out
            assert dnat(port) == []
        assert allocations(tmp_path / "ipam", "portnet") == []
        for port, sid in ((18639, "vm1"), (18650, "vm2")):
            out = cli(agent, member, "setup", sid, path, "--network", f"portnet:e{sid}",
                      "--capabilities", json.dumps(ports(port)))
            assert out.returncode == 0, out
            assert len(dnat(port)) == 1
        # access.host_ports: [] (the default) with portMappings open: no port at all.
        del agent.config["access"]["host_ports"]
        agent.write_config()
        agent.call("Reload")
        out = cli(agent, member, "setup", "vm3", path, "--network", "portnet:evm3",
                  "--capabilities", json.dumps(ports(18630)))
        assert out.returncode == 4 and "(access.host_ports: none)" in out.stderr, out
        assert dnat(18630) == []
        for sid in ("vm1", "vm2"):
            assert cli(agent, member, "teardown", sid, path).returncode == 0
        assert dnat(18639) == dnat(18650) == []
    finally:
        mine.kill()
