"""`python -m bench.crio_profile [--pods N] [--out DIR]`: where the agent's CPU goes
under CRI-O's pattern (ADD, CHECK, DEL through the shim, pod after pod; see
bench/crio_pattern.py), as ms per shim call.

The agent runs with production settings; after a warm-up, py-spy (from PyPI:
`pip install py-spy`; not a dependency of the project) samples it, all
threads, on-CPU only, while N pods run. Each frame's share of the samples
times the agent's measured CPU per call (schedstat, all threads) is its cost
per call. Prints the top frames of the agent's own code, self and inclusive,
and writes the collapsed stacks (flamegraph.pl's input) to DIR.
"""

from __future__ import annotations

import argparse
import collections
import os
import pstats
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.crio_pattern import SUBNETS, ShimPod, crio_shim_conf, pod
from bench.harness import (
    Lab,
    bridge_chain,
    delete_link,
    proc_cpu_ns,
    reference_plugins,
    thread_cpu_ns,
    unique,
)
from tests.support.plugins import write_conf


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.crio_profile", description=__doc__)
    parser.add_argument("--pods", type=int, default=150)
    parser.add_argument("--out", type=Path, default=Path("out") / "crio-profile")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--cprofile", action="store_true",
                        help="cProfile (CPU clock, main thread only) over the same window instead "
                             "of py-spy: OUT/agent.prof")
    parser.add_argument("--gil", action="store_true",
                        help="sample only the thread holding the GIL (the Python work; blocking "
                             "syscalls and waits drop out)")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not args.cprofile and not Path(py_spy).exists():
        parser.error("needs py-spy (pip install py-spy), or --cprofile")
    args.out.mkdir(parents=True, exist_ok=True)
    prof = args.out.resolve() / "agent.prof"
    plugins, version = reference_plugins()
    with Lab("crioprof") as lab:
        bridge = unique("pp")
        lab.cleanups.append(lambda: delete_link(bridge))
        write_conf(lab.conf_dir, "10-podnet.conflist",
                   bridge_chain("podnet", bridge, SUBNETS["shim"], lab.tmp / "ipam", version))
        agent = lab.agent(start=False, plugin_dirs=[str(plugins)])
        if args.cprofile:
            agent.python_args = [str(Path(__file__).parent / "cpuprof.py"), str(prof)]
        agent.start(env={"BENCH_CPROFILE_WINDOW": "1"} if args.cprofile else None)
        assert agent.call("WaitReady", "d", "10")[0] is True, agent.log()
        assert agent.proc is not None
        pid = agent.proc.pid
        conf = crio_shim_conf(agent.config_path)
        shim = ShimPod(conf, lab.bus.address, str(agent.shim_socket))
        for i in range(10):  # warm-up: imports, caches
            pod(shim.call, f"warm-{i}", lab.netns.add(lo_up=True))
        lab.netns.close()
        spaces = lab.netns.many(args.pods, lo_up=True)  # as CRI-O hands them over
        raw = args.out / "agent.collapsed"
        if args.cprofile:
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.2)
        else:
            spy = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", "500",
                                    "--threads", "--format", "raw", "--output", str(raw),
                                    "--nonblocking", *(["--gil"] if args.gil else [])],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        t0 = thread_cpu_ns(pid)
        c0 = proc_cpu_ns(pid)
        walls = [pod(shim.call, f"prof-{i}", ns) for i, ns in enumerate(spaces)]
        cpu_ms = (proc_cpu_ns(pid) - c0) / 1e6
        t1 = thread_cpu_ns(pid)
        if args.cprofile:
            os.kill(pid, signal.SIGUSR2)
            time.sleep(0.5)
        else:
            spy.send_signal(signal.SIGINT)
            spy.communicate(timeout=60)
    calls = 3 * args.pods
    per_call = cpu_ms / calls
    print(f"{args.pods} pods, {calls} shim calls: agent CPU {per_call:.2f} ms per call (all "
          f"threads), pod wall median {sorted(walls)[len(walls) // 2]:.1f} ms")
    main_tid = str(pid)
    main = (t1.get(main_tid, 0) - t0.get(main_tid, 0)) / 1e6 / calls
    others = sum(v - t0.get(k, 0) for k, v in t1.items() if k != main_tid) / 1e6 / calls
    print(f"main thread {main:.2f} ms per call, other threads {others:.2f} ms per call")
    if args.cprofile:
        summarize_cprofile(prof, calls, args.top)
    else:
        summarize(raw, per_call, args.top)
    return 0


def summarize(raw: Path, per_call: float, top: int) -> None:
    """Self and inclusive cost per call of each frame (py-spy's raw format:
    `frame;frame;… count` per line, root first)."""
    self_n: collections.Counter[str] = collections.Counter()
    incl_n: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        total += n
        if frames:
            self_n[frames[-1]] += n
        for f in set(frames):
            incl_n[f] += n
    print(f"{total} samples; ms per shim call = share of samples x {per_call:.2f}")
    for title, counter in (("self", self_n), ("inclusive", incl_n)):
        print(f"\n== {title}")
        for frame, n in counter.most_common(top):
            print(f"{n / total * per_call:7.3f} ms  {100 * n / total:5.1f} %  {frame}")



def summarize_cprofile(prof: Path, calls: int, top: int) -> None:
    """Self and cumulative CPU (main thread) per shim call of each function. A
    coroutine's every resumption counts as a call of it, so only the times are
    per shim call; the profiler's own overhead inflates small functions."""
    st = pstats.Stats(str(prof)).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in st.values())
    print(f"cProfile: main thread {total / calls * 1000:.2f} ms per call under the profiler")

    def name(key: tuple[str, int, str]) -> str:
        path, line, func = key
        return f"{func} ({path.split('site-packages/')[-1].split('agent/')[-1]}:{line})"

    for title, index in (("self", 2), ("cumulative", 3)):
        print(f"\n== {title}")
        for key, v in sorted(st.items(), key=lambda kv: -kv[1][index])[:top]:
            print(f"{v[index] / calls * 1000:7.3f} ms  {100 * v[index] / total:5.1f} %  {name(key)}")


if __name__ == "__main__":
    sys.exit(main())
