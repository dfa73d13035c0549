"""The agent's own disk full or read-only (issue 36, item 3): the network is
released all the same, and what was not recorded is said, and finished later.

DEL is idempotent, so a Teardown (or Detach, or a reaping pass) whose
"deleting" mark the state dir does not take still runs the DEL chain: the
runtime's pod keeps no address because the agent's bookkeeping could not be
written. Before, Teardown was refused at once ("agent state error: ... No
space left on device") and the IP stayed until an operator freed space.

Real bridge + host-local (its dataDir is outside the state dir, as
/var/lib/cni/networks is outside /var/lib/cni-agent), a real tmpfs mounted
as the state dir and filled, and a read-only bind mount of it.
"""

from __future__ import annotations

import errno
import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.daemon.test_http import samples
from tests.support.agent import Agent
from tests.support.net import addresses, allocations, link_exists, netns_name
from tests.support.plugins import Control, wait_for
from tests.support.shim import run_shim, shim_conf
from tests.support.state import record
from tests.support.state import records as journal_records

pytestmark = pytest.mark.root
ERR = "org.cniagent.Agent1.Error."


@pytest.fixture
def state_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs as the agent's state dir (its default place in the test agent)."""
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(state)],
                   check=True)
    yield state
    # Tests list this fixture before make_agent, whose agents stop first.
    subprocess.run(["umount", "-l", str(state)], check=False)


def fill(directory: Path) -> Path:
    """Fill the filesystem of `directory` to its last byte."""
    filler = directory / "filler"
    with open(filler, "ab", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    with pytest.raises(OSError) as full:
        (directory / ".probe").write_bytes(b"{}")
    assert full.value.errno == errno.ENOSPC
    return filler


def read_only(state: Path) -> None:
    """Bind-mount the state dir over itself and make that mount read-only."""
    subprocess.run(["mount", "--bind", str(state), str(state)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(state)], check=True)


def lo_up(netns: str) -> bool:
    out = subprocess.run(["ip", "-n", netns_name(netns), "-j", "link", "show", "lo"],
                         capture_output=True, text=True, check=True)
    return "UP" in json.loads(out.stdout)[0]["flags"]


def records(state: Path) -> list[str]:
    """The sandboxes the journal holds a record of."""
    return sorted(journal_records(state))


def fresh_segment(state: Path) -> bool:
    """Whether the journal's only segment is empty (after a compaction)."""
    names = sorted(p.name for p in (state / "journal").iterdir())
    logs = [n for n in names if n.startswith("log-")]
    return len(logs) == 1 and (state / "journal" / logs[0]).stat().st_size == 0 and any(
        n.startswith("snapshot-") for n in names)


def entries(state: Path) -> list[str]:
    d = state / "results"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def start(make_agent: Callable[..., Agent], **config: object) -> Agent:
    # Reaping every second: "the next reaping pass" comes soon after the disk allows.
    return make_agent(gc={"interval": 1}, check={"interval": 0}, **config)


def test_detach_and_teardown_on_a_full_state_dir_release_the_network(
    state_tmpfs: Path, make_agent: Callable[..., Agent], bridge_chain: str, netns: str,
    tmp_path: Path,
) -> None:
    agent = start(make_agent)
    agent.setup("web", netns, networks=[("pods", "eth0"), ("pods", "eth1")])
    [ip0], [ip1] = addresses(netns, "eth0"), addresses(netns, "eth1")
    assert allocations(tmp_path / "ipam", "pods") == sorted(i.split("/")[0] for i in (ip0, ip1))
    # A journal segment with no page of its own yet, so the first line needs
    # one: a restart starts a new segment, and once what it replayed is
    # compacted the new one is the only one left. Still empty once the disk
    # is full, or again: a line the agent appended in between (a CI run saw
    # one, under load) took a page that the Detach's mark would then fit in.
    for _ in range(5):
        assert agent.stop() == 0
        agent.start()
        wait_for(lambda: fresh_segment(state_tmpfs), timeout=10)
        filler = fill(state_tmpfs)
        if fresh_segment(state_tmpfs):
            break
        filler.unlink()
    else:
        pytest.fail("the agent's new journal segment never stayed empty until the disk was full")

    # The "deleting" mark does not go to disk, but the DEL runs, and what comes
    # after it can be written: the DEL's cache entry, unlinked, leaves room for
    # the record's update, and a Teardown's unlinks need none. Nothing is left
    # unrecorded, so neither is an error.
    out = agent.gdbus("Detach", "web", netns, "pods", "eth1", "{}")
    assert out.returncode == 0, out.stderr + agent.log()[-3000:]
    assert not link_exists("eth1", netns) and addresses(netns, "eth0") == [ip0]
    assert allocations(tmp_path / "ipam", "pods") == [ip0.split("/")[0]]
    web = record(state_tmpfs, "web")
    assert web is not None
    assert [(a["ifname"], a["phase"]) for a in web["attachments"]] == [("eth0", "ready")]
    fill(state_tmpfs)  # full again
    out = agent.gdbus("Teardown", "web", netns, "{}")
    assert out.returncode == 0, out.stderr + agent.log()[-3000:]
    assert allocations(tmp_path / "ipam", "pods") == []
    assert not link_exists("eth0", netns)
    assert records(state_tmpfs) == [] and entries(state_tmpfs) == []
    assert agent.call("ListSandboxes")[0] == []
    # The Detach's mark needed a page the disk did not have; the Teardown's fit in
    # the page the Detach's record update took (the journal appends, it does
    # not rewrite a file per change).
    mark = [x for x in agent.log().splitlines() if 'without its "deleting" mark' in x]
    assert len(mark) == 1 and all("No space left on device" in x and "WARNING" in x
                                  and "eth1" in x for x in mark), mark
    filler.unlink()
    agent.setup("web", netns)  # the id is free, and space is back
    assert addresses(netns)


def test_a_detach_on_a_read_only_state_dir_is_released_and_the_next_pass_records_it(
    state_tmpfs: Path, make_agent: Callable[..., Agent], bridge_chain: str, netns: str,
    tmp_path: Path,
) -> None:
    agent = start(make_agent)
    agent.setup("web", netns, networks=[("pods", "eth0"), ("pods", "eth1")])
    [ip0] = addresses(netns, "eth0")
    read_only(state_tmpfs)
    try:
        out = agent.gdbus("Detach", "web", netns, "pods", "eth1", "{}")
        assert out.returncode != 0 and ERR + "StateError" in out.stderr, out.stderr
        # What was done and what was not: the record still lists eth1.
        assert "DEL of eth1 of web: the DELs succeeded and the network is released, but not " \
            'recorded: the "deleting" mark, the removal of the cache entry of pods/eth1 and ' \
            "the record's update (Read-only file system); the next reaping pass finishes it " \
            "once the disk allows" in out.stderr, out.stderr
        assert not link_exists("eth1", netns) and addresses(netns, "eth0") == [ip0]
        assert allocations(tmp_path / "ipam", "pods") == [ip0.split("/")[0]]
        # Not "ready" while the record says eth1: it is being removed.
        assert json.loads(agent.call("Show", "s", "web")[0])["state"] == "tearing-down"
    finally:
        subprocess.run(["umount", str(state_tmpfs)], check=True)  # the bind mount: writable again

    wait_for(lambda: json.loads(agent.call("Show", "s", "web")[0])["state"] == "ready",
             timeout=10)
    doc = json.loads(agent.call("Show", "s", "web")[0])
    assert [a["ifname"] for a in doc["attachments"]] == ["eth0"]
    web = record(state_tmpfs, "web")
    assert web is not None and [a["ifname"] for a in web["attachments"]] == ["eth0"]
    assert entries(state_tmpfs) == ["pods-web-eth0"]
    assert addresses(netns, "eth0") == [ip0]  # the pass touched only eth1
    assert allocations(tmp_path / "ipam", "pods") == [ip0.split("/")[0]]
    agent.call("Teardown", "ssa{sv}", "web", netns, "0")
    assert allocations(tmp_path / "ipam", "pods") == [] and records(state_tmpfs) == []


def test_a_teardown_on_a_read_only_state_dir_releases_the_network_and_says_what_was_not_recorded(
    state_tmpfs: Path, make_agent: Callable[..., Agent], bridge_chain: str,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    agent = start(make_agent)
    web, ctr, dead = netns_factory(), netns_factory(), netns_factory()
    agent.setup("web", web)
    agent.setup("dead", dead)
    # A runtime's pod through the shim: its DEL is answered in CNI's words.
    conf = shim_conf("runtime-net", "pods")
    added = run_shim(agent.bus.address, "ADD", conf, cid="ctr", netns=ctr)
    assert added.rc == 0, added
    assert len(allocations(tmp_path / "ipam", "pods")) == 3
    read_only(state_tmpfs)
    try:
        # A namespace deleted while nobody calls: the reaping pass (every
        # second) DELs its attachment though it can record nothing.
        subprocess.run(["ip", "netns", "del", netns_name(dead)], check=True)
        wait_for(lambda: len(allocations(tmp_path / "ipam", "pods")) == 2, timeout=10)
        out = agent.gdbus("Teardown", "web", web, "{}")
        assert out.returncode != 0 and ERR + "StateError" in out.stderr, out.stderr
        assert "PluginFailed" not in out.stderr
        assert "teardown of web: the DELs succeeded and the network is released, but not " \
            'recorded: the "deleting" mark, the removal of the cache entry of pods/eth0 and ' \
            "the record's removal (Read-only file system); the next reaping pass finishes it " \
            "once the disk allows" in out.stderr, out.stderr
        assert not link_exists("eth0", web)
        # The shim's DEL: released too, and "try again later" (11), not 999.
        deleted = run_shim(agent.bus.address, "DEL", conf, cid="ctr", netns=ctr)
        assert deleted.rc == 1 and deleted.code == 11, deleted
        assert "Read-only file system" in deleted.out["msg"]
        assert not link_exists("eth0", ctr)
        assert allocations(tmp_path / "ipam", "pods") == []
        # Until the disk allows, both are shown being torn down, not ready.
        assert json.loads(agent.call("Show", "s", "web")[0])["state"] == "tearing-down"
        assert records(state_tmpfs) == ["ctr", "dead", "web"]
    finally:
        subprocess.run(["umount", str(state_tmpfs)], check=True)  # the bind mount: writable again
    # The next reaping pass finishes all three (their DEL again is harmless).
    wait_for(lambda: records(state_tmpfs) == [] and entries(state_tmpfs) == [], timeout=10)
    assert agent.call("ListSandboxes")[0] == []
    out = agent.gdbus("Show", "web")
    assert out.returncode != 0 and ERR + "NotFound" in out.stderr
    assert allocations(tmp_path / "ipam", "pods") == []


def test_a_setup_the_full_state_dir_refuses_leaves_lo_down(
    state_tmpfs: Path, make_agent: Callable[..., Agent], bridge_chain: str, netns: str,
    control: Control,
) -> None:
    agent = start(make_agent)
    fill(state_tmpfs)
    assert not lo_up(netns)
    out = agent.gdbus("Setup", "web", netns, "{}")
    assert out.returncode != 0 and ERR + "StateError" in out.stderr, out.stderr
    assert "No space left on device" in out.stderr
    assert not lo_up(netns)  # as the Setup found it
    assert "ADD" not in control.commands()  # no plugin ran


def test_a_failed_setup_leaves_lo_as_it_found_it(
    make_agent: Callable[..., Agent], bridge_chain: str, netns_factory: Callable[[], str],
    control: Control,
) -> None:
    agent = start(make_agent)
    control.set("ADD", "fail", code=11, msg="no address for you", only=["testplug"])
    down, up = netns_factory(), netns_factory()
    subprocess.run(["ip", "-n", netns_name(up), "link", "set", "lo", "up"], check=True)
    for ns in (down, up):
        out = agent.gdbus("Setup", "web", ns, "{}")
        assert out.returncode != 0 and ERR + "PluginFailed" in out.stderr, out.stderr
        assert not link_exists("eth0", ns)  # rolled back
    assert not lo_up(down)  # this Setup brought it up, and put it back down
    assert lo_up(up)  # it was up before: left up
    control.clear("ADD")
    agent.setup("web", down)
    assert lo_up(down)


def test_state_errors_are_counted_on_both_faces(
    state_tmpfs: Path, make_agent: Callable[..., Agent], bridge_chain: str,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    """cni_agent_state_errors_total counts a D-Bus StateError and the shim's
    code 11 that stands for one (CNIAgentStateErrors reads it); the shim's is
    cni_agent_shim_errors_total{code="11"} too."""
    sock = tmp_path / "metrics.sock"
    agent = start(make_agent, http={"listen": f"unix:{sock}"})
    assert samples(sock)[("cni_agent_state_errors_total", ())] == 0
    fill(state_tmpfs)
    out = agent.gdbus("Setup", "web", netns_factory(), "{}")
    assert out.returncode != 0 and ERR + "StateError" in out.stderr, out.stderr
    shim = run_shim(agent.bus.address, "ADD", shim_conf("pods", "pods"), cid="ctr",
                    netns=netns_factory())
    assert shim.code == 11 and "agent state error" in shim.out["msg"], shim
    got = samples(sock)
    assert got[("cni_agent_state_errors_total", ())] == 2
    assert got[("cni_agent_shim_errors_total", (("code", "11"),))] == 1
    assert got[("cni_agent_operations_total", (("method", "Setup"), ("result", "StateError")))] == 1
