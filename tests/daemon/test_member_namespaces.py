"""A member's namespace is its descriptor alone (issue 44, item 6): the path it
gives is a label the agent never opens, it passes the descriptor again to
Teardown, Detach and Check, and root reaches a member's namespace only
through a process inside it (/proc), never through the member's path.

Real users, real namespaces in user namespaces they made (unshare -U -r -n),
the real bridge + host-local, a really hung FUSE mount, a private bus.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.test_owners import cli, links, own_netns
from tests.support.agent import IFACE, NAME, PATH, Agent, Bus, as_member, readable_source
from tests.support.hung import HungMount
from tests.support.net import allocations
from tests.support.plugins import Control, seen_netns, wait_for

pytestmark = pytest.mark.root
ERR = "org.cniagent.Agent1.Error."
SIGNATURES = {"Setup": "ssa{sv}", "Teardown": "ssa{sv}", "Check": "ssa{sv}",
              "Detach": "ssssa{sv}"}


def member_calls(agent: Agent, user: str, calls: list[dict[str, Any]]) -> list[list[Any]]:
    """Calls made at once by `user` (with its groups) straight on the bus, each
    {"method", "args" (before the options), "fd": a path the member opens
    itself and passes as netns_fd, or None}; [error name or None, reply
    text] of each."""
    probe = textwrap.dedent(f"""
        import asyncio, json, os, sys
        sys.path.insert(0, {str(readable_source())!r})
        from dbus_fast import Message, Variant
        from cni_agent.bus import connect
        CALLS = json.loads({json.dumps(json.dumps(calls))})
        SIGS = {SIGNATURES!r}
        async def one(bus, c):
            fds, opts = [], {{}}
            if c["fd"]:
                fds = [os.open(c["fd"], os.O_RDONLY | os.O_CLOEXEC)]
                opts["netns_fd"] = Variant("h", 0)
            try:
                reply = await bus.call(Message(
                    destination="org.cniagent.Agent1", path="/org/cniagent/Agent1",
                    interface="org.cniagent.Agent1", member=c["method"],
                    signature=SIGS[c["method"]], body=[*c["args"], opts], unix_fds=fds))
            finally:
                for fd in fds:
                    os.close(fd)
            return [reply.error_name, reply.body[0] if reply.body else None]
        async def main():
            bus = await connect({agent.bus.address!r})
            print(json.dumps(await asyncio.gather(*(one(bus, c) for c in CALLS))))
        asyncio.run(main())
    """)
    out = subprocess.run([*as_member(user), "/usr/bin/python3", "-I", "-c", probe],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out
    result: list[list[Any]] = json.loads(out.stdout)
    return result


def call(method: str, *args: str, fd: str | None = None) -> dict[str, Any]:
    return {"method": method, "args": list(args), "fd": fd}


def bind_netns(netns: str, where: Path) -> str:
    """Root's namespace also at a path outside /run/netns and /proc: the agent
    resolves such a path on one of its few path threads."""
    where.touch()
    subprocess.run(["mount", "--bind", netns, str(where)], check=True)
    return str(where)


@pytest.fixture
def hung(tmp_path: Path) -> Iterator[HungMount]:
    mount = HungMount(tmp_path / "hung")
    yield mount
    mount.release()


@pytest.fixture
def member_agent(make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str,
                 member: str) -> Agent:
    return make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods"]})


def test_members_paths_on_a_hung_mount_neither_busy_roots_setup_nor_fail_its_gc(
    member_agent: Agent, member: str, netns: str, netns_factory: Callable[[], str],
    hung: HungMount, tmp_path: Path,
) -> None:
    """A member names paths on a mount that never answers (one it could make in
    its own mount namespace), passing its own descriptors: the paths are
    labels, never opened, so none of root's path threads is taken; root's
    Setup (on a path needing a thread) and GarbageCollect go on, and root's
    CHECK pass reaches the members' namespaces without their paths."""
    agent = member_agent
    root_path = bind_netns(netns, tmp_path / "rootns")
    try:
        agent.setup("rootpod", root_path)
        n = 6  # more than the path threads (4)
        mine = [own_netns(member) for _ in range(n)]
        try:
            labels = [str(hung.where / f"ns{i}") for i in range(n)]
            setups = member_calls(agent, member, [
                call("Setup", f"m{i}", labels[i], fd=f"/proc/{p.pid}/ns/net")
                for i, p in enumerate(mine)])
            # Root's Setup on a path that needs a path thread: not Busy (before
            # issue 44, the labels held every path thread: "4 network namespace
            # path(s) given earlier have not answered yet").
            other = bind_netns(netns_factory(), tmp_path / "rootns2")
            try:
                out = agent.busctl("call", NAME, PATH, IFACE, "Setup", "ssa{sv}", "rootpod2",
                                   other, "0", check=False)
                assert out.returncode == 0, out.stderr
                # The members' Setups were answered at once, each in its own namespace.
                assert [err for err, _ in setups] == [None] * n, setups
                assert all("eth0" in links(p.pid) for p in mine)
                uid = pwd.getpwnam(member).pw_uid
                ids = ["rootpod", "rootpod2", *(f"cni-agent.u{uid}.m{i}" for i in range(n))]
                # Root's GC looks at every sandbox, the members' included, and fails none.
                assert agent.call("GarbageCollect", "as", str(len(ids)), *ids) is None
                assert sorted(agent.call("ListSandboxes")[0]) == sorted(ids)
                # Root's CHECK pass reaches each member's namespace through a process in it.
                rows = json.loads(agent.call("CheckSandboxes", "as", "0")[0])["attachments"]
                states = {r["sandbox"]: r["state"] for r in rows}
                assert all(states[f"cni-agent.u{uid}.m{i}"] == "ok" for i in range(n)), states
                # The members' own Check and Teardown: with their descriptors.
                replies = member_calls(agent, member, [
                    call("Check", f"m{i}", labels[i], fd=f"/proc/{p.pid}/ns/net")
                    for i, p in enumerate(mine)])
                assert [err for err, _ in replies] == [None] * n, replies
                replies = member_calls(agent, member, [
                    call("Teardown", f"m{i}", labels[i], fd=f"/proc/{p.pid}/ns/net")
                    for i, p in enumerate(mine)])
                assert [err for err, _ in replies] == [None] * n, replies
                assert all(links(p.pid) == ["lo"] for p in mine)
                agent.call("Teardown", "ssa{sv}", "rootpod2", other, "0")
            finally:
                subprocess.run(["umount", other], check=False)
        finally:
            for p in mine:
                p.kill()
        agent.call("Teardown", "ssa{sv}", "rootpod", root_path, "0")
        assert allocations(tmp_path / "ipam", "pods") == []
    finally:
        subprocess.run(["umount", root_path], check=False)


def test_a_members_teardown_detach_and_check_take_its_descriptor(
    member_agent: Agent, member: str, tmp_path: Path,
) -> None:
    agent = member_agent
    mine, another = own_netns(member), own_netns(member)
    try:
        path, wrong = f"/proc/{mine.pid}/ns/net", f"/proc/{another.pid}/ns/net"
        assert cli(agent, member, "setup", "m1", path).returncode == 0
        # Check: the CLI passes the descriptor; without one, a named refusal.
        out = cli(agent, member, "check", "m1", path)
        assert out.returncode == 0, out
        [(err, text)] = member_calls(agent, member, [call("Check", "m1", path)])
        assert err == ERR + "AccessDenied" and "netns_fd" in text, (err, text)
        # Another namespace's descriptor: refused, nothing done.
        for method, args in (("Check", ("m1", wrong)), ("Teardown", ("m1", wrong)),
                             ("Detach", ("m1", wrong, "pods", "eth0"))):
            [(err, text)] = member_calls(agent, member, [call(method, *args, fd=wrong)])
            assert err == ERR + "InvalidArgument" and text.startswith("netns_fd: is not the "
                                                                      "network namespace"), \
                (method, err, text)
        # Detach and Teardown without it while a process is in the namespace:
        # refused by name, the address kept by the interface that has it.
        for method, args in (("Teardown", ("m1", path)), ("Detach", ("m1", path, "pods", "eth0"))):
            [(err, text)] = member_calls(agent, member, [call(method, *args)])
            assert err == ERR + "InvalidArgument" and "netns_fd" in text and \
                "still in use" in text, (method, err, text)
        assert "eth0" in links(mine.pid) and len(allocations(tmp_path / "ipam", "pods")) == 1
        # Detach with it (the CLI passes it): the interface and its address go.
        out = cli(agent, member, "detach", "m1", path, "--network", "pods:eth0")
        assert out.returncode == 0, out
        assert links(mine.pid) == ["lo"] and allocations(tmp_path / "ipam", "pods") == []
        assert cli(agent, member, "list").stdout.split() == []
        # The path beside a descriptor is a label: "" will do, a relative one will not.
        [(err, text), (err2, _)] = member_calls(agent, member, [
            call("Setup", "m3", "not/absolute", fd=path), call("Setup", "m4", "", fd=wrong)])
        assert err == ERR + "InvalidArgument" and "must be empty or an absolute path" in text
        assert err2 is None and "eth0" in links(another.pid), _
        [(err, _)] = member_calls(agent, member, [call("Teardown", "m4", "", fd=wrong)])
        assert err is None and links(another.pid) == ["lo"]
        # Teardown with it, through the CLI.
        assert cli(agent, member, "setup", "m2", path).returncode == 0
        out = cli(agent, member, "teardown", "m2", path)
        assert out.returncode == 0, out
        assert links(mine.pid) == ["lo"] and allocations(tmp_path / "ipam", "pods") == []
    finally:
        mine.kill()
        another.kill()


def test_a_members_sandbox_is_reaped_once_no_process_is_in_its_namespace(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str, member: str,
    control: Control, hung: HungMount, tmp_path: Path,
) -> None:
    """Reaping looks for the namespace's identity among /proc/*/ns/net, never at
    the member's path (here a label on a hung mount): once the last process
    in it exits, the sandbox is reaped, its DEL without a netns, its address
    released. Root's GC not listing a live one DELs it inside, through /proc."""
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods"]},
                       gc={"interval": 0.5})
    uid = pwd.getpwnam(member).pw_uid
    doomed, listed = own_netns(member), own_netns(member)
    try:
        replies = member_calls(agent, member, [
            call("Setup", "dies", str(hung.where / "a"), fd=f"/proc/{doomed.pid}/ns/net"),
            call("Setup", "lives", str(hung.where / "b"), fd=f"/proc/{listed.pid}/ns/net")])
        assert [err for err, _ in replies] == [None, None], replies
        assert len(allocations(tmp_path / "ipam", "pods")) == 2
        # Root's GC listing both keeps both: a process is in each.
        ids = [f"cni-agent.u{uid}.dies", f"cni-agent.u{uid}.lives"]
        assert agent.call("GarbageCollect", "as", "2", *ids) is None
        assert sorted(agent.call("ListSandboxes")[0]) == ids
        control.reset_records()
        doomed.kill()
        doomed.wait()
        wait_for(lambda: agent.call("ListSandboxes")[0] == [f"cni-agent.u{uid}.lives"],
                 timeout=15)
        assert len(allocations(tmp_path / "ipam", "pods")) == 1
        dels = [r for r in control.records() if r["command"] == "DEL"]
        assert [(r["env"]["CNI_CONTAINERID"], seen_netns(r)) for r in dels] == \
            [(f"cni-agent.u{uid}.dies", "")]
        # Root's GC not listing the live one: its DEL runs inside the namespace.
        assert agent.call("GarbageCollect", "as", "0") is None
        assert agent.call("ListSandboxes")[0] == []
        assert links(listed.pid) == ["lo"] and allocations(tmp_path / "ipam", "pods") == []
        assert os.path.exists(f"/proc/{listed.pid}")
    finally:
        doomed.kill()
        listed.kill()
