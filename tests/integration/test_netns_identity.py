"""Namespace identity without the kernel's id (issue 12, item 4): an inode can be
a recreated namespace's, so what the attachment left there must be there too."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cni_agent.cni.cache import CachedAttachment
from cni_agent.node.netns import NetnsId, pin
from cni_agent.sandboxes.journal import is_recorded
from cni_agent.sandboxes.records import Attachment, Phase, SandboxRecord

pytestmark = pytest.mark.root
MAC = "02:00:00:ab:cd:ef"


def _entries(netns: str, ifaces: list[dict[str, Any]]) -> dict[tuple[str, str], CachedAttachment]:
    entry = CachedAttachment("s1", "n1", "eth0", netns, b"{}",
                             result={"cniVersion": "1.0.0", "interfaces": ifaces})
    return {("n1", "eth0"): entry}


def _record(netns: str, ident: NetnsId) -> SandboxRecord:
    return SandboxRecord("s1", netns, ident, (Attachment("n1", "eth0", b"{}", phase=Phase.READY),))


def _veth(netns: str, name: str = "eth0", mac: str = MAC) -> None:
    subprocess.run(["ip", "-n", Path(netns).name, "link", "add", name, "address", mac, "type",
                    "veth", "peer", "name", "peer0"], check=True)


@pytest.mark.parametrize(("present", "recorded_mac", "live"), [
    (True, MAC, True),                 # the interface and its MAC are there: the same namespace
    (True, MAC.upper(), True),         # MACs compare case-insensitively
    (True, "02:00:00:00:00:99", False),  # another MAC: another namespace
    (False, MAC, False),               # the recorded interface is missing: another namespace
])
async def test_without_a_kernel_id_the_interface_and_mac_decide(
        netns: str, present: bool, recorded_mac: str, live: bool) -> None:
    if present:
        _veth(netns)
    with pin(netns) as ns:
        uncertain = dataclasses.replace(ns.identity, nsid=None)  # Linux < 6.11, old records
        entries = _entries(netns, [{"name": "eth0", "mac": recorded_mac, "sandbox": netns},
                                   {"name": "cab0", "mac": "02:00:00:00:00:77"}])  # host side
        assert await is_recorded(_record(netns, uncertain), entries, ns) is live


async def test_the_kernel_id_settles_it_and_no_evidence_means_the_inode(netns: str) -> None:
    with pin(netns) as ns:
        entries = _entries(netns, [{"name": "eth0", "mac": MAC, "sandbox": netns}])
        assert await is_recorded(_record(netns, ns.identity), entries, ns)  # certain: no look
        uncertain = dataclasses.replace(ns.identity, nsid=None)
        # Nothing recorded to confirm by (no MAC, or not the attachment's interface).
        for ifaces in ([{"name": "eth0", "sandbox": netns}], [{"name": "x", "mac": MAC,
                                                              "sandbox": netns}]):
            assert await is_recorded(_record(netns, uncertain), _entries(netns, ifaces), ns)
        other = dataclasses.replace(uncertain, ino=uncertain.ino + 1)
        assert not await is_recorded(_record(netns, other), entries, ns)
