"""2. Real plugins: Setup and Teardown with bridge + host-local + portmap, serially.

Each sandbox gets a fresh netns and a host port mapping (so portmap really
writes iptables rules). Interleaved with the same chain executed directly,
for the ratio. The bridge and every netns are removed at the end.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from bench.harness import Client, DirectChain, Lab, conflist, delete_link, ms_since, unique
from bench.report import figure, p95, ratio, result
from tests.support.net import allocations
from tests.support.plugins import write_conf

SUBNET = "10.236.0.0/24"


def chain(bridge: str, ipam_dir: Path) -> list[dict[str, Any]]:
    return [
        {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
         "ipam": {"type": "host-local", "subnet": SUBNET, "dataDir": str(ipam_dir)}},
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ]


def ports(i: int) -> dict[str, Any]:
    return {"portMappings": [{"hostPort": 31000 + i, "containerPort": 80, "protocol": "tcp"}]}


def run(smoke: bool) -> dict[str, Any]:
    count, warmup = (1, 0) if smoke else (30, 2)
    with asyncio.Runner() as runner, Lab("real") as lab:
        bridge = unique("br")
        lab.cleanups.append(lambda: delete_link(bridge))
        config = conflist("pods", chain(bridge, lab.tmp / "ipam"), "1.0.0")
        write_conf(lab.conf_dir, "10-pods.conflist", config)
        agent = lab.agent()
        client = runner.run(Client.connect(lab.bus.address))
        lab.cleanups.append(client.close)
        assert runner.run(client.call("WaitReady", "d", [10.0])) == [True], agent.log()
        direct = DirectChain(config, ["/usr/lib/cni"])
        setup: list[float] = []
        teardown: list[float] = []
        agent_total: list[float] = []
        direct_total: list[float] = []
        for i in range(warmup + count):
            ns_agent, ns_direct = lab.netns.add(), lab.netns.add()
            t0 = time.perf_counter()
            runner.run(client.setup(f"real-{i}", ns_agent, caps=ports(i)))
            t1 = time.perf_counter()
            runner.run(client.teardown(f"real-{i}", ns_agent))
            t2 = time.perf_counter()
            prev = direct.add(f"direct-{i}", ns_direct, ports(500 + i))
            direct.delete(f"direct-{i}", ns_direct, prev, ports(500 + i))
            if i >= warmup:
                setup.append((t1 - t0) * 1000)
                teardown.append((t2 - t1) * 1000)
                agent_total.append((t2 - t0) * 1000)
                direct_total.append(ms_since(t2))
        leftover = allocations(lab.tmp / "ipam", "pods")
    figures = [
        figure("real.setup", setup, note=f"p95 {p95(setup):.1f} ms"),
        figure("real.teardown", teardown, note=f"p95 {p95(teardown):.1f} ms"),
        figure("real.setup_teardown", agent_total, ratio=ratio(agent_total, direct_total),
               note=f"p95 {p95(agent_total):.1f} ms; ratio vs direct"),
        figure("real.direct.setup_teardown", direct_total, note=f"p95 {p95(direct_total):.1f} ms"),
        figure("real.leftover_ips", [len(leftover)], "count", goal="must be 0", passed=not leftover),
    ]
    return result(figures, ["real_plugins: /usr/lib/cni bridge + host-local + portmap (1 hostPort each), "
                            "cniVersion 1.0.0, a fresh netns per sandbox, serial, agent and direct "
                            "interleaved"])
