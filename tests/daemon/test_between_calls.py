"""What happens to an attachment between calls: unprompted reaping, damaged
state after a power loss, and a namespace identity no container can forge.

Real bridge + host-local, real namespaces, the agent on a private bus.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import Agent
from tests.support.net import addresses, allocations
from tests.support.plugins import Control, seen_netns, wait_for
from tests.support.shim import run_shim, shim_conf
from tests.support.state import lose, record, replace_latest, wait_record

pytestmark = pytest.mark.root

NO_NS_GET_ID = {"CNI_AGENT_TEST_NO_NS_GET_ID": "1"}  # the agent's seam: a kernel < 6.11


def _name(path: str) -> str:
    return Path(path).name


def _dels(control: Control) -> dict[str, Any]:
    return {r["env"]["CNI_CONTAINERID"]: seen_netns(r)
            for r in control.records() if r["command"] == "DEL"}


def _ips(tmp_path: Path) -> list[str]:
    return allocations(tmp_path / "ipam", "pods")


def _checked(agent: Agent, sid: str) -> None:
    """Wait for the baseline CHECK after Setup, which writes the record: a test
    that edits the record (an older agent's) must come after it."""
    wait_for(lambda: all(a["check"]["state"] != "unchecked" for a in
                         json.loads(agent.call("Show", "s", sid)[0])["attachments"]), timeout=5)


def _start(make_agent: Callable[..., Agent], env: dict[str, str] | None = None,
           **config: Any) -> Agent:
    agent = make_agent(start=False, **config)
    agent.start(env=env)
    assert agent.call("WaitReady", "d", "10")[0] is True, agent.log()
    return agent


# --- 1. reaping that nobody has to ask for ------------------------------------------


def test_a_deleted_namespace_gives_its_ip_back_though_nobody_calls(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    agent = _start(make_agent, gc={"interval": 1})
    dead, live = netns_factory(), netns_factory()
    agent.setup("dead", dead)
    agent.setup("live", live)
    assert len(_ips(tmp_path)) == 2
    control.reset_records()
    subprocess.run(["ip", "netns", "del", _name(dead)], check=True)  # the runtime forgot it
    # No Teardown, no GarbageCollect, no restart, no readiness change.
    wait_for(lambda: len(_ips(tmp_path)) == 1, timeout=10)
    assert agent.call("ListSandboxes")[0] == ["live"]
    assert _dels(control) == {"dead": ""}  # with an empty netns, as at start-up
    assert len(addresses(live)) == 1


def test_interval_0_turns_the_passes_off(
    make_agent: Callable[..., Agent], bridge_chain: str, netns: str, tmp_path: Path,
) -> None:
    agent = _start(make_agent, gc={"interval": 0})
    agent.setup("pod", netns)
    subprocess.run(["ip", "netns", "del", _name(netns)], check=True)
    time.sleep(3)  # time passes; nothing calls Teardown or GC
    assert len(_ips(tmp_path)) == 1
    agent.call("GarbageCollect", "as", "0")  # asked for: reaped as ever
    assert _ips(tmp_path) == []


def test_a_del_from_a_renamed_runtime_network_is_a_warning_and_the_pass_frees_the_ip(
    make_agent: Callable[..., Agent], bridge_chain: str, netns: str, tmp_path: Path,
) -> None:
    agent = _start(make_agent, gc={"interval": 1})
    bus = agent.bus.address
    made, renamed = shim_conf("k8s-pod-network", "pods"), shim_conf("cni-agent", "pods")
    assert run_shim(bus, "ADD", made, cid="ctr", netns=netns).rc == 0
    # The runtime's conflist was regenerated with another --name: its DEL is not
    # the ADD's, so the agent does nothing but says so, naming both.
    assert run_shim(bus, "DEL", renamed, cid="ctr", netns=netns).rc == 0
    line = next(x for x in agent.log().splitlines() if "nothing to do" in x)
    assert "WARNING" in line and "'cni-agent'" in line and "'k8s-pod-network'" in line, line
    assert len(_ips(tmp_path)) == 1
    subprocess.run(["ip", "netns", "del", _name(netns)], check=True)
    wait_for(lambda: _ips(tmp_path) == [], timeout=10)
    assert agent.call("ListSandboxes")[0] == []


# --- 2. damaged state never blocks ----------------------------------------------------


@pytest.mark.parametrize("damage", ["unknown phase", "newer version"])
def test_a_damaged_record_is_set_aside_and_teardown_works_from_the_cache(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path, damage: str,
) -> None:
    """A record whose content is unusable (what a newer agent wrote, read after
    a downgrade): set aside at start-up, the sandbox handled from its cache."""
    agent = _start(make_agent)
    agent.setup("pod", netns)
    _checked(agent, "pod")
    assert agent.stop() == 0
    doc = record(tmp_path / "state", "pod")
    assert doc is not None
    damaged = {
        "unknown phase": {**doc, "phase": "migrating",
                          "attachments": [{**a, "phase": "migrating"} for a in doc["attachments"]]},
        "newer version": {**doc, "version": 99},
    }[damage]
    replace_latest(tmp_path / "state", "pod", damaged)
    agent.start()
    aside = tmp_path / "state" / "sandboxes" / "damaged" / "pod.json"
    shown = json.loads(agent.call("Show", "s", "pod")[0])
    assert shown["damaged_record"] == str(aside)
    assert [a["ifname"] for a in shown["attachments"]] == ["eth0"]  # from the cache
    control.reset_records()
    agent.call("Teardown", "ssa{sv}", "pod", netns, "0")
    assert _ips(tmp_path) == [] and addresses(netns) == []
    assert "pod" in _dels(control)
    assert agent.call("ListSandboxes")[0] == []
    assert json.loads(aside.read_text()) == damaged  # kept for a post-mortem
    assert record(tmp_path / "state", "pod") is None
    assert any("WARNING" in x and "pod" in x and "unusable" in x
               for x in agent.log().splitlines())


def test_a_record_a_power_cut_took_leaves_the_sandbox_to_its_cache_entries(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    """Every line of the sandbox's record zeroed, as a power cut zeroes what it
    did not write (here even the committed intent, which a real one cannot
    take): the damaged bytes are kept, and the sandbox is handled from the
    libcni cache entry that names it."""
    agent = _start(make_agent)
    agent.setup("pod", netns)
    _checked(agent, "pod")
    assert agent.stop() == 0
    assert lose(tmp_path / "state", "pod") > 0
    agent.start()
    assert record(tmp_path / "state", "pod") is None
    shown = json.loads(agent.call("Show", "s", "pod")[0])
    assert [a["ifname"] for a in shown["attachments"]] == ["eth0"]  # from the cache
    assert list((tmp_path / "state" / "sandboxes" / "damaged").glob("journal-*"))
    assert any("WARNING" in x and "damaged byte(s)" in x for x in agent.log().splitlines())
    control.reset_records()
    agent.call("Teardown", "ssa{sv}", "pod", netns, "0")
    assert _ips(tmp_path) == [] and addresses(netns) == []
    assert "pod" in _dels(control)
    assert agent.call("ListSandboxes")[0] == []


def test_a_damaged_record_of_a_dead_namespace_is_reaped_at_start_up(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    agent = _start(make_agent)
    agent.setup("pod", netns)
    _checked(agent, "pod")
    assert agent.stop() == 0
    lose(tmp_path / "state", "pod")  # the power loss...
    subprocess.run(["ip", "netns", "del", _name(netns)], check=True)  # ...took the namespace
    control.reset_records()
    agent.start()
    wait_for(lambda: _ips(tmp_path) == [], timeout=10)
    assert _dels(control) == {"pod": ""}
    assert list((tmp_path / "state" / "sandboxes" / "damaged").glob("journal-*"))


def test_a_damaged_cache_entry_is_deleted_with_the_journals_result(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    """The journal holds each result: a cache entry zeroed under a running
    agent changes nothing of the DEL, which gets the result as its
    prevResult all the same (before the journal: the record's config and no
    prevResult)."""
    agent = _start(make_agent)
    agent.setup("pod", netns)
    [entry] = (tmp_path / "state" / "results").iterdir()
    entry.write_bytes(b"")
    control.reset_records()
    agent.call("Teardown", "ssa{sv}", "pod", netns, "0")
    assert _ips(tmp_path) == [] and addresses(netns) == []
    [rec] = [r for r in control.records() if r["command"] == "DEL"]
    assert rec["stdin"]["prevResult"]["ips"]  # the journal's result
    assert not entry.exists()


def test_a_cache_entry_a_power_cut_zeroed_is_written_again_from_the_journal(
    make_agent: Callable[..., Agent], bridge_chain: str, netns: str, tmp_path: Path,
) -> None:
    """libcni's cache is not fsynced (libcni never fsyncs it either): after a
    power cut an entry may be empty or gone. The journal is the source of
    truth: at start-up, and in every reaping pass, such an entry is written
    again from it, as it was."""
    agent = _start(make_agent, gc={"interval": 1})
    agent.setup("pod", netns)
    [entry] = (tmp_path / "state" / "results").iterdir()
    before = json.loads(entry.read_text())
    assert agent.stop() == 0
    entry.write_bytes(b"")
    agent.start()
    agent.call("ListSandboxes")  # answered once start-up's recovery is done
    assert json.loads(entry.read_text()) == before
    assert any("written again from the journal" in x for x in agent.log().splitlines())
    entry.unlink()  # under a running agent: the next reaping pass restores it
    wait_for(entry.exists, timeout=10)
    assert json.loads(entry.read_text()) == before
    agent.call("Teardown", "ssa{sv}", "pod", netns, "0")
    assert _ips(tmp_path) == [] and not entry.exists()


# --- 3. an identity no container can forge -------------------------------------------


def _forge(netns: str) -> None:
    """What a pod with CAP_NET_ADMIN may do to its own interface."""
    ns = _name(netns)
    for args in (["link", "set", "eth0", "down"], ["link", "set", "eth0", "name", "eth9"],
                 ["link", "set", "eth9", "address", "02:00:00:12:34:56"],
                 ["link", "set", "eth9", "up"]):
        subprocess.run(["ip", "-n", ns, *args], check=True)


def test_without_ns_get_id_renaming_eth0_and_its_mac_keeps_the_pods_ip(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    agent = _start(make_agent, env=NO_NS_GET_ID, gc={"interval": 1})
    agent.setup("pod", netns)
    _checked(agent, "pod")
    doc = record(tmp_path / "state", "pod")
    assert doc is not None
    # What a kernel without NS_GET_ID records (also where the seam is unknown).
    assert doc["netnsId"]["nsId"] is None, doc
    assert doc["netnsId"].get("cookie"), doc  # the socket's netns cookie instead
    [ip] = _ips(tmp_path)
    _forge(netns)
    control.reset_records()
    agent.call("GarbageCollect", "as", "1", "pod")
    time.sleep(2.5)  # and two unprompted passes
    assert agent.call("ListSandboxes")[0] == ["pod"]
    assert _dels(control) == {}
    assert _ips(tmp_path) == [ip]
    assert addresses(netns, "eth9") != []
    # Gone is still gone.
    subprocess.run(["ip", "netns", "del", _name(netns)], check=True)
    wait_for(lambda: _ips(tmp_path) == [], timeout=10)


def _as_0_1_0_wrote_it(agent: Agent, tmp_path: Path, netns: str) -> None:
    """The agent stopped, and the sandbox's record replaced by 0.1.0's: a record
    file (imported at the next start) whose netnsId is the inode only."""
    assert agent.stop() == 0
    doc = record(tmp_path / "state", "pod")
    assert doc is not None
    st = os.stat(netns)
    doc["netnsId"] = [st.st_dev, st.st_ino]
    for a in doc["attachments"]:
        a.pop("result", None)  # 0.1.0 kept results in the cache only
    legacy = tmp_path / "state" / "sandboxes"
    legacy.mkdir(exist_ok=True)
    (legacy / "pod.json").write_text(json.dumps(doc))


def test_an_old_inode_only_record_earns_the_kernels_id_once_confirmed(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    agent = _start(make_agent)
    agent.setup("pod", netns)
    _checked(agent, "pod")
    doc = record(tmp_path / "state", "pod")
    assert doc is not None
    if doc["netnsId"]["nsId"] is None:
        pytest.fail("CI's kernel has NS_GET_ID (Linux >= 6.11); this one does not")
    _as_0_1_0_wrote_it(agent, tmp_path, netns)
    agent.start()
    agent.call("ListSandboxes")  # answered once start-up's recovery is done
    assert not (tmp_path / "state" / "sandboxes" / "pod.json").exists()  # imported
    agent.call("GarbageCollect", "as", "1", "pod")  # eth0 and its MAC are there: confirmed
    upgraded = wait_record(tmp_path / "state", "pod", lambda d: d is not None and isinstance(
        d["netnsId"], dict) and d["netnsId"]["nsId"] is not None)
    assert upgraded is not None
    assert upgraded["netnsId"]["nsId"] is not None
    assert upgraded["netnsId"]["ino"] == os.stat(netns).st_ino
    _forge(netns)
    control.reset_records()
    agent.call("GarbageCollect", "as", "1", "pod")
    assert agent.call("ListSandboxes")[0] == ["pod"] and _dels(control) == {}


def test_an_old_record_whose_links_changed_is_neither_reaped_nor_entered(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    agent = _start(make_agent)
    agent.setup("pod", netns)
    _checked(agent, "pod")
    _as_0_1_0_wrote_it(agent, tmp_path, netns)
    _forge(netns)  # before any pass confirmed it: the links prove nothing either way
    agent.start()
    assert agent.call("WaitReady", "d", "10")[0] is True
    control.reset_records()
    agent.call("GarbageCollect", "as", "1", "pod")
    assert agent.call("ListSandboxes")[0] == ["pod"] and _dels(control) == {}
    assert len(_ips(tmp_path)) == 1
    # The runtime's Teardown still works; the DEL stays out of the unconfirmed namespace.
    agent.call("Teardown", "ssa{sv}", "pod", netns, "0")
    assert _ips(tmp_path) == [] and _dels(control) == {"pod": ""}


def _holds(pid: int, netns: str) -> list[str]:
    """The descriptors of process `pid` open on the namespace at `netns`."""
    want = os.stat(netns)
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            st = os.stat(f"/proc/{pid}/fd/{fd}")
            if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
                held.append(fd)
    return held


def test_a_namespace_left_unconfirmed_is_not_held_open_after_the_pass(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    """A pass that pins a recorded namespace and cannot confirm it (an inode-only
    record whose links a pod changed) lets go of it: the agent keeps no
    descriptor that would keep a deleted namespace alive."""
    agent = _start(make_agent)
    agent.setup("pod", netns)
    _checked(agent, "pod")
    _as_0_1_0_wrote_it(agent, tmp_path, netns)
    _forge(netns)
    agent.start()
    assert agent.call("WaitReady", "d", "10")[0] is True
    assert agent.proc is not None
    pid = agent.proc.pid
    for _ in range(3):  # each pass pins it, judges it unconfirmed, lets go
        agent.call("GarbageCollect", "as", "1", "pod")
    assert agent.call("ListSandboxes")[0] == ["pod"] and _dels(control) == {}
    # Start-up's own passes may still hold it a moment; a leaked pin never goes.
    wait_for(lambda: _holds(pid, netns) == [], timeout=10)


def test_a_namespace_path_that_cannot_be_opened_is_unknown_not_gone(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    """Only ENOENT or "not a network namespace" means gone: here the recorded path
    (a symlink the runtime made) turns into a loop (ELOOP), as EACCES, EMFILE or
    ENOMEM would: unknown, so kept, until the path really is gone."""
    agent = _start(make_agent, gc={"interval": 1})
    link, loop = tmp_path / "pod-netns", tmp_path / "loop"
    link.symlink_to(netns)
    agent.setup("pod", str(link))
    link.unlink()
    link.symlink_to(loop)
    loop.symlink_to(link)
    control.reset_records()
    time.sleep(2.5)  # two passes
    assert len(_ips(tmp_path)) == 1 and _dels(control) == {}
    assert "not looked at" in agent.log()
    link.unlink()  # now ENOENT: gone
    wait_for(lambda: _ips(tmp_path) == [], timeout=10)
    assert _dels(control) == {"pod": ""}
