"""A power cut that damages a member's record never blocks the member's Teardown.

docs/reliability.md, "Damaged state never blocks": a record the journal lost
(its lines zeroed by a power cut) or cannot use leaves the sandbox to the
cache entries that name it; Teardown DELs what they list.
tests/daemon/test_between_calls.py proves it for root's sandboxes. A
member's sandbox lives in its own id space (`cni-agent.u<UID>.ID`, which root
may not create in), so its cache entries are the member's whatever the
record says: its Teardown must release the address as root's does, not leave
it until its namespace dies.
"""

from __future__ import annotations

import pwd
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.test_owners import cli, own_netns
from tests.support.agent import Agent, Bus
from tests.support.net import allocations
from tests.support.state import lose

pytestmark = pytest.mark.root


def test_a_members_teardown_works_from_the_cache_after_a_power_cut_zeroed_its_record(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str, member: str,
    tmp_path: Path,
) -> None:
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods"]})
    uid = pwd.getpwnam(member).pw_uid
    mine = own_netns(member)
    try:
        assert cli(agent, member, "setup", "vm1", f"/proc/{mine.pid}/ns/net").returncode == 0
        assert len(allocations(tmp_path / "ipam", "pods")) == 1
        assert agent.stop() == 0
        assert lose(tmp_path / "state", f"cni-agent.u{uid}.vm1")  # what a power cut zeroes
        agent.start()
        assert agent.call("WaitReady", "d", "10")[0] is True
        out = cli(agent, member, "teardown", "vm1", f"/proc/{mine.pid}/ns/net")
        assert out.returncode == 0, out
        assert allocations(tmp_path / "ipam", "pods") == []
        assert agent.call("ListSandboxes")[0] == []
    finally:
        mine.kill()
