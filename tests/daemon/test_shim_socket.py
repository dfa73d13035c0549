"""The shim's own socket (runtime_dir/shim.sock): the same call as CNICall on the
bus, with the same answers, bounds and shutdown behaviour, and every request
answered, a malformed or stalled one too.

Real parts: the shim exec'd as libcni execs it, the agent as a process, the
reference plugins and the test plugin, real users (nobody, a member made by
the test) connecting from processes of their own. Where a test means the
socket, the shim has no bus behind it (tests.support.shim.NO_BUS): a shim that
fell back to the bus would fail.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.conftest import bridge_plugins
from tests.support.agent import Agent, as_member, as_user
from tests.support.plugins import Control, conflist, wait_for, write_conf
from tests.support.shim import (
    MAGIC,
    NO_BUS,
    SHIM,
    Answer,
    Way,
    exchange,
    frame,
    read_answer,
    readable_shim,
    run_shim,
    shim_conf,
    shim_env,
)
from tests.support.stranger import idle_fds, settle_fds

pytestmark = pytest.mark.root
ERR = "org.cniagent.Agent1.Error."
STATUS = {"CNI_COMMAND": "STATUS", "CNI_PATH": "/usr/lib/cni"}


@pytest.fixture
def podnet(tmp_path: Path, control: Control, bridge_name: str) -> str:
    """The agent's network "podnet": bridge + host-local, then the test plugin."""
    write_conf(tmp_path / "net.d", "10-podnet.conflist", conflist(
        "podnet", bridge_plugins(tmp_path, control, bridge_name, "10.216.0.0/24"), "1.0.0"))
    return "podnet"


# A client of the socket, for another user's process (the system python3).
CLIENT = """
import asyncio, json, socket, struct, sys
MAGIC = b"CNA1"
def frame(env, config):
    data = b"".join(f"{k}={v}".encode() + b"\\0" for k, v in env.items())
    return MAGIC + struct.pack(">I", len(data)) + data + struct.pack(">I", len(config)) + config
async def ask(path, data):
    # As the shim does: a write cut short (answered early) still has its answer to read.
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setblocking(False)
        await loop.sock_connect(s, path)
        try:
            await loop.sock_sendall(s, data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        buf = b""
        while len(buf) < 16 or len(buf) < 16 + sum(struct.unpack(">II", buf[8:16])):
            chunk = await loop.sock_recv(s, 65536)
            if not chunk:
                raise EOFError(buf)
            buf += chunk
    _, status, n, t = struct.unpack(">4sIII", buf[:16])
    return status, buf[16:16 + n].decode(), buf[16 + n:16 + n + t].decode()
"""


def as_user_python(user: str, body: str, *args: str, timeout: float = 120) -> str:
    """CLIENT and `body` run by the system python3 as `user`; its stdout."""
    p = subprocess.run([*as_user(user), "/usr/bin/python3", "-I", "-c",
                        CLIENT + textwrap.dedent(body), *args],
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_both_ways_give_the_same_answers_to_every_case(
    make_agent: Callable[..., Agent], podnet: str, netns: str, member: str, open_dir: Path,
    tmp_path: Path,
) -> None:
    """Each case through the shim on the socket (no bus behind it) and on the bus
    (the socket absent): the same exit status and the same stdout, byte for byte."""
    agent = make_agent(runtime_dir=str(open_dir), access={"groups": [member]})
    binary = readable_shim()
    conf = shim_conf("pods", podnet)
    by = {name: Way(name, tmp_path / "no-agent-here.sock") for name in ("socket", "bus")}
    many = {f"CNI_X{i}": "x" for i in range(70)}
    cases: list[tuple[str, str, Any, dict[str, Any]]] = [
        ("root", "STATUS", conf, {}),
        ("root", "STATUS", shim_conf("pods", "nosuchnet"), {}),
        ("root", "ADD", conf, {"cid": "", "netns": netns}),
        ("root", "ADD", conf, {"cid": "bad/id", "netns": netns}),
        ("root", "ADD", conf, {"cid": "c", "netns": netns, "args": "novalue"}),
        ("root", "ADD", "{not json", {"cid": "c", "netns": netns}),
        ("root", "ADD", shim_conf("pods", podnet, "0.2.0"), {"cid": "c", "netns": netns}),
        ("root", "ADD", {**conf, "prevResult": {}}, {"cid": "c", "netns": netns}),
        ("root", "ADD", shim_conf("pods", "nosuchnet"), {"cid": "c", "netns": netns}),
        ("root", "CHECK", conf, {"cid": "nothing", "netns": netns}),
        ("root", "DEL", conf, {"cid": "nothing", "netns": netns}),
        ("root", "GC", {**conf, "cni.dev/valid-attachments": "no"}, {}),
        ("root", "NOSUCHVERB", conf, {}),
        ("root", "STATUS", conf, {"env": many}),  # more than 64 variables
        # Refused by the shim itself, before either way: the same words.
        ("root", "ADD", b'{"cniVersion": "1.1.0", "name": "\xff"}', {"cid": "c", "netns": netns}),
        ("root", "ADD", json.dumps(conf)[:-1] + ', "x": "\ufffe"}', {"cid": "c", "netns": netns}),
        ("root", "ADD", json.dumps(conf) + "\0", {"cid": "c", "netns": netns}),
        ("root", "ADD", json.dumps({**conf, "x": "y" * (1 << 20)}), {"cid": "c", "netns": netns}),
        ("nobody", "STATUS", conf, {}),
        ("nobody", "VERSION", conf, {}),
        ("nobody", "ADD", conf, {"cid": "c", "netns": netns}),
        ("nobody", "GC", conf, {}),
        ("nobody", "STATUS", json.dumps({**conf, "x": "y" * 100_000}), {}),
        ("member", "ADD", conf, {"cid": "c", "netns": netns}),
        ("member", "STATUS", json.dumps({**conf, "x": "y" * 100_000}), {}),
    ]
    for who, command, stdin, kw in cases:
        kw = dict(kw)
        extra = kw.pop("env", {})
        got: dict[str, tuple[int, str]] = {}
        for name, way in by.items():
            env = {**way.env(agent), **extra}
            if who == "root":
                prefix: list[str] = []
            else:
                user = member if who == "member" else "nobody"
                prefix = as_member(user) if who == "member" else as_user(user)
            data = stdin if isinstance(stdin, str | bytes) else json.dumps(stdin)
            p = subprocess.run([*prefix, binary], input=data.encode() if isinstance(data, str)
                               else data, capture_output=True, timeout=60,
                               env={**shim_env("", command, **kw), **env})
            got[name] = (p.returncode, p.stdout.decode(errors="replace"))
        assert got["socket"] == got["bus"], (who, command, kw, got)
        assert got["socket"][1] or command in ("DEL", "STATUS"), (who, command, got)
    # What the cases expect of each caller, once (the same on both ways, above).
    assert agent.call("ListSandboxes")[0] == []


def test_a_caller_outside_the_group_reads_over_the_socket_but_never_adds(
    make_agent: Callable[..., Agent], podnet: str, netns: str, open_dir: Path, tmp_path: Path,
) -> None:
    agent = make_agent(runtime_dir=str(open_dir))
    binary = readable_shim()
    conf = shim_conf("pods", podnet)
    status = run_shim(NO_BUS, "STATUS", conf, socket=str(agent.shim_socket), user="nobody",
                      binary=binary)
    assert (status.rc, status.out) == (0, None), status
    add = run_shim(NO_BUS, "ADD", conf, cid="c", netns=netns, socket=str(agent.shim_socket),
                   user="nobody", binary=binary)
    assert add.code == 999 and add.out["msg"] == (
        "access denied by cni-agent: CNICall is for runtimes running as root; use Setup or "
        "Attach with netns_fd"), add
    assert agent.call("ListSandboxes")[0] == [] and not (tmp_path / "ipam").exists()


def test_a_strangers_flood_over_the_socket_is_bounded_and_root_is_still_served(
    make_agent: Callable[..., Agent], podnet: str, netns_factory: Callable[[], str],
    open_dir: Path, tmp_path: Path,
) -> None:
    agent = make_agent(runtime_dir=str(open_dir))
    assert agent.proc is not None
    baseline = idle_fds(agent.proc.pid)
    flood = subprocess.Popen(
        [*as_user("nobody"), "/usr/bin/python3", "-I", "-c", CLIENT + textwrap.dedent("""
            async def main():
                path, request = sys.argv[1], frame({"CNI_COMMAND": "STATUS"},
                    b'{"cniVersion": "1.1.0", "name": "pods"}')
                answers = []
                for _ in range(15):  # 15 rounds of 40 connections at once
                    answers += await asyncio.gather(*(ask(path, request) for _ in range(40)))
                print(json.dumps([[s, n, t] for s, n, t in answers]))
            asyncio.run(main())
            """), str(agent.shim_socket)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        shim = Way("socket", tmp_path / "absent").shim(agent)
        for i in range(3):  # root's pods meanwhile, as ever
            ns = netns_factory()
            add = shim("ADD", shim_conf("pods", podnet), cid=f"r{i}", netns=ns)
            assert add.rc == 0, add
            assert shim("DEL", shim_conf("pods", podnet), cid=f"r{i}", netns=ns).rc == 0
        out, err = flood.communicate(timeout=120)
    finally:
        flood.kill()
    answers = json.loads(out or "null")
    assert answers is not None, err
    names = [name for _s, name, _t in answers]
    ok, busy = names.count(""), names.count(ERR + "Busy")
    assert len(answers) == 600 and ok + busy == 600, (set(names), err)  # every one answered
    print(f"stranger's flood: {ok} served, {busy} Busy")
    assert busy > 0 and ok >= 60, (ok, busy)  # its burst served, the rest Busy
    texts = {text for _s, name, text in answers if name}
    assert any("connections at once per uid" in t for t in texts), texts
    assert any("calls per second from this uid" in t for t in texts), texts
    assert settle_fds(agent.proc.pid, baseline) <= baseline
    assert agent.call("ListSandboxes")[0] == []
    assert "Traceback" not in agent.log()


def test_malformed_and_oversize_requests_are_answered_and_change_nothing(
    make_agent: Callable[..., Agent], podnet: str, open_dir: Path,
) -> None:
    agent = make_agent(runtime_dir=str(open_dir))
    assert agent.proc is not None
    path = agent.shim_socket
    baseline = idle_fds(agent.proc.pid)
    u32 = struct.Struct(">I").pack
    status_env = b"CNI_COMMAND=STATUS\0"
    cases = [
        (b"GET / HTTP/1.0\r\n\r\n", "request: not a cni-agent-shim request (it must begin with "
                                    "CNA1)"),
        (MAGIC + u32(3) + b"A=B" + u32(0), "environment: each KEY=VALUE entry must end with a "
                                           "NUL byte"),
        (MAGIC + u32(6) + b"NOVAL\0" + u32(0), "environment: 'NOVAL' is not KEY=VALUE"),
        (MAGIC + u32(8) + b"CNI_X=\xff\0" + u32(0), "request: the environment is not valid "
                                                   "UTF-8"),
        (MAGIC + u32(len(status_env)) + status_env + u32(2) + b"\xc3(",
         "request: the configuration is not valid UTF-8"),
        # Lengths beyond the bounds: answered without reading what they announce.
        (MAGIC + u32(10 << 20), "environment: larger than 65536 bytes"),
        (MAGIC + u32(len(status_env)) + status_env + u32(2 << 20),
         "config: larger than 1048576 bytes"),
        (frame({f"CNI_X{i}": "x" for i in range(65)}, "{}"), "environment: more than 64 "
                                                              "variables"),
    ]
    for data, text in cases:
        answer = exchange(path, data)
        assert (answer.status, answer.name, answer.text) == (0, ERR + "InvalidArgument", text), (
            data[:40], answer)
    # A request that ends early (the client shut its side) is answered too.
    answer = exchange(path, MAGIC + u32(100) + b"CNI_COMMAND", shut=True)
    assert (answer.name, answer.text) == (
        ERR + "InvalidArgument", "request: it ended after 19 bytes, before its end"), answer
    # A stranger's config over 64 KiB: refused unread, as on the bus, and promptly.
    out = as_user_python("nobody", """
        print(json.dumps(asyncio.run(ask(sys.argv[1], MAGIC + struct.pack(">I", 19)
              + b"CNI_COMMAND=STATUS\\0" + struct.pack(">I", 1 << 20)))))
        """, str(path))
    assert json.loads(out) == [0, ERR + "InvalidArgument", "config: larger than 65536 bytes (the "
                               "limit for callers neither root nor in the access group)"]
    # And none of it changed anything or kept a descriptor.
    assert settle_fds(agent.proc.pid, baseline) <= baseline
    assert agent.call("ListSandboxes")[0] == []
    assert exchange(path, frame(STATUS, json.dumps(shim_conf("pods", podnet)))) == Answer(0, "", "")
    assert "Traceback" not in agent.log()


def test_a_client_that_never_writes_is_answered_in_time_and_its_descriptor_goes(
    make_agent: Callable[..., Agent], podnet: str, control: Control, netns: str,
    open_dir: Path, tmp_path: Path,
) -> None:
    agent = make_agent(runtime_dir=str(open_dir))
    assert agent.proc is not None
    baseline = idle_fds(agent.proc.pid)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.settimeout(30)
        silent.connect(str(agent.shim_socket))
        # Meanwhile a runtime's ADD is served, and its plugins inherit nothing of ours.
        control.update(record_fds=True)
        shim = Way("socket", tmp_path / "absent").shim(agent)
        assert shim("ADD", shim_conf("pods", "podnet"), cid="c", netns=netns).rc == 0
        assert [r["proc_fds"] for r in control.records() if r["command"] == "ADD"] == [[0, 1, 2]]
        assert shim("DEL", shim_conf("pods", "podnet"), cid="c", netns=netns).rc == 0
        answer = read_answer(silent)  # after READ_TIMEOUT (5 s)
    assert (answer.name, answer.text) == (
        ERR + "Timeout", "the request did not arrive whole within 5s"), answer
    assert settle_fds(agent.proc.pid, baseline) <= baseline

    # Idle connections at a stop: each answered ShuttingDown at once, none holds it up.
    idle = []
    for _ in range(4):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(str(agent.shim_socket))
        idle.append(s)
    try:
        assert agent.stop() == 0
        answers = [read_answer(s) for s in idle]
    finally:
        for s in idle:
            s.close()
    assert {(a.name, a.text) for a in answers} == {(ERR + "ShuttingDown",
                                                   "cni-agent is shutting down")}
    assert not agent.shim_socket.exists()


def test_a_client_that_stops_reading_is_dropped_and_others_are_served(
    make_agent: Callable[..., Agent], podnet: str, control: Control, netns: str,
    open_dir: Path, tmp_path: Path,
) -> None:
    agent = make_agent(runtime_dir=str(open_dir))
    assert agent.proc is not None
    baseline = idle_fds(agent.proc.pid)
    # An answer far larger than the socket's buffer: a plugin's error, passed on whole.
    control.set("ADD", "fail", code=7, msg="big", details="d" * 2_000_000)
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c", "CNI_NETNS": netns, "CNI_IFNAME": "eth0"}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
        stalled.connect(str(agent.shim_socket))
        stalled.sendall(frame(env, json.dumps(shim_conf("pods", podnet))))
        wait_for(lambda: "ADD" in control.commands(), timeout=10)
        # The agent is not stuck on it: a runtime's STATUS is answered meanwhile.
        shim = Way("socket", tmp_path / "absent").shim(agent)
        assert shim("STATUS", shim_conf("pods", podnet)).rc == 0
        # After WRITE_TIMEOUT (5 s) the agent drops it and its descriptor.
        assert settle_fds(agent.proc.pid, baseline, timeout=20) <= baseline
        stalled.settimeout(10)
        data = b""
        while chunk := stalled.recv(1 << 20):
            data += chunk
    assert data[:4] == MAGIC and len(data) < 2_000_000  # cut short: the rest was dropped
    assert agent.call("ListSandboxes")[0] == []  # the failed ADD was rolled back all the same


def test_the_shim_falls_back_to_the_bus_when_the_socket_is_stale_or_cannot_carry_the_call(
    make_agent: Callable[..., Agent], podnet: str, tmp_path: Path,
) -> None:
    agent = make_agent()
    conf = shim_conf("pods", podnet)
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))  # a socket file nobody listens on: ECONNREFUSED
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for path in (stale, a_file, tmp_path / "absent.sock", tmp_path / "a-file" / "below"):
        assert run_shim(agent.bus.address, "STATUS", conf, socket=str(path)).rc == 0, path
        gone = run_shim(NO_BUS, "STATUS", conf, socket=str(path))
        assert gone.code == 11 and "cannot connect to the system bus" in gone.out["details"]
    # An environment larger than the socket takes goes by the bus, which carries it.
    huge = {"CNI_PATH": "/usr/lib/cni:" + "x" * 70_000}
    assert run_shim(agent.bus.address, "STATUS", conf, socket=str(agent.shim_socket),
                    env=huge).rc == 0
    assert run_shim(NO_BUS, "STATUS", conf, socket=str(agent.shim_socket), env=huge).code == 11
    # "": the bus alone, even with the agent's socket there.
    assert agent.shim_socket.exists()
    assert run_shim(NO_BUS, "STATUS", conf, socket="").code == 11


def test_the_socket_is_open_to_all_replaced_after_a_crash_and_gone_after_a_stop(
    make_agent: Callable[..., Agent], podnet: str, netns: str,
) -> None:
    agent = make_agent()
    path = agent.shim_socket
    assert path.is_socket() and path.stat().st_mode & 0o777 == 0o666
    assert agent.stop(signal.SIGKILL) != 0
    assert path.is_socket()  # left behind: a connect is refused, the shim takes the bus
    assert run_shim(NO_BUS, "STATUS", shim_conf("pods", podnet), socket=str(path)).code == 11
    agent.start()
    assert agent.call("WaitReady", "d", "10")[0] is True
    assert run_shim(NO_BUS, "STATUS", shim_conf("pods", podnet), socket=str(path)).rc == 0
    assert agent.stop() == 0
    assert not path.exists()


def test_a_call_in_flight_over_the_socket_holds_the_stop_until_it_is_answered(
    make_agent: Callable[..., Agent], podnet: str, control: Control, netns: str,
    tmp_path: Path,
) -> None:
    agent = make_agent(shutdown_drain=0)
    assert agent.proc is not None
    control.set("ADD", "succeed", sleep=2.0)
    env = {**shim_env(NO_BUS, "ADD", cid="c", netns=netns, socket=str(agent.shim_socket))}
    proc = subprocess.Popen([str(SHIM)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(shim_conf("pods", podnet)).encode())
    proc.stdin.close()
    wait_for(lambda: "ADD" in control.commands(), timeout=10)
    agent.proc.send_signal(signal.SIGTERM)
    # The ADD is counted in flight, as over the bus: it ends, then the agent does.
    assert proc.wait(30) == 0
    result = json.loads(proc.stdout.read())
    assert result["ips"], result
    assert agent.proc.wait(30) == 0
    assert "waiting for 1 request(s) in flight" in agent.log()
    agent.start()
    shim = Way("socket", tmp_path / "absent").shim(agent)
    assert shim("DEL", shim_conf("pods", podnet), cid="c", netns=netns).rc == 0
    assert agent.call("ListSandboxes")[0] == []

