"""Load and crash consistency with the real bridge + host-local, as a library.

`make soak` runs the long versions (`python -m tests.soak`); `make test` runs
short ones (test_soak.py). Both check the same invariant: every sandbox is
either fully set up (a record in the journal, cache entry, address in its
namespace, IP allocated) or fully gone — nothing leaked, nothing lost.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.agent import Agent, Bus
from tests.support.dbusclient import CLIENT_TIMEOUT, SyncClient
from tests.support.net import addresses
from tests.support.state import lose, records

NETWORK = "soak"
SUBNET = "10.218.0.0/22"


@dataclass
class Report:
    name: str
    operations: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)  # what is not a failure, by name
    leaks: list[str] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


class Node:
    """A temp dir, a private bus, an agent with one bridge network, and namespaces."""

    def __init__(self, sandboxes: int, tag: str = "soak") -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=f"cni-agent-{tag}-"))
        self.bridge = f"cas{random.randrange(10**6)}"
        self.bus = Bus("system")
        conf = self.tmp / "net.d"
        conf.mkdir()
        (conf / "10-soak.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": NETWORK,
            "plugins": [{"type": "bridge", "bridge": self.bridge, "isGateway": True,
                         "ipMasq": False,
                         "ipam": {"type": "host-local", "subnet": SUBNET,
                                  "dataDir": str(self.tmp / "ipam")}}],
        }))
        (self.tmp / "bin").mkdir()
        self.agent = Agent(self.tmp, self.bus, monitor={"startup_interval": 0.05, "interval": 1},
                           timeouts={"ready": 10, "lock": 60}, log_level="info")
        self.ids = [f"s{i:03d}" for i in range(sandboxes)]
        self.netns = {sid: f"{self.bridge}-{sid}" for sid in self.ids}
        for name in self.netns.values():
            subprocess.run(["ip", "netns", "add", name], check=True)

    def path(self, sid: str) -> str:
        return f"/run/netns/{self.netns[sid]}"

    def start(self) -> None:
        self.agent.start()
        client = SyncClient(self.bus.address)
        try:
            err, body = client.call("WaitReady", "d", [20.0])
            assert err is None and body == [True], (err, body)
            # Teardown takes the GC lock: it returns once start-up recovery is done.
            assert client.call("Teardown", "ssa{sv}", ["probe", "", {}])[0] is None
        finally:
            client.close()

    def close(self) -> None:
        self.agent.stop()
        for name in self.netns.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.bus.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # --- what is on the node -------------------------------------------------------

    def allocations(self) -> dict[str, str]:
        """IP → container ID, from host-local's files."""
        d = self.tmp / "ipam" / NETWORK
        if not d.exists():
            return {}
        found = {}
        for p in d.iterdir():
            if p.name[0].isdigit():
                try:
                    found[p.name] = p.read_text().split()[0]
                except FileNotFoundError:  # released while we looked
                    continue
        return found

    def unfinished(self) -> list[str]:
        """Sandboxes whose record says an operation is under way."""
        return [sid for sid, doc in records(self.tmp / "state").items()
                if doc["phase"] != "ready"]

    def veths(self) -> int:
        out = subprocess.run(["ip", "-j", "link", "show", "master", self.bridge],
                             capture_output=True, text=True)
        return len(json.loads(out.stdout or "[]")) if out.returncode == 0 else 0

    def check(self) -> list[str]:
        """Every sandbox fully set up or fully gone; returns the violations."""
        problems = []
        state = self.tmp / "state"
        recs = records(state)
        cached = {p.name.split("-")[1]: p for p in (state / "results").glob(f"{NETWORK}-*")}
        owners = Counter(self.allocations().values())
        live = 0
        for sid in self.ids:
            rec, entry, ips = recs.get(sid), cached.get(sid), addresses(self.path(sid))
            allocated = owners.get(sid, 0)
            if rec is None and entry is None and not ips and allocated == 0:
                continue
            if rec is not None and rec["phase"] == "ready" and entry is not None and \
                    len(ips) == 1 and allocated == 1:
                result = json.loads(entry.read_text())["result"]
                if result["ips"][0]["address"] == ips[0]:
                    live += 1
                    continue
            problems.append(f"{sid}: record={rec and rec['phase']} cached={entry is not None} "
                            f"addresses={ips} allocations={allocated}")
        stray = set(owners) - set(self.ids)
        problems += [f"allocation for unknown container {s}" for s in sorted(stray)]
        problems += [f"record of unknown sandbox {s}" for s in sorted(set(recs) - set(self.ids))]
        if self.veths() != live:
            problems.append(f"{self.veths()} veths on the bridge for {live} live sandboxes")
        locks = list((self.tmp / "run" / "locks").glob("*")) if (self.tmp / "run" / "locks").exists() else []
        problems += [f"lock file left: {p.name}" for p in locks]
        temp = [p for d in ("results", "journal") for pattern in (".tmp*", "*.tmp")
                for p in (state / d).glob(pattern)]
        problems += [f"temp file left: {p}" for p in temp]
        return problems


def _setup(client: SyncClient, node: Node, sid: str, report: Report, lock: threading.Lock) -> None:
    err, body = client.call("Setup", "ssa{sv}", [sid, node.path(sid), {}])
    with lock:
        report.operations += 1
        if err is not None and err.endswith(".Cancelled"):
            # A Teardown of the same sandbox arrived while this Setup queued: by
            # design it wins, and nothing was set up.
            report.outcomes["Cancelled"] += 1
            return
        if err is not None:
            report.failures[err.rsplit(".", 1)[-1]] += 1
            return
    address = json.loads(body[0])["attachments"][0]["result"]["ips"][0]["address"]
    if address not in addresses(node.path(sid)):
        # Only a failure if the sandbox is still set up (a Teardown may have raced us).
        err2, body2 = client.call("Show", "s", [sid])
        shown = json.loads(body2[0]) if err2 is None else {}
        if shown.get("state") == "ready" and address in body2[0]:
            with lock:
                report.failures["SetupWithoutAddress"] += 1


def _teardown(client: SyncClient, node: Node, sid: str, report: Report, lock: threading.Lock) -> None:
    err, _ = client.call("Teardown", "ssa{sv}", [sid, node.path(sid), {}])
    with lock:
        report.operations += 1
        if err is not None:
            report.failures[err.rsplit(".", 1)[-1]] += 1


def _finish(node: Node, report: Report, lock: threading.Lock) -> None:
    """Check the node, tear every sandbox down, and check that nothing is left."""
    report.leaks += node.check()
    client = SyncClient(node.bus.address)
    for sid in node.ids:
        _teardown(client, node, sid, report, lock)
    client.close()
    report.leaks += node.check()
    report.leaks += [f"{ip} still allocated" for ip in node.allocations()]


def soak(ops: int, sandboxes: int = 50, workers: int = 16, seed: int = 1) -> Report:
    """`ops` Setup/Teardown calls in random order and concurrency over `sandboxes`."""
    report = Report("soak")
    node = Node(sandboxes)
    rng = random.Random(seed)
    plan = [(rng.choice(node.ids), rng.random() < 0.55) for _ in range(ops)]
    lock = threading.Lock()
    start = time.monotonic()
    try:
        node.start()

        def worker(n: int) -> None:
            client = SyncClient(node.bus.address)
            wrng = random.Random(seed * 1000 + n)
            try:
                while True:
                    with lock:
                        if not plan:
                            return
                        sid, is_setup = plan.pop()
                    if wrng.random() < 0.1:  # random concurrency: workers pause now and then
                        time.sleep(wrng.random() * 0.02)
                    (_setup if is_setup else _teardown)(client, node, sid, report, lock)
            finally:
                client.close()

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _finish(node, report, lock)
    finally:
        report.seconds = time.monotonic() - start
        node.close()
    return report


def gc_and_waiting(ops: int, sandboxes: int = 20, workers: int = 8, seed: int = 3) -> Report:
    """The network flaps; impatient Setups wait for it, their callers give up and
    Teardown; GarbageCollect calls with random valid lists run through it all."""
    report = Report("gc+wait")
    node = Node(sandboxes, tag="gcw")
    conf = node.tmp / "net.d" / "10-soak.conflist"
    aside = node.tmp / "soak.conflist.off"
    rng = random.Random(seed)
    plan = [(rng.choice(node.ids), rng.random()) for _ in range(ops)]
    lock = threading.Lock()
    done = threading.Event()
    start = time.monotonic()

    def flap() -> None:
        frng = random.Random(seed + 1)
        while not done.wait(frng.uniform(0.2, 0.6)):
            os.replace(conf, aside)  # the provider goes away: NetworkReady false
            time.sleep(frng.uniform(0.1, 0.4))
            os.replace(aside, conf)

    def worker(n: int) -> None:
        client = SyncClient(node.bus.address)
        wrng = random.Random(seed * 1000 + n)
        try:
            while True:
                with lock:
                    if not plan:
                        return
                    sid, r = plan.pop()
                if r < 0.5:  # a caller with a short D-Bus timeout, which then cleans up
                    err, _ = client.call("Setup", "ssa{sv}", [sid, node.path(sid), {}],
                                         timeout=wrng.uniform(0.05, 0.5))
                    outcome = err.rsplit(".", 1)[-1] if err else "ok"
                    if err == CLIENT_TIMEOUT:
                        err, _ = client.call("Teardown", "ssa{sv}", [sid, node.path(sid), {}])
                        outcome = "gave-up-and-tore-down"
                elif r < 0.8:
                    err, _ = client.call("Teardown", "ssa{sv}", [sid, node.path(sid), {}])
                    outcome = "ok"
                else:
                    valid = wrng.sample(node.ids, k=len(node.ids) // 2)
                    err, _ = client.call("GarbageCollect", "as", [valid])
                    outcome = "ok"
                with lock:
                    report.operations += 1
                    name = err.rsplit(".", 1)[-1] if err else None
                    if name in (None, "NotReady", "Cancelled", "Timeout") or outcome != "ok":
                        report.outcomes[outcome] += 1
                    else:
                        report.failures[name] += 1
        finally:
            client.close()

    try:
        node.start()
        flapper = threading.Thread(target=flap)
        flapper.start()
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        flapper.join()
        if aside.exists():
            os.replace(aside, conf)
        client = SyncClient(node.bus.address)
        assert client.call("WaitReady", "d", [20.0]) == (None, [True])
        # Callers that gave up left no Setup behind: nothing is still in flight.
        deadline = time.monotonic() + 30
        while node.unfinished() and time.monotonic() < deadline:
            time.sleep(0.1)
        client.close()
        _finish(node, report, lock)
    finally:
        report.seconds = time.monotonic() - start
        node.close()
    return report


def crashes(kills: int, sandboxes: int = 12, seed: int = 2) -> Report:
    """kill -9 the agent at random points during Setups and Teardowns, restart, check."""
    report = Report("crash")
    node = Node(sandboxes, tag="crash")
    rng = random.Random(seed)
    start = time.monotonic()
    try:
        node.start()
        lock = threading.Lock()
        for _ in range(kills):

            def hammer(n: int) -> None:
                client = SyncClient(node.bus.address)
                try:
                    for _ in range(50):
                        sid = rng.choice(node.ids)
                        err, _ = client.call("Setup" if rng.random() < 0.6 else "Teardown",
                                             "ssa{sv}", [sid, node.path(sid), {}])
                        with lock:
                            report.operations += 1
                        if err and ("NoReply" in err or "ServiceUnknown" in err):
                            return  # the agent was killed under us
                finally:
                    client.close()

            threads = [threading.Thread(target=hammer, args=(n,)) for n in range(4)]
            for t in threads:
                t.start()
            time.sleep(rng.uniform(0.05, 0.4))
            node.agent.stop(signal.SIGKILL)
            for t in threads:
                t.join(30)
            node.start()
            problems = node.check()
            if problems:
                report.leaks += problems
                break
        client = SyncClient(node.bus.address)
        for sid in node.ids:
            client.call("Teardown", "ssa{sv}", [sid, "", {}])
        client.close()
        report.leaks += node.check()
        report.leaks += [f"{ip} still allocated" for ip in node.allocations()]
        report.notes.append(f"{kills} kills")
    finally:
        report.seconds = time.monotonic() - start
        node.close()
    return report


def power_loss(kills: int, sandboxes: int = 12, seed: int = 4) -> Report:
    """kill -9 at random points, then zero a random cache entry (written without
    fsync: what a power loss can leave) or every journal line of a sandbox's
    record (damage from outside: the journal commits before plugins run),
    restart: every Teardown succeeds and no IP, veth, record or cache entry is
    left."""
    report = Report("power")
    node = Node(sandboxes, tag="power")
    rng = random.Random(seed)
    start = time.monotonic()
    state = node.tmp / "state"
    try:
        node.start()
        for _ in range(kills):
            client = SyncClient(node.bus.address)
            try:
                for sid in rng.sample(node.ids, k=len(node.ids) // 2):
                    client.call("Setup", "ssa{sv}", [sid, node.path(sid), {}])
                    report.operations += 1
            finally:
                client.close()
            stop = threading.Event()

            def hammer(stop: threading.Event) -> None:
                client = SyncClient(node.bus.address)
                try:
                    while not stop.is_set():
                        sid = rng.choice(node.ids)
                        err, _ = client.call("Setup" if rng.random() < 0.6 else "Teardown",
                                             "ssa{sv}", [sid, node.path(sid), {}])
                        report.operations += 1
                        if err and ("NoReply" in err or "ServiceUnknown" in err):
                            return
                finally:
                    client.close()

            threads = [threading.Thread(target=hammer, args=(stop,)) for _ in range(3)]
            for t in threads:
                t.start()
            time.sleep(rng.uniform(0.05, 0.4))
            node.agent.stop(signal.SIGKILL)
            stop.set()
            for t in threads:
                t.join(30)
            # Any cache entry; a record only when its sandbox has a cache entry
            # too. A record lost while its first ADD was in flight (no cache
            # entry yet) leaves nothing on disk that names the network, and the
            # agent does not guess (docs/reliability.md, "Damaged state never blocks"); our
            # own writes are durable, so only outside damage can do that.
            # (The agent is killed already: the journal can be damaged now.)
            results = sorted((state / "results").glob("*"))
            cached = {p.name.split("-")[1] for p in results}
            victims: list[str | Path] = [*sorted(sid for sid in records(state) if sid in cached),
                                         *results]
            if victims:
                victim = rng.choice(victims)
                if isinstance(victim, str):
                    assert lose(state, victim), victim
                    report.outcomes["record zeroed"] += 1
                else:
                    victim.write_bytes(b"")
                    report.outcomes["cache entry zeroed"] += 1
            node.start()
            client = SyncClient(node.bus.address)
            try:
                for sid in node.ids:
                    err, _ = client.call("Teardown", "ssa{sv}", [sid, node.path(sid), {}])
                    report.operations += 1
                    if err:
                        report.failures[err.rsplit(".", 1)[-1]] += 1
            finally:
                client.close()
            problems = node.check()
            problems += [f"{ip} still allocated (owner {o})" for ip, o in node.allocations().items()]
            left = [p.name for p in (state / "results").glob("*")]
            problems += [f"cache entry left: {n}" for n in left]
            if problems:
                report.leaks += problems
                break
        report.notes.append(f"{kills} kills, each followed by a zeroed cache entry or record; "
                            f"{len(list((state / 'sandboxes' / 'damaged').glob('*')))} "
                            "damaged records set aside")
    finally:
        report.seconds = time.monotonic() - start
        node.close()
    return report


def reboot(sandboxes: int = 10) -> Report:
    """Namespaces deleted behind the agent's back, agent restarted: stale IPs reaped."""
    report = Report("reboot")
    node = Node(sandboxes, tag="reboot")
    start = time.monotonic()
    try:
        node.start()
        client = SyncClient(node.bus.address)
        for sid in node.ids:
            err, _ = client.call("Setup", "ssa{sv}", [sid, node.path(sid), {}])
            report.operations += 1
            if err:
                report.failures[err.rsplit(".", 1)[-1]] += 1
        client.close()
        node.agent.stop()
        for name in node.netns.values():  # the "reboot": every namespace is gone
            subprocess.run(["ip", "netns", "del", name], check=True)
        for name in list(node.netns.values())[: sandboxes // 2]:  # some paths come back, new
            subprocess.run(["ip", "netns", "add", name], check=True)
        node.start()
        # Start-up reaping runs in the background: the IP is released by the DEL
        # before the record and lock are removed, so wait for the whole outcome.
        deadline = time.monotonic() + 20
        while (node.allocations() or node.check()) and time.monotonic() < deadline:
            time.sleep(0.1)
        report.leaks += [f"{ip} still allocated (owner {o})" for ip, o in node.allocations().items()]
        report.leaks += node.check()
        for name in node.netns.values():
            subprocess.run(["ip", "netns", "add", name], capture_output=True)
    finally:
        report.seconds = time.monotonic() - start
        node.close()
    return report


def table(reports: list[Report]) -> str:
    rows = [("run", "operations", "failures by error name", "leaks", "seconds")]
    for r in reports:
        fails = ", ".join(f"{k}={v}" for k, v in sorted(r.failures.items())) or "none"
        rows.append((r.name, str(r.operations), fails, str(len(r.leaks)), f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    for r in reports:
        lines += [f"  {r.name}: {leak}" for leak in r.leaks[:20]]
        lines += [f"  {r.name}: {note}" for note in r.notes]
        if r.outcomes:
            lines.append(f"  {r.name}: expected outcomes: "
                         + ", ".join(f"{k}={v}" for k, v in sorted(r.outcomes.items())))
    return "\n".join(lines)
