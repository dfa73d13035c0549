"""8. CRI-O's pattern: what a pod costs when CRI-O's libcni runs it through the
shim, against the same chain exec'd directly as that libcni execs it.

Per new pod CRI-O's libcni sends ADD then CHECK (with the cached result as
prevResult), and at StopPodSandbox one DEL (none at Remove): three calls,
each an exec of the shim, so the agent's cost per call counts three times a
pod (containerd's figures hid it behind its second DEL and its STATUS execs).
No CRI-O is needed: the calls are made exactly as libcni makes them (the
environment, CRI-O's CNI_ARGS, stdin with prevResult, runtimeConfig only for
declared capabilities), from one process.

"direct": bridge + host-local + portmap exec'd plugin by plugin (ADD in order,
CHECK in order, DEL in reverse), as CRI-O's own CNI does. "shim": the shim's
conflist (`cni-agent shim-config --runtime crio`), one exec per verb, on the
agent's socket, and the agent (production settings) running the same chain on
a bridge of its own. "bus": the same shim on the bus, its socket path absent
(the shim's fallback, and what every call cost before the socket). Each round
runs one pod each way, the first rotating; every pod gets a fresh netns (made
outside the timing) with its loopback up, as CRI-O hands it to CNI (ocicni's
SetUpPod brings `lo` up itself before the first ADD, in every way alike: the
agent then finds it up and leaves it). Then bursts of 20 pods at once, each way.

The agent's CPU per shim call is the time on CPU of all its threads
(/proc/PID/task/*/schedstat) across the pod's three calls, divided by three;
its plugins' CPU is not in it (the same in both ways).

"libcni", when tools/build-crio has built bench/libcni_anchor.go: CRI-O's own
CNI code (libcni in one Go process) running the same chain's ADD, CHECK, DEL
on a third bridge, serial rounds only. Its own CPU per call is the baseline
for the agent's: spawning and reaping the plugins costs either process alike.

Two of the project's goals (bench/goals.py) are judged here: the pod through
the shim against the direct chain (`cri.crio_pattern.pod`), and the agent's
CPU per shim call against libcni's own (`cri.crio_pattern.agent_cpu`; without
the anchor it FAILs, anchor missing). Beside them, the agent's CPU per shim
call above the floor's: the direct way's own CPU per call (this thread's,
exec'ing the plugins from Python).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import goals
from bench.anchor import Anchor, usable_anchor
from bench.harness import (
    CallFailed,
    DirectChain,
    Lab,
    bridge_chain,
    children_cpu_ms,
    delete_link,
    proc_cpu_ns,
    reference_plugins,
    unique,
)
from bench.report import figure, ratio, result
from cni_agent.cni.runtime import plugin_stdin
from tests.support.net import allocations
from tests.support.plugins import write_conf
from tests.support.shim import SHIM

SUBNETS = {"direct": "10.232.0.0/22", "shim": "10.233.0.0/22", "libcni": "10.231.0.0/22"}
WAYS = ("direct", "shim", "bus")  # and "libcni", when the anchor is built
SHIMS = ("shim", "bus")
VERBS = ("ADD", "CHECK", "DEL")
# What CRI-O sends on every pod; libcni passes it only to a plugin that declares it.
RUNTIME_CONFIG = {"cgroupPath": "/kubepods/besteffort/pod-bench",
                  "io.kubernetes.cri.pod-annotations": {"kubernetes.io/config.source": "api"}}


def cni_args(pod: str) -> str:
    """CRI-O's CNI_ARGS (ocicni)."""
    return (f"IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME={pod};"
            f"K8S_POD_INFRA_CONTAINER_ID={pod};K8S_POD_UID=uid-{pod}")


class DirectPod(DirectChain):
    """The chain as CRI-O's own libcni runs it: ADD, CHECK, DEL, verb by verb."""

    def call(self, command: str, pod: str, netns: str, prev: Any) -> Any:
        env = {**self._env(command, pod, netns, "eth0"), "CNI_ARGS": cni_args(pod)}
        pairs = list(zip(self.net.plugins, self.binaries, strict=True))
        result = None
        for plugin, binary in reversed(pairs) if command == "DEL" else pairs:
            out = self._exec(binary, env, plugin_stdin(self.net, plugin, result if command == "ADD"
                                                       else prev, RUNTIME_CONFIG))
            if command == "ADD":
                result = json.loads(out)
        return result


class ShimPod:
    """The shim's list as CRI-O's libcni runs it: one exec of the shim per verb."""

    def __init__(self, conflist: Mapping[str, Any], bus_address: str, socket: str) -> None:
        """`socket`: the agent's socket (a path with nothing there: the bus)."""
        plugin = conflist["plugins"][0]
        self.conf = {"cniVersion": conflist["cniVersion"], "name": conflist["name"], **plugin}
        self.declared = {k for k, v in plugin.get("capabilities", {}).items() if v}
        self.base = {"PATH": os.environ["PATH"], "DBUS_SYSTEM_BUS_ADDRESS": bus_address,
                     "CNI_PATH": str(SHIM.parent), "CNI_AGENT_SHIM_SOCKET": socket}
        self.shim_cpu: list[float] = []  # ms per exec, the shim process's own
        # Off for bursts: RUSAGE_CHILDREN then counts other threads' children too.
        self.count_cpu = True

    def call(self, command: str, pod: str, netns: str, prev: Any) -> Any:
        conf = dict(self.conf)
        caps = {k: v for k, v in RUNTIME_CONFIG.items() if k in self.declared}
        if caps:
            conf["runtimeConfig"] = caps
        if command != "ADD":
            conf["prevResult"] = prev
        env = {**self.base, "CNI_COMMAND": command, "CNI_CONTAINERID": pod, "CNI_NETNS": netns,
               "CNI_IFNAME": "eth0", "CNI_ARGS": cni_args(pod)}
        before = children_cpu_ms()
        out = subprocess.run([str(SHIM)], input=json.dumps(conf).encode(), env=env,
                             capture_output=True)
        if self.count_cpu:
            self.shim_cpu.append(children_cpu_ms() - before)
        if out.returncode != 0:
            raise CallFailed(f"shim {command}: {out.stdout!r} {out.stderr!r}")
        return json.loads(out.stdout) if command == "ADD" else None


def crio_shim_conf(agent_config: Path) -> Any:
    """The shim's network config for CRI-O, as `cni-agent shim-config --runtime crio`
    prints it for the agent's network "podnet" (runtime "pods")."""
    return json.loads(subprocess.run(
        [sys.executable, "-m", "cni_agent", "shim-config", "--runtime", "crio", "--network",
         "podnet", "--name", "pods", "--config", str(agent_config)],
        capture_output=True, text=True, check=True).stdout)


Runner = Callable[[str, str, str, Any], Any]


def pod(call: Runner, name: str, netns: str, times: dict[str, float] | None = None) -> float:
    """ADD, CHECK, DEL of one pod; wall ms (each verb's into `times`)."""
    t0 = time.perf_counter()
    prev = None
    for verb in VERBS:
        t = time.perf_counter()
        got = call(verb, name, netns, prev)
        prev = got if verb == "ADD" else prev
        if times is not None:
            times[verb] = (time.perf_counter() - t) * 1000
    return (time.perf_counter() - t0) * 1000


def run(smoke: bool) -> dict[str, Any]:
    rounds, warmup, bursts, size = (1, 0, 1, 3) if smoke else (40, 3, 3, 20)
    plugins, version = reference_plugins()
    with Lab("crio") as lab:
        binary, missing = usable_anchor()
        ways = (*WAYS, "libcni") if binary is not None else WAYS
        bridges = {way: unique("cp") for way in ways}
        lab.cleanups += [functools.partial(delete_link, b) for b in bridges.values()]
        ipam = lab.tmp / "ipam"
        agent_net = bridge_chain("podnet", bridges["shim"], SUBNETS["shim"], ipam, version)
        write_conf(lab.conf_dir, "10-podnet.conflist", agent_net)
        agent = lab.agent(plugin_dirs=[str(plugins)])
        assert agent.call("WaitReady", "d", "10")[0] is True, agent.log()
        assert agent.proc is not None
        conf = crio_shim_conf(agent.config_path)
        calls: dict[str, Any] = {
            "direct": DirectPod(bridge_chain("crio", bridges["direct"], SUBNETS["direct"], ipam, version),
                                [str(plugins)]),
            "shim": ShimPod(conf, lab.bus.address, str(agent.shim_socket)),
            "bus": ShimPod(conf, lab.bus.address, str(lab.tmp / "no-agent-here.sock"))}
        if binary is not None and "libcni" in ways:
            anchor_conf = write_conf(lab.tmp, "libcni.conflist", bridge_chain(
                "crio-libcni", bridges["libcni"], SUBNETS["libcni"], ipam, version))
            anchor = Anchor(binary, anchor_conf, plugins, lab.tmp / "libcni-cache")
            lab.cleanups.append(anchor.close)
            calls["libcni"] = anchor
        samples = measure(lab, calls, agent.proc.pid, rounds, warmup, bursts, size)
        for way in SHIMS:
            samples[f"{way}.exec_cpu"] = calls[way].shim_cpu
        leftover = (allocations(ipam, "crio") + allocations(ipam, "podnet")
                    + allocations(ipam, "crio-libcni"))
    return report(samples, leftover, plugins, version, size, missing)


def measure(lab: Lab, calls: dict[str, Any], agent_pid: int, rounds: int, warmup: int,
            bursts: int, size: int) -> dict[str, list[float]]:
    ways = tuple(calls)
    s: dict[str, list[float]] = {f"{way}.{what}": [] for way in ways
                                 for what in ("pod", "burst", *VERBS)}
    s.update({"agent.cpu_per_call": [], "bus.agent_cpu_per_call": [], "direct.cpu_per_call": [],
              **{f"{way}.bus_daemon_cpu_per_call": [] for way in SHIMS},
              **{f"agent.cpu.{v}": [] for v in VERBS}})
    n = 0
    for i in range(warmup + rounds):
        spaces = {way: lab.netns.add(lo_up=True) for way in ways}
        for way in ways[i % len(ways):] + ways[:i % len(ways)]:
            n += 1
            if way == "libcni":  # one request runs the whole pod
                t0 = time.perf_counter()
                calls[way].run("pod", spaces[way])
                if i >= warmup:
                    s["libcni.pod"].append((time.perf_counter() - t0) * 1000)
                continue
            times: dict[str, float] = {}
            cpu = AgentCPU(agent_pid)
            bus_daemon = proc_cpu_ns(lab.bus.pid)
            call = cpu.wrap(calls[way].call) if way in SHIMS else calls[way].call
            own = time.thread_time_ns()  # the floor: exec'ing the chain from this thread
            wall = pod(call, f"bench-{n}", spaces[way], times)
            if i >= warmup:
                s[f"{way}.pod"].append(wall)
                if way == "direct":
                    s["direct.cpu_per_call"].append((time.thread_time_ns() - own) / 1e6 / len(VERBS))
                for verb in VERBS:
                    s[f"{way}.{verb}"].append(times[verb])
                if way in SHIMS:  # what the bus daemon spent relaying this pod's calls
                    s[f"{way}.bus_daemon_cpu_per_call"].append(
                        (proc_cpu_ns(lab.bus.pid) - bus_daemon) / 1e6 / len(VERBS))
                if way == "bus":
                    s["bus.agent_cpu_per_call"].append(sum(cpu.per_verb.values()) / len(VERBS))
                if way == "shim":
                    s["agent.cpu_per_call"].append(sum(cpu.per_verb.values()) / len(VERBS))
                    for verb in VERBS:
                        s[f"agent.cpu.{verb}"].append(cpu.per_verb[verb])
        lab.netns.close()  # every pod's DEL is done: the namespaces go
    if "libcni" in calls:
        s["libcni.cpu_per_call"] = [ms / len(VERBS) for ms in calls["libcni"].cpu[warmup:]]
    for way in SHIMS:
        calls[way].count_cpu = False
    with ThreadPoolExecutor(size) as pool:
        for i in range(bursts):  # the anchor runs one pod at a time: not in bursts
            for way in WAYS[i % len(WAYS):] + WAYS[:i % len(WAYS)]:
                netns = lab.netns.many(size, lo_up=True)
                names = [f"burst-{way}-{i}-{k}" for k in range(size)]
                t0 = time.perf_counter()
                list(pool.map(functools.partial(pod, calls[way].call), names, netns))
                s[f"{way}.burst"].append((time.perf_counter() - t0) * 1000)
                lab.netns.close()
    return s


class AgentCPU:
    """The agent's CPU (all threads) across each call of one pod, per verb."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.per_verb: dict[str, float] = {}

    def wrap(self, call: Runner) -> Runner:
        def timed(verb: str, name: str, netns: str, prev: Any) -> Any:
            c0 = proc_cpu_ns(self.pid)
            try:
                return call(verb, name, netns, prev)
            finally:
                self.per_verb[verb] = (proc_cpu_ns(self.pid) - c0) / 1e6
        return timed


def report(s: dict[str, list[float]], leftover: list[str], plugins: Path, version: str,
           size: int, missing: str) -> dict[str, Any]:
    pod_ratio = ratio(s["shim.pod"], s["direct.pod"])
    cpu, floor = statistics.median(s["agent.cpu_per_call"]), statistics.median(s["direct.cpu_per_call"])
    direct = statistics.median(s["direct.pod"])
    libcni_cpu = statistics.median(s["libcni.cpu_per_call"]) if s.get("libcni.pod") else None
    cpu_ratio = cpu / libcni_cpu if libcni_cpu else None
    figures = [
        figure("cri.crio_pattern.pod", s["shim.pod"], ratio=pod_ratio,
               note="ADD+CHECK+DEL through the shim, per pod, against the same chain exec'd directly",
               **goals.judge("cri.crio_pattern.pod", pod_ratio, above_floor_ms=cpu - floor,
                             versus=f"{statistics.median(s['shim.pod']):.1f} vs {direct:.1f} ms")),
        figure("cri.crio_pattern.agent_cpu", s["agent.cpu_per_call"], ratio=cpu_ratio,
               note="the agent's own CPU per shim call (all threads; plugins not); ratio: against "
                    "libcni's own per call",
               **goals.judge("cri.crio_pattern.agent_cpu", cpu_ratio, missing=missing,
                             above_floor_ms=cpu - floor,
                             versus=f"{cpu:.2f} vs {libcni_cpu:.2f} ms" if libcni_cpu else "")),
        figure("cri.crio_pattern.direct_cpu", s["direct.cpu_per_call"],
               note="the floor: this thread's own CPU per call exec'ing the chain directly"),
        figure("cri.crio_pattern.pod_bus", s["bus.pod"], ratio=ratio(s["bus.pod"], s["direct.pod"]),
               note="the same through the shim on the bus (its fallback); agent CPU "
                    f"{statistics.median(s['bus.agent_cpu_per_call']):.2f} ms per call; "
                    f"socket / bus {ratio(s['shim.pod'], s['bus.pod']):.3f}"),
    ]
    for verb in VERBS:
        figures.append(figure(f"cri.crio_pattern.{verb.lower()}", s[f"shim.{verb}"],
                              ratio=ratio(s[f"shim.{verb}"], s[f"direct.{verb}"]),
                              note=f"{verb} through the shim; direct "
                                   f"{statistics.median(s[f'direct.{verb}']):.1f} ms; agent CPU "
                                   f"{statistics.median(s[f'agent.cpu.{verb}']):.2f} ms"))
    if s.get("libcni.pod"):
        figures += [
            figure("cri.crio_pattern.pod_vs_libcni", s["shim.pod"],
                   ratio=ratio(s["shim.pod"], s["libcni.pod"]),
                   note=f"per pod, against CRI-O's libcni in one Go process: "
                        f"{statistics.median(s['libcni.pod']):.1f} ms"),
            figure("cri.crio_pattern.libcni_cpu", s["libcni.cpu_per_call"], ratio=cpu_ratio,
                   note="libcni's own CPU per call (its process, getrusage; spawning and reaping "
                        "the plugins included, as in the agent's); ratio: the agent's against it"),
        ]
    figures += [
        figure("cri.crio_pattern.burst", s["shim.burst"], ratio=ratio(s["shim.burst"], s["direct.burst"]),
               note=f"{size} pods at once (ADD+CHECK+DEL each); direct "
                    f"{statistics.median(s['direct.burst']):.0f} ms; on the bus "
                    f"{statistics.median(s['bus.burst']):.0f} ms"),
        figure("cri.crio_pattern.bus_daemon_cpu", s["shim.bus_daemon_cpu_per_call"],
               note="dbus-daemon's CPU per shim call, on the socket (nothing to relay); on the "
                    f"bus {statistics.median(s['bus.bus_daemon_cpu_per_call']):.2f} ms"),
        figure("cri.crio_pattern.shim_cpu", s["shim.exec_cpu"],
               ratio=ratio(s["shim.exec_cpu"], s["bus.exec_cpu"]),
               note="the shim process's own CPU per exec (user + system), on the socket; on the "
                    f"bus {statistics.median(s['bus.exec_cpu']):.2f} ms (ratio: socket / bus)"),
        figure("cri.crio_pattern.leftover_ips", [len(leftover)], "count", goal="must be 0",
               passed=not leftover),
    ]
    return result(figures, [
        f"crio_pattern: CRI-O's libcni calls made from Python as libcni makes them (ADD, CHECK "
        f"with prevResult, DEL; CRI-O's CNI_ARGS and runtimeConfig); {plugins} bridge + host-local "
        f"+ portmap at cniVersion {version}, no host ports (CRI-O maps them itself); direct, "
        "shim on the agent's socket and shim on the bus interleaved, a fresh netns per pod"])
