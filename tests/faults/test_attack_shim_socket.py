"""Descriptors passed to the shim's socket (runtime_dir/shim.sock) by a caller
outside the access group are never the agent's to keep.

The socket is open to every local user (mode 0666), so `nobody` may send
SCM_RIGHTS ancillary data with anything it writes: 16 descriptors (half
/dev/null, half pipe ends) with every sendmsg, over 50 connections, and with
several sendmsg calls on one connection, a valid request frame or bytes that
are none. The agent reads the stream with plain recv, so the kernel must drop
them; an agent that took them in (recvmsg with room for them) and kept them
would run out of descriptors at the hands of any local user.

Afterwards: the agent holds what it held before, every request was answered
(or, where the client went on writing after it, its connection ended) within
the client's socket timeout, root's ADD and DEL through the shim work, and no
plugin run inherited a descriptor.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faults.test_descriptor_flood import inherited
from tests.support.agent import Agent, as_user
from tests.support.plugins import Control
from tests.support.shim import Way, frame, shim_conf
from tests.support.stranger import fd_targets, idle_fds, settle_fds

pytestmark = pytest.mark.root

ERR = "org.cniagent.Agent1.Error."
CONNECTIONS = 50  # one sendmsg with descriptors each
PIECES = 5  # sendmsg calls, each with descriptors, on one connection
CLIENT_TIMEOUT = 8.0  # seconds a client waits on any one step: no answer within it is a hang
FDS = 16

# nobody's process (the system python3): argv = socket path, the request (hex);
# one JSON line out per connection: its kind and what became of it.
WORKER = r"""
import json, os, socket, struct, sys
path, request = sys.argv[1], bytes.fromhex(sys.argv[2])
fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(FDS // 2)]
for _ in range(FDS // 4):
    fds += os.pipe()
rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]

def answer(s):
    buf = b""
    while len(buf) < 16 or len(buf) < 16 + sum(struct.unpack(">II", buf[8:16])):
        chunk = s.recv(65536)
        if not chunk:
            return {"closed": len(buf)}
        buf += chunk
    status, n, t = struct.unpack(">III", buf[4:16])
    return {"magic": buf[:4].decode("latin1"), "status": status, "name": buf[16:16 + n].decode(),
            "text": buf[16 + n:16 + n + t].decode()[:200]}

def run(kind, pieces, shut=True, read=True):
    out = {"kind": kind, "passed": 0}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(CLIENT_TIMEOUT)
        try:
            s.connect(path)
            for piece in pieces:
                try:
                    s.sendmsg([piece], rights)
                except (BrokenPipeError, ConnectionResetError):
                    break  # answered (and closed) before it took it all
                out["passed"] += 1
            if shut:
                try:
                    s.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            if read:
                out.update(answer(s))
        except socket.timeout:
            out["error"] = "timeout"
        except OSError as e:
            out["error"] = repr(e)
    print(json.dumps(out), flush=True)

third = len(request) // 3
for i in range(CONNECTIONS):
    if i % 2:
        run("frame", [request])
    else:
        run("junk", [b"\x00junk, not a frame"])
# Several sendmsg calls on one connection.
step = -(-len(request) // PIECES)
run("frame in pieces", [request[i:i + step] for i in range(0, len(request), step)])
run("junk in pieces", [b"CNA"] + [b"\xff" * 8] * (PIECES - 1))
run("frame, then more", [request] + [b"more"] * (PIECES - 1), shut=False)
run("frame cut short", [request[:third], request[third:2 * third]])
run("cut short, then gone", [request[:third], request[third:2 * third]], shut=False, read=False)
"""
WORKER = (f"CONNECTIONS, PIECES, CLIENT_TIMEOUT, FDS = {CONNECTIONS}, {PIECES}, {CLIENT_TIMEOUT}, "
          f"{FDS}\n" + WORKER)

# What each kind must get: the error names accepted ("" is the plugin's answer).
# Busy: the stranger's rate, should the agent count earlier calls against it.
EXPECTED = {
    "frame": {"", ERR + "Busy"},
    "junk": {ERR + "InvalidArgument", ERR + "Busy"},
    "frame in pieces": {"", ERR + "Busy"},
    "junk in pieces": {ERR + "InvalidArgument", ERR + "Busy"},
    "frame, then more": {"", ERR + "Busy"},
    "frame cut short": {ERR + "InvalidArgument", ERR + "Busy"},
}


def test_a_strangers_descriptors_sent_to_the_socket_are_never_kept(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    open_dir: Path, netns: str, tmp_path: Path,
) -> None:
    testnet()
    control.update(record_fds=True)
    agent = make_agent(runtime_dir=str(open_dir))
    assert agent.proc is not None
    pid = agent.proc.pid
    baseline = idle_fds(pid)
    request = frame({"CNI_COMMAND": "STATUS", "CNI_PATH": "/usr/lib/cni"},
                    json.dumps(shim_conf("pods", "testnet")))

    worker = subprocess.run(
        [*as_user("nobody"), "/usr/bin/python3", "-I", "-c", WORKER, str(agent.shim_socket),
         request.hex()], capture_output=True, text=True, timeout=60)
    assert worker.returncode == 0, worker.stderr
    results = [json.loads(line) for line in worker.stdout.splitlines()]

    print("\n".join(sorted({f"{r['kind']}: {r.get('name', r.get('closed', r.get('error')))!r} "
                             f"({r['passed']} sendmsg)" for r in results})))
    problems = []
    assert len(results) == CONNECTIONS + 5, worker.stdout
    for r in results:
        if "error" in r:  # a timeout is a hang; nothing else may go wrong
            problems.append(f"{r['kind']}: {r['error']}")
        elif r["kind"] == "cut short, then gone":
            pass  # it left without reading
        elif "closed" in r:
            problems.append(f"{r['kind']}: the connection ended after {r['closed']} bytes, unanswered")
        elif r["magic"] != "CNA1" or r["name"] not in EXPECTED[r["kind"]]:
            problems.append(f"{r['kind']}: answered {r['name']!r}: {r['text']}")
        if r["passed"] == 0:  # the descriptors must have reached the socket at least once
            problems.append(f"{r['kind']}: no sendmsg got through: {r}")
    assert agent.proc.poll() is None, f"the agent exited {agent.proc.returncode}:\n{agent.log()[-3000:]}"
    left = settle_fds(pid, baseline)
    if left > baseline:
        problems.append(f"the agent holds {left} descriptors, {baseline} before; "
                        f"most: {fd_targets(pid).most_common(3)}")

    # Root's pod through the shim on the socket (no bus behind it), as ever.
    shim = Way("socket", tmp_path / "absent").shim(agent)
    add = shim("ADD", shim_conf("pods", "testnet"), cid="rootpod", netns=netns)
    if add.rc != 0:
        problems.append(f"root's ADD failed afterwards: {add}")
    delete = shim("DEL", shim_conf("pods", "testnet"), cid="rootpod", netns=netns)
    if delete.rc != 0:
        problems.append(f"root's DEL failed afterwards: {delete}")
    if "ADD" not in control.commands():
        problems.append("root's ADD ran no plugin")
    if runs := inherited(control):
        problems.append(f"{len(runs)} plugin runs inherited descriptors, e.g. {runs[0]}")
    if "Traceback" in agent.log():
        problems.append("a traceback in the agent's log")
    if problems:
        problems.append(f"agent log, last lines:\n{agent.log()[-2000:]}")
    assert not problems, "\n".join(problems)
    assert agent.call("ListSandboxes")[0] == []
