"""What every benchmark needs: a lab (private bus + agents), netns, C plugins, clients."""

from __future__ import annotations

import functools
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from cni_agent.cni.config import parse_list
from cni_agent.cni.exec import find_plugin
from cni_agent.cni.runtime import plugin_stdin
from tests.cri.containerd import CACHE
from tests.support.agent import IFACE, NAME, PATH, Agent, Bus

HERE = Path(__file__).resolve().parent
PLUGINS_191 = CACHE / "cni-plugins-1.9.1"
# A tmpfs, where a node's /run is (runtime_dir: lock files, the shim's socket).
_TMPFS = "/dev/shm" if os.path.isdir("/dev/shm") else None
# Every netns and link the benchmarks create starts with this (the smoke test checks).
PREFIX = "cnib"
_counter = itertools.count()


def unique(tag: str = "") -> str:
    """A short unique name (interface names have at most 15 bytes)."""
    name = f"{PREFIX}{os.getpid() % 10000}{tag}{next(_counter)}"
    assert len(name) <= 15, name
    return name


def build_c(source: str, target: Path, **defines: str) -> Path:
    """Compile bench/<source> into `target` (an executable root-owned 0755 file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(target.parent, 0o755)
    flags = [f"-D{k}={json.dumps(v)}" for k, v in defines.items()]
    subprocess.run(["gcc", "-O2", "-o", str(target), *flags, str(HERE / source)], check=True)
    os.chmod(target, 0o755)
    return target


def conflist(name: str, plugins: Sequence[Mapping[str, Any]], version: str = "1.0.0") -> bytes:
    return json.dumps({"cniVersion": version, "name": name, "plugins": list(plugins)}).encode()


def reference_plugins() -> tuple[Path, str]:
    """The plugins the runtime benchmarks run, and the cniVersion they speak: 1.9.1 from the
    test tools cache when tools/setup-system fetched it, else Debian 12's."""
    if (PLUGINS_191 / "portmap").exists():
        return PLUGINS_191, "1.1.0"
    return Path("/usr/lib/cni"), "1.0.0"


def bridge_chain(name: str, bridge: str, subnet: str, ipam: Path, version: str) -> bytes:
    """A pod network as runtimes configure one: bridge + host-local, then portmap."""
    return conflist(name, [
        {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
         "ipam": {"type": "host-local", "subnet": subnet, "dataDir": str(ipam)}},
        {"type": "portmap", "capabilities": {"portMappings": True}}], version)


# --- namespaces and links --------------------------------------------------------------------

class NetnsPool:
    """Named network namespaces made with `ip netns add`; all deleted by close()."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def add(self, lo_up: bool = False) -> str:
        """A new namespace; with `lo_up`, its loopback up (as CRI-O leaves it
        before its first CNI ADD)."""
        name = unique("n")
        subprocess.run(["ip", "netns", "add", name], check=True)
        self.names.append(name)
        if lo_up:
            subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        return f"/run/netns/{name}"

    def many(self, count: int, lo_up: bool = False) -> list[str]:
        return [self.add(lo_up) for _ in range(count)]

    def close(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.names.clear()


def delete_link(name: str) -> None:
    subprocess.run(["ip", "link", "del", name], capture_output=True)


def links_with_master(bridge: str) -> list[str]:
    out = subprocess.run(["ip", "-j", "link", "show", "master", bridge], capture_output=True, text=True)
    return [link["ifname"] for link in json.loads(out.stdout or "[]")] if out.returncode == 0 else []


def netns_links(path: str) -> list[str]:
    """Interfaces other than lo inside a netns."""
    out = subprocess.run(["ip", "-n", os.path.basename(path), "-j", "link"], capture_output=True, text=True)
    links = json.loads(out.stdout or "[]") if out.returncode == 0 else []
    return [link["ifname"] for link in links if link["ifname"] != "lo"]


# --- the agent's process --------------------------------------------------------------------

def proc_cpu(pid: int) -> tuple[float, float]:
    """(own utime+stime, waited-for children's cutime+cstime) in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    hz = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / hz, (int(fields[13]) + int(fields[14])) / hz


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """Each of pid's threads' time on CPU in ns, by thread id (schedstat: exact, where
    /proc/PID/stat counts 10 ms ticks). A thread that has exited is not counted."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                out[task] = int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread exited meanwhile
    return out


def proc_cpu_ns(pid: int) -> int:
    """Time on CPU of all of pid's threads, in ns."""
    return sum(thread_cpu_ns(pid).values())


def children_cpu_ms() -> float:
    """CPU (user + system) of this process's waited-for children, in ms."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (r.ru_utime + r.ru_stime) * 1000


def proc_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


class Lab:
    """A temp dir, a private system-like bus and the agents started on it; close() undoes all."""

    def __init__(self, name: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=f"cni-bench-{name}-"))
        os.chmod(self.tmp, 0o755)
        self.bin = self.tmp / "bin"
        self.bin.mkdir(mode=0o755)
        self.conf_dir = self.tmp / "net.d"
        self.conf_dir.mkdir()
        self.netns = NetnsPool()
        self.cleanups: list[Callable[[], None]] = []
        self.agents: list[Agent] = []
        self.bus = Bus("system")

    def agent(self, start: bool = True, **config: Any) -> Agent:
        """Production settings (log level info, default intervals and timeouts) unless overridden.

        Its runtime_dir is on tmpfs, as /run/cni-agent is on a node (this
        VM's /run is not: its lock files would cost an ext4 inode each)."""
        run = Path(tempfile.mkdtemp(prefix=f"{self.tmp.name}-run-", dir=_TMPFS))
        self.cleanups.append(lambda: shutil.rmtree(run, ignore_errors=True))
        settings: dict[str, Any] = {"log_level": "info", "monitor": {}, "timeouts": {},
                                    "runtime_dir": str(run), **config}
        agent = Agent(self.tmp, self.bus, **settings)
        # BENCH_AGENT_CPROFILE=DIR: each agent runs under cProfile (CPU time of its
        # main thread, see cpuprof.py), its stats in DIR when it exits.
        if profile_dir := os.environ.get("BENCH_AGENT_CPROFILE"):
            os.makedirs(profile_dir, exist_ok=True)
            out = os.path.join(profile_dir, f"{self.tmp.name}-{len(self.agents)}.prof")
            agent.python_args = [str(HERE / "cpuprof.py"), out]
        self.agents.append(agent)
        if start:
            agent.start()
        return agent

    def noop(self, name: str = "noop") -> Path:
        return build_c("noop.c", self.bin / name)

    def close(self) -> None:
        """Undo everything; one step failing must not leave the others undone."""
        steps: list[Callable[[], object]] = [functools.partial(a.stop, timeout=15) for a in self.agents]
        steps += reversed(self.cleanups)
        steps += [self.netns.close, self.bus.stop, lambda: shutil.rmtree(self.tmp, ignore_errors=True)]
        for step in steps:
            try:
                step()
            except Exception as e:
                print(f"bench: cleanup step failed: {e!r}", file=sys.stderr)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- clients ---------------------------------------------------------------------------------

class CallFailed(Exception):
    pass


class Client:
    """An in-process dbus-fast connection to the agent."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus

    @classmethod
    async def connect(cls, address: str) -> Client:
        return cls(await MessageBus(bus_address=address).connect())

    async def call(self, member: str, signature: str, body: list[Any]) -> list[Any]:
        reply = await self.bus.call(Message(destination=NAME, path=PATH, interface=IFACE,
                                            member=member, signature=signature, body=body))
        if reply.message_type is MessageType.ERROR:
            raise CallFailed(f"{member}: {reply.error_name}: {reply.body}")
        return list(reply.body)

    async def setup(self, sid: str, netns: str, network: str = "", caps: Any = None) -> str:
        opts: dict[str, Variant] = {}
        if network:
            opts["networks"] = Variant("a(ss)", [[network, "eth0"]])
        if caps is not None:
            opts["capabilities"] = Variant("s", json.dumps(caps))
        return str((await self.call("Setup", "ssa{sv}", [sid, netns, opts]))[0])

    async def teardown(self, sid: str, netns: str) -> None:
        await self.call("Teardown", "ssa{sv}", [sid, netns, {}])

    def close(self) -> None:
        self.bus.disconnect()


def busctl(address: str, member: str, signature: str, *args: str) -> None:
    """One call through `busctl`, a separate process (as a shell script would)."""
    out = subprocess.run(["busctl", f"--address={address}", "call", NAME, PATH, IFACE, member,
                          signature, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise CallFailed(f"busctl {member}: {out.stderr.strip()}")


# --- the floor: the same chain executed directly ---------------------------------------------

_STRIPPED = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
             "LISTEN_FDNAMES", "INVOCATION_ID")


class DirectChain:
    """ADD forward, DEL in reverse: the binaries, stdin and env the agent would use."""

    def __init__(self, config: bytes, plugin_dirs: Sequence[str]) -> None:
        self.net = parse_list(config)
        self.path = ":".join(plugin_dirs)
        self.binaries = [find_plugin(p.type, plugin_dirs) for p in self.net.plugins]
        self.env = {k: v for k, v in os.environ.items() if k not in _STRIPPED}

    def _exec(self, binary: str, env: dict[str, str], stdin: bytes) -> bytes:
        out = subprocess.run([binary], input=stdin, capture_output=True, env=env, cwd="/",
                             start_new_session=True)
        if out.returncode != 0:
            raise CallFailed(f"{binary} {env['CNI_COMMAND']}: {out.stdout!r} {out.stderr!r}")
        return out.stdout

    def _env(self, command: str, sid: str, netns: str, ifname: str) -> dict[str, str]:
        return {**self.env, "CNI_COMMAND": command, "CNI_CONTAINERID": sid, "CNI_NETNS": netns,
                "CNI_IFNAME": ifname, "CNI_ARGS": "", "CNI_PATH": self.path}

    def add(self, sid: str, netns: str, caps: Mapping[str, Any] | None = None) -> Any:
        env, prev = self._env("ADD", sid, netns, "eth0"), None
        for plugin, binary in zip(self.net.plugins, self.binaries, strict=True):
            prev = json.loads(self._exec(binary, env, plugin_stdin(self.net, plugin, prev, caps or {})))
        return prev

    def delete(self, sid: str, netns: str, prev: Any, caps: Mapping[str, Any] | None = None) -> None:
        env = self._env("DEL", sid, netns, "eth0")
        for plugin, binary in reversed(list(zip(self.net.plugins, self.binaries, strict=True))):
            self._exec(binary, env, plugin_stdin(self.net, plugin, prev, caps or {}))


def floor_cpu_ms(chain: DirectChain, spaces: Sequence[str], prefix: str = "floor") -> float:
    """The floor's CPU per call, ms: this thread's own CPU exec'ing `chain` from
    Python, ADD in each netns, then DEL in each, one at a time. The thread's clock,
    not the process's: the benchmark's other threads (a gRPC client's) are no floor."""
    t0 = time.thread_time_ns()
    added = [chain.add(f"{prefix}-{i}", ns) for i, ns in enumerate(spaces)]
    for i, (ns, prev) in enumerate(zip(spaces, added, strict=True)):
        chain.delete(f"{prefix}-{i}", ns, prev)
    return (time.thread_time_ns() - t0) / 1e6 / (2 * len(spaces))


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def interleave(ways: Mapping[str, Callable[[], Any]], rounds: int, warmup: int,
               on_warmed_up: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Each way once per round, the first rotating (shared machines drift: A, B,
    B, A …); wall ms per call after `warmup` rounds, then `on_warmed_up()` once."""
    samples: dict[str, list[float]] = {name: [] for name in ways}
    order = list(ways)
    for i in range(warmup + rounds):
        if i == warmup:
            on_warmed_up()
        k = i % len(order)
        for name in order[k:] + order[:k]:
            t0 = time.perf_counter()
            ways[name]()
            if i >= warmup:
                samples[name].append(ms_since(t0))
    return samples
