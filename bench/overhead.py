"""1. Per-call overhead: Setup+Teardown of one sandbox over D-Bus, 3 no-op C plugins.

Interleaved per round (the first of each round rotates): the chain executed
directly from Python (the floor), the agent through an in-process dbus-fast
client, the agent through `busctl` processes, and an empty D-Bus round trip
(WaitReady on a ready agent) to show what the bus alone costs.

And the libcni anchor, when tools/build-crio has built it (bench/libcni_anchor.go,
against CRI-O's vendored libcni; `make test-crio` does): one Go process
embedding libcni, as containerd and CRI-O do, running the same chain's ADD and
DEL. Two of the project's goals (bench/goals.py) are judged here:
`overhead.libcni_pair`, the agent's pair against libcni's, and
`overhead.libcni.cpu`, the agent's CPU per pair against the anchor process's
own. Without the anchor both FAIL (anchor missing): the Python floor is no
stand-in for libcni. The floor's figures stay, as information, and so does
`overhead.agent.cpu.above_floor`: the agent's CPU per call beyond the floor's.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench import goals
from bench.anchor import Anchor, usable_anchor
from bench.harness import Client, DirectChain, Lab, busctl, conflist, interleave, proc_cpu_ns
from bench.report import figure, ratio, result
from tests.support.plugins import write_conf

SID = "bench-overhead"


def run(smoke: bool) -> dict[str, Any]:
    rounds, warmup = (1, 0) if smoke else (200, 10)
    with asyncio.Runner() as runner, Lab("overhead") as lab:
        lab.noop()
        config = conflist("noopchain", [{"type": "noop"}] * 3, "1.0.0")
        conf_file = write_conf(lab.conf_dir, "10-noop.conflist", config)
        agent = lab.agent()
        client = runner.run(Client.connect(lab.bus.address))
        lab.cleanups.append(client.close)
        assert runner.run(client.call("WaitReady", "d", [10.0])) == [True], agent.log()
        ns = lab.netns.add()
        direct = DirectChain(config, [str(lab.bin), "/usr/lib/cni"])
        address = lab.bus.address
        assert agent.proc is not None
        agent_pid = agent.proc.pid
        # Own CPU (all threads' time on CPU, not the children's: the plugins'
        # CPU is the same for both) per pair, in ms.
        cpu: dict[str, list[float]] = {"agent": [], "direct": []}

        async def dbus_pair() -> None:
            await client.setup(SID, ns)
            await client.teardown(SID, ns)

        def via_dbus_fast() -> None:
            c0 = proc_cpu_ns(agent_pid)
            runner.run(dbus_pair())
            cpu["agent"].append((proc_cpu_ns(agent_pid) - c0) / 1e6)

        def via_direct() -> None:
            # Our own CPU clock (the same sum as schedstat's): one call, where
            # reading our threads' files would count itself in the window.
            c0 = time.process_time_ns()
            direct.delete(SID, ns, direct.add(SID, ns))
            cpu["direct"].append((time.process_time_ns() - c0) / 1e6)

        def via_busctl() -> None:
            busctl(address, "Setup", "ssa{sv}", SID, ns, "0")
            busctl(address, "Teardown", "ssa{sv}", SID, ns, "0")

        ways: dict[str, Callable[[], Any]] = {
            "direct": via_direct,
            "dbus_fast": via_dbus_fast,
            "busctl": via_busctl,
            "dbus_roundtrip": lambda: runner.run(client.call("WaitReady", "d", [0.0])),
        }
        binary, missing = usable_anchor()
        anchor = None
        if binary is not None:
            anchor = Anchor(binary, conf_file, lab.bin, lab.tmp / "libcni-cache")
            lab.cleanups.append(anchor.close)
            ways["libcni"] = lambda: anchor.run("pair", ns) if anchor else None

        def forget_warmup() -> None:
            for series in cpu.values():
                series.clear()
            if anchor is not None:
                anchor.cpu.clear()

        samples = interleave(ways, rounds, warmup, on_warmed_up=forget_warmup)
    if anchor is not None:
        cpu["libcni"] = anchor.cpu
    return _report(samples, cpu, missing)


def _report(s: dict[str, list[float]], cpu: dict[str, list[float]], missing: str) -> dict[str, Any]:
    floor = statistics.median(s["direct"])
    extra = {k: [a - b for a, b in zip(s[k], s["direct"], strict=True)] for k in ("dbus_fast", "busctl")}
    figures = [
        figure("overhead.direct", s["direct"], note="Setup+Teardown floor: 6 fork/exec from Python"),
        figure("overhead.dbus_fast", s["dbus_fast"], ratio=ratio(s["dbus_fast"], s["direct"]),
               note=f"the agent's Setup+Teardown; ratio: against the floor's {floor:.2f} ms"),
        figure("overhead.dbus_fast.extra", extra["dbus_fast"],
               note="agent's own cost per Setup+Teardown (paired, minus direct)"),
        figure("overhead.busctl", s["busctl"], ratio=ratio(s["busctl"], s["direct"]),
               note="includes starting 2 busctl processes"),
        figure("overhead.busctl.extra", extra["busctl"], note="paired, minus direct"),
        figure("overhead.dbus_roundtrip", s["dbus_roundtrip"], note="WaitReady: the bus alone"),
    ]
    # Each pair's CPU is exact (schedstat), so these are medians like the rest.
    floor_cpu, agent_cpu = statistics.median(cpu["direct"]), statistics.median(cpu["agent"])
    # Per call: a pair is two calls. Paired per round, so drift cancels.
    above = [(a - d) / 2 for a, d in zip(cpu["agent"], cpu["direct"], strict=True)]
    figures += [
        figure("overhead.direct.cpu", cpu["direct"],
               note="floor: this Python process's own CPU per pair"),
        figure("overhead.agent.cpu", cpu["agent"], ratio=agent_cpu / floor_cpu if floor_cpu else None,
               note="agent's own CPU per Setup+Teardown (schedstat of all its threads, plugins "
                    "not); ratio: against the floor's"),
        figure("overhead.agent.cpu.above_floor", above,
               note="the agent's CPU per Setup or Teardown above the floor's (paired rounds)"),
    ]
    figures += _libcni(s, cpu, statistics.median(above), missing)
    return result(figures, ["overhead: 3 no-op C plugins, cniVersion 1.0.0 (no STATUS), one netns; "
                            "ratios are median/median of interleaved series"])


def _libcni(s: dict[str, list[float]], cpu: dict[str, list[float]], above: float,
            missing: str) -> list[Any]:
    """The two goals against libcni (the Go anchor); without it both FAIL, anchor missing."""
    agent_cpu = statistics.median(cpu["agent"])
    if "libcni" not in s:
        return [figure("overhead.libcni_pair", s["dbus_fast"], note="the agent's Setup+Teardown",
                       **goals.judge("overhead.libcni_pair", None, missing=missing,
                                     above_floor_ms=above)),
                figure("overhead.libcni.cpu", cpu["agent"], note="the agent's CPU per pair",
                       **goals.judge("overhead.libcni.cpu", None, missing=missing,
                                     above_floor_ms=above))]
    pair, libcni_pair = statistics.median(s["dbus_fast"]), statistics.median(s["libcni"])
    libcni_cpu = statistics.median(cpu["libcni"])
    return [
        figure("overhead.libcni_pair", s["dbus_fast"], ratio=pair / libcni_pair,
               note="the agent's Setup+Teardown against libcni's (Go, one process) ADD+DEL",
               **goals.judge("overhead.libcni_pair", pair / libcni_pair, above_floor_ms=above,
                             versus=f"{pair:.2f} vs {libcni_pair:.2f} ms")),
        figure("overhead.libcni", s["libcni"], note="libcni's ADD+DEL pair, wall"),
        figure("overhead.libcni.cpu", cpu["libcni"], ratio=agent_cpu / libcni_cpu,
               note="libcni's own CPU per pair (getrusage of its process); ratio: the agent's "
                    "CPU per pair against it",
               **goals.judge("overhead.libcni.cpu", agent_cpu / libcni_cpu, above_floor_ms=above,
                             versus=f"{agent_cpu:.2f} vs {libcni_cpu:.2f} ms")),
    ]
