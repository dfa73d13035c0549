"""The conflist a runtime needs to use the agent through `cni-agent-shim`.

`cni-agent shim-config` prints it; no bus, no agent needed.
"""

from __future__ import annotations

from typing import Any

from cni_agent.cni.config import SHIM_TYPE

# Runtimes pass a capability only to a plugin that declares it; the agent then
# hands each of its plugins those that plugin declares.
CAPABILITIES = ("portMappings", "bandwidth", "ipRanges", "ips", "mac", "dns", "aliases",
                "cgroupPath", "infinibandGUID", "deviceID")
# libcni < 1.2 (podman 4, containerd 1.x) rejects 1.1.0 results; 1.1.0 adds STATUS and GC.
DEFAULT_VERSION = "1.0.0"


def conflist(network: str = "", name: str = "", cni_version: str = DEFAULT_VERSION
             ) -> dict[str, Any]:
    """`name` is the runtime's network name (default: the agent network's, else cni-agent)."""
    plugin: dict[str, Any] = {"type": SHIM_TYPE, "network": network,
                              "capabilities": dict.fromkeys(CAPABILITIES, True)}
    return {"cniVersion": cni_version, "name": name or network or "cni-agent",
            "plugins": [plugin]}
