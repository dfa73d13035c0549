"""`python -m bench.pairprof [--pairs N] [--strace] [--root-path]`: where the
agent's CPU per Setup+Teardown goes, by thread and by system call.

An agent on `overhead`'s chain (3 no-op C plugins, one netns), warmed up,
then N pairs over dbus-fast: the CPU per pair of the main thread and of
every other thread (schedstat), the thread round trips (the worker threads'
wake-ups: voluntary context switches), and with --strace the system calls
per pair of the agent's threads (`strace -c -f`, attached for the N pairs
only; plugins' own calls are not counted: strace follows no new process).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from bench.harness import Client, Lab, conflist
from tests.support.plugins import write_conf


def _switches(pid: int) -> dict[str, tuple[str, int]]:
    """Per thread: its name and voluntary context switches so far."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{task}/status").read_text()
        except OSError:
            continue
        name = re.search(r"^Name:\s*(.*)$", status, re.M)
        vol = re.search(r"^voluntary_ctxt_switches:\s*(\d+)", status, re.M)
        out[task] = (name.group(1) if name else "?", int(vol.group(1)) if vol else 0)
    return out


def _cpu(pid: int) -> dict[str, int]:
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            out[task] = int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
        except OSError:
            continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pairprof", description=__doc__)
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--strace", action="store_true", help="count system calls (slower)")
    parser.add_argument("--log-level", default="info", help="the agent's (info: production's)")
    parser.add_argument("--show-log", action="store_true", help="print the agent's last log lines")
    parser.add_argument("--py-spy", metavar="OUT", help="sample the agent with py-spy (collapsed "
                        "stacks into OUT, with --idle off: CPU only)")
    args = parser.parse_args()
    with asyncio.Runner() as runner, Lab("pairprof") as lab:
        lab.noop()
        write_conf(lab.conf_dir, "10-noop.conflist",
                   conflist("noopchain", [{"type": "noop"}] * 3, "1.0.0"))
        agent = lab.agent(log_level=args.log_level)
        assert agent.proc is not None
        pid = agent.proc.pid
        client = runner.run(Client.connect(lab.bus.address))
        lab.cleanups.append(client.close)
        ns = lab.netns.add()

        async def pairs(n: int) -> None:
            for _ in range(n):
                await client.setup("prof", ns)
                await client.teardown("prof", ns)

        runner.run(pairs(50))  # warm-up
        tracer = None
        out = Path(f"/tmp/cni-agent-pairprof-{os.getpid()}.strace")
        if args.strace:
            tracer = subprocess.Popen(["strace", "-c", "-f", "-o", str(out), "-p", str(pid)],
                                      stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        spy = None
        if args.py_spy:
            spy = subprocess.Popen(["py-spy", "record", "--format", "raw", "-r", "1000", "-o",
                                    args.py_spy, "--threads", "-p", str(pid)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        c0, s0, t0 = _cpu(pid), _switches(pid), time.perf_counter()
        runner.run(pairs(args.pairs))
        c1, s1, wall = _cpu(pid), _switches(pid), time.perf_counter() - t0
        if args.show_log:
            print("\n".join(agent.log().splitlines()[-12:]))
        for watcher in (tracer, spy):
            if watcher is not None:
                watcher.send_signal(signal.SIGINT)
                watcher.wait(10)
    n = args.pairs
    main_cpu = (c1.get(str(pid), 0) - c0.get(str(pid), 0)) / 1e6 / n
    others = sum(c1[t] - c0.get(t, 0) for t in c1 if t != str(pid)) / 1e6 / n
    print(f"{n} pairs, {wall / n * 1000:.2f} ms wall per pair")
    print(f"agent CPU per pair: main thread {main_cpu:.2f} ms, other threads {others:.2f} ms, "
          f"total {main_cpu + others:.2f} ms")
    for task, (name, vol) in sorted(s1.items()):
        before = s0.get(task, (name, 0))[1]
        cpu = (c1.get(task, 0) - c0.get(task, 0)) / 1e6 / n
        if vol - before or cpu > 0.001:
            print(f"  thread {task} {name:<24} wake-ups per pair {(vol - before) / n:6.2f}  "
                  f"CPU per pair {cpu:.3f} ms")
    if tracer is not None and out.exists():
        print("system calls per pair (strace -c -f: all agent threads):")
        for line in out.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 5 and fields[3].isdigit():
                calls = int(fields[3])
                print(f"  {fields[-1]:<20} {calls / n:7.2f}")


if __name__ == "__main__":
    main()
