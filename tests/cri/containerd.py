"""containerd 2.x as a CRI server in a private corner: its own root, state,
socket and config, whose only CNI network is the shim's conflist.

The binaries are Debian's (the unstable suite), extracted into the test tools
cache by tools/setup-system, not installed: containerd is no service of this
machine. Set for a reason each:
- `restrict_oom_score_adj` only when root lacks CAP_SYS_RESOURCE (these VMs):
  runc cannot then lower the sandbox's oom_score_adj to the -998 containerd
  asks for, and every RunPodSandbox fails ("can't get final child's PID from
  pipe: EOF"). A node with the capability runs containerd's default.
- `use_internal_loopback`: containerd brings `lo` up itself instead of
  exec'ing the loopback plugin, so the shim is the only plugin in `bin_dirs`.
- `netns_mounts_under_state_dir`: the pods' namespaces under the test's own
  state dir, not /run/netns.
- NRI off: its socket is a machine-wide path. runc's state under the test's
  dir too (`Root`); only the shims' sockets go to /run/containerd/s, named
  by a hash of socket, namespace and id.
- `DBUS_SYSTEM_BUS_ADDRESS` and `CNI_AGENT_SHIM_SOCKET` in containerd's
  environment: libcni hands its environment to plugins, so the shim finds the
  test's bus and its agent's socket. On a node both are the defaults.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tests.cri.image import IMAGE_NAME
from tests.cri.runtime import Runtime, toml_str

CACHE = Path(os.environ.get("CNI_AGENT_TEST_CACHE", "/var/cache/cni-agent-tests"))
BIN = CACHE / "containerd" / "usr" / "bin"
CAP_SYS_RESOURCE = 24

CONFIG = """\
version = 3
root = {root}
state = {state}
disabled_plugins = ["io.containerd.nri.v1.nri"]

[grpc]
  address = {socket}

[plugins.'io.containerd.internal.v1.opt']
  path = {opt}

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = {image}

[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = {restrict_oom}
  netns_mounts_under_state_dir = true
  enable_cdi = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = {runc}
      Root = {runc_root}
      SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = [{bin_dirs}]
    conf_dir = {conf_dir}
    max_conf_num = 1
    use_internal_loopback = true
"""


def has_cap_sys_resource() -> bool:
    with open("/proc/self/status") as f:
        eff = next(line.split()[1] for line in f if line.startswith("CapEff:"))
    return bool(int(eff, 16) >> CAP_SYS_RESOURCE & 1)


class Containerd(Runtime):
    name = title = "containerd"

    def __init__(self, top: Path, bus_address: str, plugin_dirs: Sequence[Path] = (),
                 shim_socket: Path | None = None) -> None:
        """`plugin_dirs`: where containerd looks for plugins; by default only a
        directory holding the shim (a benchmark gives containerd its own chain).
        `shim_socket`: the agent's socket for the shim (None: the bus alone)."""
        super().__init__(top, bus_address, shim_socket)
        self.config = top / "config.toml"
        self.config.write_text(CONFIG.format(
            root=toml_str(top / "root"), state=toml_str(top / "state"),
            socket=toml_str(self.socket), opt=toml_str(top / "opt"), image=toml_str(IMAGE_NAME),
            restrict_oom=str(not has_cap_sys_resource()).lower(),
            runc=toml_str(shutil.which("runc") or "runc"), runc_root=toml_str(top / "runc"),
            bin_dirs=", ".join(toml_str(d) for d in plugin_dirs or [self.bin_dir]),
            conf_dir=toml_str(self.conf_dir)))
        self.env["PATH"] = f"{BIN}:{self.env['PATH']}"

    def command(self) -> list[str]:
        return [str(BIN / "containerd"), "--config", str(self.config)]

    def load_image(self, archive: Path) -> None:
        self.ctr("images", "import", str(archive))

    def ctr(self, *args: str) -> str:
        p = subprocess.run([str(BIN / "ctr"), "--address", self.socket, "--namespace", "k8s.io", *args],
                           env=self.env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"ctr {' '.join(args)}: {p.stdout}{p.stderr}"
        return p.stdout

    def kill_leftovers(self) -> None:
        """The shims it left (they outlive containerd by design)."""
        for pid in os.listdir("/proc"):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmdline and self.socket.encode() in cmdline:
                os.kill(int(pid), signal.SIGKILL)
