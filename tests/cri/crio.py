"""CRI-O as a CRI server in a private corner: its own root, runroot, socket,
config and namespaces dir, whose only CNI network is the shim's conflist.

CRI-O is in no Debian suite: `make test-crio CRIO_SRC=DIR` builds it from a
source tree (tools/build-crio) and names the directory holding `crio` and
`pinns` in CNI_AGENT_CRIO_DIR; conmon and runc are Debian 12's. Set for a
reason each:
- The drop-in `cni-agent shim-config --runtime crio --drop-in` prints is
  installed as a user would install it (so its `cni_status_grace_period`
  is what these tests see), then a later drop-in points network_dir and
  plugin_dirs at this test's own directories.
- `drop_infra_ctr = true` (CRI-O's default) and pods whose PID namespace is
  their containers' (kubelet's default): a pod runs no process, so no infra
  container whose oom_score_adj runc could not lower on these VMs (root lacks
  CAP_SYS_RESOURCE). CRI-O still makes a storage container from the pause
  image, so tests/cri's image is put into its storage with CRI-O's own test
  tool, copyimg (built by tools/build-crio): no registry, no pull.
- cgroupfs, AppArmor unconfined, no NRI, no CDI, no hooks, no metrics: the
  machine's systemd, profiles and sockets are left alone.
- `DBUS_SYSTEM_BUS_ADDRESS` and `CNI_AGENT_SHIM_SOCKET` in CRI-O's
  environment: libcni hands its environment to plugins, so the shim finds the
  test's bus and its agent's socket.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.cri.containerd import CACHE
from tests.cri.image import IMAGE_NAME
from tests.cri.runtime import Runtime, toml_str

# Where `make test-crio` puts what tools/build-crio built.
CRIO_DIR = Path(os.environ.get("CNI_AGENT_CRIO_DIR", CACHE / "crio" / "current"))

CONFIG = """\
[crio]
root = {root}
runroot = {runroot}
storage_driver = "overlay"
log_dir = {log_dir}
version_file = {version_file}
clean_shutdown_file = {clean_shutdown_file}

[crio.api]
listen = {socket}
stream_address = "127.0.0.1"
stream_port = "0"

[crio.runtime]
cgroup_manager = "cgroupfs"
apparmor_profile = "unconfined"
selinux = false
container_exits_dir = {exits}
container_attach_socket_dir = {attach}
namespaces_dir = {namespaces}
pinns_path = {pinns}
drop_infra_ctr = true
hooks_dir = []
cdi_spec_dirs = []
irqbalance_config_file = {irqbalance}
irqbalance_config_restore_file = "disable"
enable_criu_support = false
default_runtime = "runc"

[crio.runtime.runtimes.runc]
runtime_path = {runc}
runtime_type = "oci"
runtime_root = {runc_root}
monitor_path = {conmon}
monitor_cgroup = "pod"

[crio.image]
signature_policy = {policy}
signature_policy_dir = {policies}
pause_image = {pause_image}

[crio.metrics]
enable_metrics = false

[crio.nri]
enable_nri = false
"""

# After the user's drop-in (10-cni-agent.conf): this test's dirs, nothing else.
TEST_DROP_IN = """\
[crio.network]
network_dir = {conf_dir}
plugin_dirs = [{bin_dirs}]
"""


class CRIO(Runtime):
    name, title = "crio", "CRI-O"

    def __init__(self, top: Path, bus_address: str, drop_in: str,
                 plugin_dirs: tuple[Path, ...] = (), shim_socket: Path | None = None) -> None:
        """`drop_in`: what `cni-agent shim-config --runtime crio --drop-in` printed.
        `plugin_dirs`: where CRI-O looks for plugins; by default only a directory
        holding the shim (a benchmark gives a CRI-O its own chain).
        `shim_socket`: the agent's socket for the shim (None: the bus alone)."""
        super().__init__(top, bus_address, shim_socket)
        self.config_dir = top / "crio.conf.d"
        for d in (self.config_dir, top / "policies"):
            d.mkdir(parents=True, exist_ok=True)
        policy = top / "policy.json"
        policy.write_text('{"default": [{"type": "insecureAcceptAnything"}]}\n')
        self.config = top / "crio.conf"
        self.config.write_text(CONFIG.format(
            root=toml_str(top / "root"), runroot=toml_str(top / "run"),
            log_dir=toml_str(top / "pod-logs"), version_file=toml_str(top / "run" / "version"),
            clean_shutdown_file=toml_str(top / "root" / "clean.shutdown"),
            socket=toml_str(self.socket), exits=toml_str(top / "exits"),
            attach=toml_str(top / "attach"), namespaces=toml_str(top / "ns"),
            pinns=toml_str(CRIO_DIR / "pinns"), irqbalance=toml_str(top / "irqbalance"),
            runc=toml_str(shutil.which("runc") or "runc"), runc_root=toml_str(top / "runc"),
            conmon=toml_str(shutil.which("conmon") or "conmon"),
            policy=toml_str(policy), policies=toml_str(top / "policies"),
            pause_image=toml_str(IMAGE_NAME)))
        self.policy = policy
        (self.config_dir / "10-cni-agent.conf").write_text(drop_in)
        (self.config_dir / "99-test.conf").write_text(TEST_DROP_IN.format(
            conf_dir=toml_str(self.conf_dir),
            bin_dirs=", ".join(toml_str(d) for d in plugin_dirs or (self.bin_dir,))))

    def command(self) -> list[str]:
        return [str(CRIO_DIR / "crio"), "--config", str(self.config), "--config-dir",
                str(self.config_dir), "--log-level", "info"]

    def start(self, timeout: float = 60) -> None:
        super().start(timeout)

    def load_image(self, archive: Path) -> None:
        """The pause image, from an OCI archive, into CRI-O's storage."""
        p = subprocess.run(
            [str(CRIO_DIR / "copyimg"), "--root", str(self.top / "root"), "--runroot",
             str(self.top / "run"), "--storage-driver", "overlay", "--signature-policy",
             str(self.policy), "--image-name", IMAGE_NAME, "--import-from", f"oci-archive:{archive}"],
            capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"copyimg: {p.stdout}{p.stderr}"
