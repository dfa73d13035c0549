"""cni-agent-shim driven exactly as libcni drives a plugin, against a real agent,
the reference plugins and real namespaces: every verb, several networks on one
container, a runtime's GC, readiness, and the error codes a runtime acts on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unique_name
from tests.daemon.conftest import plug
from tests.support.agent import Agent
from tests.support.net import addresses, allocations, delete_link
from tests.support.plugins import Control, conflist, wait_for, write_conf
from tests.support.shim import SHIM, Reply, Way, readable_shim, run_shim, shim_conf, shim_env

pytestmark = pytest.mark.root


@pytest.fixture
def bridges(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Agent networks: bridge + host-local, each with its own bridge and subnet."""
    made: list[str] = []

    def write(name: str, subnet: str, version: str = "1.0.0",
              extra: list[dict[str, Any]] | None = None) -> str:
        br = unique_name("cas")
        made.append(br)
        plugins = [{"type": "bridge", "bridge": br, "isGateway": True, "ipMasq": False,
                    "ipam": {"type": "host-local", "subnet": subnet,
                             "dataDir": str(tmp_path / "ipam")}}, *(extra or [])]
        write_conf(tmp_path / "net.d", f"10-{name}.conflist", conflist(name, plugins, version))
        return name

    yield write
    for br in made:
        delete_link(br)


def ipam(tmp_path: Path, network: str) -> list[str]:
    return allocations(tmp_path / "ipam", network)


def test_the_shim_is_built() -> None:
    assert SHIM.is_file() and os.access(SHIM, os.X_OK), "make builds build/cni-agent-shim"


def test_every_verb_as_libcni_runs_it(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str], netns: str, tmp_path: Path,
) -> None:
    bridges("podnet", "10.241.0.0/24")
    agent = make_agent()
    shim = way.shim(agent)
    conf = shim_conf("pods", "podnet")

    version = shim("VERSION", conf)
    assert version.rc == 0 and "1.1.0" in version.out["supportedVersions"]
    assert shim("STATUS", conf).rc == 0

    add = shim("ADD", conf, cid="ctr1", netns=netns, ifname="eth0",
               args="IgnoreUnknown=1;K8S_POD_NAME=web")
    assert add.rc == 0, add
    assert add.out["cniVersion"] == "1.1.0"
    address = add.out["ips"][0]["address"]
    assert addresses(netns) == [address]
    assert ipam(tmp_path, "podnet") == [address.split("/")[0]]
    assert agent.call("ListSandboxes")[0] == ["ctr1"]
    listed = subprocess.run([sys.executable, "-m", "cni_agent", "--bus", agent.bus.address,
                             "list"],
                            capture_output=True, text=True)
    assert listed.stdout.split() == ["ctr1"], listed.stderr

    check = shim("CHECK", {**conf, "prevResult": add.out}, cid="ctr1", netns=netns)
    assert check.rc == 0 and check.out is None, check

    delete = shim("DEL", {**conf, "prevResult": add.out}, cid="ctr1", netns=netns)
    assert delete.rc == 0 and delete.out is None, delete
    assert addresses(netns) == [] and ipam(tmp_path, "podnet") == []
    assert agent.call("ListSandboxes")[0] == []
    # The spec's DEL rules: again, and with the namespace gone, are successes.
    assert shim("DEL", conf, cid="ctr1", netns=netns).rc == 0
    assert shim("DEL", conf, cid="ctr1", netns="").rc == 0
    # CHECK of what is not there is "unknown container".
    assert shim("CHECK", conf, cid="ctr1", netns=netns).code == 3


def test_the_result_comes_back_in_the_callers_cni_version(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str], netns: str,
) -> None:
    bridges("podnet", "10.242.0.0/24", version="1.0.0")
    agent = make_agent()
    shim = way.shim(agent)
    add = shim("ADD", shim_conf("old", "podnet", "0.3.1"), cid="c",
               netns=netns)
    assert add.rc == 0, add
    assert add.out["cniVersion"] == "0.3.1"
    assert add.out["ips"][0]["version"] == "4"  # the 0.3.x shape
    assert shim("DEL", shim_conf("old", "podnet", "0.3.1"), cid="c",
                netns=netns).rc == 0


def test_several_networks_on_one_container_are_added_and_removed_one_by_one(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str], netns: str, tmp_path: Path,
) -> None:
    bridges("red", "10.243.0.0/24")
    bridges("blue", "10.244.0.0/24")
    agent = make_agent()
    shim = way.shim(agent)
    red, blue = shim_conf("pods-red", "red"), shim_conf("pods-blue", "blue")
    a = shim("ADD", red, cid="ctr", netns=netns, ifname="eth0")
    b = shim("ADD", blue, cid="ctr", netns=netns, ifname="net1")
    assert a.rc == b.rc == 0, (a, b)
    assert len(addresses(netns)) == len(addresses(netns, "net1")) == 1
    shown = json.loads(agent.call("Show", "s", "ctr")[0])
    assert [(x["network"], x["ifname"]) for x in shown["attachments"]] == [
        ("red", "eth0"), ("blue", "net1")]
    # The runtime DELs each network; the other stays until its own DEL.
    assert shim("DEL", red, cid="ctr", netns=netns, ifname="eth0").rc == 0
    assert addresses(netns) == [] and ipam(tmp_path, "red") == []
    assert len(ipam(tmp_path, "blue")) == 1 and len(addresses(netns, "net1")) == 1
    # A DEL from one runtime network never removes what another one made.
    assert shim("DEL", red, cid="ctr", netns=netns, ifname="net1").rc == 0
    assert len(ipam(tmp_path, "blue")) == 1
    assert shim("DEL", blue, cid="ctr", netns=netns, ifname="net1").rc == 0
    assert ipam(tmp_path, "blue") == [] and agent.call("ListSandboxes")[0] == []


def add_pods(agent: Agent, shim: Callable[..., Reply], netns_factory: Callable[[], str],
             *pods: tuple[dict[str, Any], str]) -> dict[str, str]:
    """Each (runtime network's config, container id) ADDed through the shim, then
    "setup" by Setup, each in a namespace of its own: the namespaces, by id."""
    spaces = {cid: netns_factory() for _, cid in pods} | {"setup": netns_factory()}
    for conf, cid in pods:
        assert shim("ADD", conf, cid=cid, netns=spaces[cid]).rc == 0
    agent.setup("setup", spaces["setup"])
    return spaces


def test_gc_removes_only_what_this_runtime_network_made_and_no_longer_lists(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str],
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    bridges("podnet", "10.245.0.0/24")
    agent = make_agent()
    shim = way.shim(agent)
    conf, other = shim_conf("pods", "podnet"), shim_conf("other-runtime", "podnet")
    spaces = add_pods(agent, shim, netns_factory, (conf, "c1"), (conf, "c2"), (conf, "c3"),
                      (other, "c4"))
    assert len(ipam(tmp_path, "podnet")) == 5

    gc = shim("GC", {**conf, "cni.dev/valid-attachments": [
        {"containerID": "c1", "ifname": "eth0"}]})
    assert gc.rc == 0, gc
    assert agent.call("ListSandboxes")[0] == ["c1", "c4", "setup"]
    assert addresses(spaces["c2"]) == addresses(spaces["c3"]) == []
    assert len(ipam(tmp_path, "podnet")) == 3
    # A D-Bus GarbageCollect lists Setup's sandboxes: the runtime's are not its to remove.
    agent.call("GarbageCollect", "as", "0")
    assert agent.call("ListSandboxes")[0] == ["c1", "c4"]
    assert len(addresses(spaces["c1"])) == len(addresses(spaces["c4"])) == 1


def test_a_gc_with_a_null_list_as_crio_sends_at_start_up_with_no_pods_keeps_none_of_its_own(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str],
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    # libcni marshals CRI-O's empty pod list (a Go nil slice) as null, under
    # both keys: the spec's empty list, so every attachment of this runtime
    # network goes, and another runtime's and Setup's stay.
    bridges("podnet", "10.245.1.0/24")
    agent = make_agent()
    shim = way.shim(agent)
    conf, other = shim_conf("crio", "podnet"), shim_conf("other-runtime", "podnet")
    spaces = add_pods(agent, shim, netns_factory, (conf, "c1"), (conf, "c2"), (other, "c3"))

    gc = shim("GC", {**conf, "cni.dev/valid-attachments": None,
                     "cni.dev/attachments": None})
    assert (gc.rc, gc.out) == (0, None), gc
    assert agent.call("ListSandboxes")[0] == ["c3", "setup"]
    assert addresses(spaces["c1"]) == addresses(spaces["c2"]) == []
    assert len(ipam(tmp_path, "podnet")) == 2
    # And a GC with no list at all is the same: nothing of this network is valid.
    assert shim("ADD", conf, cid="c1", netns=spaces["c1"]).rc == 0
    assert shim("GC", conf).rc == 0
    assert agent.call("ListSandboxes")[0] == ["c3", "setup"]


def test_status_follows_readiness_and_a_stopped_agent_is_try_again_later(
    make_agent: Callable[..., Agent], way: Way, testnet: Callable[..., Path], control: Control,
) -> None:
    testnet("podnet")
    agent = make_agent()
    shim = way.shim(agent)
    conf = shim_conf("pods", "podnet")
    assert shim("STATUS", conf).rc == 0
    control.set("STATUS", "fail", code=50, msg="the uplink is down")
    wait_for(lambda: agent.prop("NetworkReady") is False)
    status = shim("STATUS", conf)
    assert status.code == 50 and "the uplink is down" in status.out["msg"], status
    # A STATUS of the default network ("network" absent) is the same answer.
    assert shim("STATUS", shim_conf("pods")).code == 50
    control.clear("STATUS")
    wait_for(lambda: agent.prop("NetworkReady") is True)
    assert shim("STATUS", conf).rc == 0
    unknown = shim("STATUS", shim_conf("pods", "nosuchnet"))
    assert unknown.code == 50 and "network nosuchnet not found" in unknown.out["msg"]

    agent.stop()
    gone = shim("STATUS", conf)
    assert gone.code == 11, gone
    assert gone.out["msg"] == "cni-agent is not running: systemctl start cni-agent"


def test_a_plugins_error_reaches_the_runtime_unchanged_and_nothing_is_left(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str], control: Control,
    netns: str, tmp_path: Path,
) -> None:
    bridges("podnet", "10.246.0.0/24", extra=[plug(control)])
    agent = make_agent()
    shim = way.shim(agent)
    control.set("ADD", "fail", code=7, msg="bad subnet", details="10.0.0.0/33")
    add = shim("ADD", shim_conf("pods", "podnet"), cid="c", netns=netns)
    assert add.rc == 1
    assert (add.out["code"], add.out["msg"], add.out["details"]) == (7, "bad subnet", "10.0.0.0/33")
    assert addresses(netns) == [] and ipam(tmp_path, "podnet") == []  # rolled back
    assert agent.call("ListSandboxes")[0] == []


def test_bad_requests_get_the_specs_codes_and_change_nothing(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str], netns: str, tmp_path: Path,
) -> None:
    bridges("podnet", "10.247.0.0/24")
    agent = make_agent()
    shim = way.shim(agent)
    conf = shim_conf("pods", "podnet")
    cases = [
        (shim("ADD", conf, cid="", netns=netns), 4, "CNI_CONTAINERID is not set"),
        (shim("ADD", conf, cid="c", netns=""), 4, "CNI_NETNS is not set"),
        (shim("ADD", conf, cid="bad/id", netns=netns), 4, "CNI_CONTAINERID"),
        (shim("ADD", conf, cid="c", netns=netns, args="novalue"), 4, "CNI_ARGS"),
        (shim("ADD", conf, cid="c", netns="/etc/hostname"), 4, "CNI_NETNS"),
        (shim("ADD", shim_conf("pods", "nosuchnet"), cid="c", netns=netns), 7,
              "network nosuchnet not found"),
        (shim("ADD", "{not json", cid="c", netns=netns), 6, "not valid JSON"),
        (shim("ADD", shim_conf("pods", "podnet", "0.2.0"), cid="c", netns=netns), 1,
              "cniVersion"),
        (shim("ADD", {**conf, "prevResult": {"cniVersion": "1.1.0"}}, cid="c",
              netns=netns), 7, "first plugin"),
    ]
    for reply, code, text in cases:
        assert reply.rc == 1 and reply.code == code and text in reply.out["msg"], reply
    assert agent.call("ListSandboxes")[0] == [] and ipam(tmp_path, "podnet") == []


def test_callers_outside_the_group_may_ask_status_but_not_add(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str], netns: str,
    tmp_path: Path, open_dir: Path,
) -> None:
    bridges("podnet", "10.248.0.0/24")
    agent = make_agent(runtime_dir=str(open_dir))  # its socket: anyone may connect
    shim = way.shim(agent)
    binary = readable_shim()
    conf = shim_conf("pods", "podnet")
    assert shim("STATUS", conf, user="nobody", binary=binary).rc == 0
    add = shim("ADD", conf, cid="c", netns=netns, user="nobody", binary=binary)
    # The agent refused it, and says why: a runtime's ADD is root's, whatever the groups.
    assert add.code == 999 and add.out["msg"] == (
        "access denied by cni-agent: CNICall is for runtimes running as root; use Setup or "
        "Attach with netns_fd"), add
    assert ipam(tmp_path, "podnet") == [] and agent.call("ListSandboxes")[0] == []


def test_an_agent_network_that_contains_the_shim_is_refused(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str], tmp_path: Path,
) -> None:
    bridges("podnet", "10.249.0.0/24")
    write_conf(tmp_path / "net.d", "05-loop.conflist",
               conflist("loop", [{"type": "cni-agent-shim", "network": "podnet"}]))
    (tmp_path / "bin").mkdir(exist_ok=True)
    os.symlink(SHIM, tmp_path / "bin" / "cni-agent-shim")
    agent = make_agent()
    shim = way.shim(agent)
    assert agent.prop("Networks") == ["podnet"]
    assert "would call itself" in agent.prop("Status")
    assert shim("STATUS", shim_conf("x", "loop")).code == 50


def test_a_runtime_that_kills_the_shim_mid_add_leaves_a_whole_attachment_or_none(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str], control: Control,
    netns: str, tmp_path: Path,
) -> None:
    bridges("podnet", "10.250.0.0/24", extra=[plug(control)])
    agent = make_agent()
    shim = way.shim(agent)
    control.set("ADD", "succeed", sleep=1.5)
    env = {**shim_env("", "ADD", cid="c", netns=netns), **way.env(agent)}
    proc = subprocess.Popen([str(SHIM)], stdin=subprocess.PIPE, env=env, text=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(shim_conf("pods", "podnet")))
    proc.stdin.close()
    wait_for(lambda: "ADD" in control.commands(), timeout=10)
    proc.send_signal(signal.SIGKILL)  # the runtime's timeout
    proc.wait()
    # The agent finishes the ADD it started: the attachment is whole, and the
    # runtime's DEL (it DELs after a failed ADD) removes it completely.
    wait_for(lambda: shown_state(agent, "c") == "ready", timeout=15)
    assert len(addresses(netns)) == 1 and len(ipam(tmp_path, "podnet")) == 1
    control.clear("ADD")
    assert shim("DEL", shim_conf("pods", "podnet"), cid="c", netns=netns).rc == 0
    assert addresses(netns) == [] and ipam(tmp_path, "podnet") == []
    assert agent.call("ListSandboxes")[0] == []
    assert not list((tmp_path / "run" / "locks").glob("*"))


def shown_state(agent: Agent, sid: str) -> str | None:
    out = agent.busctl("--json=short", "call", "org.cniagent.Agent1", "/org/cniagent/Agent1",
                       "org.cniagent.Agent1", "Show", "s", sid, check=False)
    return json.loads(json.loads(out.stdout)["data"][0])["state"] if out.returncode == 0 else None


def test_a_runtimes_del_after_an_agent_restart_still_finds_what_its_add_made(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str], netns: str, tmp_path: Path,
) -> None:
    bridges("podnet", "10.251.0.0/24")
    agent = make_agent()
    shim = way.shim(agent)
    conf = shim_conf("pods", "podnet")
    assert shim("ADD", conf, cid="c", netns=netns).rc == 0
    agent.stop()
    agent.start()
    # The runtime network that made it is in the record: its DEL and GC still match.
    assert shim("DEL", shim_conf("other", "podnet"), cid="c", netns=netns).rc == 0
    assert len(ipam(tmp_path, "podnet")) == 1
    assert shim("DEL", conf, cid="c", netns=netns).rc == 0
    assert ipam(tmp_path, "podnet") == [] and addresses(netns) == []
    assert agent.call("ListSandboxes")[0] == []


def test_an_oversize_config_is_refused_whole_with_code_7_even_when_multibyte(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str], netns: str, tmp_path: Path,
) -> None:
    bridges("podnet", "10.252.0.0/24")
    agent = make_agent()
    shim = way.shim(agent)
    conf = shim_conf("pods", "podnet")
    # 600 000 characters, 1.2 MB: cut at 1 MiB in bytes it would split a
    # UTF-8 sequence and read as "not valid UTF-8" or "not valid JSON".
    big = json.dumps({**conf, "note": "é" * 600_000}, ensure_ascii=False)
    assert len(big) < 1024 * 1024 < len(big.encode())
    reply = shim("ADD", big, cid="c", netns=netns)
    assert reply.rc == 1 and reply.code == 7, reply
    assert reply.out["msg"] == "the network configuration is larger than 1048576 bytes"
    # Just under the bound, the same multibyte config reaches the agent and works.
    fits = json.dumps({**conf, "note": "é" * 500_000}, ensure_ascii=False)
    assert len(fits.encode()) < 1024 * 1024
    assert shim("ADD", fits, cid="c", netns=netns).rc == 0
    assert len(ipam(tmp_path, "podnet")) == 1
    assert shim("DEL", fits, cid="c", netns=netns).rc == 0
    assert ipam(tmp_path, "podnet") == []


def test_an_agent_killed_mid_call_is_try_again_later_and_the_retry_finds_it_whole(
    make_agent: Callable[..., Agent], way: Way, bridges: Callable[..., str], control: Control,
    netns: str, tmp_path: Path,
) -> None:
    bridges("podnet", "10.253.0.0/24", extra=[plug(control)])
    agent = make_agent()
    shim = way.shim(agent)
    control.set("ADD", "succeed", sleep=3)
    conf = shim_conf("pods", "podnet")
    env = {**shim_env("", "ADD", cid="c", netns=netns), **way.env(agent)}
    proc = subprocess.Popen([str(SHIM)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                            text=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(conf))
    proc.stdin.close()
    wait_for(lambda: "ADD" in control.commands(), timeout=10)
    agent.stop(signal.SIGKILL)  # a crash, or systemd's SIGKILL at TimeoutStopSec
    assert proc.stdout is not None
    proc.wait(timeout=10)
    reply = json.loads(proc.stdout.read())
    assert proc.returncode == 1 and reply["code"] == 11, reply  # a runtime retries on 11
    assert reply["msg"] == "cni-agent went away during the call: see journalctl -u cni-agent"
    # The details say which way: the bus's NoReply, or the socket's early end.
    assert reply["details"] == (
        f"the agent's socket {agent.shim_socket}: Connection reset by peer" if way.name == "socket"
        else reply["details"]), reply
    assert way.name == "socket" or "org.freedesktop.DBus.Error.NoReply" in reply["details"]
    # The next start rolls the half-done ADD back; the runtime's retry then works.
    control.clear("ADD")
    agent.start()
    assert shim("ADD", conf, cid="c", netns=netns).rc == 0
    assert len(addresses(netns)) == 1 and len(ipam(tmp_path, "podnet")) == 1
    assert shim("DEL", conf, cid="c", netns=netns).rc == 0
    assert addresses(netns) == [] and ipam(tmp_path, "podnet") == []


def test_no_system_bus_is_try_again_later_with_the_address_and_errno(tmp_path: Path) -> None:
    address = f"unix:path={tmp_path}/no-bus-here"
    reply = run_shim(address, "STATUS", shim_conf("pods"))
    assert reply.rc == 1 and reply.code == 11, reply
    assert reply.out["msg"] == "cni-agent is not running: systemctl start cni-agent"
    assert reply.out["details"] == (
        f"cannot connect to the system bus at {address}: No such file or directory")
