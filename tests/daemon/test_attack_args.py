"""A member may not pick its address through CNI_ARGS when `ips` is closed to it.

Issue 35 closed the capabilities that reach other sandboxes' addresses
(`ips`, `mac`, ...) to callers that are not root unless the admin lists them
in `access.capabilities`. host-local (1.1.1) takes a requested address from
CNI_ARGS too (`IP=`, with `IgnoreUnknown=1` so bridge lets it pass): the
same lever as the `ips` capability, under another name. Root may (see
tests/daemon/test_sandboxes.py::test_args_a_plugin_rejects_fail_setup_cleanly).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.test_owners import cli, own_netns
from tests.support.agent import Agent, Bus
from tests.support.net import allocations

pytestmark = pytest.mark.root


def test_a_member_cannot_choose_its_address_through_args_when_ips_is_closed(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str, member: str,
    tmp_path: Path,
) -> None:
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods"]})
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        # The capability: refused (test_hostile_callers covers it; here as the reference).
        out = cli(agent, member, "setup", "vm1", path, "--capabilities",
                  json.dumps({"ips": ["10.215.0.77/24"]}))
        assert out.returncode == 4, out
        # The same address through CNI_ARGS: refused as well, and not allocated.
        out = cli(agent, member, "setup", "vm1", path, "--arg", "IgnoreUnknown=1",
                  "--arg", "IP=10.215.0.77")
        assert "10.215.0.77" not in allocations(tmp_path / "ipam", "pods"), \
            (out.stdout, allocations(tmp_path / "ipam", "pods"))
        assert out.returncode == 4 and "argument IP sets what capability 'ips' sets" in out.stderr, out
    finally:
        cli(agent, member, "teardown", "vm1", path)
        mine.kill()
