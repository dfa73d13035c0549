"""podman (Debian's 4.3, CNI backend) in a private corner: its own storage,
containers.conf and CNI config dir, so a test never touches the machine's.

Set for these test machines, each for a measured reason:
- runc, not crun: crun refuses the hybrid cgroup layout here ("cgroups in
  hybrid mode not supported").
- nofile/nproc ulimits at 1024: podman's defaults are above this machine's
  hard limits, and without CAP_SYS_RESOURCE raising them fails (EPERM).
- no image: `--rootfs` on a busybox-static tree (nothing to pull).
- the private bus's address and the agent's socket in containers.conf's
  engine env too: conmon starts `podman container cleanup` (which may be the
  one that DELs) without the test's environment, but with CONTAINERS_CONF. On
  a node both are the defaults and none of this is needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.support.shim import SHIM

CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[network]
network_backend = "cni"
cni_plugin_dirs = ["{bin}", "/usr/lib/cni"]
network_config_dir = "{net}"
[engine]
env = ["DBUS_SYSTEM_BUS_ADDRESS={bus}", "CNI_AGENT_SHIM_SOCKET={socket}"]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
APPLETS = ("sh", "ip", "sleep", "cat")


class Podman:
    def __init__(self, top: Path, bus_address: str, shim_socket: Path | None = None) -> None:
        """`shim_socket`: the agent's socket for the shim (None: the bus alone)."""
        self.top = top
        self.net_dir = top / "net.d"
        bin_dir = top / "cni-bin"
        for d in (self.net_dir, bin_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.symlink(SHIM, bin_dir / "cni-agent-shim")
        self.rootfs = top / "rootfs"
        for d in ("bin", "proc", "sys", "dev", "etc", "tmp"):
            (self.rootfs / d).mkdir(parents=True)
        shutil.copy("/bin/busybox", self.rootfs / "bin" / "busybox")
        for applet in APPLETS:
            os.symlink("busybox", self.rootfs / "bin" / applet)
        conf = top / "containers.conf"
        socket = str(shim_socket or "")
        conf.write_text(CONTAINERS_CONF.format(bin=bin_dir, net=self.net_dir, bus=bus_address,
                                               socket=socket))
        self.env = {"PATH": os.environ["PATH"], "CONTAINERS_CONF": str(conf),
                    # libcni passes its own environment on to plugins: the shim finds the
                    # bus and the agent's socket.
                    "DBUS_SYSTEM_BUS_ADDRESS": bus_address, "CNI_AGENT_SHIM_SOCKET": socket}
        self.base = ["podman", "--root", str(top / "storage"), "--runroot", str(top / "run")]

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([*self.base, *args], env=self.env, capture_output=True, text=True,
                           timeout=120)
        if check:
            assert p.returncode == 0, f"podman {' '.join(args)}: {p.stdout}{p.stderr}"
        return p

    def close(self) -> None:
        self("rm", "--all", "--force", "--time", "0", check=False)
        subprocess.run(["umount", "-R", str(self.top / "storage")], capture_output=True)
        shutil.rmtree(self.top, ignore_errors=True)
