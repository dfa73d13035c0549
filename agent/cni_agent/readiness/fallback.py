"""The built-in default network served while no real configuration exists.

A plain bridge with host-local IPAM on a private subnet: no iptables, no
masquerading, so it works on any node. `lo` is brought up by the sandbox
layer for every sandbox, so loopback works too. cniVersion 1.0.0 because
that is what Debian 12's reference plugins support.
"""

from __future__ import annotations

import json
import os

from cni_agent.cni.config import NetworkConfigList, parse_list

FALLBACK_NAME = "cni-agent-fallback"
FALLBACK_BRIDGE = "cniagent0"
FALLBACK_SUBNET = "10.234.0.0/24"


def fallback_network(state_dir: str) -> NetworkConfigList:
    """The built-in network; its IPAM state lives in the agent's own state dir."""
    doc = {
        "cniVersion": "1.0.0",
        "name": FALLBACK_NAME,
        "plugins": [{
            "type": "bridge",
            "bridge": FALLBACK_BRIDGE,
            "isGateway": True,
            "ipMasq": False,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": FALLBACK_SUBNET}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": os.path.join(state_dir, "fallback-ipam"),
            },
        }],
    }
    return parse_list(json.dumps(doc, indent=2).encode(), "<built-in fallback network>")
