"""Sandbox events: WatchSandboxes and the unicast SandboxChanged (issue 47).

The agent on a private system-like bus, real bridge + host-local in real
namespaces, watchers as real D-Bus clients (`tests/support/watch.py`) and
the real `cni-agent events --json` as a subprocess, a member's run as that
user with its groups.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from tests.daemon.conftest import plug
from tests.daemon.test_owners import own_netns
from tests.support.agent import IFACE, NAME, PATH, Agent, as_member, member_cli, readable_source
from tests.support.net import addresses, delete_link
from tests.support.plugins import Control, conflist, wait_for, write_conf
from tests.support.shim import run_shim, shim_conf
from tests.support.watch import Watcher

pytestmark = pytest.mark.root

ERR = "org.cniagent.Agent1.Error."


def mac_of(netns: str, ifname: str = "eth0") -> str:
    out = subprocess.run(["ip", "-n", os.path.basename(netns), "-j", "link", "show", ifname],
                         capture_output=True, text=True, check=True)
    return str(json.loads(out.stdout)[0]["address"])


class Events:
    """`cni-agent events --json` as a subprocess (as `prefix` runs it): its lines."""

    def __init__(self, agent: Agent, prefix: list[str] | None = None) -> None:
        if prefix is None:
            cmd = [sys.executable, "-m", "cni_agent"]
        else:
            cmd = [*prefix, "/usr/bin/python3", "-I", "-c",
                   f"import sys; sys.path.insert(0, {str(readable_source())!r}); "
                   "from cni_agent.main import main; sys.exit(main())"]
        self.proc = subprocess.Popen([*cmd, "--bus", agent.bus.address, "events", "--json"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def docs(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in list(self.lines)]

    def stop(self) -> tuple[int, str]:
        self.proc.terminate()
        code = self.proc.wait(10)
        assert self.proc.stderr is not None
        return code, self.proc.stderr.read()


def watching(agent: Agent, count: int) -> None:
    """Wait until the agent counts `count` watchers (its debug log says each)."""
    wait_for(lambda: agent.log().count("is watching the sandboxes now") -
             agent.log().count("stopped watching the sandboxes") >= count, timeout=10)


@pytest.fixture
def pods(tmp_path: Path, control: Control, bridge_name: str) -> Iterator[str]:
    """"pods" (eth0) and "side" (for Attach): real bridge + host-local, the test plugin last."""
    side = bridge_name[:-1] + "s"
    for name, subnet, br in (("pods", "10.217.0.0/24", bridge_name),
                             ("side", "10.218.0.0/24", side)):
        write_conf(tmp_path / "net.d", f"10-{name}.conflist", conflist(name, [
            {"type": "bridge", "bridge": br, "isGateway": True, "ipMasq": False,
             "ipam": {"type": "host-local", "subnet": subnet,
                      "dataDir": str(tmp_path / "ipam")}}, plug(control)], "1.0.0"))
    yield "pods"
    delete_link(side)


@pytest.fixture
def agent(make_agent: Callable[..., Agent], pods: str) -> Agent:
    return make_agent()


def test_a_watcher_sees_set_up_attached_detached_torn_down_with_addresses_and_macs(
    agent: Agent, netns: str,
) -> None:
    watcher = Watcher(agent.bus.address)
    cli = Events(agent)
    try:
        watching(agent, 2)
        agent.setup("web", netns)
        [eth0] = addresses(netns)
        mac0 = mac_of(netns)
        agent.call("Attach", "ssssa{sv}", "web", netns, "side", "net1", "0")
        [net1] = addresses(netns, "net1")
        mac1 = mac_of(netns, "net1")
        agent.call("Detach", "ssssa{sv}", "web", netns, "side", "net1", "0")
        agent.call("Teardown", "ssa{sv}", "web", netns, "0")
        got = wait_for(lambda: len(watcher.changes()) >= 4 and watcher.changes(), timeout=10)
        time.sleep(0.3)  # nothing more comes
        assert got == watcher.changes() == [
            {"sandbox": "web", "change": "set-up", "owner": 0, "attachments": [
                {"network": "pods", "ifname": "eth0", "state": "ready", "mac": mac0,
                 "addresses": [eth0]}]},
            {"sandbox": "web", "change": "attached", "owner": 0, "attachments": [
                {"network": "side", "ifname": "net1", "state": "ready", "mac": mac1,
                 "addresses": [net1]}]},
            {"sandbox": "web", "change": "detached", "owner": 0, "attachments": [
                {"network": "side", "ifname": "net1", "state": "gone", "mac": mac1,
                 "addresses": [net1]}]},
            {"sandbox": "web", "change": "torn-down", "owner": 0, "attachments": [
                {"network": "pods", "ifname": "eth0", "state": "gone", "mac": mac0,
                 "addresses": [eth0]}]},
        ]
        # The real CLI printed the same, one JSON object per line, with its time.
        docs = wait_for(lambda: len(cli.docs()) >= 4 and cli.docs(), timeout=10)
        assert [{k: v for k, v in d.items() if k != "time"} for d in docs] == got
        assert all(d["time"] for d in docs)
        code, err = cli.stop()
        assert code == 0 and err == "", err
        # An identical repeat changes nothing, and tells nothing; nor does a Teardown of nothing.
        agent.setup("web", netns)
        agent.setup("web", netns)
        agent.call("Teardown", "ssa{sv}", "web", netns, "0")
        agent.call("Teardown", "ssa{sv}", "web", netns, "0")
        wait_for(lambda: len(watcher.changes()) >= 6, timeout=10)
        time.sleep(0.3)
        assert [c["change"] for c in watcher.changes()[4:]] == ["set-up", "torn-down"]
    finally:
        watcher.close()
        if cli.proc.poll() is None:
            cli.stop()


def test_a_setup_that_rolls_back_tells_nothing(
    agent: Agent, control: Control, netns: str, netns_factory: Callable[[], str],
) -> None:
    watcher = Watcher(agent.bus.address)
    try:
        control.set("ADD", "fail", code=11, msg="no room", only=["testplug"])
        out = agent.gdbus("Setup", "doomed", netns, "{}")
        assert ERR + "PluginFailed" in out.stderr, out.stderr
        # An Attach that fails on a sandbox that exists: rolled back too.
        control.clear("ADD")
        agent.setup("kept", netns)
        control.set("ADD", "fail", code=11, msg="no room", only=["testplug"])
        out = agent.gdbus("Attach", "kept", netns, "side", "net1", "{}")
        assert ERR + "PluginFailed" in out.stderr, out.stderr
        control.clear("ADD")
        # A later change of another sandbox: were anything told for the failures,
        # it would have come before this one (a watcher's signals keep their order).
        other = netns_factory()
        agent.setup("later", other)
        got = wait_for(lambda: len(watcher.changes()) >= 2 and watcher.changes(), timeout=10)
        assert [(c["sandbox"], c["change"]) for c in got] == [("kept", "set-up"),
                                                              ("later", "set-up")]
    finally:
        watcher.close()


def test_cni_agent_events_watches_again_when_the_agent_is_back(agent: Agent, netns: str) -> None:
    cli = Events(agent)
    try:
        watching(agent, 1)
        agent.stop()
        wait_for(lambda: cli.docs() and cli.docs()[-1] == {**cli.docs()[-1],
                                                            "agent_running": False}, timeout=10)
        agent.start()
        wait_for(lambda: cli.docs()[-1].get("agent_running") is True, timeout=20)
        agent.setup("web", netns)
        docs = wait_for(lambda: len(cli.docs()) >= 3 and cli.docs(), timeout=10)
        assert [d.get("change", d.get("agent_running")) for d in docs] == [False, True, "set-up"]
        agent.call("Teardown", "ssa{sv}", "web", netns, "0")
        code, err = cli.stop()
        assert code == 0 and err == "", err
    finally:
        if cli.proc.poll() is None:
            cli.stop()


def test_a_runtimes_add_and_del_through_the_shim_are_told(agent: Agent, netns: str) -> None:
    watcher = Watcher(agent.bus.address)
    try:
        conf = shim_conf("rtnet", "pods")
        added = run_shim(agent.bus.address, "ADD", conf, cid="rt1", netns=netns,
                         socket=str(agent.shim_socket))
        assert added.rc == 0, added
        [address] = addresses(netns)
        deleted = run_shim(agent.bus.address, "DEL", conf, cid="rt1", netns=netns,
                           socket=str(agent.shim_socket))
        assert deleted.rc == 0, deleted
        got = wait_for(lambda: len(watcher.changes()) >= 2 and watcher.changes(), timeout=10)
        assert [(c["sandbox"], c["change"], c["attachments"][0]["state"],
                 c["attachments"][0]["addresses"]) for c in got] == [
            ("rt1", "attached", "ready", [address]), ("rt1", "detached", "gone", [address])]
    finally:
        watcher.close()


def test_reaping_is_told(agent: Agent, netns_factory: Callable[[], str]) -> None:
    watcher = Watcher(agent.bus.address)
    try:
        doomed, listed = netns_factory(), netns_factory()
        agent.setup("doomed", doomed)
        agent.setup("listed", listed)
        [address] = addresses(doomed)
        subprocess.run(["ip", "netns", "del", os.path.basename(doomed)], check=True)
        agent.setup("listed", listed)  # an identical repeat: nothing told
        # A GC that lists only the live one reaps the other (its namespace is gone).
        agent.call("GarbageCollect", "as", "1", "listed")
        got = wait_for(lambda: len(watcher.changes()) >= 3 and watcher.changes(), timeout=10)
        time.sleep(0.3)
        assert [(c["sandbox"], c["change"]) for c in watcher.changes()] == [
            ("doomed", "set-up"), ("listed", "set-up"), ("doomed", "reaped")]
        [gone] = got[2]["attachments"]
        assert gone["state"] == "gone" and gone["addresses"] == [address]
        agent.call("Teardown", "ssa{sv}", "listed", listed, "0")
    finally:
        watcher.close()


def test_a_member_cannot_observe_roots_sandboxes_and_sees_its_own(
    make_agent: Callable[..., Agent], pods: str, member: str, netns: str,
) -> None:
    agent = make_agent(access={"groups": [member], "networks": ["pods"]})
    uid = pwd.getpwnam(member).pw_uid
    root = Watcher(agent.bus.address)
    theirs = Events(agent, as_member(member))
    own = own_netns(member)
    try:
        watching(agent, 2)
        agent.setup("rootpod", netns)
        agent.call("Teardown", "ssa{sv}", "rootpod", netns, "0")
        path = f"/proc/{own.pid}/ns/net"
        out = member_cli(agent.bus.address, member, "setup", "m1", path)
        assert out.returncode == 0, out.stderr
        [doc] = wait_for(lambda: theirs.docs(), timeout=10)
        assert doc["sandbox"] == "m1" and doc["change"] == "set-up" and doc["owner"] == uid
        [att] = doc["attachments"]
        assert att["network"] == "pods" and att["state"] == "ready" and att["addresses"]
        # Root sees all three, the member's by the id root knows it by.
        got = wait_for(lambda: len(root.changes()) >= 3 and root.changes(), timeout=10)
        assert [(c["sandbox"], c["change"], c["owner"]) for c in got] == [
            ("rootpod", "set-up", 0), ("rootpod", "torn-down", 0),
            (f"cni-agent.u{uid}.m1", "set-up", uid)]
        time.sleep(0.3)
        assert len(theirs.docs()) == 1, theirs.docs()  # nothing of root's, ever
        code, err = theirs.stop()
        assert code == 0 and err == "", err
        agent.call("Teardown", "ssa{sv}", f"cni-agent.u{uid}.m1", "", "0")
    finally:
        root.close()
        own.kill()
        own.wait()
        if theirs.proc.poll() is None:
            theirs.stop()


def test_the_fifth_watcher_of_a_uid_is_refused_and_one_that_leaves_is_dropped(
    agent: Agent, netns: str,
) -> None:
    watchers = [Watcher(agent.bus.address) for _ in range(4)]
    try:
        assert watchers[0].watch() == (None, "")  # a repeat is the same watcher
        fifth = Watcher(agent.bus.address, watch=False)
        watchers.append(fifth)
        err, text = fifth.watch()
        assert err == ERR + "Busy" and "uid 0" in text and "(4)" in text, (err, text)
        # One leaves the bus: it is dropped, and the fifth is let in.
        watchers.pop(0).close()
        wait_for(lambda: fifth.watch() == (None, ""), timeout=10)
        agent.setup("web", netns)
        for w in watchers:
            wait_for(lambda w=w: [c["change"] for c in w.changes()] == ["set-up"], timeout=10)
        agent.call("Teardown", "ssa{sv}", "web", netns, "0")
        # A stranger (neither root nor a member) may not watch at all.
        out = agent.gdbus("WatchSandboxes", user="nobody")
        assert ERR + "AccessDenied" in out.stderr, out.stderr
    finally:
        for w in watchers:
            w.close()


def test_fifty_sandboxes_at_once_every_event_exactly_once_and_in_order(
    agent: Agent, netns_factory: Callable[[], str],
) -> None:
    paths = {f"p{i:02d}": netns_factory() for i in range(50)}
    watcher = Watcher(agent.bus.address)
    try:
        async def each(bus: MessageBus, sid: str, path: str) -> None:
            for member, body in (("Setup", [sid, path, {}]), ("Teardown", [sid, path, {}])):
                reply = await bus.call(Message(destination=NAME, path=PATH, interface=IFACE,
                                               member=member, signature="ssa{sv}", body=body))
                assert reply is not None and reply.message_type is MessageType.METHOD_RETURN, \
                    reply.body if reply else None

        async def all_at_once() -> None:
            bus = await MessageBus(bus_address=agent.bus.address).connect()
            try:
                await asyncio.gather(*(each(bus, sid, path) for sid, path in paths.items()))
            finally:
                bus.disconnect()

        asyncio.run(all_at_once())
        wait_for(lambda: len(watcher.changes()) >= 100, timeout=30)
        time.sleep(0.5)
        got = watcher.changes()
        assert len(got) == 100
        by_sandbox: dict[str, list[dict[str, Any]]] = {}
        for c in got:
            by_sandbox.setdefault(c["sandbox"], []).append(c)
        assert sorted(by_sandbox) == sorted(paths)
        for events in by_sandbox.values():
            assert [e["change"] for e in events] == ["set-up", "torn-down"]
            up, down = events
            assert up["attachments"][0]["addresses"] == down["attachments"][0]["addresses"]
            assert up["attachments"][0]["state"] == "ready"
            assert down["attachments"][0]["state"] == "gone"
    finally:
        watcher.close()

