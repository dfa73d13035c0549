"""3. Concurrency: N sandboxes set up at once from 8 client connections, then torn down.

Against the same N serially (one connection, one call at a time), and against
the Go libcni anchor (bench/libcni_anchor.go) doing the same N at once (a
goroutine each: every ADD, then every DEL), as CRI-O and containerd handle
many pods at once; rounds interleaved, the first way rotating, for bridge +
host-local and for a chain of 3 no-op C plugins. The agent at once against
libcni at once is one of the project's goals (bench/goals.py), judged on 100
sandboxes; without the anchor it FAILs (anchor missing).

Every round is checked for failures and leftovers. Where the time goes is
reported from CPU accounting (agent, its plugins, dbus-daemon, this client),
with the agent's CPU per call above the floor's (the same chain exec'd from
this process, serially), and, with a timing shim in front of host-local, from
host-local itself (its file lock serialises allocations).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

from bench import goals
from bench.anchor import Anchor, usable_anchor
from bench.harness import (
    Client,
    DirectChain,
    Lab,
    build_c,
    conflist,
    delete_link,
    floor_cpu_ms,
    links_with_master,
    netns_links,
    proc_cpu,
    unique,
)
from bench.report import figure, result
from cni_agent.sandboxes.store import recorded
from tests.support.agent import Agent
from tests.support.net import allocations
from tests.support.plugins import write_conf

# Speedup of 100 at once over serial, per network (issue 15: no-op plugins, where
# the agent itself is what is left to scale).
GOALS = {"pods": 1.7, "noopnet": 1.8}
GOAL = GOALS["pods"]
CONNECTIONS = 8
NETWORKS = ("pods", "noopnet")
WAYS = ("serial", "concurrent", "libcni")  # libcni: the anchor, N at once


class Rig:
    def __init__(self, lab: Lab, agent: Agent, clients: list[Client], netns: list[str], bridge: str) -> None:
        self.lab, self.agent, self.clients, self.netns, self.bridge = lab, agent, clients, netns, bridge
        self.errors: list[str] = []

    async def cycle(self, network: str, concurrent: bool) -> float:
        """Set up every sandbox, then tear all down; the wall time in seconds."""

        async def one(i: int, setup: bool) -> None:
            client = self.clients[i % len(self.clients)] if concurrent else self.clients[0]
            try:
                if setup:
                    await client.setup(f"conc-{i}", self.netns[i], network)
                else:
                    await client.teardown(f"conc-{i}", self.netns[i])
            except Exception as e:
                self.errors.append(str(e))

        t0 = time.perf_counter()
        for setup in (True, False):
            if concurrent:
                await asyncio.gather(*(one(i, setup) for i in range(len(self.netns))))
            else:
                for i in range(len(self.netns)):
                    await one(i, setup)
        return time.perf_counter() - t0

    def cpu(self) -> dict[str, float]:
        assert self.agent.proc is not None
        agent, plugins = proc_cpu(self.agent.proc.pid)
        me = os.times()
        return {"agent": agent, "plugins": plugins, "dbus-daemon": sum(proc_cpu(self.lab.bus.pid)),
                "client": me.user + me.system}

    def leftovers(self) -> dict[str, list[str]]:
        state, run = self.lab.tmp / "state", Path(self.agent.config["runtime_dir"])

        def ls(d: Path) -> list[str]:
            return sorted(n for n in os.listdir(d) if not n.startswith(".")) if d.exists() else []

        return {
            "host-local IPs": allocations(self.lab.tmp / "ipam", "pods"),
            "cache entries": ls(state / "results"), "sandbox records": sorted(recorded(str(state))),
            "lock files": ls(run / "locks"), "veths": links_with_master(self.bridge),
            "netns with links": [ns for ns in self.netns if netns_links(ns)],
        }


def run(smoke: bool) -> dict[str, Any]:
    count, rounds = (4, 1) if smoke else (100, 3)
    with asyncio.Runner() as runner, Lab("conc") as lab:
        lab.noop()
        bridge = unique("br")
        lab.cleanups.append(lambda: delete_link(bridge))
        configs = {
            "pods": conflist("pods", [
                {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
                 "ipam": {"type": "host-local", "subnet": "10.237.0.0/24",
                          "dataDir": str(lab.tmp / "ipam")}}]),
            "noopnet": conflist("noopnet", [{"type": "noop"}] * 3)}
        files = {"pods": write_conf(lab.conf_dir, "10-pods.conflist", configs["pods"]),
                 "noopnet": write_conf(lab.conf_dir, "20-noop.conflist", configs["noopnet"])}
        agent = lab.agent()
        clients = [runner.run(Client.connect(lab.bus.address)) for _ in range(CONNECTIONS)]
        lab.cleanups.extend(c.close for c in clients)
        assert runner.run(clients[0].call("WaitReady", "d", [10.0])) == [True], agent.log()
        rig = Rig(lab, agent, clients, lab.netns.many(count), bridge)
        # Warm-up: the bridge exists before any timing (creating it is a one-off).
        runner.run(clients[0].setup("warm-up", rig.netns[0], "pods"))
        runner.run(clients[0].teardown("warm-up", rig.netns[0]))
        plugin_dirs = [str(lab.bin), "/usr/lib/cni"]  # the agent's, as Lab configures it
        anchors, missing = start_anchors(lab, files, plugin_dirs, rig.netns[0])
        walls: dict[str, list[float]] = {}
        cpu: dict[str, list[dict[str, float]]] = {}
        left: dict[str, int] = {}
        floor: dict[str, float] = {}
        for network in NETWORKS:
            ways = [w for w in WAYS if w != "libcni" or network in anchors]
            for r in range(rounds):
                for way in ways[r % len(ways):] + ways[:r % len(ways)]:
                    key = f"{network}.{way}"
                    before = rig.cpu()
                    if way == "libcni":
                        t0 = time.perf_counter()
                        anchors[network].run("many", *rig.netns)
                        walls.setdefault(key, []).append(time.perf_counter() - t0)
                    else:
                        walls.setdefault(key, []).append(runner.run(rig.cycle(network, way == "concurrent")))
                    after = rig.cpu()
                    cpu.setdefault(key, []).append({k: after[k] - before[k] for k in after})
                    for what, items in rig.leftovers().items():
                        left[what] = left.get(what, 0) + len(items)
            # The floor, once: its CPU per call hardly varies (no wall time is compared).
            floor[network] = floor_cpu_ms(DirectChain(configs[network], plugin_dirs), rig.netns)
            for what, items in rig.leftovers().items():
                left[what] = left.get(what, 0) + len(items)
        libcni_cpu = {network: a.cpu for network, a in anchors.items()}
        speedup = statistics.median(walls["pods.serial"]) / statistics.median(walls["pods.concurrent"])
        shim = hostlocal_profile(rig, runner) if smoke or speedup < GOAL else None
    return _report(count, walls, cpu, left, rig.errors, shim,
                   Anchored(libcni_cpu, floor, missing))


def start_anchors(lab: Lab, files: dict[str, Path], plugin_dirs: list[str],
                  netns: str) -> tuple[dict[str, Anchor], str]:
    """One anchor per network, warmed up as the agent was; or none, and why.

    Each runs the agent's own conflist: the same bridge, address range and
    plugins (the ways never overlap in time), with a libcni cache of its own."""
    binary, missing = usable_anchor()
    anchors: dict[str, Anchor] = {}
    if binary is None:
        return anchors, missing
    for network in NETWORKS:
        anchor = anchors[network] = Anchor(binary, files[network], ":".join(plugin_dirs),
                                           lab.tmp / f"libcni-cache-{network}")
        lab.cleanups.append(anchor.close)
        anchor.run("pair", netns)
        anchor.cpu.clear()
    return anchors, ""


def hostlocal_profile(rig: Rig, runner: asyncio.Runner) -> dict[str, Any]:
    """One serial and one concurrent pods cycle with host-local behind the timing shim."""
    log = rig.lab.tmp / "hostlocal.times"
    shim = build_c("timeshim.c", rig.lab.bin / "host-local", REAL="/usr/lib/cni/host-local", LOG=str(log))
    out: dict[str, Any] = {}
    try:
        for concurrent in (False, True):
            log.unlink(missing_ok=True)
            wall = runner.run(rig.cycle("pods", concurrent))
            spans = [(int(a), int(b)) for _, a, b in (line.split() for line in log.read_text().splitlines())]
            out["concurrent" if concurrent else "serial"] = {
                "wall_s": wall, "calls_ms": [(b - a) / 1e6 for a, b in spans],
                "busy_s": _union(spans) / 1e9,
            }
    finally:
        shim.unlink()
    return out


def _union(spans: list[tuple[int, int]]) -> int:
    """Total time covered by at least one span (ns)."""
    total, end = 0, -1
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class Anchored(NamedTuple):
    """What the goal against libcni is judged with."""

    libcni_cpu: dict[str, list[float]]  # the anchor's own CPU per cycle (ms), per network
    floor_ms: dict[str, float]  # the floor's CPU per call, per network
    missing: str  # why there is no anchor ("" when there is)


def _report(count: int, walls: dict[str, list[float]], cpu: dict[str, list[dict[str, float]]],
            left: dict[str, int], errors: list[str], shim: dict[str, Any] | None,
            anchored: Anchored) -> dict[str, Any]:
    figures, notes = [], []
    ncpu = os.cpu_count() or 1
    for network in NETWORKS:
        serial, conc = walls[f"{network}.serial"], walls[f"{network}.concurrent"]
        speedup = statistics.median(serial) / statistics.median(conc)
        figures += [
            figure(f"concurrency.{network}.serial", serial, "s", note=f"{count} sandboxes, 1 connection"),
            figure(f"concurrency.{network}.concurrent", conc, "s", ratio=speedup,
                   goal=f"speedup, goal ≥{GOALS[network]}x", passed=speedup >= GOALS[network],
                   note=f"{count} at once over {CONNECTIONS} connections"),
        ]
        figures += _against_libcni(network, count, walls, cpu, anchored)
        for mode in ("serial", "concurrent"):
            runs = cpu[f"{network}.{mode}"]
            used = {k: statistics.median(c[k] for c in runs) for k in runs[0]}
            total = sum(used.values())
            wall = statistics.median(walls[f"{network}.{mode}"])
            notes.append(f"{network} {mode}: CPU s per cycle "
                         + ", ".join(f"{k} {v:.2f}" for k, v in used.items())
                         + f"; total {total:.2f} = {total / ncpu:.2f} s on {ncpu} cores vs wall {wall:.2f} s")
    figures.append(figure("concurrency.failures", [len(errors)], "count", goal="must be 0", passed=not errors,
                          note=errors[0][:80] if errors else ""))
    bad = {k: v for k, v in left.items() if v}
    figures.append(figure("concurrency.leftovers", [sum(left.values())], "count", goal="must be 0",
                          passed=not bad, note=", ".join(f"{k} {v}" for k, v in bad.items())))
    if shim:
        for mode, data in shim.items():
            busy = f"per call; busy {data['busy_s']:.2f} s of {data['wall_s']:.2f} s wall"
            figures.append(figure(f"concurrency.host-local.{mode}", data["calls_ms"], note=busy))
        serial_work = sum(shim["serial"]["calls_ms"]) / 1000
        notes.append(f"host-local: its calls take {serial_work:.2f} s in a serial cycle; its lock serialises "
                     "them, so a concurrent cycle cannot beat that "
                     f"(it took {shim['concurrent']['wall_s']:.2f} s)")
    return result(figures, notes, walls=walls, cpu=cpu, leftovers=left, errors=errors[:20], host_local=shim,
                  libcni_cpu_ms=anchored.libcni_cpu, floor_cpu_ms_per_call=anchored.floor_ms)


def _against_libcni(network: str, count: int, walls: dict[str, list[float]],
                    cpu: dict[str, list[dict[str, float]]], anchored: Anchored) -> list[Any]:
    """The goal: the agent's N at once against the anchor's N at once, and the CPU
    per call of both (a cycle is 2N calls: N Setups, N Teardowns)."""
    conc = walls[f"{network}.concurrent"]
    per_call = [c["agent"] * 1000 / (2 * count) for c in cpu[f"{network}.concurrent"]]
    agent_ms, floor = statistics.median(per_call), anchored.floor_ms[network]
    name = f"concurrency.{network}.vs_libcni"
    what = f"{count} at once over {CONNECTIONS} connections against libcni's {count} at once"
    cpu_note = (f"the agent's CPU per call, {count} at once (10 ms ticks over the cycle); "
                f"the floor's {floor:.2f} ms")
    if network not in anchored.libcni_cpu:
        return [figure(name, conc, "s", note=what, **goals.judge(
                    name, None, missing=anchored.missing, above_floor_ms=agent_ms - floor)),
                figure(f"concurrency.{network}.cpu_per_call", per_call, note=cpu_note)]
    libcni = walls[f"{network}.libcni"]
    r = statistics.median(conc) / statistics.median(libcni)
    libcni_ms = statistics.median(anchored.libcni_cpu[network]) / (2 * count)
    return [
        figure(name, conc, "s", ratio=r, note=what, **goals.judge(
            name, r, above_floor_ms=agent_ms - floor,
            versus=f"{statistics.median(conc):.2f} vs {statistics.median(libcni):.2f} s, {count} sandboxes")),
        figure(f"concurrency.{network}.libcni", libcni, "s",
               note=f"libcni (Go, one process): {count} ADDs at once, then {count} DELs at once"),
        figure(f"concurrency.{network}.cpu_per_call", per_call,
               ratio=agent_ms / libcni_ms if libcni_ms else None,
               note=f"{cpu_note}; ratio: against libcni's own, {libcni_ms:.2f} ms"),
    ]
