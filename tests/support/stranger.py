"""Another user's D-Bus caller (stranger_worker.py in a process of its own), and
what a hostile caller's effect on the agent is measured by: its open descriptors
and its memory, from /proc."""

from __future__ import annotations

import atexit
import collections
import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import dbus_fast

from tests.support.agent import as_member, as_user, compiled_for_everyone

WORKER = Path(__file__).with_name("stranger_worker.py")
SYSTEM_PYTHON = "/usr/bin/python3"
AGENT_IFACE = "org.cniagent.Agent1"
INTROSPECTABLE = "org.freedesktop.DBus.Introspectable"
PEER = "org.freedesktop.DBus.Peer"
PROPERTIES = "org.freedesktop.DBus.Properties"
NO_REPLY_EXPECTED = 0x1
ALLOW_INTERACTIVE_AUTHORIZATION = 0x4
MAX_MESSAGE_FDS = 16  # dbus-daemon's max_message_unix_fds


def spec(member: str, signature: str = "", body: list[Any] | None = None, *,
         interface: str | None = AGENT_IFACE, **kw: Any) -> dict[str, Any]:
    """One message for the worker (see stranger_worker.py for the keys)."""
    return {"kind": "call", "member": member, "signature": signature, "body": body or [],
            "interface": interface, **kw}


_LIBRARY: list[Path] = []


def readable_dbus_fast() -> Path:
    """A copy of the dbus-fast these tests run with, readable by any user.

    Not Debian's 1.84 (what the system python has): it writes a string's
    length in characters, not bytes, so a message with any non-ASCII string
    is malformed and the bus drops the sender. What a hostile caller puts on
    the wire must be what it meant to, so the worker uses this copy (built
    for the same CPython 3.11 ABI).
    """
    if not _LIBRARY:
        top = Path(tempfile.mkdtemp(prefix="cni-agent-dbus-fast-"))
        atexit.register(shutil.rmtree, top, ignore_errors=True)
        shutil.copytree(Path(dbus_fast.__file__).parent, top / "dbus_fast",
                        ignore=shutil.ignore_patterns("__pycache__"))
        compiled_for_everyone(top)
        _LIBRARY.append(top)
    return _LIBRARY[0]


class Stranger:
    """stranger_worker.py run by the system python3, as `user` (None: root),
    with its primary group only, or with all its groups (`member=True`)."""

    def __init__(self, address: str, user: str | None = "nobody", member: bool = False) -> None:
        prefix = [] if user is None else as_member(user) if member else as_user(user)
        source = f"import sys; sys.path.insert(0, {str(readable_dbus_fast())!r})\n" + WORKER.read_text()
        self.proc = subprocess.Popen(
            [*prefix, SYSTEM_PYTHON, "-I", "-c", source, address],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self._lines: queue.Queue[str] = queue.Queue()
        self._stderr: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self._stderr.append),
                         daemon=True).start()

    @staticmethod
    def _pump(stream: Any, sink: Any) -> None:
        for line in stream:
            sink(line)

    def request(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout)

    def answer(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the stranger's worker gave no answer within {timeout}s "
                                 f"(exit {self.proc.poll()}): {''.join(self._stderr)[-3000:]}") from None
        answer: dict[str, Any] = json.loads(line)
        return answer

    def send(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message; its outcome (every wait is bounded by its timeout)."""
        return self.request({"op": "send", "spec": message}, message.get("timeout", 30) + 15)

    def run(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [self.send(m) for m in messages]

    def own(self, name: str) -> dict[str, Any]:
        return self.request({"op": "own", "name": name}, 30)

    def start_flood(self, conns: int, messages: list[dict[str, Any]], timeout: float = 30) -> None:
        """Flood on `conns` connections until stop_flood(); returns once all are connected."""
        ready = self.request({"op": "flood", "conns": conns, "specs": messages, "timeout": timeout}, 60)
        assert ready.get("ready") == conns, ready

    def stop_flood(self, timeout: float = 60) -> dict[str, Any]:
        """The flood's counts: {label: {outcome or error name: n}}."""
        self.resume()
        assert self.proc.stdin is not None
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        return self.answer(timeout)

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def stderr(self) -> str:
        return "".join(self._stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# --- the agent's process, from /proc ------------------------------------------------------

def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> collections.Counter[str]:
    """What the process's descriptors point to, counted (for a failure's message)."""
    out: collections.Counter[str] = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[os.readlink(f"/proc/{pid}/fd/{fd}")] += 1
        except OSError:
            pass
    return out


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def idle_fds(pid: int, seconds: float = 0.5) -> int:
    """The fewest descriptors seen over `seconds`: the count between the agent's
    own short-lived ones (a monitor's plugin run holds pipes for a moment)."""
    deadline = time.monotonic() + seconds
    low = fd_count(pid)
    while time.monotonic() < deadline:
        time.sleep(0.02)
        low = min(low, fd_count(pid))
    return low


def settle_fds(pid: int, baseline: int, timeout: float = 10) -> int:
    """Poll until the agent holds no more descriptors than `baseline`; the
    fewest seen (more than `baseline` only if it never got back down)."""
    deadline = time.monotonic() + timeout
    low = fd_count(pid)
    while low > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
        low = min(low, fd_count(pid))
    return low
