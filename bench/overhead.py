"""1. Per-call overhead: Setup+Teardown of one sandbox over D-Bus, 3 no-op C plugins.

Interleaved per round (the first of each round rotates): the chain executed
directly from Python (the floor), the agent through an in-process dbus-fast
client, the agent through `busctl` processes, and an empty D-Bus round trip
(WaitReady on a ready agent) to show what the bus alone costs.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.harness import Client, DirectChain, Lab, busctl, conflist, ms_since
from bench.report import figure, ratio, result
from tests.support.plugins import write_conf

GOAL_RATIO, GOAL_MS = 1.15, 3.0
SID = "bench-overhead"


def run(smoke: bool) -> dict[str, Any]:
    rounds, warmup = (1, 0) if smoke else (200, 10)
    with asyncio.Runner() as runner, Lab("overhead") as lab:
        lab.noop()
        config = conflist("noopchain", [{"type": "noop"}] * 3, "1.0.0")
        write_conf(lab.conf_dir, "10-noop.conflist", config)
        agent = lab.agent()
        client = runner.run(Client.connect(lab.bus.address))
        lab.cleanups.append(client.close)
        assert runner.run(client.call("WaitReady", "d", [10.0])) == [True], agent.log()
        ns = lab.netns.add()
        direct = DirectChain(config, [str(lab.bin), "/usr/lib/cni"])
        address = lab.bus.address

        async def dbus_pair() -> None:
            await client.setup(SID, ns)
            await client.teardown(SID, ns)

        def via_direct() -> None:
            direct.delete(SID, ns, direct.add(SID, ns))

        def via_busctl() -> None:
            busctl(address, "Setup", "ssa{sv}", SID, ns, "0")
            busctl(address, "Teardown", "ssa{sv}", SID, ns, "0")

        ways: dict[str, Callable[[], Any]] = {
            "direct": via_direct,
            "dbus_fast": lambda: runner.run(dbus_pair()),
            "busctl": via_busctl,
            "dbus_roundtrip": lambda: runner.run(client.call("WaitReady", "d", [0.0])),
        }
        samples: dict[str, list[float]] = {name: [] for name in ways}
        order = list(ways)
        for i in range(warmup + rounds):
            k = i % len(order)
            for name in order[k:] + order[:k]:
                t0 = time.perf_counter()
                ways[name]()
                if i >= warmup:
                    samples[name].append(ms_since(t0))
    return _report(samples)


def _report(s: dict[str, list[float]]) -> dict[str, Any]:
    floor = statistics.median(s["direct"])
    goal = f"goal ≤{GOAL_RATIO}x direct + {GOAL_MS:g} ms = {GOAL_RATIO * floor + GOAL_MS:.2f} ms"
    extra = {k: [a - b for a, b in zip(s[k], s["direct"], strict=True)] for k in ("dbus_fast", "busctl")}
    figures = [
        figure("overhead.direct", s["direct"], note="Setup+Teardown floor: 6 fork/exec from Python"),
        figure("overhead.dbus_fast", s["dbus_fast"], ratio=ratio(s["dbus_fast"], s["direct"]), goal=goal,
               passed=statistics.median(s["dbus_fast"]) <= GOAL_RATIO * floor + GOAL_MS),
        figure("overhead.dbus_fast.extra", extra["dbus_fast"],
               note="agent's own cost per Setup+Teardown (paired, minus direct)"),
        figure("overhead.busctl", s["busctl"], ratio=ratio(s["busctl"], s["direct"]),
               note="includes starting 2 busctl processes"),
        figure("overhead.busctl.extra", extra["busctl"], note="paired, minus direct"),
        figure("overhead.dbus_roundtrip", s["dbus_roundtrip"], note="WaitReady: the bus alone"),
    ]
    return result(figures, ["overhead: 3 no-op C plugins, cniVersion 1.0.0 (no STATUS), one netns; "
                            "ratios are median/median of interleaved series"])
