"""5. Footprint: idle RSS and CPU with 10 networks, and the start-up curve.

Idle: 10 networks of cniVersion 1.1.0 (one C no-op plugin each, so STATUS
polling really runs) at the default intervals (0.5 s until ready, then 5 s).
RSS is sampled and CPU (utime+stime from /proc/PID/stat) summed per 10 s window.

Start-up: process start → READY=1 on the notify socket, and → the first Setup
answered, with 0/100/1,000 sandboxes already on disk (libcni cache entries and
sandbox records, written with the agent's own classes), and the RSS then
(VmRSS of /proc/PID/status, once the first Setup is answered). The cached
sandboxes are live — every record names one existing netns with its real
identity — so start-up recovery and the GC at first ready DEL nothing: this
is an agent restarted on a busy node, and it can be restarted again and again
on the same state. (With vanished netns the first start would DEL them all
and later ones would start empty.) The first Setup waits for readiness and for
that GC, which reads every entry: it shows what the sandboxes on disk cost
before service.

The project's footprint goal (bench/goals.py) is "the same or better" than a
baseline measured on an earlier commit (`goals.FOOTPRINT_BASELINE`, or the file
BENCH_BASELINE names): each of RSS idle, the start-up times and the RSS after
start within `goals.SPREAD` of the baseline's, judged on the worst of each
group. A figure the baseline lacks prints "no baseline".
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench import goals
from bench.harness import Client, Lab, conflist, proc_cpu, proc_rss_kib
from bench.report import Figure, figure, result
from cni_agent.cni.cache import CachedAttachment, ResultCache
from cni_agent.node.netns import netns_identity
from cni_agent.sandboxes.records import Attachment, Phase, SandboxRecord
from cni_agent.sandboxes.store import SandboxStore
from tests.support.plugins import write_conf

NETWORKS = 10
COUNTS = (0, 100, 1000)
WINDOW = 10.0
STARTUP = {"ready": ("start → READY=1", "ms"), "serving": ("start → first Setup answered", "ms"),
           "call": ("then one Setup+Teardown", "ms"),
           "rss": ("RSS after start (READY, first Setup answered)", "MiB")}


def run(smoke: bool) -> dict[str, Any]:
    baseline = goals.footprint_baseline()
    idle = idle_usage(2.0 if smoke else 60.0, 1.0 if smoke else 5.0)
    startup = startup_curve(1 if smoke else 5)
    rss_idle = {"footprint.rss_idle": [kib / 1024 for kib in idle["rss_kib"]]}
    figures = [
        against_baseline("footprint.rss_idle", rss_idle, "MiB", baseline,
                         f"{NETWORKS} networks, sampled each second"),
        figure("footprint.cpu_idle", idle["agent_pct"], "%",
               note=f"agent, per {idle['window']:g} s window; its STATUS plugins: "
                    f"{sum(idle['plugins_s']) / idle['seconds'] * 100:.2f}%"),
    ]
    named = {f"footprint.{_name(what)}.{n}": startup[what][n] for what in STARTUP for n in COUNTS}
    for what, (label, unit) in STARTUP.items():
        for n in COUNTS:
            name = f"footprint.{_name(what)}.{n}"
            base = baseline.figures.get(name)
            today = statistics.median(named[name])
            figures.append(figure(
                name, named[name], unit, ratio=today / base if base else None,
                note="; ".join(p for p in (
                    f"{label}, {n} sandboxes on disk" if n == 0 else "",
                    f"{baseline.commit}: {base:g} {unit}" if base else
                    ("" if what == "call" else f"no baseline at {baseline.commit}")) if p)))
    starts = {k: v for k, v in named.items() if ".start.ready." in k or ".start.serving." in k}
    figures += [
        against_baseline("footprint.start.vs_baseline", starts, "ms", baseline,
                         "start → READY=1 and → first Setup at 0/100/1,000 sandboxes"),
        against_baseline("footprint.rss_start.vs_baseline",
                         {k: v for k, v in named.items() if ".rss_start." in k}, "MiB", baseline,
                         "RSS after start at 0/100/1,000 sandboxes"),
    ]
    curve = ", ".join(f"{n}: {_median(startup['ready'][n]):.0f}/{_median(startup['serving'][n]):.0f} ms "
                      f"{_median(startup['rss'][n]):.1f} MiB" for n in COUNTS)
    return result(figures, [f"footprint: start-up curve (READY=1 / first Setup, RSS then): {curve}",
                            "footprint: the cached sandboxes are live (one existing netns), so no DEL "
                            "runs at start; see bench/footprint.py",
                            f"footprint: baseline {baseline.commit} ({baseline.date}, {baseline.where}); "
                            f"same or better = at most {goals.SPREAD:g}x its figures"],
                  idle=idle, startup=startup, baseline=baseline.figures)


def _name(what: str) -> str:
    return "rss_start" if what == "rss" else f"start.{what}"


def against_baseline(name: str, today: dict[str, list[float]], unit: str, baseline: goals.Baseline,
                     what: str) -> Figure:
    """Goal `name`: the worst of `today`'s figures against the baseline's; its
    samples are that figure's. None of them in the baseline: not judged."""
    ratios = {n: r for n, xs in today.items()
              if (r := baseline.ratio(n, statistics.median(xs))) is not None}
    if not ratios:  # the largest, to show something
        worst = max(today, key=lambda n: statistics.median(today[n]))
        return figure(name, today[worst], unit, note=f"{what}; shown: {worst}", **goals.judge(
            name, None, missing=f"no baseline at {baseline.commit}"))
    worst = max(ratios, key=lambda n: ratios[n])
    unjudged = sorted(set(today) - set(ratios))
    versus = (f"{worst.removeprefix('footprint.')} {statistics.median(today[worst]):.4g} vs "
              f"{baseline.figures[worst]:.4g} {unit} at {baseline.commit}")
    note = what if len(today) == 1 else f"{what}; the worst against the baseline: {worst}"
    return figure(name, today[worst], unit, ratio=ratios[worst],
                  note=note + (f"; no baseline for {', '.join(unjudged)}" if unjudged else ""),
                  **goals.judge(name, ratios[worst], versus=versus))


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
    """`count` live, ready sandboxes in the agent's on-disk formats (the journal
    and the libcni cache), written with the agent's own classes."""
    identity = netns_identity(netns)
    cache, store = ResultCache(str(state_dir)), SandboxStore(str(state_dir))
    store.open()
    for i in range(count):
        sid = f"cached-{i:04d}"
        ip = f"10.98.{i // 250}.{i % 250 + 2}/16"
        result = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": netns}],
                  "ips": [{"address": ip, "interface": 0}]}
        cache.write(CachedAttachment(sid, "noopnet", "eth0", netns, config, result=result))
        store.write(SandboxRecord(sid, netns, identity, (
            Attachment("noopnet", "eth0", config, phase=Phase.READY, result=result),)))
    store.shutdown()


def startup_curve(reps: int) -> dict[str, dict[int, list[float]]]:
    kinds = tuple(STARTUP)
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

        def start(n: int) -> tuple[float, float, float, float]:
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
            rss = proc_rss_kib(agent.proc.pid) / 1024
            runner.run(client.teardown("probe", live))
            t1 = time.perf_counter()  # once serving: one more call, to see what N costs per call
            runner.run(client.setup("probe", live))
            runner.run(client.teardown("probe", live))
            call = time.perf_counter() - t1
            agent.stop()
            left = len(os.listdir(lab.tmp / f"state-{n}" / "results"))
            if left != n:
                raise RuntimeError(f"{n} cached sandboxes expected after a restart, found {left}")
            return (ready - t0) * 1000, (serving - t0) * 1000, call * 1000, rss

        start(0)  # warm-up: .pyc files written, page cache warm
        for _ in range(reps):
            for n in COUNTS:
                for key, value in zip(kinds, start(n), strict=True):
                    out[key][n].append(value)
    return out
