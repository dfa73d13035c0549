"""2. cni-agent-shim: what a runtime pays per CNI call through the shim.

Interleaved per round: ADD+DEL of one attachment (3 no-op C plugins) and a
STATUS, each through the installed-style shim binary (exec'd with the CNI
environment and stdin, as libcni does) on the agent's socket, the same binary
on the bus (its fallback: the socket path absent), and as the same CNICall
from an in-process dbus-fast client (the agent's side alone, over the bus).
The shim's CPU is its own process's (user + system, from the kernel's
accounting of the reaped child); the agent's work is the same in all.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
from collections.abc import Callable
from typing import Any

from bench.harness import CallFailed, Client, Lab, children_cpu_ms, conflist, interleave, proc_cpu_ns
from bench.report import figure, ratio, result
from tests.support.plugins import write_conf
from tests.support.shim import SHIM

GOAL_EXTRA_MS, GOAL_CPU_MS, GOAL_STATUS_MS = 10.0, 8.0, 10.0
SID = "bench-shim"


def run(smoke: bool) -> dict[str, Any]:
    rounds, warmup = (1, 0) if smoke else (200, 10)
    with asyncio.Runner() as runner, Lab("shim") as lab:
        lab.noop()
        write_conf(lab.conf_dir, "10-noop.conflist",
                   conflist("noopchain", [{"type": "noop"}] * 3, "1.0.0"))
        agent = lab.agent()
        client = runner.run(Client.connect(lab.bus.address))
        lab.cleanups.append(client.close)
        assert runner.run(client.call("WaitReady", "d", [10.0])) == [True], agent.log()
        ns = lab.netns.add()
        config = json.dumps({"cniVersion": "1.0.0", "name": "pods", "type": "cni-agent-shim",
                             "network": "noopchain"})
        status_config = config.replace('"1.0.0"', '"1.1.0"')
        base = {"PATH": os.environ["PATH"], "DBUS_SYSTEM_BUS_ADDRESS": lab.bus.address,
                "CNI_PATH": "/usr/lib/cni"}
        socket = {"shim": str(agent.shim_socket), "bus": str(lab.tmp / "no-agent-here.sock")}
        call_env = {"CNI_CONTAINERID": SID, "CNI_NETNS": ns, "CNI_IFNAME": "eth0"}
        cpu: dict[str, list[float]] = {name: [] for name in (
            "shim_pair", "shim_status", "bus_pair", "bus_status",
            "agent_shim_status", "agent_bus_status", "daemon_shim_status", "daemon_bus_status")}
        assert agent.proc is not None
        pid = agent.proc.pid

        def shim(command: str, stdin: str, into: str) -> None:
            env = {**base, "CNI_COMMAND": command, **(call_env if command != "STATUS" else {}),
                   "CNI_AGENT_SHIM_SOCKET": socket[into.split("_")[0]]}
            before, agent_before = children_cpu_ms(), proc_cpu_ns(pid)
            daemon_before = proc_cpu_ns(lab.bus.pid)
            out = subprocess.run([str(SHIM)], input=stdin, env=env, capture_output=True, text=True)
            cpu[into].append(children_cpu_ms() - before)
            if command == "STATUS":  # the agent's and the bus's side of a call that runs no plugin
                cpu[f"agent_{into}"].append((proc_cpu_ns(pid) - agent_before) / 1e6)
                cpu[f"daemon_{into}"].append((proc_cpu_ns(lab.bus.pid) - daemon_before) / 1e6)
            if out.returncode != 0:
                raise CallFailed(f"shim {command}: {out.stdout} {out.stderr}")

        async def cnicall(command: str, stdin: str) -> None:
            env = {"CNI_COMMAND": command, **(call_env if command != "STATUS" else {})}
            status, output = await client.call("CNICall", "a{ss}s", [env, stdin])
            if status != 0:
                raise CallFailed(f"CNICall {command}: {output}")

        async def direct_pair() -> None:
            await cnicall("ADD", config)
            await cnicall("DEL", config)

        def pair(way: str) -> None:
            shim("ADD", config, f"{way}_pair")
            shim("DEL", config, f"{way}_pair")

        ways: dict[str, Callable[[], Any]] = {
            "direct_pair": lambda: runner.run(direct_pair()),
            "shim_pair": lambda: pair("shim"),
            "bus_pair": lambda: pair("bus"),
            "direct_status": lambda: runner.run(cnicall("STATUS", status_config)),
            "shim_status": lambda: shim("STATUS", status_config, "shim_status"),
            "bus_status": lambda: shim("STATUS", status_config, "bus_status"),
        }

        def forget_warmup() -> None:
            for series in cpu.values():
                series.clear()

        samples = interleave(ways, rounds, warmup, on_warmed_up=forget_warmup)
    return _report(samples, cpu)


def _report(s: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict[str, Any]:
    # Per invocation: a pair is two shim runs (ADD, DEL).
    extra = [(a - b) / 2 for a, b in zip(s["shim_pair"], s["direct_pair"], strict=True)]
    status_extra = [a - b for a, b in zip(s["shim_status"], s["direct_status"], strict=True)]
    add_del_cpu = cpu["shim_pair"]
    median_cpu = statistics.median(add_del_cpu + cpu["shim_status"])
    bus_cpu = cpu["bus_pair"] + cpu["bus_status"]
    figures = [
        figure("shim.add_del.direct", s["direct_pair"],
               note="ADD+DEL as CNICall from dbus-fast (the agent's side alone)"),
        figure("shim.add_del", s["shim_pair"], note="ADD+DEL, each an exec of cni-agent-shim on "
                                                     "the agent's socket"),
        figure("shim.add_del.bus", s["bus_pair"], ratio=ratio(s["shim_pair"], s["bus_pair"]),
               note="the same on the bus (the shim's fallback); ratio: socket / bus"),
        figure("shim.extra", extra, goal=f"goal ≤ {GOAL_EXTRA_MS:g} ms per invocation",
               passed=statistics.median(extra) <= GOAL_EXTRA_MS,
               note="wall the shim adds per invocation (paired, (shim - direct) / 2)"),
        figure("shim.cpu", add_del_cpu + cpu["shim_status"],
               goal=f"goal ≤ {GOAL_CPU_MS:g} ms per invocation", passed=median_cpu <= GOAL_CPU_MS,
               note="the shim process's own CPU (user + system) per invocation, on the socket"),
        figure("shim.cpu.bus", bus_cpu,
               ratio=median_cpu / statistics.median(bus_cpu) if statistics.median(bus_cpu) else None,
               note="the same on the bus (libsystemd loaded, sd-bus); ratio: socket / bus"),
        figure("shim.status", s["shim_status"], goal=f"goal ≤ {GOAL_STATUS_MS:g} ms",
               passed=statistics.median(s["shim_status"]) <= GOAL_STATUS_MS,
               note="a runtime's STATUS through the shim on the socket, exec to exit"),
        figure("shim.status.bus", s["bus_status"], ratio=ratio(s["shim_status"], s["bus_status"]),
               note="the same on the bus; ratio: socket / bus"),
        figure("shim.status.agent_cpu", cpu["agent_shim_status"],
               ratio=ratio(cpu["agent_shim_status"], cpu["agent_bus_status"]),
               note="the agent's CPU (all threads) while the shim's STATUS runs, on the socket; "
                    f"on the bus {statistics.median(cpu['agent_bus_status']):.2f} ms (ratio: "
                    "socket / bus): what each way costs the agent, no plugin run"),
        figure("shim.status.bus_daemon_cpu", cpu["daemon_bus_status"],
               note="dbus-daemon's CPU while the shim's STATUS runs on the bus (its Hello, the "
                    "call, the agent's credentials look-up); on the socket "
                    f"{statistics.median(cpu['daemon_shim_status']):.2f} ms"),
        figure("shim.status.direct", s["direct_status"], note="the same CNICall from dbus-fast"),
        figure("shim.status.extra", status_extra, note="paired, shim minus direct"),
    ]
    return result(figures, ["shim: cni-agent-shim (C) exec'd as libcni does, on the agent's socket "
                            "and on the bus, interleaved; 3 no-op C plugins, one netns; CPU from "
                            "RUSAGE_CHILDREN of each reaped shim"])
