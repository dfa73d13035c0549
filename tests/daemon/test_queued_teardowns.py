"""Teardowns that don't wait for the agent (issue 47, item 4).

A runtime's DEL through the real shim while no agent runs (stopped: its
socket gone, no owner of its name on the private bus, no bus activation) is
queued durably in the agent's state dir and answered as done; the agent runs
it when it is back. Real bridge + host-local (their dataDir outside the state
dir), real namespaces, the real built shim as libcni execs it.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.agent import Agent
from tests.support.net import allocations
from tests.support.plugins import Control, wait_for
from tests.support.shim import Reply, run_shim, shim_conf
from tests.support.state import records as journal_records

pytestmark = pytest.mark.root
RUNTIME_NET = "rt-pods"


def conf(agent: Agent, **extra: Any) -> dict[str, Any]:
    """The shim's conflist entry as `cni-agent shim-config` writes it for this
    agent (its state_dir is not the default one)."""
    return shim_conf(RUNTIME_NET, network="pods", version="1.0.0",
                     **{"stateDir": agent.config["state_dir"], "queueWhenDown": True, **extra})


def shim(agent: Agent, command: str, cid: str, netns: str = "", config: dict[str, Any] | None = None
         ) -> Reply:
    """The shim as CRI-O execs it: the agent's socket, then the bus."""
    return run_shim(agent.bus.address, command, config or conf(agent), cid=cid, netns=netns,
                    socket=str(agent.shim_socket))


def queued(agent: Agent) -> list[Path]:
    return sorted(p for p in (Path(agent.config["state_dir"]) / "queue").glob("*")
                  if not p.name.startswith("."))


def ips(tmp_path: Path) -> list[str]:
    return allocations(tmp_path / "ipam", "pods")


def ip_of(reply: Reply) -> str:
    assert reply.rc == 0, reply
    return str(reply.out["ips"][0]["address"]).split("/")[0]


def stop_pod(agent: Agent, cid: str, netns: str) -> Reply:
    """CRI-O's StopPodSandbox: the CNI DEL, then the namespace goes."""
    reply = shim(agent, "DEL", cid, netns)
    subprocess.run(["ip", "netns", "del", Path(netns).name], check=True)
    return reply


def outcomes(agent: Agent) -> dict[str, float]:
    """cni_agent_queued_teardowns_total by outcome, scraped from the agent's /metrics."""
    sock = agent.config["http"]["listen"].removeprefix("unix:")
    out = subprocess.run(["curl", "-sf", "--max-time", "10", "--unix-socket", sock,
                          "http://agent/metrics"], capture_output=True, text=True, check=True)
    return {s.labels["outcome"]: s.value
            for fam in text_string_to_metric_families(out.stdout)
            for s in fam.samples if s.name == "cni_agent_queued_teardowns_total"}


@pytest.fixture
def agent(make_agent: Callable[..., Agent], bridge_chain: str, tmp_path: Path) -> Agent:
    return make_agent(http={"listen": f"unix:{tmp_path / 'metrics.sock'}"})


def test_a_del_with_the_agent_stopped_succeeds_at_once_and_the_address_goes_once_it_is_back(
        agent: Agent, netns_factory: Callable[[], str], tmp_path: Path) -> None:
    netns = netns_factory()
    ip = ip_of(shim(agent, "ADD", "crio-1", netns))
    assert ips(tmp_path) == [ip]
    assert agent.stop() == 0
    reply = stop_pod(agent, "crio-1", netns)
    assert (reply.rc, reply.out) == (0, None), reply  # a DEL's success, at once
    [request] = queued(agent)
    assert request.stat().st_uid == 0 and request.stat().st_mode & 0o777 == 0o600
    doc = json.loads(request.read_text())
    assert doc["env"]["CNI_CONTAINERID"] == "crio-1" and doc["env"]["CNI_COMMAND"] == "DEL"
    assert json.loads(doc["config"])["name"] == RUNTIME_NET
    assert doc["netns"]["ino"] > 0
    assert ips(tmp_path) == [ip]  # until the agent is back: the trade-off runtimes.md states
    agent.start()
    wait_for(lambda: not ips(tmp_path), timeout=30)
    wait_for(lambda: not queued(agent), timeout=10)
    assert "crio-1" not in journal_records(Path(agent.config["state_dir"]))
    wait_for(lambda: "queued by cni-agent-shim" in agent.log() and "is done" in agent.log())
    assert outcomes(agent) == {"done": 1, "gone": 0, "stale": 0, "failed": 0, "refused": 0}
    # The runtime's repeat of the DEL (it may retry) is a DEL of nothing: success.
    assert shim(agent, "DEL", "crio-1").rc == 0


def test_queue_when_down_false_keeps_the_del_failing_with_code_11(
        agent: Agent, netns: str, tmp_path: Path) -> None:
    ip = ip_of(shim(agent, "ADD", "crio-2", netns))
    assert agent.stop() == 0
    reply = shim(agent, "DEL", "crio-2", netns, conf(agent, queueWhenDown=False))
    assert reply.rc == 1 and reply.code == 11, reply
    assert "cni-agent is not running" in reply.out["msg"]
    assert "queued" not in reply.out.get("details", "")
    assert queued(agent) == [] and ips(tmp_path) == [ip]
    agent.start()
    assert shim(agent, "DEL", "crio-2", netns).rc == 0
    assert ips(tmp_path) == []


def test_no_del_is_queued_while_an_agent_holds_the_queue(
        agent: Agent, netns: str, tmp_path: Path) -> None:
    """An agent that runs but answers neither way (here: its socket and bus
    name out of the shim's reach) holds the queue: the DEL fails as before,
    saying so, and nothing is queued behind its back."""
    ip_of(shim(agent, "ADD", "crio-3", netns))
    reply = run_shim(agent.bus.address.replace("unix:path=", "unix:path=/nonexistent"), "DEL",
                     conf(agent), cid="crio-3", netns=netns, socket="")
    assert reply.rc == 1 and reply.code == 11, reply
    assert "a cni-agent holds" in reply.out["details"], reply
    assert queued(agent) == []


def test_sigkill_during_the_drain_runs_the_del_exactly_once_and_the_file_goes(
        agent: Agent, control: Control, netns_factory: Callable[[], str], tmp_path: Path) -> None:
    netns = netns_factory()
    ip_of(shim(agent, "ADD", "crio-4", netns))
    assert agent.stop() == 0
    assert stop_pod(agent, "crio-4", netns).rc == 0
    control.reset_records()
    control.set("DEL", "succeed", sleep=30)  # the drain's DEL is under way...
    agent.start()
    wait_for(lambda: "DEL" in control.commands(), timeout=30)
    assert agent.stop(signal.SIGKILL) == -signal.SIGKILL  # ...when the agent is killed
    assert len(queued(agent)) == 1  # not lost
    control.clear("DEL")
    agent.start()
    wait_for(lambda: not ips(tmp_path), timeout=30)
    wait_for(lambda: not queued(agent), timeout=10)
    # The killed DEL, then once more: recovery finishes it (DEL is idempotent),
    # and the queued request, bound to the generation now gone, is not run again.
    wait_for(lambda: "was already done" in agent.log(), timeout=10)
    assert control.commands().count("DEL") == 2, control.commands()
    assert outcomes(agent)["gone"] == 1 and outcomes(agent)["done"] == 0
    assert "crio-4" not in journal_records(Path(agent.config["state_dir"]))


def test_a_setup_of_the_same_id_while_its_del_is_queued_runs_that_del_first(
        agent: Agent, control: Control, netns_factory: Callable[[], str], tmp_path: Path) -> None:
    """podman reuses ids: its next ADD of the id may come the moment the agent
    is back. The queued DEL of the earlier pod runs first (the drain is busy
    elsewhere, so it is the ADD that runs it): the new pod is set up, the old
    address released, and the new pod's network is never torn down by it."""
    slow, reused = netns_factory(), netns_factory()
    ip_of(shim(agent, "ADD", "slow-1", slow))
    old = ip_of(shim(agent, "ADD", "reused", reused))
    assert agent.stop() == 0
    assert stop_pod(agent, "slow-1", slow).rc == 0  # queued first: the drain starts with it
    assert stop_pod(agent, "reused", reused).rc == 0
    assert len(queued(agent)) == 2
    control.reset_records()
    control.set("DEL", "succeed", sleep=2)
    agent.start()
    again = netns_factory()
    new = ip_of(shim(agent, "ADD", "reused", again))
    records = [(r["command"], r["env"].get("CNI_CONTAINERID")) for r in control.records()]
    assert records.index(("DEL", "reused")) < records.index(("ADD", "reused")), records
    wait_for(lambda: not queued(agent), timeout=30)
    assert ips(tmp_path) == [new] and old not in ips(tmp_path)
    assert "reused" in journal_records(Path(agent.config["state_dir"]))
    assert shim(agent, "CHECK", "reused", again).rc == 0


def test_a_queued_del_bound_to_an_earlier_generation_is_dropped_as_stale(
        agent: Agent, netns_factory: Callable[[], str], tmp_path: Path) -> None:
    """A request bound to a generation the sandbox no longer has (a file a
    power loss brought back after the id was set up again) is not run."""
    netns = netns_factory()
    ip = ip_of(shim(agent, "ADD", "crio-5", netns))
    assert agent.stop() == 0
    assert shim(agent, "DEL", "crio-5", netns).rc == 0
    [request] = queued(agent)
    request.rename(request.with_name(request.name + ".g999999"))
    agent.start()
    wait_for(lambda: not queued(agent), timeout=30)
    wait_for(lambda: "the sandbox was set up again since" in agent.log(), timeout=10)
    assert outcomes(agent)["stale"] == 1 and outcomes(agent)["done"] == 0
    assert ips(tmp_path) == [ip]  # the pod set up now keeps its network
    assert shim(agent, "CHECK", "crio-5", netns).rc == 0


@pytest.fixture
def small_state(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs as the agent's state dir (as tests/faults/test_full_disk.py)."""
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(state)],
                   check=True)
    yield state
    subprocess.run(["umount", "-l", str(state)], check=False)


def fill(directory: Path) -> None:
    with open(directory / "filler", "ab", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e


def test_a_full_disk_when_queuing_fails_the_del_as_before_with_the_reason(
        small_state: Path, make_agent: Callable[..., Agent], bridge_chain: str, netns: str,
        tmp_path: Path) -> None:
    agent = make_agent()
    ip = ip_of(shim(agent, "ADD", "crio-6", netns))
    assert agent.stop() == 0
    fill(small_state)
    reply = shim(agent, "DEL", "crio-6", netns)
    assert reply.rc == 1 and reply.code == 11, reply
    assert "cni-agent is not running" in reply.out["msg"]
    assert "could not be queued" in reply.out["details"], reply
    assert "No space left on device" in reply.out["details"], reply
    assert queued(agent) == [] and ips(tmp_path) == [ip]
    (small_state / "filler").unlink()
    agent.start()
    assert shim(agent, "DEL", "crio-6", netns).rc == 0  # the runtime's retry
    assert ips(tmp_path) == []


def test_a_queued_del_that_is_not_roots_is_set_aside_never_run(
        agent: Agent, netns: str, tmp_path: Path) -> None:
    """A runtime's CNI call that changes something is root's alone: a file in
    the queue owned by another uid (who asked) is not run, and is kept for a
    person as `.bad`."""
    ip = ip_of(shim(agent, "ADD", "crio-7", netns))
    assert agent.stop() == 0
    assert shim(agent, "DEL", "crio-7", netns).rc == 0
    [request] = queued(agent)
    os.chown(request, 65534, 65534)
    agent.start()
    wait_for(lambda: [p.suffix for p in queued(agent)] == [".bad"], timeout=30)
    wait_for(lambda: "only root's DELs are run" in agent.log())
    assert ips(tmp_path) == [ip]
    assert shim(agent, "CHECK", "crio-7", netns).rc == 0


def test_a_queued_del_that_fails_is_kept_and_run_again_at_the_next_start(
        agent: Agent, control: Control, netns_factory: Callable[[], str], tmp_path: Path) -> None:
    """A plugin's failure of the queued DEL does not lose it: the file stays
    (bound to its generation) and the next start finishes the removal."""
    netns = netns_factory()
    ip_of(shim(agent, "ADD", "crio-8", netns))
    assert agent.stop() == 0
    assert stop_pod(agent, "crio-8", netns).rc == 0
    control.set("DEL", "fail", code=11, msg="the plugin's backend is away")
    agent.start()
    wait_for(lambda: "its file is kept and run again at the next start" in agent.log(), timeout=30)
    assert outcomes(agent)["failed"] == 1
    [kept] = queued(agent)
    assert ".g" in kept.name  # bound: never the DEL of a later set-up of the id
    assert ips(tmp_path) != []
    assert agent.stop() == 0
    control.clear("DEL")
    agent.start()
    wait_for(lambda: not ips(tmp_path), timeout=30)
    wait_for(lambda: not queued(agent), timeout=10)
    # Recovery finishes the removal the failed DEL left (the sandbox was
    # "tearing-down"), and the queued DEL is then found done.
    wait_for(lambda: sum(outcomes(agent).values()) == 1)
    assert outcomes(agent)["gone"] + outcomes(agent)["done"] == 1


@pytest.mark.parametrize(("extra", "queues"), [
    ({}, True),  # absent: true
    ({"queueWhenDown": False}, False),
    ({"queueWhenDown": True}, True),
    # Only the top-level key counts: the runtime's own config nested anywhere is not it.
    ({"runtimeConfig": {"queueWhenDown": False, "x": "\"queueWhenDown\": false"}}, True),
    ({"args": {"cni": {"queueWhenDown": False}}, "queueWhenDown": True}, True),
])
def test_the_shim_reads_queue_when_down_from_its_own_entry_only(
        tmp_path: Path, extra: dict[str, Any], queues: bool) -> None:
    """No agent at all (no socket, no bus): the C shim's look at its conflist."""
    state = tmp_path / "state"
    state.mkdir()
    config = shim_conf(RUNTIME_NET, network="pods", stateDir=str(state), **extra)
    reply = run_shim(f"unix:path={tmp_path}/no-bus", "DEL", config, cid="c1", socket="")
    files = list((state / "queue").glob("*.del")) if (state / "queue").exists() else []
    if queues:
        assert (reply.rc, reply.out, len(files)) == (0, None, 1), reply
        doc = json.loads(files[0].read_text())
        assert json.loads(doc["config"]) == config  # stdin, byte for byte as JSON
    else:
        assert reply.rc == 1 and reply.code == 11 and files == [], reply


def test_a_state_dir_the_shim_cannot_use_fails_the_del_as_before(tmp_path: Path) -> None:
    for state_dir in ("relative/dir", str(tmp_path / "no\\\"where"), str(tmp_path / "absent")):
        reply = run_shim(f"unix:path={tmp_path}/no-bus", "DEL",
                         shim_conf(RUNTIME_NET, stateDir=state_dir), cid="c1", socket="")
        assert reply.rc == 1 and reply.code == 11, (state_dir, reply)
    assert "cannot create" in reply.out["details"] and "absent/queue" in reply.out["details"]


def test_a_queued_del_of_a_record_from_before_generations_is_run(
        agent: Agent, netns_factory: Callable[[], str], tmp_path: Path) -> None:
    """The journal an agent before generations wrote: its record has none.
    The DEL queued for it is run (the record gets a generation first), not
    taken for another set-up of the id."""
    from cni_agent.node.applog import frame, unframe

    netns = netns_factory()
    ip_of(shim(agent, "ADD", "crio-9", netns))
    assert agent.stop() == 0
    journal = Path(agent.config["state_dir"]) / "journal"
    assert not list(journal.glob("snapshot-*"))
    for segment in journal.glob("log-*"):
        lines = []
        for line in segment.read_bytes().splitlines():
            payload = unframe(line)
            assert payload is not None
            doc = json.loads(payload)
            assert isinstance(doc, dict)
            doc.pop("generation", None)
            lines.append(frame(json.dumps(doc).encode()))
        segment.write_bytes(b"".join(lines))
    assert all("generation" not in r for r in journal_records(Path(agent.config["state_dir"]))
               .values())
    assert stop_pod(agent, "crio-9", netns).rc == 0
    agent.start()
    wait_for(lambda: not ips(tmp_path), timeout=30)
    wait_for(lambda: not queued(agent), timeout=10)
    wait_for(lambda: outcomes(agent)["done"] == 1)


def test_a_config_that_is_not_one_json_object_is_not_queued(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    good = json.dumps(shim_conf(RUNTIME_NET, stateDir=str(state)))
    for config in (good[:-1], good + "}", "[" + good + "]", good + " x"):
        reply = run_shim(f"unix:path={tmp_path}/no-bus", "DEL", config, cid="c1", socket="")
        assert reply.rc == 1 and reply.code == 11, (config, reply)
    assert not list(state.glob("queue/*.del"))
    assert run_shim(f"unix:path={tmp_path}/no-bus", "DEL", good + "\n", cid="c1", socket="").rc == 0
