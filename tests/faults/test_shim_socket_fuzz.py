"""A fuzz of the shim's socket (runtime_dir/shim.sock), as a caller that is not root.

Hypothesis, in this (root) process, makes the requests: well-formed frames with
odd environments and configurations (the verbs, made-up variables, odd
unicode, sizes past a stranger's 64 KiB), frames whose lengths lie, frames cut
short, and bytes that are no frame at all. `nobody` sends them from a process
of its own, one connection each, ending its side after the request (so a
request cut short is answered at once, not after the read timeout), and at a
pace under its rate (else most answers would be the tarpit's Busy).
Reproducible: derandomized, no example database, a fixed number of examples.

Every request gets a reply that is whole and names no unexpected error.
Afterwards the agent is alive, holds the descriptors it held before, has not
grown by more than RSS_GROWTH, has logged no traceback, and serves root.
"""

from __future__ import annotations

import base64
import collections
import json
import struct
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.support.agent import Agent, as_user
from tests.support.shim import MAGIC, NO_BUS, frame, run_shim, shim_conf
from tests.support.stranger import idle_fds, rss_kib, settle_fds

pytestmark = pytest.mark.root

EXAMPLES = 150
RSS_GROWTH = 20 * 1024  # KiB
ERR = "org.cniagent.Agent1.Error."
# What a stranger may be answered: a plugin's answer ("") or one of these.
EXPECTED = {"", ERR + "InvalidArgument", ERR + "AccessDenied", ERR + "Busy"}
KEYS = ["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH"]
WORDS = ["STATUS", "VERSION", "ADD", "DEL", "CHECK", "GC", "", "eth0", "/proc/1/ns/net",
         "/run/netns/x", "IgnoreUnknown=1;K8S_POD_NAME=x", "ｓbx", "\u202eevil", "\U0001f600" * 20,
         "a=b=c", "\x7f\x01\x1b[2J"]
CONFIGS = ['{"cniVersion": "1.1.0", "name": "pods", "network": "testnet"}',
           '{"cniVersion": "1.1.0", "name": "pods", "cni.dev/valid-attachments": null}',
           '{"cniVersion": "0.2.0", "name": "x"}', "{not json", "[]", "null", ""]

# The worker: nobody's process; one line of JSON in (the request, base64), one out.
WORKER = r"""
import base64, json, socket, struct, sys, time
path = sys.argv[1]
last = 0.0
for line in sys.stdin:
    data = base64.b64decode(json.loads(line)["data"])
    time.sleep(max(0.0, last + 0.06 - time.monotonic()))  # under 20 calls a second
    last = time.monotonic()
    out = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        try:
            s.connect(path)
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass  # answered before it had it all
            buf = b""
            while len(buf) < 16 or len(buf) < 16 + sum(struct.unpack(">II", buf[8:16])):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
            if len(buf) >= 16:
                status, n, t = struct.unpack(">III", buf[4:16])
                out = {"magic": buf[:4].decode("latin1"), "status": status, "whole": len(buf) == 16 + n + t,
                       "name": buf[16:16 + n].decode(), "text": buf[16 + n:16 + n + t].decode()}
            else:
                out = {"error": f"{len(buf)} bytes, then the end"}
        except OSError as e:
            out = {"error": repr(e)}
    print(json.dumps(out), flush=True)
"""


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    env = draw(st.lists(st.tuples(st.sampled_from(KEYS) | st.text(min_size=1, max_size=20).filter(
        lambda k: "=" not in k and "\0" not in k), st.sampled_from(WORDS) | st.text(max_size=50)),
        max_size=8))
    if draw(st.booleans()):  # a read, which a stranger may make: the agent parses it all
        env.insert(0, ("CNI_COMMAND", draw(st.sampled_from(["STATUS", "VERSION"]))))
    config = draw(st.sampled_from(CONFIGS) | st.text(max_size=200)).encode()
    if draw(st.integers(0, 9)) == 0:  # past a stranger's bound, or near it
        config = b" " * draw(st.sampled_from([65535, 65536, 65537, 200_000])) + config
    data = frame(env, config)
    how = draw(st.sampled_from(["whole", "whole", "cut", "env_len", "config_len", "junk", "raw"]))
    if how == "cut":
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "env_len":
        return MAGIC + struct.pack(">I", draw(st.integers(0, (1 << 32) - 1))) + data[8:]
    if how == "config_len":
        at = 8 + struct.unpack(">I", data[4:8])[0]
        return data[:at] + struct.pack(">I", draw(st.integers(0, (1 << 32) - 1))) + data[at + 4:]
    if how == "junk":
        return data + draw(st.binary(min_size=1, max_size=100))
    if how == "raw":
        return draw(st.binary(max_size=300))
    return data


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate], print_blob=False,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture
def socket_agent(make_agent: Callable[..., Agent], testnet: Callable[..., Path],
                 open_dir: Path) -> Iterator[tuple[Agent, subprocess.Popen[str]]]:
    testnet()
    agent = make_agent(runtime_dir=str(open_dir))
    worker = subprocess.Popen([*as_user("nobody"), "/usr/bin/python3", "-I", "-c", WORKER,
                               str(agent.shim_socket)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    yield agent, worker
    worker.kill()
    worker.wait()


def test_the_socket_as_a_stranger(socket_agent: tuple[Agent, subprocess.Popen[str]]) -> None:
    agent, worker = socket_agent
    assert agent.proc is not None and worker.stdin is not None and worker.stdout is not None
    pid = agent.proc.pid
    baseline_fds, baseline_rss = idle_fds(pid), rss_kib(pid)
    seen: collections.Counter[str] = collections.Counter()

    def send(data: bytes) -> dict[str, Any]:
        assert worker.stdin is not None and worker.stdout is not None
        worker.stdin.write(json.dumps({"data": base64.b64encode(data).decode()}) + "\n")
        worker.stdin.flush()
        answer: dict[str, Any] = json.loads(worker.stdout.readline())
        return answer

    @SETTINGS
    @given(data=requests())
    @example(data=b"")
    @example(data=MAGIC + struct.pack(">I", 1 << 31))
    @example(data=frame([("CNI_COMMAND", "STATUS")], b" " * (1 << 20)))
    @example(data=frame([("CNI_COMMAND", "ADD"), ("CNI_NETNS", "/proc/1/ns/net"),
                         ("CNI_CONTAINERID", "x"), ("CNI_IFNAME", "eth0")], CONFIGS[0].encode()))
    def fuzz(data: bytes) -> None:
        answer = send(data)
        seen[answer.get("error") or answer["name"] or "answered"] += 1
        assert "error" not in answer, (data[:100], answer)
        assert answer["magic"] == "CNA1" and answer["whole"], (data[:100], answer)
        assert answer["name"] in EXPECTED, (data[:100], answer)
        assert agent.proc is not None and agent.proc.poll() is None, agent.log()[-3000:]

    fuzz()
    print("\n".join(f"{n:5} {k}" for k, n in sorted(seen.items())))
    assert settle_fds(pid, baseline_fds) <= baseline_fds
    assert rss_kib(pid) - baseline_rss < RSS_GROWTH
    assert "Traceback" not in agent.log()
    status = run_shim(NO_BUS, "STATUS", shim_conf("pods", "testnet"), socket=str(agent.shim_socket))
    assert status.rc == 0, status
