"""The conflist a runtime needs to use the agent through `cni-agent-shim`.

`cni-agent shim-config` prints it; no bus, no agent needed. `--runtime` picks
the cniVersion that runtime needs and says where the file goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cni_agent.cni.config import SHIM_TYPE

# Runtimes pass a capability only to a plugin that declares it; the agent then
# hands each of its plugins those that plugin declares.
CAPABILITIES = ("portMappings", "bandwidth", "ipRanges", "ips", "mac", "dns", "aliases",
                "cgroupPath", "infinibandGUID", "deviceID")
# Without --runtime: the version every runtime reads. libcni < 1.2 (podman 4,
# containerd 1.x) rejects 1.1.0 lists; 1.1.0 adds STATUS and GC.
DEFAULT_VERSION = "1.0.0"
# libcni ≥ 1.2 sends STATUS (and GC) only to a list of this version or newer.
STATUS_VERSION = "1.1.0"


@dataclass(frozen=True)
class Runtime:
    label: str
    cni_version: str
    why: str  # why this version, one line
    config: str  # the runtime's config file and the key that points at conf_dir
    plugin_dir: str  # where the runtime looks for the shim
    picks: str  # which file of the conf dir the runtime uses

    def comments(self, name: str, cni_version: str) -> list[str]:
        chosen = f"({self.why})" if cni_version == self.cni_version else "(from --cni-version)"
        lines = [f"for {self.label}: cniVersion {cni_version} {chosen}",
                 f"save as /etc/cni/net.d/10-{name}.conflist ({self.picks})",
                 f"read from: {self.config}",
                 f"the shim: {self.plugin_dir}"]
        if cni_version != self.cni_version:
            lines.append(f"warning: {self.label} wants {self.cni_version}; "
                         + ("below 1.1.0 it never sends STATUS, so its NetworkReady ignores the agent"
                            if self.cni_version == STATUS_VERSION else
                            "its libcni rejects a newer list"))
        return lines


RUNTIMES = {
    "containerd": Runtime(
        "containerd 2.x", STATUS_VERSION,
        "containerd >= 2.0 sends STATUS only to >= 1.1.0 lists: CRI NetworkReady then follows the agent",
        "/etc/containerd/config.toml, [plugins.'io.containerd.cri.v1.runtime'.cni] "
        "conf_dir = \"/etc/cni/net.d\"",
        "add its directory to bin_dirs in that table (default [\"/opt/cni/bin\"])",
        "the pods' network is the first file there in name order"),
    "crio": Runtime(
        "CRI-O >= 1.30", STATUS_VERSION,
        "CRI-O >= 1.30 sends STATUS only to >= 1.1.0 lists: CRI NetworkReady then follows the agent",
        "/etc/crio/crio.conf.d/*.conf, [crio.network] network_dir = \"/etc/cni/net.d/\"",
        "[crio.network] plugin_dirs (includes /usr/libexec/cni; on Debian add /usr/lib/cni)",
        "the pods' network is the first file there in name order, unless cni_default_network"),
    "podman": Runtime(
        "podman 4 (CNI backend)", DEFAULT_VERSION,
        "its libcni 1.1 rejects 1.1.0 lists; podman sends no STATUS",
        "/etc/containers/containers.conf, [network] network_backend = \"cni\", "
        "network_config_dir = \"/etc/cni/net.d\"; then podman run --network NAME",
        "[network] cni_plugin_dirs (Debian and Fedora list both directories)",
        "podman uses it by its name"),
}


def conflist(network: str = "", name: str = "", cni_version: str = DEFAULT_VERSION
             ) -> dict[str, Any]:
    """`name` is the runtime's network name (default: the agent network's, else cni-agent)."""
    plugin: dict[str, Any] = {"type": SHIM_TYPE, "network": network,
                              "capabilities": dict.fromkeys(CAPABILITIES, True)}
    return {"cniVersion": cni_version, "name": runtime_name(network, name),
            "plugins": [plugin]}


def runtime_name(network: str = "", name: str = "") -> str:
    return name or network or "cni-agent"


def choose(runtime: str | None, cni_version: str | None, name: str) -> tuple[str, list[str]]:
    """The cniVersion to write (an explicit one wins) and the comment lines for stderr."""
    if runtime is None:
        version = cni_version or DEFAULT_VERSION
        return version, [f"cniVersion {version}; containerd >= 2.0 and CRI-O >= 1.30 need "
                         f"{STATUS_VERSION} to see the agent's readiness: pass --runtime"]
    spec = RUNTIMES[runtime]
    version = cni_version or spec.cni_version
    return version, spec.comments(name, version)
