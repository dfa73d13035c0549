"""The conflist a runtime needs to use the agent through `cni-agent-shim`.

`cni-agent shim-config` prints it; no bus, no agent needed. `--runtime` picks
the cniVersion that runtime needs and says where the file goes; for CRI-O,
`--drop-in` prints the crio.conf.d file that makes its NetworkReady follow
the agent at all.

The shim's plugin declares the capabilities the plugins of the agent's network
declare (read from the agent's conf_dir by the caller): a runtime passes a
capability only to a plugin that declares it, and the agent then hands each of
its plugins those that plugin declares.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cni_agent.cni.config import SHIM_TYPE

# When the agent's network cannot be read here: every capability a runtime is
# known to send (CRI-O sends the last two on every pod).
WELL_KNOWN_CAPABILITIES = ("portMappings", "bandwidth", "ipRanges", "ips", "mac", "dns", "aliases",
                           "infinibandGUID", "deviceID", "cgroupPath",
                           "io.kubernetes.cri.pod-annotations")
# Without --runtime: the version every runtime reads. libcni < 1.2 (podman 4,
# containerd 1.x, CRI-O <= 1.30) rejects 1.1.0 lists; 1.1.0 adds STATUS and GC.
DEFAULT_VERSION = "1.0.0"
# libcni >= 1.2 sends STATUS (and GC) only to a list of this version or newer.
STATUS_VERSION = "1.1.0"
CRIO_DROP_IN = "/etc/crio/crio.conf.d/10-cni-agent.conf"
# Where both packages install docs/runtimes.md.
RUNTIMES_DOC = "/usr/share/doc/cni-agent/docs/runtimes.md"

# What CRI-O's CRI NetworkReady does, per version (read from its source:
# internal/config/cnimgr). It reports its own last STATUS poll, never a fresh
# one, so nothing the agent does makes CRI-O notice sooner than that poll.
CRIO_READINESS = (
    "CRI-O's NetworkReady is its own last STATUS poll; the agent cannot make CRI-O notice faster:",
    "  <= 1.31: no STATUS at all (ready once a conflist exists);",
    "  1.32-1.35: polls every 0.5 s only until first ready, then never: stays true;",
    "  1.36.0-1.36.2: polls every 5 s: false 0-5 s after the agent's network fails, "
    "true 0-5 s after it recovers;",
    "  1.36.3 and later: polls every 5 s only when [crio.network] cni_status_grace_period > 0; "
    "the default 0s never notices; with 1s, false 5-10 s after a failure, true 0-5 s after "
    "recovery",
)


@dataclass(frozen=True)
class Runtime:
    label: str
    cni_version: str
    why: str  # why this version, one line
    config: str  # the runtime's config file and the key that points at conf_dir
    plugin_dir: str  # where the runtime looks for the shim
    picks: str  # which file of the conf dir the runtime uses
    readiness: tuple[str, ...] = ()  # what its NetworkReady does with the agent, other versions

    def comments(self, name: str, cni_version: str) -> list[str]:
        chosen = f"({self.why})" if cni_version == self.cni_version else "(from --cni-version)"
        lines = [f"for {self.label}: cniVersion {cni_version} {chosen}",
                 f"save as /etc/cni/net.d/10-{name}.conflist ({self.picks})",
                 f"read from: {self.config}",
                 f"the shim: {self.plugin_dir}", *self.readiness]
        if cni_version != self.cni_version:
            lines.append(f"warning: {self.label} wants {self.cni_version}; "
                         + ("below 1.1.0 it never sends STATUS, so its NetworkReady ignores the agent"
                            if self.cni_version == STATUS_VERSION else
                            "its libcni rejects a newer list"))
        return lines


RUNTIMES = {
    "containerd": Runtime(
        "containerd 2.x", STATUS_VERSION,
        "containerd >= 2.0 sends STATUS only to >= 1.1.0 lists, on every CRI Status: "
        "its NetworkReady then follows the agent",
        "/etc/containerd/config.toml, [plugins.'io.containerd.cri.v1.runtime'.cni] "
        "conf_dir = \"/etc/cni/net.d\"",
        "add its directory to bin_dirs in that table (default [\"/opt/cni/bin\"]); containerd "
        "2.0 reads bin_dir, one directory (a string)",
        "the pods' network is the first file there in name order",
        ("containerd 1.6 and 1.7: --cni-version 1.0.0, and [plugins.\"io.containerd.grpc.v1.cri\""
         ".cni] bin_dir and conf_dir (config version 2); their NetworkReady never asks the agent",
         f"every version's snippet: {RUNTIMES_DOC}")),
    "crio": Runtime(
        "CRI-O", STATUS_VERSION,
        "CRI-O >= 1.32 sends STATUS and GC only to >= 1.1.0 lists; 1.30 and older reject "
        "them: pass --cni-version 1.0.0",
        f"{CRIO_DROP_IN} (`cni-agent shim-config --runtime crio --drop-in`), [crio.network] "
        "network_dir = \"/etc/cni/net.d/\"",
        "[crio.network] plugin_dirs (the drop-in lists /usr/libexec/cni and /usr/lib/cni)",
        "the pods' network is the first file there in name order, unless cni_default_network",
        CRIO_READINESS),
    "podman": Runtime(
        "podman 4 (CNI backend)", DEFAULT_VERSION,
        "its libcni 1.1 rejects 1.1.0 lists; podman sends no STATUS",
        "/etc/containers/containers.conf, [network] network_backend = \"cni\", "
        "network_config_dir = \"/etc/cni/net.d\"; then podman run --network NAME",
        "[network] cni_plugin_dirs (Debian and Fedora list both directories)",
        "podman uses it by its name",
        ("podman 5 has no CNI backend and never reads this file: there, set a namespace up with "
         "`cni-agent sandbox up NAME` and run the container with --network ns:/run/netns/NAME",
         f"see {RUNTIMES_DOC}")),
}

CRIO_DROP_IN_TEXT = f"""\
# {CRIO_DROP_IN}: CRI-O's side of cni-agent
# (written by `cni-agent shim-config --runtime crio --drop-in`).
[crio.network]
# Where `cni-agent shim-config --runtime crio` writes the shim's conflist.
network_dir = "/etc/cni/net.d/"
# CRI-O's default is ["/opt/cni/bin/"]; the shim is installed in
# /usr/libexec/cni (Fedora) or /usr/lib/cni (Debian).
plugin_dirs = ["/opt/cni/bin/", "/usr/libexec/cni", "/usr/lib/cni"]
# CRI-O 1.36.3 and later poll the network's STATUS after start-up only when
# this is above 0; with its default "0s" NetworkReady never goes false once
# true, so kubelet keeps scheduling pods onto a node whose network is gone.
# Above 0, CRI-O polls every 5 s and reports a failure once it has lasted this
# long: with "1s", NetworkReady goes false 5-10 s after the agent's network
# fails and true again within 5 s of its recovery, and a restart of the agent
# (a fraction of a second) is never reported. CRI-O 1.36.0-1.36.2 poll every
# 5 s without it; 1.32-1.35 stop polling once ready; older ones ignore it.
# The agent cannot make CRI-O notice faster than this poll.
cni_status_grace_period = "1s"
"""


# Where the shim queues a DEL while no agent runs, unless its conflist says
# "stateDir" (shim/cni-agent-shim.c, STATE_DIR: the same default).
DEFAULT_STATE_DIR = "/var/lib/cni-agent"


def conflist(network: str = "", name: str = "", cni_version: str = DEFAULT_VERSION,
             capabilities: Iterable[str] = WELL_KNOWN_CAPABILITIES, queue_when_down: bool = True,
             state_dir: str = DEFAULT_STATE_DIR) -> dict[str, Any]:
    """`name` is the runtime's network name (default: the agent network's, else
    cni-agent); `capabilities` those the agent network's plugins declare;
    `queue_when_down`: the shim queues a DEL no agent answers, in the agent's
    `state_dir` (written only when it is not the default)."""
    plugin: dict[str, Any] = {"type": SHIM_TYPE, "network": network,
                              "capabilities": dict.fromkeys(sorted(capabilities), True),
                              "queueWhenDown": queue_when_down}
    if state_dir.rstrip("/") != DEFAULT_STATE_DIR:
        plugin["stateDir"] = state_dir
    return {"cniVersion": cni_version, "name": runtime_name(network, name),
            "plugins": [plugin]}


def runtime_name(network: str = "", name: str = "") -> str:
    return name or network or "cni-agent"


def capability_comments(found: frozenset[str] | None, where: str) -> list[str]:
    """Where the declared capabilities came from, for stderr."""
    if found is None:
        return [f"warning: {where}: declaring every capability a runtime is known to send; "
                "run shim-config again once the network exists, so that the file declares "
                "what its plugins do"]
    names = ", ".join(sorted(found)) or "none"
    return [f"capabilities: {names} (what the plugins of {where} declare; run shim-config "
            "again when they change)"]


def choose(runtime: str | None, cni_version: str | None, name: str) -> tuple[str, list[str]]:
    """The cniVersion to write (an explicit one wins) and the comment lines for stderr."""
    if runtime is None:
        version = cni_version or DEFAULT_VERSION
        return version, [f"cniVersion {version}; containerd >= 2.0 and CRI-O >= 1.32 need "
                         f"{STATUS_VERSION} to see the agent's readiness: pass --runtime"]
    spec = RUNTIMES[runtime]
    version = cni_version or spec.cni_version
    return version, spec.comments(name, version)
