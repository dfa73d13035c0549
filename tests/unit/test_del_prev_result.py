"""A DEL's prevResult is the cached result in the version of the config the DEL uses."""

from __future__ import annotations

import json
from pathlib import Path

from cni_agent.cni.config import parse_list
from cni_agent.cni.runtime import CNIRuntime, RuntimeConf
from tests.support.fakeexec import FakeExecutor

CACHED_1_0 = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0"}],
              "ips": [{"address": "10.1.0.5/24", "interface": 0}]}


async def test_stale_del_converts_the_cached_result_to_the_current_configs_version(
        tmp_path: Path) -> None:
    # The ADD ran with a 1.0.0 list; the DEL falls back to today's 0.4.0 one.
    fake = FakeExecutor()
    runtime = CNIRuntime(["/fake"], str(tmp_path), executor=fake)
    current = parse_list(json.dumps(
        {"cniVersion": "0.4.0", "name": "n", "plugins": [{"type": "fake"}]}).encode())
    await runtime.delete(current, RuntimeConf("c1", "", "eth0"), prev_result=CACHED_1_0)
    [call] = fake.of("DEL")
    prev = call.stdin["prevResult"]
    assert prev["cniVersion"] == "0.4.0"
    assert prev["ips"] == [{"version": "4", "address": "10.1.0.5/24", "interface": 0}]
