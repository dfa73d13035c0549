"""The pool size cni/pool.py computes is what the real host-local hands out.

host-local is run on its own (it touches no namespace) with new container
ids until it refuses: the addresses it leased are the pool.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cni_agent.cni.config import parse_list
from cni_agent.cni.pool import pool_of
from tests.support.net import allocations
from tests.support.plugins import REFERENCE_PLUGIN_DIR

pytestmark = pytest.mark.root


def lease_all(ipam: dict[str, Any], data_dir: Path, most: int = 64) -> int:
    """ADDs until host-local refuses: how many it answered."""
    conf = json.dumps({"cniVersion": "1.0.0", "name": "pool",
                       "ipam": {**ipam, "dataDir": str(data_dir)}})
    for i in range(most + 1):
        env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": f"c{i}", "CNI_NETNS": "/proc/self/ns/net",
               "CNI_IFNAME": "eth0", "CNI_PATH": REFERENCE_PLUGIN_DIR, "PATH": os.environ["PATH"]}
        out = subprocess.run([f"{REFERENCE_PLUGIN_DIR}/host-local"], input=conf, env=env,
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            assert "no IP addresses available" in out.stdout, out
            return i
    raise AssertionError(f"host-local gave more than {most} addresses")


@pytest.mark.parametrize("ipam", [
    {"type": "host-local", "subnet": "10.231.0.0/28", "rangeStart": "10.231.0.2",
     "rangeEnd": "10.231.0.13"},
    {"type": "host-local", "subnet": "10.231.0.0/28", "rangeStart": "10.231.0.1",
     "rangeEnd": "10.231.0.6"},
    {"type": "host-local", "subnet": "10.231.0.0/28", "gateway": "10.231.0.9"},
    {"type": "host-local", "ranges": [[{"subnet": "10.231.0.0/29"}, {"subnet": "10.232.0.0/30"}],
                                      [{"subnet": "fd00:231::/124"}]]},
], ids=["range-12", "gateway-inside", "gateway-moved", "two-range-sets"])
def test_host_local_leases_exactly_the_computed_pool(ipam: dict[str, Any], tmp_path: Path) -> None:
    net = parse_list(json.dumps({"cniVersion": "1.0.0", "name": "pool", "plugins": [
        {"type": "bridge", "bridge": "unused", "ipam": ipam}]}).encode())
    pool = pool_of(net)
    assert pool is not None
    leased = lease_all(ipam, tmp_path)
    assert leased == pool.size
    # One address of every range set per attachment.
    assert len(allocations(tmp_path, "pool")) == leased * len(pool.range_sets)
