"""7. What a CHECK pass costs: one pass over 250 sandboxes (issue 26).

250 sandboxes on a network of 3 C no-op plugins (CHECK passes at once), so
what is measured is the agent's own work per attachment: the record and cache
reads, the namespace pin and identity check, the lock, three plugin spawns.
The pass is run through CheckSandboxes (the `cni-agent check` path: the same
CHECKs as a scheduled pass, waiting for locks instead of skipping busy ones);
scheduled passes are off so nothing else runs meanwhile. The sandboxes share
one namespace (the no-op plugins make no interfaces).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from bench.harness import Client, Lab, conflist, proc_cpu, proc_cpu_ns
from bench.report import figure, result
from tests.support.plugins import write_conf

SANDBOXES = 250
PLUGINS = 3


def run(smoke: bool) -> dict[str, Any]:
    count, rounds = (10, 1) if smoke else (SANDBOXES, 5)
    with asyncio.Runner() as runner, Lab("checks") as lab:
        lab.noop()
        write_conf(lab.conf_dir, "10-noop.conflist",
                   conflist("noopchain", [{"type": "noop"}] * PLUGINS, "1.0.0"))
        agent = lab.agent(check={"interval": 0})
        client = runner.run(Client.connect(lab.bus.address))
        lab.cleanups.append(client.close)
        assert runner.run(client.call("WaitReady", "d", [10.0])) == [True], agent.log()
        ns = lab.netns.add()

        async def populate() -> None:
            for i in range(count):
                await client.setup(f"chk-{i}", ns)

        runner.run(populate())
        assert agent.proc is not None
        pid = agent.proc.pid
        cpu, children, wall = [], [], []
        for _ in range(rounds):
            c0, (_, k0), t0 = proc_cpu_ns(pid), proc_cpu(pid), time.perf_counter()
            [text] = runner.run(client.call("CheckSandboxes", "as", [[]]))
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((proc_cpu_ns(pid) - c0) / 1e6)
            children.append((proc_cpu(pid)[1] - k0) * 1e3)
            rows = json.loads(text)["attachments"]
            assert len(rows) == count and {r["state"] for r in rows} == {"ok"}, rows[:2]
    per = [c / count for c in cpu]
    return result([
        figure("checks.pass.cpu", cpu, note=f"agent CPU of one pass over {count} sandboxes "
                                            f"({PLUGINS} no-op plugins each)"),
        figure("checks.pass.per_sandbox", per, note="agent CPU per sandbox CHECKed"),
        figure("checks.pass.plugins", children, note="the plugins' CPU (10 ms ticks)"),
        figure("checks.pass.wall", wall, note="wall time, at most 4 sandboxes at once "
                                              "(check.concurrency)"),
    ], [f"checks: a pass over {count} sandboxes costs the agent "
        f"{sorted(cpu)[len(cpu) // 2]:.0f} ms of CPU; at check.interval 300 that is "
        f"{sorted(cpu)[len(cpu) // 2] / 3000:.3f}% of one core"])
