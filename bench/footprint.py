"""5. Footprint: idle RSS and CPU with 10 networks, and the start-up curve.

Idle: 10 networks of cniVersion 1.1.0 (one C no-op plugin each, so STATUS
polling really runs) at the default intervals (0.5 s until ready, then 5 s).
RSS is sampled and CPU (utime+stime from /proc/PID/stat) summed per 10 s window.

Start-up: process start → READY=1 on the notify socket, and → the first Setup
answered, with 0/100/1,000 sandboxes already on disk (libcni cache entries and
sandbox records, written with the agent's own classes). The cached sandboxes are
live — every record names one existing netns with its real identity — so
start-up recovery and the GC at first ready DEL nothing: this is an agent
restarted on a busy node, and it can be restarted again and again on the same
state. (With vanished netns the first start would DEL them all and later ones
would start empty.) The first Setup waits for readiness and for that GC, which
reads every entry: it shows what the sandboxes on disk cost before service.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from bench.harness import Client, Lab, conflist, proc_cpu, proc_rss_kib
from bench.report import figure, result
from cni_agent.cni.cache import CachedAttachment, ResultCache
from cni_agent.node.netns import netns_identity
from cni_agent.sandboxes.records import Attachment, Phase, SandboxRecord, SandboxStore
from tests.support.plugins import write_conf

NETWORKS = 10
COUNTS = (0, 100, 1000)
WINDOW = 10.0


def run(smoke: bool) -> dict[str, Any]:
    idle = idle_usage(2.0 if smoke else 60.0, 1.0 if smoke else 5.0)
    startup = startup_curve(1 if smoke else 5)
    figures = [
        figure("footprint.rss_idle", [kib / 1024 for kib in idle["rss_kib"]], "MiB",
               note=f"{NETWORKS} networks, sampled each second"),
        figure("footprint.cpu_idle", idle["agent_pct"], "%",
               note=f"agent, per {idle['window']:g} s window; its STATUS plugins: "
                    f"{sum(idle['plugins_s']) / idle['seconds'] * 100:.2f}%"),
    ]
    for what, label in (("ready", "start → READY=1"), ("serving", "start → first Setup answered"),
                        ("call", "then one Setup+Teardown")):
        for n in COUNTS:
            figures.append(figure(f"footprint.start.{what}.{n}", startup[what][n],
                                  note=f"{label}, {n} sandboxes on disk" if n == 0 else ""))
    curve = ", ".join(f"{n}: {_median(startup['ready'][n]):.0f}/{_median(startup['serving'][n]):.0f} ms"
                      for n in COUNTS)
    return result(figures, [f"footprint: start-up curve (READY=1 / first Setup): {curve}",
                            "footprint: the cached sandboxes are live (one existing netns), so no DEL "
                            "runs at start; see bench/footprint.py"], idle=idle, startup=startup)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def idle_usage(seconds: float, settle: float) -> dict[str, Any]:
    with asyncio.Runner() as runner, Lab("idle") as lab:
        lab.noop()
        for i in range(NETWORKS):
            config = conflist(f"net{i}", [{"type": "noop"}], "1.1.0")
            write_conf(lab.conf_dir, f"{10 + i}-net{i}.conflist", config)
        agent = lab.agent()
        assert agent.proc is not None
        client = runner.run(Client.connect(lab.bus.address))
        assert runner.run(client.call("WaitReady", "d", [10.0])) == [True], agent.log()
        client.close()
        time.sleep(settle)
        window = min(WINDOW, seconds)
        rss, agent_pct, plugins_s = [], [], []
        for _ in range(round(seconds / window)):
            (a0, c0), t0 = proc_cpu(agent.proc.pid), time.monotonic()
            while time.monotonic() - t0 < window:
                time.sleep(min(1.0, window))
                rss.append(proc_rss_kib(agent.proc.pid))
            (a1, c1), dt = proc_cpu(agent.proc.pid), time.monotonic() - t0
            agent_pct.append((a1 - a0) / dt * 100)
            plugins_s.append(c1 - c0)
    return {"rss_kib": rss, "agent_pct": agent_pct, "plugins_s": plugins_s, "window": window,
            "seconds": seconds}


def populate(state_dir: Path, count: int, netns: str, config: bytes) -> None:
    """`count` live, ready sandboxes in the agent's on-disk formats."""
    identity = netns_identity(netns)
    cache, store = ResultCache(str(state_dir)), SandboxStore(str(state_dir))
    for i in range(count):
        sid = f"cached-{i:04d}"
        ip = f"10.98.{i // 250}.{i % 250 + 2}/16"
        cache.write(CachedAttachment(sid, "noopnet", "eth0", netns, config, result={
            "cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": netns}],
            "ips": [{"address": ip, "interface": 0}]}))
        store.write(SandboxRecord(sid, netns, identity,
                                  (Attachment("noopnet", "eth0", config, phase=Phase.READY),)))


def startup_curve(reps: int) -> dict[str, dict[int, list[float]]]:
    kinds = ("ready", "serving", "call")
    out: dict[str, dict[int, list[float]]] = {k: {n: [] for n in COUNTS} for k in kinds}
    with asyncio.Runner() as runner, Lab("start") as lab:
        lab.noop()
        config = conflist("noopnet", [{"type": "noop"}], "1.0.0")
        write_conf(lab.conf_dir, "10-noop.conflist", config)
        live = lab.netns.add()
        for n in COUNTS:
            populate(lab.tmp / f"state-{n}", n, live, config)
        client = runner.run(Client.connect(lab.bus.address))
        lab.cleanups.append(client.close)

        def start(n: int) -> tuple[float, float, float]:
            agent = lab.agent(start=False, state_dir=str(lab.tmp / f"state-{n}"),
                              runtime_dir=str(lab.tmp / f"run-{n}"))
            t0 = time.perf_counter()
            # This sandbox sets PYTHONDONTWRITEBYTECODE=1; an installed agent has its .pyc files.
            agent.start(wait=False, env={"PYTHONDONTWRITEBYTECODE": ""})
            assert agent.notify is not None and agent.proc is not None
            while "READY=1" not in agent.notify.lines():
                if agent.proc.poll() is not None:
                    raise RuntimeError(f"agent exited:\n{agent.log()[-2000:]}")
                time.sleep(0.001)
            ready = time.perf_counter()
            runner.run(client.setup("probe", live))
            serving = time.perf_counter()
            runner.run(client.teardown("probe", live))
            t1 = time.perf_counter()  # once serving: one more call, to see what N costs per call
            runner.run(client.setup("probe", live))
            runner.run(client.teardown("probe", live))
            call = time.perf_counter() - t1
            agent.stop()
            left = len(os.listdir(lab.tmp / f"state-{n}" / "results"))
            if left != n:
                raise RuntimeError(f"{n} cached sandboxes expected after a restart, found {left}")
            return (ready - t0) * 1000, (serving - t0) * 1000, call * 1000

        start(0)  # warm-up: .pyc files written, page cache warm
        for _ in range(reps):
            for n in COUNTS:
                for key, value in zip(kinds, start(n), strict=True):
                    out[key][n].append(value)
    return out
