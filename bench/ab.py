"""`python -m bench.ab --base DIR [--pattern crio|pair] [--rounds N]`: two agents, one
run from another checkout's sources (DIR: a tree with `agent/`, e.g. `git archive main`
unpacked), the other from this one, measured side by side, rounds alternating.

Each agent has a lab of its own (bus, state, bridge); every round runs one unit on
each, the first rotating, as `interleave` does, so a shared machine's drift hits
both alike. A unit is, with `--pattern crio`, one pod as CRI-O runs it through the
shim (ADD, CHECK, DEL: bench/crio_pattern.py, bridge + host-local + portmap), or,
with `--pattern pair`, one Setup+Teardown over dbus-fast of 3 no-op plugins
(bench/overhead.py's). Printed per agent: the agent's own CPU per shim call (or per
pair; all its threads, schedstat) and the unit's wall time, as median (p25-p75), and
the median of the paired per-round differences (new - base).

A development tool, not one of `make bench`'s: it compares code, not the agent
with its baselines.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.crio_pattern import ShimPod, crio_shim_conf, pod
from bench.harness import (
    PLUGINS_191,
    Client,
    Lab,
    bridge_chain,
    conflist,
    delete_link,
    proc_cpu_ns,
    unique,
)
from tests.support.plugins import write_conf

SUBNETS = {"base": "10.229.0.0/22", "new": "10.230.0.0/22"}


def _quartiles(s: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0]] * 3
    return q[0], statistics.median(s), q[2]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__)
    parser.add_argument("--base", type=Path, required=True,
                        help="the other checkout (a dir holding agent/cni_agent)")
    parser.add_argument("--pattern", choices=("crio", "pair"), default="crio")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--new-wrapper", metavar="SCRIPT",
                        help="run the new agent as `python SCRIPT -m cni_agent ...` (as "
                             "bench/cpuprof.py runs it): an experiment with its interpreter")
    args = parser.parse_args()
    base_src = (args.base / "agent").resolve()
    if not (base_src / "cni_agent").is_dir():
        parser.error(f"{base_src}/cni_agent: no such directory")
    envs = {"base": {"PYTHONPATH": str(base_src)}, "new": None}
    runner = asyncio.Runner()
    labs: dict[str, Lab] = {}
    units: dict[str, Callable[[int], float]] = {}
    pids: dict[str, int] = {}
    try:
        for way, env in envs.items():
            lab = labs[way] = Lab(f"ab{way}")
            wrapper = [args.new_wrapper] if way == "new" and args.new_wrapper else []
            units[way], pids[way] = setup_unit(lab, way, env, args.pattern, runner, wrapper)
        per = 3 if args.pattern == "crio" else 1
        cpu: dict[str, list[float]] = {w: [] for w in envs}
        wall: dict[str, list[float]] = {w: [] for w in envs}
        ways = list(envs)
        for i in range(args.warmup + args.rounds):
            for way in ways[i % 2:] + ways[:i % 2]:
                c0 = proc_cpu_ns(pids[way])
                ms = units[way](i)
                c = (proc_cpu_ns(pids[way]) - c0) / 1e6 / per
                if i >= args.warmup:
                    cpu[way].append(c)
                    wall[way].append(ms)
            if args.pattern == "crio":
                for lab in labs.values():
                    lab.netns.close()
    finally:
        for lab in labs.values():
            lab.close()
        runner.close()
    what = "shim call" if args.pattern == "crio" else "Setup+Teardown"
    print(f"{args.pattern}: {args.rounds} rounds; agent CPU per {what}, wall per unit; "
          "median (p25-p75)")
    for name, series in (("cpu", cpu), ("wall", wall)):
        for way in ways:
            lo, mid, hi = _quartiles(series[way])
            print(f"  {name:4} {way:4} {mid:8.3f} ms ({lo:.3f}-{hi:.3f})")
        diffs = [n - b for n, b in zip(series["new"], series["base"], strict=True)]
        lo, mid, hi = _quartiles(diffs)
        print(f"  {name:4} new-base paired {mid:+8.3f} ms ({lo:+.3f}..{hi:+.3f}); ratio of "
              f"medians {statistics.median(series['new']) / statistics.median(series['base']):.3f}")
    return 0


def setup_unit(lab: Lab, way: str, env: dict[str, str] | None, pattern: str,
               runner: asyncio.Runner, wrapper: list[str]) -> tuple[Callable[[int], float], int]:
    if pattern == "pair":
        lab.noop()
        write_conf(lab.conf_dir, "10-noop.conflist",
                   conflist("noopchain", [{"type": "noop"}] * 3, "1.0.0"))
        agent = lab.agent(start=False)
        agent.python_args = wrapper
        agent.start(env=env)
        client = runner.run(Client.connect(lab.bus.address))
        lab.cleanups.append(client.close)
        assert runner.run(client.call("WaitReady", "d", [10.0])) == [True], agent.log()
        ns = lab.netns.add()

        async def pair(sid: str) -> None:
            await client.setup(sid, ns)
            await client.teardown(sid, ns)

        def unit(i: int) -> float:
            t0 = time.perf_counter()
            runner.run(pair(f"ab-{i}"))
            return (time.perf_counter() - t0) * 1000
        assert agent.proc is not None
        return unit, agent.proc.pid
    bridge = unique("ab")
    lab.cleanups.append(lambda: delete_link(bridge))
    write_conf(lab.conf_dir, "10-podnet.conflist",
               bridge_chain("podnet", bridge, SUBNETS[way], lab.tmp / "ipam", "1.1.0"))
    agent = lab.agent(start=False, plugin_dirs=[str(PLUGINS_191)])
    agent.python_args = wrapper
    agent.start(env=env)
    assert agent.call("WaitReady", "d", "10")[0] is True, agent.log()
    conf: dict[str, Any] = crio_shim_conf(agent.config_path)
    shim = ShimPod(conf, lab.bus.address, str(agent.shim_socket))

    def run_pod(i: int) -> float:
        return pod(shim.call, f"ab-{way}-{i}", lab.netns.add(lo_up=True))  # as CRI-O hands it over
    assert agent.proc is not None
    return run_pod, agent.proc.pid


if __name__ == "__main__":
    sys.exit(main())
