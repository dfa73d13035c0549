"""`python -m bench.straight [--rounds N]`: the agent, a straight line and Go libcni,
side by side on CRI-O's pattern: what `cri.crio_pattern.agent_cpu` could be at best
in Python.

The straight line (`serve`, below) answers the shim's socket protocol
(service/shimsock.py) with one straight line per call and the core guarantees
only: the caller's uid (SO_PEERCRED); the namespace's identity (open, fstat); the
sandbox's flock; for ADD and DEL an intent appended to a log and fdatasync'ed
before any plugin runs (inline: the CPU is the same in a thread); the plugins
run by the agent's own executor (`ProcessExecutor`: the trust check, the
leftovers' sweep, the timeout); the libcni cache written (temporary file and
rename, no fsync) or removed; an outcome line (not synced); one INFO record.
It leaves out everything else the agent does: authorization beyond the uid,
the request's validation, rates, records and their drift verdicts, group
commit, metrics, traces, events, and every error path.

Each round runs one pod (ADD, CHECK with prevResult, DEL: bench/crio_pattern.py's
`pod`) through the shim on the agent and on the straight line, and one through
the Go anchor (tools/build-crio), the first rotating, each in a fresh netns on
a bridge of its own. Printed: the CPU per call of each (the agent's and the
straight line's: all their threads, schedstat; libcni's: its own getrusage, as
in `make bench`) and per verb, and the ratios to libcni's. A development tool,
as bench.ab is: it prices a design, it judges no goal.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import fcntl
import functools
import json
import logging
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import uvloop

from bench.anchor import Anchor, usable_anchor
from bench.crio_pattern import VERBS, DirectPod, ShimPod, pod
from bench.harness import PLUGINS_191, Lab, bridge_chain, delete_link, proc_cpu_ns, unique
from cni_agent.cni.config import parse_list
from cni_agent.cni.exec import Invocation, ProcessExecutor
from cni_agent.cni.runtime import plugin_stdin
from tests.support.plugins import write_conf

log = logging.getLogger("straight")
_U32 = struct.Struct(">I")
_PEERCRED = struct.Struct("iII")
_TIMEOUT = 10.0
SUBNETS = {"agent": "10.224.0.0/22", "straight": "10.225.0.0/22", "direct": "10.223.0.0/22",
           "libcni": "10.226.0.0/22"}

# --- the straight line ---------------------------------------------------------------


class Straight:
    """One network's calls, each a straight line."""

    def __init__(self, conflist: Path, plugin_dir: str, state: Path) -> None:
        self.raw = conflist.read_bytes()
        self.net = parse_list(self.raw)
        self.dirs = [plugin_dir]
        self.locks, self.results = state / "locks", state / "results"
        self.locks.mkdir(parents=True, exist_ok=True)
        self.results.mkdir(exist_ok=True)
        self.log = os.open(state / "log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.executor = ProcessExecutor(subreaper=True)

    def _append(self, record: dict[str, Any], sync: bool) -> None:
        os.write(self.log, json.dumps(record).encode() + b"\n")
        if sync:
            os.fdatasync(self.log)

    async def call(self, env: dict[str, str], config: bytes) -> bytes:
        """A call's stdout; an exception for any failure."""
        verb = env["CNI_COMMAND"]
        if verb == "STATUS":
            return b""
        cid, netns, ifname = env["CNI_CONTAINERID"], env["CNI_NETNS"], env["CNI_IFNAME"]
        conf = json.loads(config)
        prev, caps = conf.get("prevResult"), conf.get("runtimeConfig") or {}
        nsfd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        lock = -1
        try:
            st = os.fstat(nsfd)
            lock = os.open(self.locks / f"{cid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)
            if verb != "CHECK":
                self._append({"intent": verb, "id": cid, "if": ifname,
                              "netns": [st.st_dev, st.st_ino]}, sync=True)
            inv = Invocation(verb, cid, netns, ifname, env.get("CNI_ARGS", ""), ":".join(self.dirs))
            cache = self.results / f"{self.net.name}-{cid}-{ifname}"
            plugins = list(self.net.plugins)
            if verb == "ADD":
                result = None
                for p in plugins:
                    binary = self.executor.find(p.type, self.dirs, verb)
                    result = json.loads(await self.executor.execute(
                        p.type, binary, inv, plugin_stdin(self.net, p, result, caps), _TIMEOUT))
                tmp = cache.with_suffix(".tmp")
                tmp.write_text(json.dumps({
                    "kind": "cniCacheV1", "containerId": cid, "ifName": ifname,
                    "networkName": self.net.name, "config": base64.b64encode(self.raw).decode(),
                    "result": result}))
                tmp.rename(cache)
                self._append({"done": verb, "id": cid}, sync=False)
                log.info("ADD %s %s: done", cid, ifname)
                return json.dumps(result).encode()
            for p in reversed(plugins) if verb == "DEL" else plugins:
                binary = self.executor.find(p.type, self.dirs, verb)
                await self.executor.execute(p.type, binary, inv, plugin_stdin(self.net, p, prev, caps),
                                            _TIMEOUT)
            if verb == "DEL":
                cache.unlink(missing_ok=True)
                self._append({"done": verb, "id": cid}, sync=False)
                log.info("DEL %s %s: done", cid, ifname)
            return b""
        finally:
            if lock >= 0:
                os.close(lock)
            os.close(nsfd)


class _Connection(asyncio.Protocol):
    def __init__(self, straight: Straight) -> None:
        self.straight, self.buf = straight, bytearray()
        self.transport: asyncio.Transport | None = None
        self.uid = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's has a Transport's methods
        sock = transport.get_extra_info("socket")
        self.uid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        b = self.buf
        if len(b) < 12:
            return
        n = _U32.unpack_from(b, 4)[0]
        if len(b) < 12 + n or len(b) < 12 + n + _U32.unpack_from(b, 8 + n)[0]:
            return
        m = _U32.unpack_from(b, 8 + n)[0]
        env = dict(e.split("=", 1) for e in bytes(b[8:8 + n]).decode().split("\0") if e)
        asyncio.get_running_loop().create_task(self._serve(env, bytes(b[12 + n:12 + n + m])))

    async def _serve(self, env: dict[str, str], config: bytes) -> None:
        name = b""
        try:
            status, out = 0, await self.straight.call(env, config)
        except Exception as e:  # a measurement tool: any failure, said and answered
            status, out, name = 1, str(e).encode(), b"org.cniagent.Agent1.Error.Failed"
        assert self.transport is not None
        self.transport.write(b"CNA1" + _U32.pack(status) + _U32.pack(len(name))
                             + _U32.pack(len(out)) + name + out)
        self.transport.close()


async def serve(sock: str, conflist: Path, plugin_dir: str, state: Path) -> None:
    straight = Straight(conflist, plugin_dir, state)
    await asyncio.get_running_loop().create_unix_server(lambda: _Connection(straight), sock)
    print("ready", flush=True)
    await asyncio.Event().wait()


# --- the comparison -----------------------------------------------------------------


def compare(rounds: int, warmup: int) -> int:
    binary, missing = usable_anchor()
    with Lab("straight") as lab:
        bridges = {way: unique("st") for way in SUBNETS}
        lab.cleanups += [functools.partial(delete_link, b) for b in bridges.values()]
        ipam = lab.tmp / "ipam"

        def chain(way: str, name: str) -> bytes:
            return bridge_chain(name, bridges[way], SUBNETS[way], ipam, "1.1.0")
        write_conf(lab.conf_dir, "10-podnet.conflist", chain("agent", "podnet"))
        agent = lab.agent(plugin_dirs=[str(PLUGINS_191)])
        assert agent.call("WaitReady", "d", "10")[0] is True, agent.log()
        assert agent.proc is not None
        conf = json.loads(subprocess.run(
            [sys.executable, "-m", "cni_agent", "shim-config", "--runtime", "crio", "--network",
             "podnet", "--name", "pods", "--config", str(agent.config_path)],
            capture_output=True, text=True, check=True).stdout)
        sock = str(lab.tmp / "straight.sock")
        with open(lab.tmp / "straight.log", "w") as err:
            server = subprocess.Popen(
                [sys.executable, "-m", "bench.straight", "serve", sock,
                 str(write_conf(lab.tmp, "straight.conflist", chain("straight", "straightnet"))),
                 str(PLUGINS_191), str(lab.tmp / "straight-state")],
                stdout=subprocess.PIPE, stderr=err, text=True, cwd=Path(__file__).parent.parent)

        def stop() -> None:
            server.kill()
            server.wait()
        lab.cleanups.append(stop)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        shims = {"agent": (ShimPod(conf, lab.bus.address, str(agent.shim_socket)), agent.proc.pid),
                 "straight": (ShimPod(conf, lab.bus.address, sock), server.pid)}
        anchor = None
        if binary is not None:
            anchor = Anchor(binary, write_conf(lab.tmp, "libcni.conflist", chain("libcni", "crio-libcni")),
                            PLUGINS_191, lab.tmp / "libcni-cache")
            lab.cleanups.append(anchor.close)
        direct = DirectPod(chain("direct", "crio"), [str(PLUGINS_191)])
        ways = [*shims, "direct", *(["libcni"] if anchor else [])]
        cpu: dict[str, list[float]] = {way: [] for way in ways}
        wall: dict[str, list[float]] = {way: [] for way in ways}
        per: dict[str, dict[str, list[float]]] = {way: {v: [] for v in VERBS} for way in shims}
        for i in range(warmup + rounds):
            spaces = {way: lab.netns.add(lo_up=True) for way in ways}
            for way in ways[i % len(ways):] + ways[:i % len(ways)]:
                t0 = time.perf_counter()
                if way in ("libcni", "direct"):
                    own = time.thread_time_ns()
                    if way == "direct":
                        pod(direct.call, f"direct-{i}", spaces[way])
                    else:
                        assert anchor is not None
                        anchor.run("pod", spaces[way])
                    if i >= warmup:
                        wall[way].append((time.perf_counter() - t0) * 1000)
                        cpu[way].append(anchor.cpu[-1] / len(VERBS) if way == "libcni" and anchor
                                        else (time.thread_time_ns() - own) / 1e6 / len(VERBS))
                    continue
                shim, pid = shims[way]
                prev = None
                verbs: dict[str, float] = {}
                for verb in VERBS:
                    c0 = proc_cpu_ns(pid)
                    got = shim.call(verb, f"{way}-{i}", spaces[way], prev)
                    verbs[verb] = (proc_cpu_ns(pid) - c0) / 1e6
                    prev = got if verb == "ADD" else prev
                if i >= warmup:
                    wall[way].append((time.perf_counter() - t0) * 1000)
                    cpu[way].append(sum(verbs.values()) / len(VERBS))
                    for verb, ms in verbs.items():
                        per[way][verb].append(ms)
            lab.netns.close()
    print(f"CRI-O's pattern, {rounds} rounds: CPU per call, median (p25-p75); wall per pod, median")
    base = statistics.median(cpu["libcni"]) if anchor else None
    floor = statistics.median(wall["direct"])
    for way in ways:
        q = statistics.quantiles(cpu[way], n=4) if len(cpu[way]) > 1 else cpu[way] * 3
        vs = f" = {statistics.median(cpu[way]) / base:.2f}x libcni's" if base else ""
        verbs_ = "".join(f", {v} {statistics.median(per[way][v]):.2f}" for v in VERBS) if way in per else ""
        pod_ = statistics.median(wall[way])
        print(f"  {way:8} CPU {statistics.median(cpu[way]):.3f} ms ({q[0]:.3f}-{q[2]:.3f}){vs}{verbs_}; "
              f"pod {pod_:.1f} ms = {pod_ / floor:.3f}x direct")
    if not anchor:
        print(f"  libcni: {missing}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.straight", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode")
    s = sub.add_parser("serve", help="the straight line alone, on SOCKET (the comparison starts it)")
    s.add_argument("socket")
    s.add_argument("conflist", type=Path)
    s.add_argument("plugin_dir")
    s.add_argument("state", type=Path)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if args.mode == "serve":
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(message)s")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(args.socket, args.conflist, args.plugin_dir, args.state))
        return 0
    return compare(args.rounds, args.warmup)


if __name__ == "__main__":
    sys.exit(main())
