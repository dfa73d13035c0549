"""Running cni-agent-shim as libcni does: exec with the CNI environment and stdin."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.agent import REPO, as_user

SHIM = REPO / "build" / "cni-agent-shim"


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
             ifname: str = "eth0", args: str = "") -> dict[str, str]:
    """The environment libcni gives a plugin, for the shim on the test's bus."""
    env = {"PATH": os.environ["PATH"], "CNI_COMMAND": command, "CNI_PATH": "/usr/lib/cni",
           "DBUS_SYSTEM_BUS_ADDRESS": bus_address}
    if command in ("ADD", "DEL", "CHECK"):
        env.update(CNI_CONTAINERID=cid, CNI_NETNS=netns, CNI_IFNAME=ifname, CNI_ARGS=args)
    return env


def run_shim(bus_address: str, command: str, conf: dict[str, Any] | str, *, cid: str = "",
             netns: str = "", ifname: str = "eth0", args: str = "", user: str | None = None,
             binary: str = str(SHIM), timeout: float = 60) -> Reply:
    env = shim_env(bus_address, command, cid=cid, netns=netns, ifname=ifname, args=args)
    stdin = conf if isinstance(conf, str) else json.dumps(conf)
    cmd = [*as_user(user), binary] if user else [binary]
    p = subprocess.run(cmd, input=stdin, env=env, capture_output=True, text=True, timeout=timeout)
    return Reply(p.returncode, json.loads(p.stdout) if p.stdout.strip() else None, p.stderr)


def readable_shim() -> str:
    """A copy of the shim that any user can run (the checkout may be unreachable)."""
    top = Path(tempfile.mkdtemp(prefix="cni-agent-shim-"))
    os.chmod(top, 0o755)
    dest = top / "cni-agent-shim"
    shutil.copy(SHIM, dest)
    os.chmod(dest, 0o755)
    return str(dest)
