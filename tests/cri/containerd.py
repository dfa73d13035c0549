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

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from tests.cri.cri import CRI
from tests.cri.image import IMAGE_NAME
from tests.support.shim import SHIM

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


def toml_str(value: object) -> str:
    return json.dumps(str(value))  # a TOML basic string is a JSON string here


class Containerd:
    def __init__(self, top: Path, bus_address: str, plugin_dirs: Sequence[Path] = (),
                 shim_socket: Path | None = None) -> None:
        """`plugin_dirs`: where containerd looks for plugins; by default only a
        directory holding the shim (a benchmark gives containerd its own chain).
        `shim_socket`: the agent's socket for the shim (None: the bus alone)."""
        self.top = top
        self.socket = str(top / "containerd.sock")
        self.conf_dir = top / "net.d"
        self.bin_dir = top / "cni-bin"
        for d in (self.conf_dir, self.bin_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.symlink(SHIM, self.bin_dir / "cni-agent-shim")
        self.config = top / "config.toml"
        self.config.write_text(CONFIG.format(
            root=toml_str(top / "root"), state=toml_str(top / "state"),
            socket=toml_str(self.socket), opt=toml_str(top / "opt"), image=toml_str(IMAGE_NAME),
            restrict_oom=str(not has_cap_sys_resource()).lower(),
            runc=toml_str(shutil.which("runc") or "runc"), runc_root=toml_str(top / "runc"),
            bin_dirs=", ".join(toml_str(d) for d in plugin_dirs or [self.bin_dir]),
            conf_dir=toml_str(self.conf_dir)))
        self.env = {"PATH": f"{BIN}:{os.environ['PATH']}", "DBUS_SYSTEM_BUS_ADDRESS": bus_address,
                    "CNI_AGENT_SHIM_SOCKET": str(shim_socket or "")}
        self.log_path = top / "containerd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.cri = CRI(self.socket)

    def start(self, timeout: float = 30) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([str(BIN / "containerd"), "--config", str(self.config)],
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"containerd exited {self.proc.returncode}:\n{self.log()}")
            try:
                if self.cri.conditions()["RuntimeReady"][0]:
                    return
            except (grpc.RpcError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"containerd's CRI not up within {timeout}s:\n{self.log()}")
            time.sleep(0.05)

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def load_image(self, archive: Path) -> None:
        """The pause image, from an OCI archive: no registry, no pull."""
        self.ctr("images", "import", str(archive))

    def ctr(self, *args: str) -> str:
        p = subprocess.run([str(BIN / "ctr"), "--address", self.socket, "--namespace", "k8s.io", *args],
                           env=self.env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"ctr {' '.join(args)}: {p.stdout}{p.stderr}"
        return p.stdout

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    def close(self) -> None:
        """Everything gone: the pods (their DELs reach the agent), containerd, the
        shims it left, the mounts under its root and state."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                for sandbox in self.cri.sandboxes():
                    self.cri.stop(sandbox)
                    self.cri.remove(sandbox)
            except grpc.RpcError:
                pass
        self.stop()
        self.cri.close()
        for pid in os.listdir("/proc"):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmdline and self.socket.encode() in cmdline:
                os.kill(int(pid), signal.SIGKILL)
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(str(self.top))), reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(self.top, ignore_errors=True)
