"""`python -m bench.sections [--pattern crio|pair] [--units N] [--section SPEC …]`:
where the agent's CPU per call goes, layer by layer, measured (not sampled).

One agent runs under bench/sectionprobe.py, which wraps the named functions
(`module:Class.method`, `module:function`) to add up the main thread's CPU
inside each; after a warm-up, N units run (`--pattern crio`: pods as CRI-O
runs them through the shim, ADD, CHECK, DEL; `pair`: Setup+Teardown over
dbus-fast of 3 no-op plugins: bench/ab.py's units). Printed per shim call
(or per pair): each section's CPU, inclusive of what it calls, its calls, and
its cost per call of it; "outside" is the main thread's CPU outside the
outermost section (the transport, the loop, timers). The process's CPU is
split into user space and kernel (os.times: 10 ms ticks, so a window of a
few hundred units is needed for it to mean something).

`--count-calls N` counts instead every call of the main thread over the
window, Python and C functions alike (sys.setprofile; a coroutine once per
resumption; no CPU figures: the
counting slows what it counts), and prints the calls per unit and the N most
called: how much code one call runs, which is what a layer removed shows.

The default sections follow one call from the transport to the plugin's
spawn. A wrapper costs ~1 us per call of it: inner sections of tight loops
inflate their callers a little. cProfile (bench/cpuprof.py) and py-spy
(bench/crio_profile.py) show the same code by function or by sample, but
distort it: cProfile's cost per call dwarfs small functions, and py-spy
counts a posix_spawn waiting for its child's exec as CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path

from bench.ab import setup_unit
from bench.harness import Lab

HERE = Path(__file__).parent

_COMMON = [
    "cni_agent.cni.runtime:CNIRuntime.add",
    "cni_agent.cni.runtime:CNIRuntime.delete",
    "cni_agent.cni.runtime:CNIRuntime.check",
    "cni_agent.cni.runtime:CNIRuntime.find",
    "cni_agent.cni.runtime:plugin_stdin",
    "cni_agent.cni.runtime:parse_result",
    "cni_agent.cni.cache:ResultCache.write",
    "cni_agent.cni.exec:ProcessExecutor.execute",
    "cni_agent.cni.spawn:Child.__init__",
    "cni_agent.cni.spawn:Child._reap",
    "cni_agent.cni.spawn:_Exits._ready",
    "cni_agent.cni.spawn:_Exits._bury",
    "cni_agent.sandboxes.journal:Journal.begin_add",
    "cni_agent.sandboxes.journal:Journal.add",
    "cni_agent.sandboxes.journal:Journal.remove",
    "cni_agent.sandboxes.journal:prepare",
    "cni_agent.sandboxes.store:SandboxStore.write",
    "cni_agent.sandboxes.store:SandboxStore.commit",
    "cni_agent.node.blocking:in_kernel",
    "cni_agent.node.blocking:pin",
    "cni_agent.node.locks:SandboxLocks._try_flock",
    "cni_agent.node.locks:_unlock",
]
DEFAULTS = {
    "crio": [
        "cni_agent.service.shimsock:ShimSocket.answer",
        "cni_agent.service.shimsock:_Connection.connection_made",
        "cni_agent.service.shimsock:_Connection.data_received",
        "cni_agent.service.callers:Callers.serve",
        "cni_agent.service.cnicall:ShimCalls.handle",
        "cni_agent.service.cnicall:parse_call",
        "cni_agent.sandboxes.attach:Attachments.attach",
        "cni_agent.sandboxes.attach:Attachments._attach_locked",
        "cni_agent.sandboxes.attach:Attachments.detach",
        "cni_agent.sandboxes.attach:Attachments._remove",
        "cni_agent.sandboxes.attach:Attachments.check",
        "cni_agent.sandboxes.attach:Attachments._check_locked",
        "cni_agent.sandboxes.checks:Checks._one",
        "cni_agent.sandboxes.journal:Journal.check",
        *_COMMON,
    ],
    "pair": [
        "cni_agent.service.dbus_service:AgentInterface._serve",
        "cni_agent.sandboxes.manager:SandboxManager.setup",
        "cni_agent.sandboxes.manager:SandboxManager._setup_in",
        "cni_agent.sandboxes.manager:SandboxManager.teardown",
        "cni_agent.sandboxes.manager:SandboxManager.add_new",
        *_COMMON,
    ],
}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sections", description=__doc__)
    parser.add_argument("--pattern", choices=("crio", "pair"), default="crio")
    parser.add_argument("--units", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--section", action="append", metavar="SPEC",
                        help="a section instead of the defaults (repeatable)")
    parser.add_argument("--count-calls", type=int, metavar="N", default=0,
                        help="count the calls of every function instead of timing "
                             "(sys.setprofile), and print the N most called")
    args = parser.parse_args()
    sections = args.section or DEFAULTS[args.pattern]
    per = 3 if args.pattern == "crio" else 1
    out = Path(f"/tmp/cni-agent-sections-{os.getpid()}.json")
    with asyncio.Runner() as runner, Lab("sections") as lab:
        # Counting, no section is wrapped: the wrappers' calls would be counted.
        env = {"CNI_AGENT_SECTIONS": "" if args.count_calls else ",".join(sections),
               "CNI_AGENT_COUNT_CALLS": "1" if args.count_calls else ""}
        unit, pid = setup_unit(lab, "new", env, args.pattern, runner,
                               [str(HERE / "sectionprobe.py"), str(out)])
        for i in range(args.warmup + args.units):
            if i == args.warmup:  # the window starts
                os.kill(pid, signal.SIGUSR1)
                time.sleep(0.2)
            unit(i)
            if args.pattern == "crio":
                lab.netns.close()  # each pod's namespace, as bench.ab does
        os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    if not out.exists():
        raise SystemExit(f"the agent wrote no figures to {out} within 10 s of SIGUSR2 "
                         "(did it exit? its log was in the lab's directory)")
    doc = json.loads(out.read_text())
    out.unlink()
    calls = args.units * per
    what = "shim call" if args.pattern == "crio" else "Setup+Teardown"
    if args.count_calls:
        return _print_calls(doc["calls"], calls, what, args.count_calls)
    main_us = doc["main_thread_ns"] / calls / 1e3
    user_us, kernel_us = doc["user_ns"] / calls / 1e3, doc["system_ns"] / calls / 1e3
    print(f"{args.pattern}: {args.units} units; the agent's CPU per {what}: main thread "
          f"{main_us:.0f} us, process {user_us + kernel_us:.0f} us (user {user_us:.0f}, "
          f"kernel {kernel_us:.0f})")
    spent = {k: v for k, v in doc["sections"].items() if v[1]}
    print(f"{'us/' + ('call' if per == 3 else 'pair'):>9} {'calls':>6} {'us each':>8}  section")
    for key, (ns, n) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
        print(f"{ns / calls / 1e3:9.0f} {n / calls:6.2f} {ns / n / 1e3:8.0f}  {key}")
    top = sections[0].partition(":")[2]
    if top in spent:
        print(f"{main_us - spent[top][0] / calls / 1e3:9.0f} {'':6} {'':8}  outside {top}")
    return 0


def _print_calls(counts: dict[str, int], units: int, what: str, top: int) -> int:
    """The calls per `what`: Python functions, C functions, the `top` most called."""
    python = sum(n for k, n in counts.items() if k.startswith("py "))
    print(f"calls per {what} in the agent's main thread: {python / units:.0f} Python "
          f"functions, {(sum(counts.values()) - python) / units:.0f} C functions")
    for key, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{n / units:8.2f}  {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
