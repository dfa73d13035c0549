"""A member cannot exhaust a network's addresses (issue 44, item 1).

Reproduced as reported: with `access.max_sandboxes` alone, a member's Setup
listing one network several times and its repeated Attach of the same network
(eth1, eth2, …) leased a 12-address host-local pool to the end, and root's next
Setup failed with "no IP addresses available". Real users, the real CLI or a
dbus-fast client run as them with their own namespace (unshare -U -r -n) passed
as a descriptor, the real bridge + host-local with that 12-address range.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import unique_name
from tests.daemon.test_attack_members import second_member  # noqa: F401 (a fixture)
from tests.daemon.test_hostile_callers import member_python
from tests.daemon.test_owners import cli, links, own_netns
from tests.daemon.test_polkit import polkit, users  # noqa: F401 (fixtures)
from tests.support.agent import Agent, Bus, options
from tests.support.net import addresses, allocations, delete_link
from tests.support.plugins import conflist, write_conf

pytestmark = pytest.mark.root
ERR = "org.cniagent.Agent1.Error."
TINY = {"type": "host-local", "subnet": "10.219.0.0/28", "rangeStart": "10.219.0.2",
        "rangeEnd": "10.219.0.13"}  # 12 addresses, as in the report


@pytest.fixture
def tiny(tmp_path: Path) -> Iterator[str]:
    """The network "tiny": a bridge of its own, host-local with 12 addresses."""
    bridge = unique_name("caq")
    write_conf(tmp_path / "net.d", "20-tiny.conflist", conflist("tiny", [
        {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
         "ipam": {**TINY, "dataDir": str(tmp_path / "ipam")}}], "1.0.0"))
    yield "tiny"
    delete_link(bridge)


def leased(tmp_path: Path) -> list[str]:
    return allocations(tmp_path / "ipam", "tiny")


def attach(agent: Agent, member: str, pid: int, *calls: tuple[str, str, str]) -> list[list[str]]:
    """The member's Attach of each (sandbox, network, ifname) in its namespace
    `pid`, all at once: [error name or "", message or result] per call."""
    out = member_python(member, agent.bus.address, f"""
        async def main(call):
            from dbus_fast import Variant
            fd = os.open("/proc/{pid}/ns/net", os.O_RDONLY)
            async def one(sid, network, ifname):
                err, body = await call("Attach", "ssssa{{sv}}",
                                       [sid, "/proc/{pid}/ns/net", network, ifname,
                                        {{"netns_fd": Variant("h", 0)}}], fds=[fd])
                return [err or "", body if err else body[0]]
            print(json.dumps(await asyncio.gather(*(one(*c) for c in {list(calls)!r}))))
    """)
    assert out.returncode == 0, out
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def setup_at_once(agent: Agent, member: str, pid: int, *calls: tuple[str, str, str]
                  ) -> list[list[str]]:
    """The member's Setup of each (sandbox, network, ifname), all at once."""
    out = member_python(member, agent.bus.address, f"""
        async def main(call):
            from dbus_fast import Variant
            fd = os.open("/proc/{pid}/ns/net", os.O_RDONLY)
            async def one(sid, network, ifname):
                err, body = await call("Setup", "ssa{{sv}}",
                                       [sid, "/proc/{pid}/ns/net",
                                        {{"netns_fd": Variant("h", 0),
                                          "networks": Variant("a(ss)", [[network, ifname]])}}],
                                       fds=[fd])
                return [err or "", body if err else body[0]]
            print(json.dumps(await asyncio.gather(*(one(*c) for c in {list(calls)!r}))))
    """)
    assert out.returncode == 0, out
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_a_member_attaches_a_sandbox_to_each_network_once(
    make_agent: Callable[..., Agent], permissive_bus: Bus, tiny: str, member: str, netns: str,
    tmp_path: Path,
) -> None:
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["tiny"],
                                                   "max_sandboxes": 2})
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        # One Setup listing the network twice: InvalidArgument, nothing leased.
        out = cli(agent, member, "setup", "vm1", path, "--network", "tiny:eth0",
                  "--network", "tiny:eth1")
        assert out.returncode == 2 and "network tiny twice in sandbox vm1" in out.stderr, out
        assert leased(tmp_path) == [] and links(mine.pid) == ["lo"]
        assert cli(agent, member, "setup", "vm1", path, "--network", "tiny:eth0").returncode == 0
        before = leased(tmp_path)
        # Attach of the network the sandbox has, under another name: refused, the
        # sandbox as it was, no lease taken.
        [[err, msg]] = attach(agent, member, mine.pid, ("vm1", "tiny", "eth1"))
        assert err == ERR + "InvalidArgument" and "network tiny twice in sandbox vm1" in msg, msg
        assert leased(tmp_path) == before and len(before) == 1
        assert links(mine.pid) == ["lo", "eth0"]
        shown = json.loads(cli(agent, member, "show", "vm1", "--json").stdout)
        assert [a["ifname"] for a in shown["attachments"]] == ["eth0"]
        # Its repeat of what it has is still answered as before.
        [[err, _]] = attach(agent, member, mine.pid, ("vm1", "tiny", "eth0"))
        assert err == ""
        # Root keeps today's behaviour: the same network twice, in Setup and by Attach.
        agent.setup("rootpod", netns, networks=[("tiny", "eth0"), ("tiny", "eth1")])
        agent.call("Attach", "ssssa{sv}", "rootpod", netns, "tiny", "eth2", *options())
        assert len(leased(tmp_path)) == 4
        assert cli(agent, member, "teardown", "vm1", path).returncode == 0
        agent.call("Teardown", "ssa{sv}", "rootpod", netns, "0")
        assert leased(tmp_path) == []
    finally:
        mine.kill()


def test_a_member_holds_at_most_max_attachments_setup_and_attach_alike(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str, tiny: str,
    member: str, tmp_path: Path,
) -> None:
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods", "tiny"],
                                                   "max_attachments": 3})
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        assert cli(agent, member, "setup", "a", path, "--network", "tiny:e0",
                   "--network", "pods:e1").returncode == 0
        # The third attachment is the quota; a fourth by Attach or Setup is Busy.
        assert cli(agent, member, "setup", "b", path, "--network", "tiny:e2").returncode == 0
        before = (leased(tmp_path), allocations(tmp_path / "ipam", "pods"), links(mine.pid))
        [[err, msg]] = attach(agent, member, mine.pid, ("b", "pods", "e4"))
        assert err == ERR + "Busy" and "access.max_attachments allows (3)" in msg, msg
        out = cli(agent, member, "setup", "d", path, "--network", "tiny:e5")
        assert out.returncode == 1 and "access.max_attachments allows (3)" in out.stderr, out
        # Nothing leased, no interface made, the sandboxes as they were.
        assert (leased(tmp_path), allocations(tmp_path / "ipam", "pods"), links(mine.pid)) == \
            before
        assert sorted(cli(agent, member, "list").stdout.split()) == ["a", "b"]
        # Freed by a Teardown: the same Attach now passes.
        assert cli(agent, member, "teardown", "a", path).returncode == 0
        [[err, _]] = attach(agent, member, mine.pid, ("b", "pods", "e4"))
        assert err == "", _
        assert len(allocations(tmp_path / "ipam", "pods")) == 1
        assert cli(agent, member, "teardown", "b", path).returncode == 0
        assert leased(tmp_path) == [] and allocations(tmp_path / "ipam", "pods") == []
    finally:
        mine.kill()


def test_two_concurrent_calls_never_both_pass_a_quota(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str, tiny: str,
    member: str, tmp_path: Path,
) -> None:
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods", "tiny"],
                                                   "max_attachments": 2})
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        assert cli(agent, member, "setup", "a", path, "--network", "tiny:e0").returncode == 0
        # One place left: an Attach takes it, then two Setups at once find none.
        [att] = attach(agent, member, mine.pid, ("a", "pods", "e1"))
        assert att[0] == "", att
        setups = setup_at_once(agent, member, mine.pid, ("b", "tiny", "e2"), ("c", "pods", "e3"))
        assert [e for e, _ in setups] == [ERR + "Busy"] * 2, setups
        assert all("access.max_attachments allows (2)" in m for _, m in setups), setups
        assert len(leased(tmp_path)) + len(allocations(tmp_path / "ipam", "pods")) == 2
        # Two Setups at once for the one place left: one passes (its claim is
        # counted before either reads the records).
        for sid in cli(agent, member, "list").stdout.split():
            assert cli(agent, member, "teardown", sid, path).returncode == 0
        assert cli(agent, member, "setup", "a", path, "--network", "tiny:e0").returncode == 0
        outcomes = setup_at_once(agent, member, mine.pid, ("b", "tiny", "e2"),
                                 ("c", "pods", "e3"))
        assert sorted(e for e, _ in outcomes) == ["", ERR + "Busy"], outcomes
        assert len(leased(tmp_path)) + len(allocations(tmp_path / "ipam", "pods")) == 2
    finally:
        mine.kill()


def test_members_keep_to_their_share_and_roots_setup_still_gets_an_address(
    make_agent: Callable[..., Agent], permissive_bus: Bus, tiny: str, member: str,
    second_member: str, netns: str, tmp_path: Path,  # noqa: F811 (the fixture)
) -> None:
    # second_member is in member's group: both are members of the access group.
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["tiny"]})
    alice, bob = own_netns(member), own_netns(second_member)
    try:
        # Alice takes 4 of the 12 addresses, Bob 2: half of the pool, the
        # default access.members_share; the next of either is Busy.
        for i in range(4):
            out = cli(agent, member, "setup", f"a{i}", f"/proc/{alice.pid}/ns/net",
                      "--network", f"tiny:e{i}")
            assert out.returncode == 0, out
        for i in range(2):
            out = cli(agent, second_member, "setup", f"b{i}", f"/proc/{bob.pid}/ns/net",
                      "--network", f"tiny:e{i}")
            assert out.returncode == 0, out
        assert len(leased(tmp_path)) == 6
        out = cli(agent, second_member, "setup", "b2", f"/proc/{bob.pid}/ns/net",
                  "--network", "tiny:e2")
        assert out.returncode == 1 and "access.members_share (0.5)" in out.stderr, out
        assert "hold 6 of its 12 addresses" in out.stderr, out
        [[err, msg]] = attach(agent, member, alice.pid, ("a0", "tiny", "e9"))
        # (each network once per sandbox is asked first)
        assert err == ERR + "InvalidArgument", msg
        out = cli(agent, member, "setup", "a4", f"/proc/{alice.pid}/ns/net",
                  "--network", "tiny:e4")
        assert out.returncode == 1 and "access.members_share" in out.stderr, out
        assert len(leased(tmp_path)) == 6
        # Root's Setups on the same pool: each succeeds and gets an address, to
        # the last of the 6 left.
        for i in range(6):
            result = agent.setup(f"root{i}", netns, networks=[("tiny", f"eth{i}")])
            [ip] = result["attachments"][0]["result"]["ips"]
            assert ip["address"].startswith("10.219.0."), result
            assert ip["address"].split("/")[0] in leased(tmp_path)
        assert len(leased(tmp_path)) == 12
        assert len(addresses(netns, "eth5")) == 1
        # A member's Teardown frees its place in the share.
        for i in range(6):
            agent.call("Teardown", "ssa{sv}", f"root{i}", netns, "0")
        assert cli(agent, member, "teardown", "a0", f"/proc/{alice.pid}/ns/net").returncode == 0
        out = cli(agent, second_member, "setup", "b2", f"/proc/{bob.pid}/ns/net",
                  "--network", "tiny:e2")
        assert out.returncode == 0, out
    finally:
        alice.kill()
        bob.kill()


def test_a_polkit_delegate_counts_as_a_member(
    make_agent: Callable[..., Agent], permissive_bus: Bus, tiny: str, member: str, netns: str,
    users: tuple[str, str], polkit: Callable[[Bus], subprocess.Popen[bytes]],  # noqa: F811
    tmp_path: Path,
) -> None:
    delegate = users[0]  # an admin's polkit rule grants it manage; not in access.groups
    polkit(permissive_bus)
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["tiny"],
                                                   "members_share": 0.25})  # 3 of 12
    ours, theirs = own_netns(member), own_netns(delegate)
    try:
        for i in range(2):
            assert cli(agent, member, "setup", f"m{i}", f"/proc/{ours.pid}/ns/net",
                       "--network", f"tiny:e{i}").returncode == 0
        dpath = f"/proc/{theirs.pid}/ns/net"
        out = cli(agent, delegate, "setup", "d0", dpath, "--network", "tiny:e0",
                  "--network", "tiny:e1")
        assert out.returncode == 2 and "network tiny twice in sandbox d0" in out.stderr, out
        assert cli(agent, delegate, "setup", "d0", dpath, "--network", "tiny:e0").returncode == 0
        # The member's two and the delegate's one are the members' share together.
        out = cli(agent, delegate, "setup", "d1", dpath, "--network", "tiny:e1")
        assert out.returncode == 1 and "access.members_share (0.25)" in out.stderr, out
        out = cli(agent, member, "setup", "m2", f"/proc/{ours.pid}/ns/net",
                  "--network", "tiny:e2")
        assert out.returncode == 1 and "access.members_share (0.25)" in out.stderr, out
        assert len(leased(tmp_path)) == 3
        agent.setup("rootpod", netns, networks=[("tiny", "eth0")])
        assert len(leased(tmp_path)) == 4
    finally:
        ours.kill()
        theirs.kill()
