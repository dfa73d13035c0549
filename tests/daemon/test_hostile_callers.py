"""What a member can do to someone else's sandbox, and what anyone can do to the node.

Each test is one of issue 35's reproductions, run through D-Bus with real
users made by the test (a member of the configured access group, running the
real CLI or a dbus-fast client with its own uid and groups), the reference
plugins and real network namespaces. The bus is permissive: the daemon's own
checks decide.
"""

from __future__ import annotations

import json
import pwd
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.test_owners import cli, own_netns
from tests.support.agent import Agent, Bus, as_member, options, readable_source
from tests.support.dbusclient import SyncClient
from tests.support.net import addresses, allocations, link_exists
from tests.support.plugins import Control

pytestmark = pytest.mark.root
ERR = "org.cniagent.Agent1.Error."


def member_python(member: str, address: str, body: str, timeout: float = 120
                  ) -> subprocess.CompletedProcess[str]:
    """Run `body` (inside `async def main(call)`) as `member` with its groups;
    `call(member, sig, body, fds=())` makes one call of the agent's interface."""
    code = textwrap.dedent("""
        import asyncio, json, os, sys, time
        sys.path.insert(0, {src!r})
        from dbus_fast import Message, MessageType
        from cni_agent.bus import connect
        async def run():
            bus = await connect({address!r})
            async def call(member, sig="", body=(), fds=()):
                reply = await bus.call(Message(destination="org.cniagent.Agent1",
                    path="/org/cniagent/Agent1", interface="org.cniagent.Agent1",
                    member=member, signature=sig, body=list(body), unix_fds=list(fds)))
                if reply.message_type is MessageType.ERROR:
                    return reply.error_name, (reply.body or [""])[0]
                return None, reply.body
            await main(call)
        """).format(src=str(readable_source()), address=address)
    code += textwrap.dedent(body) + "\nasyncio.run(run())\n"
    return subprocess.run([*as_member(member), "/usr/bin/python3", "-I", "-c", code],
                          capture_output=True, text=True, timeout=timeout)


def uid_of(user: str) -> int:
    return pwd.getpwnam(user).pw_uid


@pytest.fixture
def pods_agent(make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str,
               member: str) -> Agent:
    """Root's runtime and a member (a VM manager's user, say) on one node; the
    admin opened the network "pods" to members."""
    return make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods"]})


# --- 2. opening a namespace is not owning it ----------------------------------------------


def test_a_member_cannot_configure_roots_pod_namespace_by_path_or_descriptor(
    pods_agent: Agent, member: str, netns: str, tmp_path: Path,
) -> None:
    pods_agent.setup("rootpod", netns)
    [root_ip] = addresses(netns)
    assert (Path(netns).stat().st_mode & 0o444) == 0o444  # anyone may open it
    for network in ("pods:eth1", "pods:eth0"):
        # The CLI opens NETNS with the member's rights and passes the descriptor.
        out = cli(pods_agent, member, "setup", "evil", netns, "--network", network)
        assert out.returncode == 4, out
        assert "may only configure a network namespace of a user namespace it owns" in out.stderr
        assert Path(netns).name not in out.stderr  # nothing said about the namespace
    # By path, straight to the bus: refused as before.
    out = pods_agent.gdbus("Setup", "evil", netns, "{}", member=member)
    assert ERR + "AccessDenied" in out.stderr, out.stderr
    # Root's pod: its eth0 and address untouched, no eth1, its record ready.
    assert addresses(netns) == [root_ip] and not link_exists("eth1", netns)
    assert allocations(tmp_path / "ipam", "pods") == [root_ip.split("/")[0]]
    shown = json.loads(pods_agent.call("Show", "s", "rootpod")[0])
    assert shown["state"] == "ready"
    assert pods_agent.call("ListSandboxes")[0] == ["rootpod"]


def test_a_member_may_configure_a_namespace_of_its_own_user_namespace(
    pods_agent: Agent, member: str, tmp_path: Path,
) -> None:
    mine = own_netns(member)
    try:
        out = cli(pods_agent, member, "setup", "vm1", f"/proc/{mine.pid}/ns/net")
        assert out.returncode == 0, out
        assert cli(pods_agent, member, "teardown", "vm1",
                   f"/proc/{mine.pid}/ns/net").returncode == 0
        assert allocations(tmp_path / "ipam", "pods") == []
    finally:
        mine.kill()


def test_an_interface_already_in_the_namespace_is_never_taken_over_even_by_root(
    pods_agent: Agent, netns: str, tmp_path: Path, control: Control,
) -> None:
    """The rollback of a failed ADD DELs what the call created, nothing else:
    an eth0 the namespace had before is refused before any plugin runs."""
    name = Path(netns).name
    subprocess.run(["ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0"],
                   check=True)
    subprocess.run(["ip", "-n", name, "addr", "add", "192.0.2.9/24", "dev", "eth0"], check=True)
    client = SyncClient(pods_agent.bus.address)
    try:
        err, text = client.call("Setup", "ssa{sv}", ["taken", netns, {}])
        assert err == ERR + "InvalidArgument", (err, text)
        assert "interface eth0 already exists" in text, text
    finally:
        client.close()
    assert addresses(netns) == ["192.0.2.9/24"]  # the namespace's own eth0, untouched
    assert allocations(tmp_path / "ipam", "pods") == []
    assert control.commands() == []  # no plugin ran
    assert pods_agent.call("ListSandboxes")[0] == []
    assert not list((tmp_path / "state" / "sandboxes").glob("*.json"))


# --- 3. a member's GC --------------------------------------------------------------------


def test_a_members_gc_loop_never_reaps_roots_sandboxes(
    make_agent: Callable[..., Agent], permissive_bus: Bus, testnet: Callable[..., Path],
    control: Control, member: str, netns: str,
) -> None:
    testnet()
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["testnet"]})
    client = SyncClient(agent.bus.address)
    try:
        for i in range(150):  # many records: each of a member's GCs reads them all (on main)
            assert client.call("Setup", "ssa{sv}", [f"old{i}", netns, {}])[0] is None
        # 6 s of it (about 200 root Setups here, raced by the member's GCs,
        # each reading every record): the race needs overlap, not length.
        stop = time.monotonic() + 6
        loop = threading.Thread(target=member_python, args=(member, agent.bus.address, f"""
            async def main(call):
                n = 0
                while time.time() < {time.time() + 6}:
                    err, _ = await call("GarbageCollect", "as", [[]])
                    assert err is None, err
                    n += 1
                print(n)
            """))
        loop.start()
        new = []
        while time.monotonic() < stop - 1:
            sid = f"new{len(new)}"
            assert client.call("Setup", "ssa{sv}", [sid, netns, {}])[0] is None
            new.append(sid)
        loop.join(60)
        listed = set(client.call("ListSandboxes")[1][0])
        missing = [s for s in new if s not in listed]
        assert not missing, f"{len(missing)} of {len(new)} root Setups reaped by a member's GC"
        assert len(listed) == 150 + len(new)
        assert "DEL" not in control.commands()
    finally:
        client.close()


# --- 4. cache entries belong to one attachment -------------------------------------------


@pytest.fixture
def two_nets(testnet: Callable[..., Path]) -> None:
    for name in ("testnet", "testnet-v6"):
        testnet(name)


def test_two_sandboxes_never_share_one_cache_entry(
    make_agent: Callable[..., Agent], two_nets: None, tmp_path: Path, netns: str,
    netns_factory: Callable[[], str],
) -> None:
    agent = make_agent()
    other = netns_factory()
    results = tmp_path / "state" / "results"
    agent.setup("v6-x", netns, networks=[("testnet", "eth0")])
    entry = results / "testnet-v6-x-eth0"
    before = entry.read_text()
    client = SyncClient(agent.bus.address)
    try:
        err, text = client.call("Setup", "ssa{sv}", ["x", other, {
            "networks": _variant("a(ss)", [("testnet-v6", "eth0")])}])
        assert err == ERR + "InvalidArgument" and "would be the same file" in text, (err, text)
    finally:
        client.close()
    assert entry.read_text() == before  # root's entry is its own still
    shown = json.loads(agent.call("Show", "s", "v6-x")[0])
    assert shown["attachments"][0]["network"] == "testnet"
    agent.call("Teardown", "ssa{sv}", "x", "", "0")  # nothing of x's: v6-x's entry stays
    assert entry.read_text() == before
    agent.call("Teardown", "ssa{sv}", "v6-x", "", "0")
    assert not entry.exists()


def test_an_entry_that_names_another_attachment_is_not_read_as_this_ones(
    make_agent: Callable[..., Agent], two_nets: None, tmp_path: Path, netns: str,
) -> None:
    """A file an older agent let two attachments share: the agent goes by the
    entry's own containerId, ifName and network, never by its name — it
    neither shows another's entry as this one's, nor rewrites it from this
    one's record at start-up, nor deletes it with this one."""
    agent = make_agent()
    agent.setup("x", netns, networks=[("testnet-v6", "eth0")])
    entry = tmp_path / "state" / "results" / "testnet-v6-x-eth0"
    assert agent.stop() == 0
    doc = json.loads(entry.read_text())
    doc.update(containerId="v6-x", networkName="testnet", netns="/run/netns/elsewhere")
    entry.write_text(json.dumps(doc))  # as another attachment's write would have left it
    agent.start()
    shown = json.loads(agent.call("Show", "s", "x")[0])  # x's own, from its record
    assert "/run/netns/elsewhere" not in json.dumps(shown)
    assert [(a["network"], a["ifname"]) for a in shown["attachments"]] == [("testnet-v6", "eth0")]
    assert json.loads(entry.read_text())["containerId"] == "v6-x"  # not rewritten as x's
    agent.call("Teardown", "ssa{sv}", "x", "", "0")
    assert json.loads(entry.read_text())["containerId"] == "v6-x"  # not x's to delete
    assert "another attachment's file" in agent.log()


# --- 5. what a member may change ------------------------------------------------------------


def test_a_members_capabilities_are_the_admins_to_open(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str, member: str,
    tmp_path: Path,
) -> None:
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods"]})
    mine = own_netns(member)
    path = f"/proc/{mine.pid}/ns/net"
    try:
        for caps in ({"portMappings": [{"hostPort": 23, "containerPort": 22, "protocol": "tcp"}]},
                     {"ips": ["10.215.0.77/24"]}, {"mac": "02:00:00:00:00:77"},
                     {"ipRanges": [[{"subnet": "10.215.0.0/28"}]]}):
            out = cli(agent, member, "setup", "vm1", path, "--capabilities", json.dumps(caps))
            assert out.returncode == 4 and "is not allowed to callers that are not root" in \
                out.stderr, (caps, out)
        assert allocations(tmp_path / "ipam", "pods") == []
        # The admin opens portMappings and a range: only ports inside it, nor a port taken.
        agent.config["access"]["capabilities"] = ["portMappings"]
        agent.config["access"]["host_ports"] = ["18000-18999"]
        agent.write_config()
        agent.call("Reload")
        low = {"portMappings": [{"hostPort": 23, "containerPort": 22, "protocol": "tcp"}]}
        out = cli(agent, member, "setup", "vm1", path, "--capabilities", json.dumps(low))
        assert out.returncode == 4 and "host port 23/tcp is not in a range open to callers " \
            "that are not root (access.host_ports: 18000-18999)" in out.stderr, out
        high = {"portMappings": [{"hostPort": 18080, "containerPort": 80, "protocol": "tcp"}]}
        out = cli(agent, member, "setup", "vm1", path, "--capabilities", json.dumps(high))
        assert out.returncode == 0, out
        theirs = own_netns(member)
        try:
            out = cli(agent, member, "setup", "vm2", f"/proc/{theirs.pid}/ns/net",
                      "--capabilities", json.dumps(high))
            assert out.returncode == 2 and "host port 18080/tcp is already mapped by " \
                "another sandbox" in out.stderr, out
        finally:
            theirs.kill()
        assert cli(agent, member, "list").stdout.split() == ["vm1"]
        assert cli(agent, member, "teardown", "vm1", path).returncode == 0
    finally:
        mine.kill()


def test_a_member_holds_at_most_max_sandboxes(
    make_agent: Callable[..., Agent], permissive_bus: Bus, testnet: Callable[..., Path],
    member: str,
) -> None:
    testnet()
    # testnet is no bridge: members may use it only as an unprotected network (issue 44).
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["testnet"],
                                                   "unprotected_networks": ["testnet"],
                                                   "max_sandboxes": 2})
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        assert cli(agent, member, "setup", "a", path, "--network", "testnet:e1").returncode == 0
        assert cli(agent, member, "setup", "b", path, "--network", "testnet:e2").returncode == 0
        out = cli(agent, member, "setup", "c", path, "--network", "testnet:e3")
        assert out.returncode == 1 and "access.max_sandboxes allows (2)" in out.stderr, out
        assert cli(agent, member, "teardown", "a", path).returncode == 0
        assert cli(agent, member, "setup", "c", path, "--network", "testnet:e3").returncode == 0
        assert sorted(cli(agent, member, "list").stdout.split()) == ["b", "c"]
    finally:
        mine.kill()


def test_a_member_uses_only_the_networks_the_admin_opened(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str, member: str,
    tmp_path: Path,
) -> None:
    agent = make_agent(bus=permissive_bus, access={"groups": [member]})  # none opened
    mine = own_netns(member)
    try:
        out = cli(agent, member, "setup", "vm1", f"/proc/{mine.pid}/ns/net")
        assert out.returncode == 4 and "network pods is not open" in out.stderr, out
        assert allocations(tmp_path / "ipam", "pods") == []
    finally:
        mine.kill()


# --- 6. ids: a member can neither squat nor probe root's ----------------------------------


def test_a_members_ids_never_block_or_reveal_roots(
    pods_agent: Agent, member: str, netns: str, tmp_path: Path,
) -> None:
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        # The member takes "web" first (cni-sandbox@web would be root's, later).
        assert cli(pods_agent, member, "setup", "web", path).returncode == 0
        result = pods_agent.setup("web", netns)  # root's Setup of the same id works
        assert result["sandbox"] == "web"
        # Root's own "zzdb" exists; the member's answers about it are those of any
        # id it does not hold (and its Setup of "zzdb" would be its own).
        pods_agent.setup("zzdb", netns, networks=[("pods", "eth1")])
        assert cli(pods_agent, member, "show", "zzdb").stderr.replace("zzdb", "X") == \
            cli(pods_agent, member, "show", "zznope").stderr.replace("zznope", "X")
        assert "sandbox zzdb is not one of uid" in cli(pods_agent, member, "show", "zzdb").stderr
        uid = uid_of(member)
        assert sorted(pods_agent.call("ListSandboxes")[0]) == \
            [f"cni-agent.u{uid}.web", "web", "zzdb"]
        # Root may not create in a member's id space (it may tear one down).
        out = pods_agent.busctl("call", "org.cniagent.Agent1", "/org/cniagent/Agent1",
                                "org.cniagent.Agent1", "Setup", "ssa{sv}",
                                f"cni-agent.u{uid}.other", netns, *options(), check=False)
        assert "name sandboxes of callers that are not root" in out.stderr, out.stderr
        pods_agent.call("Teardown", "ssa{sv}", f"cni-agent.u{uid}.web", "", "0")
        assert cli(pods_agent, member, "list").stdout.split() == []
    finally:
        mine.kill()


def _variant(sig: str, value: Any) -> Any:
    from dbus_fast import Variant
    return Variant(sig, value)
