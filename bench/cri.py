"""7. CRI: what a node user feels. RunPodSandbox, StopPodSandbox and
RemovePodSandbox through containerd 2.x, with containerd's own in-process CNI
versus through the shim and the agent, and the cost of one CRI `Status`.

Two containerds (tests/cri/containerd.py), one pause image: "own" has the
bridge + host-local + portmap chain in its conf dir; "shim" has only the
conflist of `cni-agent shim-config --runtime containerd`, and the agent
(production settings) runs the same chain on a bridge of its own. Two
containerds, not two runtime handlers of one, because CRI `Status` runs
STATUS on the default network only. Every round runs each way once, the
first rotating; every pod has one hostPort, so portmap writes rules.

The plugins are 1.9.1 (Debian unstable's, cached by tools/setup-system) when
present, at cniVersion 1.1.0, as on a containerd 2 node; else Debian 12's
1.1.1 at 1.0.0, where containerd's own Status runs no STATUS at all and the
Status ratio says little (noted).

`cri.pod` is one of the project's goals (bench/goals.py). Beside it, the
agent's CPU per shim call (its CPU over each pod through the shim, all
threads, divided by containerd's three calls: ADD, DEL, DEL) above the floor's:
this thread's own CPU per call exec'ing the same chain directly, measured on a
few sandboxes of a third bridge after the rounds.
"""

from __future__ import annotations

import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import goals
from bench.harness import (
    DirectChain,
    Lab,
    bridge_chain,
    delete_link,
    floor_cpu_ms,
    proc_cpu_ns,
    reference_plugins,
    unique,
)
from bench.report import figure, ratio, result
from tests.cri.containerd import Containerd
from tests.cri.cri import CRI, Pod, PortMapping
from tests.cri.image import build_image
from tests.support.net import allocations
from tests.support.plugins import write_conf

SUBNETS = {"own": "10.234.0.0/22", "shim": "10.235.0.0/22", "floor": "10.228.0.0/24"}
# cri.pod's goal is the project's (bench/goals.py); these are this benchmark's own.
GOALS = {"run": 1.05, "stop": 1.05, "burst": 1.00, "status": 0.5}
CALLS_PER_POD = 3  # containerd's through the shim: ADD at run, DEL at stop, DEL at remove
WAYS = ("own", "shim")


class Pods:
    """Unique pods, each with its own hostPort."""

    def __init__(self) -> None:
        self.n = 0

    def next(self, way: str) -> Pod:
        self.n += 1
        return Pod(f"{way}-{self.n}", port_mappings=[PortMapping(80, 20000 + self.n)])


def cycle(cri: CRI, pod: Pod) -> tuple[float, float, float]:
    """(run, stop, remove) wall ms of one pod."""
    t0 = time.perf_counter()
    sandbox = cri.run(pod)
    t1 = time.perf_counter()
    cri.stop(sandbox)
    t2 = time.perf_counter()
    cri.remove(sandbox)
    t3 = time.perf_counter()
    return (t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t2) * 1000


def burst(pool: ThreadPoolExecutor, cri: CRI, pods: list[Pod]) -> tuple[float, float, float]:
    """(run, stop, remove) wall ms of all `pods` at once, each phase after the last."""
    t0 = time.perf_counter()
    sandboxes = list(pool.map(cri.run, pods))
    t1 = time.perf_counter()
    list(pool.map(cri.stop, sandboxes))
    t2 = time.perf_counter()
    list(pool.map(cri.remove, sandboxes))
    t3 = time.perf_counter()
    return (t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t2) * 1000


def run(smoke: bool) -> dict[str, Any]:
    rounds, warmup, bursts, size, polls = (1, 0, 1, 3, 2) if smoke else (40, 3, 3, 20, 200)
    plugins, version = reference_plugins()
    with Lab("cri") as lab:
        bridges = {way: unique("cr") for way in (*WAYS, "floor")}
        lab.cleanups += [functools.partial(delete_link, b) for b in bridges.values()]
        ipam = lab.tmp / "ipam"
        write_conf(lab.conf_dir, "10-podnet.conflist",
                   bridge_chain("podnet", bridges["shim"], SUBNETS["shim"], ipam, version))
        agent = lab.agent(plugin_dirs=[str(plugins)])
        assert agent.call("WaitReady", "d", "10")[0] is True, agent.log()
        image = build_image(lab.tmp)
        nodes = {"own": Containerd(lab.tmp / "c-own", lab.bus.address, [plugins]),
                 "shim": Containerd(lab.tmp / "c-shim", lab.bus.address,
                                    shim_socket=agent.shim_socket)}
        (nodes["own"].conf_dir / "10-pods.conflist").write_bytes(
            bridge_chain("pods", bridges["own"], SUBNETS["own"], ipam, version))
        conf = subprocess.run([sys.executable, "-m", "cni_agent", "shim-config", "--runtime",
                               "containerd", "--network", "podnet", "--name", "pods",
                               "--config", str(agent.config_path)],
                              capture_output=True, text=True, check=True).stdout
        (nodes["shim"].conf_dir / "10-pods.conflist").write_text(conf)
        try:
            for node in nodes.values():
                node.start()
                node.ctr("images", "import", str(image))
            assert agent.proc is not None
            samples = measure(nodes, agent.proc.pid, rounds, warmup, bursts, size, polls)
        finally:
            for node in nodes.values():  # while the agent still answers the shim's DELs
                node.close()
        floor = DirectChain(bridge_chain("floor", bridges["floor"], SUBNETS["floor"], ipam, version),
                            [str(plugins)])
        samples["floor.cpu_per_call"] = [floor_cpu_ms(floor, lab.netns.many(2 if smoke else 10))]
        leftover = {way: allocations(ipam, name)
                    for way, name in (("own", "pods"), ("shim", "podnet"), ("floor", "floor"))}
    return report(samples, leftover, plugins, version, size)


def measure(nodes: dict[str, Containerd], agent_pid: int, rounds: int, warmup: int, bursts: int,
            size: int, polls: int) -> dict[str, list[float]]:
    s: dict[str, list[float]] = {f"{way}.{what}": [] for way in WAYS
                                 for what in ("run", "stop", "remove", "pod", "burst.run",
                                              "burst.stop", "burst.remove", "status")}
    s["agent.cpu_per_call"] = []
    pods = Pods()

    def rotate(i: int) -> list[str]:
        return list(WAYS[i % 2:] + WAYS[:i % 2])

    for i in range(warmup + rounds):
        for way in rotate(i):
            c0 = proc_cpu_ns(agent_pid)
            times = cycle(nodes[way].cri, pods.next(way))
            if i >= warmup and way == "shim":  # all its threads; its background work included
                s["agent.cpu_per_call"].append((proc_cpu_ns(agent_pid) - c0) / 1e6 / CALLS_PER_POD)
            if i >= warmup:
                for what, ms in zip(("run", "stop", "remove"), times, strict=True):
                    s[f"{way}.{what}"].append(ms)
                s[f"{way}.pod"].append(sum(times))
    with ThreadPoolExecutor(size) as pool:
        for i in range(bursts):
            for way in rotate(i):
                times = burst(pool, nodes[way].cri, [pods.next(way) for _ in range(size)])
                for what, ms in zip(("burst.run", "burst.stop", "burst.remove"), times, strict=True):
                    s[f"{way}.{what}"].append(ms)
    statuses: dict[str, Callable[[], bool]] = {way: nodes[way].cri.network_ready for way in WAYS}
    for i in range(polls):
        for way in rotate(i):
            t0 = time.perf_counter()
            assert statuses[way](), f"{way}: NetworkReady false"
            s[f"{way}.status"].append((time.perf_counter() - t0) * 1000)
    return s


def report(s: dict[str, list[float]], leftover: dict[str, list[str]], plugins: Path, version: str,
           size: int) -> dict[str, Any]:
    figures = []

    def row(what: str, note: str, goal_key: str = "") -> None:
        r = ratio(s[f"shim.{what}"], s[f"own.{what}"])
        goal = GOALS.get(goal_key)
        figures.append(figure(f"cri.{what}", s[f"shim.{what}"], ratio=r,
                              goal=f"goal ratio ≤ {goal:g}" if goal else "",
                              passed=None if goal is None else r <= goal,
                              note=f"{note}; containerd's own {statistics.median(s[f'own.{what}']):.1f} ms"))

    row("run", "RunPodSandbox through the shim", "run")
    row("stop", "StopPodSandbox", "stop")
    row("remove", "RemovePodSandbox (containerd's second DEL)")
    cpu, floor = statistics.median(s["agent.cpu_per_call"]), statistics.median(s["floor.cpu_per_call"])
    pod, own = statistics.median(s["shim.pod"]), statistics.median(s["own.pod"])
    figures.append(figure("cri.pod", s["shim.pod"], ratio=pod / own,
                          note="run + stop + remove, per pod, through the shim against containerd's own CNI",
                          **goals.judge("cri.pod", pod / own, above_floor_ms=cpu - floor,
                                        versus=f"{pod:.0f} vs {own:.0f} ms")))
    figures.append(figure("cri.agent_cpu", s["agent.cpu_per_call"],
                          note=f"the agent's CPU per shim call (per pod / {CALLS_PER_POD}: ADD, DEL, DEL; "
                               f"all threads, plugins not); the floor's {floor:.2f} ms"))
    row("burst.run", f"{size} RunPodSandbox at once", "burst")
    row("burst.stop", f"{size} StopPodSandbox at once", "burst")
    row("burst.remove", f"{size} RemovePodSandbox at once")
    row("status", "one CRI Status (agent: its monitor; own: STATUS exec'd)", "status")
    left = sum(len(v) for v in leftover.values())  # the floor's bridge's too
    figures.append(figure("cri.leftover_ips", [left], "count", goal="must be 0", passed=not left))
    notes = [f"cri: containerd 2.x, two instances, pause image from tests/cri; {plugins} bridge + "
             f"host-local + portmap (1 hostPort per pod) at cniVersion {version}; own and shim "
             "interleaved, serial rounds then bursts"]
    if version != "1.1.0":
        notes.append("cri: plugins without 1.1.0: containerd's own Status runs no STATUS, so "
                     "cri.status compares the agent's answer with nothing")
    return result(figures, notes)
