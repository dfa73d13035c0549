"""The orchestration in-process, in milliseconds: the real core with a recording executor.

Ordering, rollback, repeats, reuse after a netns died, Teardown during the
wait for readiness, GC contention and the start-up gate. Namespaces are real
(the agent opens and checks them); plugins are the fake executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from cni_agent.api import AgentError, ErrorKind
from cni_agent.config import AgentConfig, CheckConfig, GCConfig, MonitorConfig, TimeoutsConfig
from cni_agent.node.netns import check_netns, netns_identity
from cni_agent.sandboxes.manager import NetworkRequest, SetupRequest
from cni_agent.sandboxes.records import Attachment, Phase, SandboxRecord
from cni_agent.service.wiring import Core, build_core
from tests.support.fakeexec import FakeExecutor
from tests.support.plugins import conflist, write_conf

pytestmark = pytest.mark.root


class Node:
    def __init__(self, tmp: Path, **overrides: Any) -> None:
        self.tmp = tmp
        self.fake = FakeExecutor(plugins={"fake", "fake2"})
        self.conf_dir = tmp / "net.d"
        self.network("n1")
        self.cfg = AgentConfig(
            conf_dir=str(self.conf_dir), plugin_dirs=("/fake",), state_dir=str(tmp / "state"),
            runtime_dir=str(tmp / "run"),
            monitor=MonitorConfig(startup_interval=0.01, interval=0.05),
            timeouts=TimeoutsConfig(lock=2, ready=5), gc=GCConfig(("*",)),
            # No baseline CHECK after each Setup: these tests count plugin calls
            # and open namespaces (the CHECKs have their own tests, test_drift).
            check=CheckConfig(interval=0),
        ).replace(**overrides)
        self.core: Core = build_core(self.cfg, self.fake)
        self.core.journal.open()  # as the daemon does before anything reads a record
        self.recovery: asyncio.Task[Any] | None = None

    def network(self, name: str, *types: str, filename: str = "") -> None:
        write_conf(self.conf_dir, filename or f"10-{name}.conflist",
                   conflist(name, [{"type": t} for t in (types or ("fake",))], "1.1.0"))

    async def start(self, ready: bool = True, recover: bool = True) -> None:
        await self.core.monitor.start(watch=False)
        if recover:
            self.recovery = asyncio.create_task(self.core.reaper.recover())
        if ready:
            assert await self.core.monitor.wait_ready(5)

    async def stop(self) -> None:
        if self.recovery is not None:
            await asyncio.gather(self.recovery, return_exceptions=True)
        await self.core.stop()

    @property
    def manager(self) -> Any:
        return self.core.manager

    def setup(self, sid: str, netns: str, *networks: tuple[str, str], **kw: Any) -> Any:
        req = SetupRequest(sid, netns, tuple(NetworkRequest(n, i) for n, i in networks), **kw)
        return self.manager.setup(req)

    def interrupted(self, sid: str, netns: str) -> None:
        """The record a kill -9 in the middle of an ADD on n1 leaves."""
        data = (self.conf_dir / "10-n1.conflist").read_bytes()
        self.core.journal.store.write(SandboxRecord(sid, netns, check_netns(netns),
                                                    (Attachment("n1", "eth0", data),)))

    def record(self, sid: str) -> SandboxRecord | None:
        return self.core.journal.store.read(sid)

    def cached(self) -> list[str]:
        return sorted(p.name for p in (self.tmp / "state" / "results").glob("*"))


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    n = Node(tmp_path)
    yield n
    await n.stop()


async def _kind(coro: Any) -> ErrorKind:
    with pytest.raises(AgentError) as e:
        await coro
    return e.value.kind


# --- ordering ---------------------------------------------------------------------------


async def test_teardown_during_the_wait_for_readiness_wins(
        node: Node, netns_factory: Callable[[], str]) -> None:
    node.fake.fail("fake", "STATUS", 50, "daemon not up")
    await node.start(ready=False)
    ns = netns_factory()
    waiting = asyncio.create_task(node.setup("s1", ns))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await node.manager.teardown("s1", ns)  # the caller gave up and cleaned up
    assert await _kind(waiting) is ErrorKind.CANCELLED
    node.fake.succeed("fake", "STATUS")
    node.core.monitor.trigger()
    assert await node.core.monitor.wait_ready(5)
    await asyncio.sleep(0.05)
    assert node.fake.of("ADD") == []
    assert await node.manager.list() == [] and node.record("s1") is None
    # The id is usable again at once.
    assert (await node.setup("s1", ns))["state"] == "ready"


async def test_teardown_queued_behind_a_running_setup_removes_it(
        node: Node, netns_factory: Callable[[], str]) -> None:
    await node.start()
    gate = node.fake.hold("fake", "ADD")
    ns = netns_factory()
    setup = asyncio.create_task(node.setup("s1", ns))
    await node.fake.started("ADD")
    teardown = asyncio.create_task(node.manager.teardown("s1", ns))
    await asyncio.sleep(0.02)
    gate.set()
    assert (await setup)["state"] == "ready"  # it had started: it completes...
    await teardown  # ...and the Teardown, after it, removes it
    assert node.fake.verbs("STATUS", "GC", "VERSION") == [("ADD", "s1"), ("DEL", "s1")]
    assert node.record("s1") is None and node.cached() == []


async def test_teardown_supersedes_only_its_own_sandbox(
        node: Node, netns_factory: Callable[[], str]) -> None:
    node.fake.fail("fake", "STATUS", 50, "daemon not up")
    await node.start(ready=False)
    a = asyncio.create_task(node.setup("a", netns_factory()))
    b = asyncio.create_task(node.setup("b", netns_factory()))
    await asyncio.sleep(0.02)
    await node.manager.teardown("a")
    assert await _kind(a) is ErrorKind.CANCELLED
    node.fake.succeed("fake", "STATUS")
    node.core.monitor.trigger()
    assert (await b)["state"] == "ready"
    assert [c.container for c in node.fake.of("ADD")] == ["b"]


# --- rollback and repeats -------------------------------------------------------------------


async def test_failed_setup_rolls_back_everything_attempted(
        node: Node, netns_factory: Callable[[], str]) -> None:
    node.network("n2", "fake2")
    node.network("n3")
    await node.start()
    node.fake.fail("fake2", "ADD", 7, "bad subnet")
    ns = netns_factory()
    with pytest.raises(AgentError) as e:
        await node.setup("s1", ns, ("n1", "eth0"), ("n2", "net1"), ("n3", "net2"))
    assert e.value.kind is ErrorKind.PLUGIN_FAILED and "bad subnet" in e.value.message
    # DEL of the failing one and the one before it, last first; n3 never ran.
    dels = [(c.plugin, c.inv.ifname) for c in node.fake.of("DEL")]
    assert dels == [("fake2", "net1"), ("fake", "eth0")]
    assert [c.inv.ifname for c in node.fake.of("ADD")] == ["eth0", "net1"]
    assert node.record("s1") is None and node.cached() == []


@pytest.mark.parametrize("output", [b"", b" \n"])
async def test_add_that_prints_nothing_fails_and_rolls_back(
        node: Node, netns_factory: Callable[[], str], output: bytes) -> None:
    node.network("n2", "fake", "fake2")
    await node.start()
    node.fake.prints("fake2", "ADD", output)
    with pytest.raises(AgentError) as e:
        await node.setup("s1", netns_factory(), ("n2", "eth0"))
    assert e.value.kind is ErrorKind.PLUGIN_FAILED
    assert "plugin fake2 ADD: exited 0 but printed no result" in e.value.message
    assert [c.plugin for c in node.fake.of("DEL")] == ["fake2", "fake"]
    assert node.record("s1") is None and node.cached() == []


async def test_identical_repeat_returns_the_result_and_a_different_one_is_refused(
        node: Node, netns_factory: Callable[[], str]) -> None:
    await node.start()
    ns = netns_factory()
    first = await node.setup("s1", ns, args=(("K", "V"),))
    again = await node.setup("s1", ns, args=(("K", "V"),))
    assert again == first and len(node.fake.of("ADD")) == 1
    assert await _kind(node.setup("s1", ns, args=(("K", "other"),))) is ErrorKind.INVALID_ARGUMENT
    assert await _kind(node.setup("s1", netns_factory())) is ErrorKind.INVALID_ARGUMENT


async def test_an_id_reused_after_its_netns_died_is_reaped_and_set_up_again(
        node: Node, netns_factory: Callable[[], str]) -> None:
    await node.start()
    old = netns_factory()
    old_id = netns_identity(old)
    await node.setup("s1", old)
    subprocess.run(["ip", "netns", "del", Path(old).name], check=True)
    new = netns_factory()
    doc = await node.setup("s1", new)
    assert doc["state"] == "ready"
    # The dead attachment got its DEL (empty netns: the path is no longer its), first.
    assert [(c.verb, c.target) for c in node.fake.calls if c.verb in ("ADD", "DEL")] == [
        ("ADD", old_id), ("DEL", None), ("ADD", netns_identity(new))]
    rec = node.record("s1")
    assert rec is not None and rec.netns == new and rec.phase is Phase.READY


async def test_same_path_recreated_as_a_new_namespace_counts_as_dead(
        node: Node, netns_factory: Callable[[], str]) -> None:
    await node.start()
    ns = netns_factory()
    first = netns_identity(ns)
    await node.setup("s1", ns)
    subprocess.run(["ip", "netns", "del", Path(ns).name], check=True)
    subprocess.run(["ip", "netns", "add", Path(ns).name], check=True)
    await node.setup("s1", ns)
    assert [(c.verb, c.target) for c in node.fake.calls if c.verb in ("ADD", "DEL")] == [
        ("ADD", first), ("DEL", None), ("ADD", netns_identity(ns))]


async def test_unfinished_record_is_undone_before_a_new_setup(
        node: Node, netns_factory: Callable[[], str]) -> None:
    ns = netns_factory()
    # What a kill -9 mid-ADD leaves, when recovery could not finish it (DEL failed then).
    node.interrupted("s1", ns)
    node.fake.fail("fake", "DEL", 999, "DEL broken for now")
    await node.start()
    assert node.recovery is not None
    await node.recovery
    assert node.record("s1") is not None  # recovery failed; kept for the next attempt
    node.fake.succeed("fake", "DEL")
    assert (await node.setup("s1", ns))["state"] == "ready"
    assert [c.verb for c in node.fake.calls if c.verb in ("ADD", "DEL")] == ["DEL", "DEL", "ADD"]


# --- GC contention ---------------------------------------------------------------------------


async def test_pending_gc_does_not_block_other_sandboxes(
        node: Node, netns_factory: Callable[[], str]) -> None:
    await node.start()
    await asyncio.sleep(0.05)  # the first-ready GC is over
    gate = node.fake.hold("fake", "ADD")
    slow = asyncio.create_task(node.setup("slow", netns_factory()))
    await node.fake.started("ADD")
    gc = asyncio.create_task(node.manager.garbage_collect(["slow", "fast", "other"]))
    await asyncio.sleep(0.02)
    # While the GC waits for a quiet moment on n1, another sandbox's whole Setup
    # runs (its ADD is gated too: open the gate for it only once it started).
    fast = asyncio.create_task(node.setup("fast", netns_factory()))
    await node.fake.started("ADD", 2)
    gate.set()
    assert (await fast)["state"] == "ready"
    assert (await slow)["state"] == "ready"
    await gc
    [verb] = [c for c in node.fake.of("GC") if c.stdin.get("cni.dev/valid-attachments")]
    assert sorted(a["containerID"] for a in verb.stdin["cni.dev/valid-attachments"]) == ["fast", "slow"]


async def test_gc_skips_a_sandbox_in_use_and_deletes_the_stale_one(
        node: Node, netns_factory: Callable[[], str]) -> None:
    await node.start()
    await node.setup("stale", netns_factory())
    gate = node.fake.hold("fake", "ADD")
    busy = asyncio.create_task(node.setup("busy", netns_factory()))
    await node.fake.started("ADD", 2)
    report = await node.core.reaper.collect(valid_ids=set())  # nothing is valid...
    assert report.busy == ["busy"]  # ...but "busy" is being set up: left alone
    assert [(n, s) for n, s, _ in report.deleted] == [("n1", "stale")]
    gate.set()
    assert (await busy)["state"] == "ready"
    assert await node.manager.list() == ["busy"]


async def test_gc_verb_deferred_while_chains_never_pause(
        tmp_path: Path, netns_factory: Callable[[], str]) -> None:
    node = Node(tmp_path)
    node.core.reaper._verb_wait = 0.05
    try:
        await node.start()
        await asyncio.sleep(0.05)
        gate = node.fake.hold("fake", "ADD")
        slow = asyncio.create_task(node.setup("slow", netns_factory()))
        await node.fake.started("ADD")
        before = len(node.fake.of("GC"))
        report = await node.core.reaper.collect()
        assert report.deferred == ["n1"] and len(node.fake.of("GC")) == before
        gate.set()
        await slow
    finally:
        await node.stop()


async def test_stale_del_of_gc_gets_the_same_del_policy(
        node: Node, netns_factory: Callable[[], str]) -> None:
    await node.start()
    ns = netns_factory()
    await node.setup("s1", ns, args=(("K8S_POD_NAME", "x"),))
    subprocess.run(["ip", "netns", "del", Path(ns).name], check=True)
    node.fake.fail("fake", "DEL", 999, 'ARGS: unknown args ["K8S_POD_NAME=x"]')
    original = node.fake.execute

    async def relaxed(plugin: str, binary: str, inv: Any, stdin: bytes, timeout: float) -> bytes:
        if inv.command == "DEL" and "IgnoreUnknown=1" in inv.args:
            node.fake.succeed("fake", "DEL")
        return await original(plugin, binary, inv, stdin, timeout)

    node.fake.execute = relaxed  # type: ignore[method-assign]
    report = await node.core.reaper.collect()
    assert report.errors == [] and [s for _, s, _ in report.deleted] == ["s1"]
    assert [c.inv.args for c in node.fake.of("DEL")] == ["K8S_POD_NAME=x",
                                                         "IgnoreUnknown=1;K8S_POD_NAME=x"]


# --- start-up -------------------------------------------------------------------------------


async def test_no_operation_runs_before_recovery_is_over(
        node: Node, netns_factory: Callable[[], str]) -> None:
    ns = netns_factory()
    node.interrupted("crashed", ns)
    gate = node.fake.hold("fake", "DEL")
    await node.start()  # ready; recovery runs and its DEL hangs
    await node.fake.started("DEL")
    other = asyncio.create_task(node.setup("other", netns_factory()))
    same = asyncio.create_task(node.setup("crashed", ns))
    await asyncio.sleep(0.05)
    assert not other.done() and not same.done() and node.fake.of("ADD") == []
    gate.set()
    await asyncio.gather(other, same)
    verbs = [(c.verb, c.container) for c in node.fake.calls if c.verb in ("ADD", "DEL")]
    assert verbs[0] == ("DEL", "crashed") and sorted(verbs[1:]) == [("ADD", "crashed"),
                                                                     ("ADD", "other")]


async def test_result_document_and_show_agree(node: Node, netns_factory: Callable[[], str]) -> None:
    node.network("n2", "fake2")
    await node.start()
    doc = await node.setup("s1", netns_factory(), ("n2", "eth0"), ("n1", "net1"))
    assert [a["network"] for a in doc["attachments"]] == ["n2", "n1"]
    shown = await node.manager.show("s1")
    # Show adds each attachment's check state (drift.py) to Setup's document.
    assert [a.pop("check")["state"] for a in shown["attachments"]] == ["unchecked", "unchecked"]
    assert shown == doc
    assert json.loads(json.dumps(doc)) == doc


def _open_fds_of(ns: str) -> int:
    """How many of this process's fds name the namespace at `ns`."""
    want = netns_identity(ns)
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            st = os.stat(f"/proc/self/fd/{fd}")
            if want is not None and (st.st_dev, st.st_ino) == (want.dev, want.ino):
                count += 1
    return count


async def test_the_pinned_netns_is_closed_when_the_request_ends_on_every_path(
        node: Node, netns_factory: Callable[[], str]) -> None:
    await node.start()
    ns = netns_factory()
    # While a plugin runs, the agent holds the namespace and passes it as its fd.
    gate = node.fake.hold("fake", "ADD")
    setup = asyncio.create_task(node.setup("s1", ns))
    await node.fake.started("ADD")
    assert _open_fds_of(ns) == 1
    assert node.fake.of("ADD")[0].inv.netns.startswith(f"/proc/{os.getpid()}/fd/")
    gate.set()
    await setup
    assert _open_fds_of(ns) == 0  # success
    await node.manager.check("s1", ns)
    await node.manager.teardown("s1", ns)
    node.fake.fail("fake", "ADD", 7, "no")
    assert await _kind(node.setup("s2", ns)) is ErrorKind.PLUGIN_FAILED
    assert _open_fds_of(ns) == 0  # failure and rollback
    node.fake.succeed("fake", "ADD")
    gate = node.fake.hold("fake", "ADD")
    setup = asyncio.create_task(node.setup("s3", ns))
    await node.fake.started("ADD", 3)
    assert _open_fds_of(ns) == 1
    setup.cancel()
    with contextlib.suppress(asyncio.CancelledError, AgentError):
        await setup
    gate.set()
    assert _open_fds_of(ns) == 0  # cancellation
    for path in ("/proc/self/ns/net", "/nonexistent"):
        assert await _kind(node.setup("s4", path)) is ErrorKind.INVALID_ARGUMENT
    assert await _kind(node.manager.check("s1", ns)) is ErrorKind.NOT_FOUND
    assert _open_fds_of(ns) == 0
