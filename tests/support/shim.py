"""Running cni-agent-shim as libcni does: exec with the CNI environment and stdin,
to the agent over its socket or over the bus; and the socket's frames, for
clients that are not the shim."""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket as sockets
import struct
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.agent import REPO, Agent, as_user

SHIM = REPO / "build" / "cni-agent-shim"
# No bus behind it: a shim sent over the socket that fell back to the bus fails.
NO_BUS = "unix:path=/nonexistent/cni-agent-tests/no-bus"
WAYS = ("socket", "bus")


@dataclass
class Reply:
    rc: int
    out: Any  # the parsed stdout, or None when empty
    stderr: str

    @property
    def code(self) -> int | None:
        return self.out.get("code") if self.rc and isinstance(self.out, dict) else None


def shim_conf(name: str, network: str = "", version: str = "1.1.0", **extra: Any) -> dict[str, Any]:
    """The plugin config libcni writes to stdin for a one-plugin list."""
    return {"cniVersion": version, "name": name, "type": "cni-agent-shim", "network": network,
            **extra}


def shim_env(bus_address: str, command: str, *, cid: str = "", netns: str = "",
             ifname: str = "eth0", args: str = "", socket: str = "") -> dict[str, str]:
    """The environment libcni gives a plugin, for the shim on the test's bus, and
    the agent's socket (`socket`; "": none, the bus alone)."""
    env = {"PATH": os.environ["PATH"], "CNI_COMMAND": command, "CNI_PATH": "/usr/lib/cni",
           "DBUS_SYSTEM_BUS_ADDRESS": bus_address, "CNI_AGENT_SHIM_SOCKET": socket}
    if command in ("ADD", "DEL", "CHECK"):
        env.update(CNI_CONTAINERID=cid, CNI_NETNS=netns, CNI_IFNAME=ifname, CNI_ARGS=args)
    return env


def run_shim(bus_address: str, command: str, conf: dict[str, Any] | str | bytes, *,
             cid: str = "", netns: str = "", ifname: str = "eth0", args: str = "",
             user: str | None = None, binary: str = str(SHIM), timeout: float = 60,
             socket: str = "", env: Mapping[str, str] | None = None) -> Reply:
    full_env = {**shim_env(bus_address, command, cid=cid, netns=netns, ifname=ifname, args=args,
                           socket=socket), **(env or {})}
    stdin = conf if isinstance(conf, str | bytes) else json.dumps(conf)
    cmd = [*as_user(user), binary] if user else [binary]
    p = subprocess.run(cmd, input=stdin.encode() if isinstance(stdin, str) else stdin,
                       env=full_env, capture_output=True, timeout=timeout)
    out = p.stdout.decode(errors="replace")
    return Reply(p.returncode, json.loads(out) if out.strip() else None,
                 p.stderr.decode(errors="replace"))


@dataclass(frozen=True)
class Way:
    """How the shim reaches the agent: "socket", with no bus behind it (a shim
    that fell back to the bus fails), or "bus", its socket path `absent` (the
    shim's fallback, as when the agent has no socket)."""

    name: str
    absent: Path

    def env(self, agent: Agent) -> dict[str, str]:
        if self.name == "socket":
            return {"DBUS_SYSTEM_BUS_ADDRESS": NO_BUS, "CNI_AGENT_SHIM_SOCKET": str(agent.shim_socket)}
        assert self.name == "bus" and not self.absent.exists()
        return {"DBUS_SYSTEM_BUS_ADDRESS": agent.bus.address, "CNI_AGENT_SHIM_SOCKET": str(self.absent)}

    def shim(self, agent: Agent) -> Callable[..., Reply]:
        """`run_shim` bound to `agent` this way."""
        return functools.partial(run_shim, "", env=self.env(agent))


def readable_shim() -> str:
    """A copy of the shim that any user can run (the checkout may be unreachable)."""
    top = Path(tempfile.mkdtemp(prefix="cni-agent-shim-"))
    os.chmod(top, 0o755)
    dest = top / "cni-agent-shim"
    shutil.copy(SHIM, dest)
    os.chmod(dest, 0o755)
    return str(dest)


# --- the socket's frames (agent/cni_agent/service/shimsock.py) ---------------------------

MAGIC = b"CNA1"


def frame(env: Mapping[str, str] | Iterable[tuple[str, str]], config: bytes | str) -> bytes:
    """A request as the shim writes it (`env`: a mapping, or pairs, repeats and all)."""
    pairs = env.items() if isinstance(env, Mapping) else env
    data = b"".join(f"{k}={v}".encode() + b"\0" for k, v in pairs)
    body = config.encode() if isinstance(config, str) else config
    return MAGIC + struct.pack(">I", len(data)) + data + struct.pack(">I", len(body)) + body


@dataclass
class Answer:
    status: int
    name: str  # the error's name, "" for a plugin's answer
    text: str


def read_answer(sock: sockets.socket) -> Answer:
    """One reply, whole (AssertionError when the connection ends first)."""
    data = b""
    while len(data) < 16 or len(data) < 16 + sum(struct.unpack(">II", data[8:16])):
        chunk = sock.recv(65536)
        assert chunk, f"the connection ended after {len(data)} bytes: {data[:200]!r}"
        data += chunk
    assert data[:4] == MAGIC, data[:200]
    status, name_len, text_len = struct.unpack(">III", data[4:16])
    assert len(data) == 16 + name_len + text_len, (len(data), name_len, text_len)
    # Nothing after it: one request, one answer, then the agent closes (a reset:
    # it closed with some of what was sent unread).
    try:
        rest = sock.recv(1)
    except ConnectionResetError:
        rest = b""
    assert rest == b"", rest
    return Answer(status, data[16:16 + name_len].decode(), data[16 + name_len:].decode())


def exchange(path: Path | str, request: bytes, timeout: float = 30, *,
             shut: bool = False) -> Answer:
    """Connect, send `request` (whatever it is), read the reply; `shut`: end the
    writing side after it, as a client that has nothing more to say."""
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered before it read it all
        if shut:
            sock.shutdown(sockets.SHUT_WR)
        return read_answer(sock)
