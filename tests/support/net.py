"""Looking at what the reference plugins did to the host and namespaces."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def netns_name(path: str) -> str:
    return os.path.basename(path)


def addresses(netns_path: str, ifname: str = "eth0") -> list[str]:
    """CIDRs on an interface inside a netns, as `ip -n` shows them."""
    out = subprocess.run(
        ["ip", "-n", netns_name(netns_path), "-j", "addr", "show", "dev", ifname],
        capture_output=True, text=True,
    )
    if out.returncode != 0:
        return []
    links = json.loads(out.stdout or "[]")
    return [f"{a['local']}/{a['prefixlen']}" for link in links for a in link.get("addr_info", [])
            if a.get("family") == "inet"]


def link_exists(name: str, netns_path: str | None = None) -> bool:
    cmd = ["ip"] + (["-n", netns_name(netns_path)] if netns_path else []) + ["link", "show", name]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def delete_link(name: str) -> None:
    subprocess.run(["ip", "link", "del", name], capture_output=True)


def allocations(data_dir: Path, network: str) -> list[str]:
    """IPs host-local holds for a network (one file per address)."""
    d = data_dir / network
    if not d.exists():
        return []
    return sorted(p.name for p in d.iterdir()
                  if p.name[0].isdigit() or ":" in p.name)
