"""`python -m bench.straight [--rounds N]`: the agent, a straight line, a bare server
and Go libcni, side by side on CRI-O's pattern: what `cri.crio_pattern.agent_cpu`
could be at best in Python.

The straight line (`serve`, below) answers the shim's socket protocol
(service/shimsock.py) with one straight line per call and the core guarantees
only: the caller's uid (SO_PEERCRED); the namespace's identity (open, fstat); the
sandbox's flock; for ADD and DEL an intent appended to a log and fdatasync'ed
before any plugin runs (inline: the CPU is the same in a thread); the plugins
run by the agent's own executor (`ProcessExecutor`: the trust check, the
leftovers' sweep, the timeout); the libcni cache written (temporary file and
rename, no fsync) or removed; an outcome line (not synced); one INFO record.
Each is plain system calls and strings joined by hand. It leaves out
everything else the agent does: authorization beyond the uid, the request's
validation, rates, records and their CHECK verdicts, group commit, metrics,
traces, events, and every error path. The bare server (`serve --bare`) is the
same with none of the guarantees: the transport and the plugins' execs.

Each round runs one pod (ADD, CHECK with prevResult, DEL: bench/crio_pattern.py's
`pod`) through the shim on the agent, the straight line and the bare server,
through the chain exec'd directly (the floor `make bench` uses) and through the
Go anchor (tools/build-crio), the first rotating, each in a fresh netns on a
bridge of its own. Printed: the CPU per call of each (the servers': all their
threads, schedstat; the direct chain's: this thread's; libcni's: its own
getrusage, as in `make bench`), per verb, the ratios to libcni's, and the wall
time per pod against the direct chain's. A development tool, as bench.ab is:
it prices a design, it judges no goal.
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
from bench.crio_pattern import VERBS, DirectPod, ShimPod, crio_shim_conf, pod
from bench.harness import PLUGINS_191, Lab, bridge_chain, delete_link, proc_cpu_ns, unique
from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.config import parse_list
from cni_agent.cni.exec import Invocation, ProcessExecutor
from cni_agent.cni.runtime import plugin_stdin
from cni_agent.service.callers import error_of
from cni_agent.service.cnicall import MAX_CONFIG
from cni_agent.service.shimsock import Request, RequestParser, encode_reply, refusal
from tests.support.plugins import write_conf

log = logging.getLogger("straight")
_PEERCRED = struct.Struct("iII")
_TIMEOUT = 10.0
SUBNETS = {"agent": "10.224.0.0/22", "straight": "10.225.0.0/22", "bare": "10.222.0.0/22",
           "direct": "10.223.0.0/22", "libcni": "10.226.0.0/22"}
SERVERS = {"straight": [], "bare": ["--bare"]}

# --- the straight line ---------------------------------------------------------------


class Straight:
    """One network's calls, each a straight line. `bare`: none of the
    guarantees, only the plugins' execs (what the transport costs)."""

    def __init__(self, conflist: Path, plugin_dir: str, state: Path, bare: bool = False) -> None:
        self.bare = bare
        self.raw = conflist.read_bytes()
        self.net = parse_list(self.raw)
        self.dirs = [plugin_dir]
        self.path = ":".join(self.dirs)
        (state / "locks").mkdir(parents=True, exist_ok=True)
        (state / "results").mkdir(exist_ok=True)
        self.locks, self.results = f"{state}/locks/", f"{state}/results/{self.net.name}-"
        self.log = os.open(state / "log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        # The cache entry's constant part, made once: only the ids and the result vary.
        self.cache_head = ('{"kind":"cniCacheV1","networkName":' + json.dumps(self.net.name)
                           + ',"config":"' + base64.b64encode(self.raw).decode() + '"').encode()
        self.executor = ProcessExecutor(subreaper=True)

    async def call(self, env: dict[str, str], config: str) -> bytes:
        """A call's stdout; an exception for any failure. Plain system calls,
        strings joined by hand: its cost is the guarantees', not a library's."""
        verb = env["CNI_COMMAND"]
        if verb == "STATUS":
            return b""
        cid, netns, ifname = env["CNI_CONTAINERID"], env["CNI_NETNS"], env["CNI_IFNAME"]
        conf = json.loads(config)
        prev, caps = conf.get("prevResult"), conf.get("runtimeConfig") or {}
        inv = Invocation(verb, cid, netns, ifname, env.get("CNI_ARGS", ""), self.path)
        if self.bare:
            return await self._run(verb, inv, prev, caps)
        nsfd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        lock = -1
        try:
            st = os.fstat(nsfd)
            lock = os.open(self.locks + cid, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)
            if verb == "CHECK":
                return await self._run(verb, inv, prev, caps)
            ids = f'"{cid}","{ifname}"'.encode()  # a runtime's ids: no quoting needed here
            os.write(self.log, b'{"intent":"%s","ids":[%s],"netns":[%d,%d]}\n'
                     % (verb.encode(), ids, st.st_dev, st.st_ino))
            os.fdatasync(self.log)
            out = await self._run(verb, inv, prev, caps)
            cache = f"{self.results}{cid}-{ifname}"
            if verb == "ADD":
                fd = os.open(cache + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                             0o600)
                try:
                    os.write(fd, b'%s,"containerId":"%s","ifName":"%s","result":%s}'
                             % (self.cache_head, cid.encode(), ifname.encode(), out))
                finally:
                    os.close(fd)
                os.rename(cache + ".tmp", cache)
            else:
                try:
                    os.unlink(cache)
                except FileNotFoundError:
                    pass
            os.write(self.log, b'{"done":"%s","ids":[%s]}\n' % (verb.encode(), ids))
            log.info("%s %s %s: done", verb, cid, ifname)
            return out
        finally:
            if lock >= 0:
                os.close(lock)
            os.close(nsfd)

    async def _run(self, verb: str, inv: Invocation, prev: Any, caps: dict[str, Any]) -> bytes:
        """The chain: ADD in order, each with the previous one's result (the
        last one's is the answer), CHECK in order, DEL in reverse."""
        plugins = list(self.net.plugins)
        result, out = prev, b""
        for p in reversed(plugins) if verb == "DEL" else plugins:
            binary = self.executor.find(p.type, self.dirs, verb)
            out = await self.executor.execute(p.type, binary, inv,
                                              plugin_stdin(self.net, p, result if verb == "ADD"
                                                           else prev, caps), _TIMEOUT)
            if verb == "ADD":
                result = json.loads(out)
        return out if verb == "ADD" else b""


class _Connection(asyncio.Protocol):
    """One request, read and answered with the agent's own codec (shimsock);
    root's only, as the one authorization kept."""

    def __init__(self, straight: Straight) -> None:
        self.straight = straight
        self.parser: RequestParser | None = RequestParser(MAX_CONFIG)
        self.transport: asyncio.Transport | None = None
        self.uid = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's has a Transport's methods
        sock = transport.get_extra_info("socket")
        self.uid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]

    def data_received(self, data: bytes) -> None:
        if self.parser is None:
            return  # being answered
        try:
            request = self.parser.feed(data)
        except AgentError as e:
            self.parser = None
            self._reply(refusal(e))
            return
        if request is not None:
            self.parser = None
            asyncio.get_running_loop().create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        try:
            if self.uid != 0:
                raise AgentError(ErrorKind.ACCESS_DENIED, "root's calls only")
            if request.config is None:
                raise AgentError(ErrorKind.INVALID_ARGUMENT, f"config larger than {MAX_CONFIG} bytes")
            reply = encode_reply(0, "", (await self.straight.call(request.env, request.config)).decode())
        except Exception as e:  # named as the agent names it (a plugin's error, a refusal)
            reply = encode_reply(0, *error_of("CNICall", e))
        self._reply(reply)

    def _reply(self, reply: bytes) -> None:
        assert self.transport is not None
        self.transport.write(reply)
        self.transport.close()


async def serve(sock: str, conflist: Path, plugin_dir: str, state: Path, bare: bool) -> None:
    straight = Straight(conflist, plugin_dir, state, bare)
    await asyncio.get_running_loop().create_unix_server(lambda: _Connection(straight), sock)
    print("ready", flush=True)
    await asyncio.Event().wait()


# --- the comparison -----------------------------------------------------------------


def _stop(server: subprocess.Popen[str]) -> None:
    server.kill()
    server.wait()


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
        conf = crio_shim_conf(agent.config_path)
        shims = {"agent": (ShimPod(conf, lab.bus.address, str(agent.shim_socket)), agent.proc.pid)}
        for way, flags in SERVERS.items():
            sock = str(lab.tmp / f"{way}.sock")
            with open(lab.tmp / f"{way}.log", "w") as err:
                server = subprocess.Popen(
                    [sys.executable, "-m", "bench.straight", "serve", *flags, sock,
                     str(write_conf(lab.tmp, f"{way}.conflist", chain(way, f"{way}net"))),
                     str(PLUGINS_191), str(lab.tmp / f"{way}-state")],
                    stdout=subprocess.PIPE, stderr=err, text=True, cwd=Path(__file__).parent.parent)
            lab.cleanups.append(functools.partial(_stop, server))
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            shims[way] = (ShimPod(conf, lab.bus.address, sock), server.pid)
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
    s.add_argument("--bare", action="store_true", help="none of the guarantees: only the execs")
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
            runner.run(serve(args.socket, args.conflist, args.plugin_dir, args.state, args.bare))
        return 0
    return compare(args.rounds, args.warmup)


if __name__ == "__main__":
    sys.exit(main())
