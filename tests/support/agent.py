"""A private D-Bus daemon and the agent as a real subprocess, driven by busctl/gdbus."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from tests.support.forkserver import ForkedPopen, ForkServer

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "dbus" / "org.cniagent.Agent1.conf"
NAME = "org.cniagent.Agent1"
PATH = "/org/cniagent/Agent1"
IFACE = "org.cniagent.Agent1"

SYSTEM_LIKE = (REPO / "tools" / "dev-bus.conf.in").read_text()

# Everything allowed: proves the agent's own authorization check.
PERMISSIVE = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>custom</type>
  <listen>unix:path=@SOCKET@</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


class Bus:
    """A private dbus-daemon; its socket is reachable by unprivileged users."""

    def __init__(self, policy: str = "system", policy_file: Path = POLICY) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="cni-agent-bus-"))
        os.chmod(self.dir, 0o755)
        self.socket = self.dir / "bus.sock"
        template = SYSTEM_LIKE if policy == "system" else PERMISSIVE
        self.conf = self.dir / "bus.conf"
        self.conf.write_text(template.replace("@SOCKET@", str(self.socket))
                             .replace("@POLICY@", str(policy_file)))
        out = subprocess.run(
            ["dbus-daemon", f"--config-file={self.conf}", "--print-address=1",
             "--print-pid=1", "--fork"],
            capture_output=True, text=True, check=True,
        )
        lines = out.stdout.split()
        self.address, self.pid = lines[0], int(lines[1])

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        subprocess.run(["rm", "-rf", str(self.dir)], check=False)


class NotifySocket:
    """A real AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "notify.sock")
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.messages.append(data.decode())

    def lines(self) -> list[str]:
        with self._lock:
            return [line for m in self.messages for line in m.splitlines()]

    def wait_for(self, line: str, timeout: float = 15, after: int = 0) -> int:
        """Index of the first message (from `after`) containing `line`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                for i, m in enumerate(self.messages[after:], after):
                    if line in m.splitlines() or any(x.startswith(line) for x in m.splitlines()):
                        return i
            time.sleep(0.01)
        raise AssertionError(f"no {line!r} on the notify socket; got {self.messages}")

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        self._thread.join(timeout=1)


class Agent:
    """`cni-agent run` as a subprocess, with its own config and dirs.

    Forked from `fork_server` when the tests set one (tests/conftest.py) and
    nothing of the process's start is the test's own (a `prefix`,
    `python_args`, PYTHON* or LD_* variables): forkserver.py says what that
    changes. Else exec'd."""

    fork_server: ForkServer | None = None

    def __init__(self, tmp: Path, bus: Bus, **config: Any) -> None:
        self.tmp = tmp
        self.bus = bus
        self.conf_dir = Path(config.pop("conf_dir", tmp / "net.d"))
        self.config: dict[str, Any] = {
            "conf_dir": str(self.conf_dir),
            "plugin_dirs": [str(tmp / "bin"), "/usr/lib/cni"],
            "state_dir": str(tmp / "state"),
            "runtime_dir": str(tmp / "run"),
            "bus": bus.address,
            "shutdown_drain": 0,
            "monitor": {"startup_interval": 0.05, "interval": 0.2},
            "timeouts": {"ready": 2, "lock": 5},
            "log_level": "debug",
            **config,
        }
        self.config_path = tmp / "agent.yaml"
        self.proc: subprocess.Popen[str] | None = None
        # Interpreter options before `-m cni_agent` (a benchmark's profiler).
        self.python_args: list[str] = []
        # A command the agent runs under (a mount namespace of its own).
        self.prefix: list[str] = []
        self.notify: NotifySocket | None = None
        self.log_path = tmp / "agent.log"

    @property
    def shim_socket(self) -> Path:
        """Where the agent listens for cni-agent-shim (`runtime_dir`/shim.sock)."""
        return Path(self.config["runtime_dir"]) / "shim.sock"

    def write_config(self) -> None:
        self.config_path.write_text(yaml.safe_dump(self.config))

    def start(self, wait: bool = True, env: dict[str, str] | None = None) -> Agent:
        self.write_config()
        self.notify = NotifySocket(self.tmp)
        full_env = {**os.environ, "NOTIFY_SOCKET": self.notify.path, **(env or {})}
        full_env.pop("DBUS_SYSTEM_BUS_ADDRESS", None)
        self._log = open(self.log_path, "a")
        args = ["run", "--config", str(self.config_path)]
        # What the interpreter or the loader reads as it starts (a sitecustomize
        # on PYTHONPATH) only an exec obeys.
        at_start = any(k.startswith(("PYTHON", "LD_")) for k in env or {})
        if self.fork_server is not None and not (self.prefix or self.python_args or at_start):
            self.proc = ForkedPopen(self.fork_server, args, env=full_env, stdout=self._log,
                                    stderr=subprocess.STDOUT, text=True)
        else:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, *self.python_args, "-m", "cni_agent", *args],
                env=full_env, stdout=self._log, stderr=subprocess.STDOUT, text=True,
            )
        if wait:
            self.wait_ready_notification()
        return self

    def wait_ready_notification(self, timeout: float = 20) -> None:
        assert self.notify is not None and self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode}:\n{self.log()}")
            if "READY=1" in self.notify.lines():
                return
            time.sleep(0.02)
        raise AssertionError(f"agent not READY=1 within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._log.close()
        if self.notify is not None:
            self.notify.close()
        return rc

    # --- clients -------------------------------------------------------------------

    def busctl(self, *args: str, user: str | None = None, check: bool = True,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = ["busctl", f"--address={self.bus.address}", *args]
        if user:
            cmd = [*as_user(user), *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed: {out.stderr}\n{self.log()[-3000:]}")
        return out

    def busctl_bg(self, *args: str, timeout: float = 60) -> subprocess.Popen[str]:
        """`busctl call METHOD SIGNATURE ARGS…` in the background, with its own D-Bus
        timeout (as a runtime's client gives up); read it with communicate()."""
        return subprocess.Popen(
            ["busctl", f"--address={self.bus.address}", f"--timeout={timeout}", "call",
             NAME, PATH, IFACE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def call(self, method: str, signature: str = "", *args: str, **kw: Any) -> Any:
        """busctl call with JSON output; returns the decoded reply data."""
        out = self.busctl("--json=short", "call", NAME, PATH, IFACE, method, signature, *args, **kw)
        return json.loads(out.stdout)["data"] if out.stdout.strip() else None

    def prop(self, name: str, **kw: Any) -> Any:
        out = self.busctl("--json=short", "get-property", NAME, PATH, IFACE, name, **kw)
        return json.loads(out.stdout)["data"]

    def gdbus(self, method: str, *args: str, user: str | None = None, member: str | None = None,
              timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """`user`: run as that user alone; `member`: as that user with its groups."""
        cmd = ["gdbus", "call", "--address", self.bus.address, "--dest", NAME,
               "--object-path", PATH, "--method", f"{IFACE}.{method}", *args]
        if user:
            cmd = [*as_user(user), *cmd]
        if member:
            cmd = [*as_member(member), *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    def setup(self, sandbox: str, netns: str, **opts: Any) -> dict[str, Any]:
        reply = self.call("Setup", "ssa{sv}", sandbox, netns, *options(**opts))
        return json.loads(reply[0])  # type: ignore[no-any-return]


_READABLE_SOURCE: list[Path] = []


def readable_source() -> Path:
    """A copy of the agent's source that any user can read.

    The checkout (and its .venv) may live where other users cannot reach it: a
    clone under /root, or in a 0700 temp dir. A command run as another user
    imports this copy with the system python3, whose distro packages provide
    the dependencies (tools/setup-system installs them).
    """
    if not _READABLE_SOURCE:
        top = Path(tempfile.mkdtemp(prefix="cni-agent-src-"))
        os.chmod(top, 0o755)
        shutil.copytree(REPO / "agent" / "cni_agent", top / "cni_agent",
                        ignore=shutil.ignore_patterns("__pycache__"))
        compiled_for_everyone(top)
        _READABLE_SOURCE.append(top)
    return _READABLE_SOURCE[0]


def compiled_for_everyone(top: Path) -> None:
    """Byte-compile `top` for the system python3 and make all of it readable to
    any user: another user cannot write a __pycache__ there, so each of its
    processes would compile every module it imports again (~0.1 s of CPU each,
    hundreds of processes in `make test`)."""
    subprocess.run(["/usr/bin/python3", "-m", "compileall", "-q", str(top)], check=True)
    for path in [top, *top.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def as_user_python(user: str) -> list[str]:
    """The command prefix that runs the `cni-agent` CLI as `user`."""
    return [*as_user(user), "/usr/bin/python3", "-I", "-c",
            f"import sys; sys.path.insert(0, {str(readable_source())!r}); "
            "from cni_agent.main import main; sys.exit(main())"]


def as_member(user: str) -> list[str]:
    """A command prefix that drops to `user` with all its groups (its memberships count)."""
    pw = pwd.getpwnam(user)
    return ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups"]


def member_cli(address: str, user: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The `cni-agent` CLI run as `user`, with its groups, against the bus at `address`."""
    code = (f"import sys; sys.path.insert(0, {str(readable_source())!r}); "
            "from cni_agent.main import main; sys.exit(main())")
    return subprocess.run([*as_member(user), "/usr/bin/python3", "-I", "-c", code,
                           "--bus", address, *args], capture_output=True, text=True, timeout=60)


def as_user(user: str) -> list[str]:
    """A command prefix that drops to `user` (and its primary group, nothing else)."""
    pw = pwd.getpwnam(user)
    return ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]


def options(networks: list[tuple[str, str]] | None = None, args: dict[str, str] | None = None,
            pod: dict[str, str] | None = None, capabilities: Any = None) -> list[str]:
    """busctl's spelling of an `a{sv}` options dictionary."""
    items: list[list[str]] = []
    if networks is not None:
        items.append(["networks", "a(ss)", str(len(networks)), *[x for n in networks for x in n]])
    for key, value in (("args", args), ("pod", pod)):
        if value is not None:
            items.append([key, "a{ss}", str(len(value)), *[x for kv in value.items() for x in kv]])
    if capabilities is not None:
        text = capabilities if isinstance(capabilities, str) else json.dumps(capabilities)
        items.append(["capabilities", "s", text])
    return [str(len(items)), *[x for item in items for x in item]]
