"""Integration tests of cni_agent.node.netns against real network namespaces (root)."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cni_agent.cni.errors import InvalidArgument
from cni_agent.node import netns

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
]

_counter = itertools.count()


def _unique_name() -> str:
    return f"cnitest-{os.getpid()}-{next(_counter)}"


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def _netns_list() -> list[str]:
    """This process's named namespaces (`_unique_name`'s): test files running
    alongside make and delete their own meanwhile."""
    return sorted(line.split()[0] for line in _ip("netns", "list").splitlines()
                  if line.startswith(f"cnitest-{os.getpid()}-"))


@pytest.fixture
def make_ns() -> Iterator[Callable[[], str]]:
    """Factory of fresh named namespaces, all deleted at teardown."""
    names: list[str] = []

    def make() -> str:
        name = _unique_name()
        _ip("netns", "add", name)
        names.append(name)
        return name

    yield make
    for name in names:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


@pytest.fixture
def ns(make_ns: Callable[[], str]) -> str:
    return make_ns()


def _path(name: str) -> str:
    return f"/run/netns/{name}"


def _host_identity() -> tuple[int, int]:
    st = os.stat("/proc/self/ns/net")
    return (st.st_dev, st.st_ino)


def _reason(path: str) -> str:
    with pytest.raises(InvalidArgument) as exc:
        netns.check_netns(path, field="sandbox")
    assert exc.value.field == "sandbox"
    return exc.value.reason


# --- identity ----------------------------------------------------------------


def test_identity_matches_proc_of_process_inside(ns: str) -> None:
    ident = netns.netns_identity(_path(ns))
    assert ident is not None
    assert (ident.dev, ident.ino) != _host_identity()
    proc = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "60"])
    try:
        # `ip netns exec` setns()es, then execs sleep under the same pid.
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/comm").read_text().strip() != "sleep":
            assert time.monotonic() < deadline, "ip netns exec did not start"
            time.sleep(0.01)
        assert netns.netns_identity(f"/proc/{proc.pid}/ns/net") == ident
        assert netns.check_netns(f"/proc/{proc.pid}/ns/net") == ident
    finally:
        proc.kill()
        proc.wait()
    assert netns.is_netns(_path(ns))
    assert netns.check_netns(_path(ns)) == ident


def test_identity_of_non_namespaces(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_text("x")
    for path in [
        "",
        "relative",
        str(tmp_path),
        str(regular),
        "/dev/null",
        "/proc/self/ns/mnt",
        "/nonexistent/x",
        "/etc/passwd/x",
    ]:
        assert netns.netns_identity(path) is None, path
        assert not netns.is_netns(path), path
    host = netns.netns_identity("/proc/self/ns/net")
    assert host is not None and (host.dev, host.ino) == _host_identity()


def test_missing_path_creates_nothing(tmp_path: Path) -> None:
    before = _netns_list()
    for path in [_path(_unique_name()), str(tmp_path / "missing")]:
        assert netns.netns_identity(path) is None
        assert not os.path.lexists(path)
        with pytest.raises(InvalidArgument, match="does not exist"):
            netns.check_netns(path)
        assert not os.path.lexists(path)
    assert _netns_list() == before


def _absent(path: str) -> bool:
    return not os.path.lexists(path)


async def test_missing_path_async_ops_create_nothing() -> None:
    before = _netns_list()
    path = _path(_unique_name())
    with pytest.raises(netns.NetnsError) as exc:
        await netns.bring_up_loopback(path)
    assert exc.value.path == path
    assert exc.value.reason == "does not exist"
    with pytest.raises(netns.NetnsError):
        await netns.interfaces(path)
    assert _absent(path)
    assert _netns_list() == before


# --- check_netns rejections --------------------------------------------------


def test_check_rejects_bad_paths(tmp_path: Path) -> None:
    regular = tmp_path / "regular"
    regular.write_text("not a namespace")
    assert _reason("") == "path is empty"
    assert "is not an absolute path" in _reason("run/netns/x")
    assert "contains a NUL byte" in _reason("/run/netns/x\0y")
    assert "is longer than 4096 bytes" in _reason("/" + "a" * 5000)
    assert "does not exist" in _reason(str(tmp_path / "missing"))
    assert "is a directory" in _reason(str(tmp_path))
    assert "is a device" in _reason("/dev/null")
    assert "is a regular file, not a namespace" in _reason(str(regular))
    assert "is a mnt namespace, not a network namespace" in _reason("/proc/self/ns/mnt")
    assert "is a uts namespace" in _reason("/proc/self/ns/uts")


def test_check_rejects_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)
        assert "is a socket" in _reason(path)
        assert netns.netns_identity(path) is None


def test_check_rejects_own_namespace() -> None:
    for path in ["/proc/self/ns/net", f"/proc/{os.getpid()}/ns/net", "/proc/thread-self/ns/net"]:
        reason = _reason(path)
        assert "refusing to configure the agent's own network namespace" in reason


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    results: list[object] = []

    def probe() -> None:
        results.append(netns.netns_identity(fifo))
        try:
            netns.check_netns(fifo)
        except InvalidArgument as e:
            results.append(e.reason)

    # A daemon thread, so a regression (open() of a FIFO blocks) fails the test
    # instead of hanging the run.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "probing a FIFO blocked"
    assert results[0] is None
    assert isinstance(results[1], str) and "is a FIFO" in results[1]


# --- netlink inside a namespace -----------------------------------------------


async def test_bring_up_loopback(ns: str) -> None:
    assert "UP" not in _ip("-n", ns, "link", "show", "lo").split(">")[0]
    await netns.bring_up_loopback(_path(ns))
    flags = _ip("-n", ns, "link", "show", "lo").split("<")[1].split(">")[0].split(",")
    assert "UP" in flags
    await netns.bring_up_loopback(_path(ns))  # idempotent


async def test_interfaces_lists_addresses(ns: str) -> None:
    # A veth pair rather than a dummy link: the dummy module is not always loadable.
    _ip(*f"-n {ns} link add v0 address 02:00:00:aa:bb:cc type veth peer name v1".split())
    _ip("-n", ns, "link", "set", "v0", "up")
    _ip("-n", ns, "addr", "add", "10.250.0.2/24", "dev", "lo")
    _ip("-n", ns, "addr", "add", "10.250.1.2/24", "dev", "v0")
    _ip("-n", ns, "addr", "add", "fd00:250::2/64", "dev", "v0", "nodad")
    ifaces = {i.name: i for i in await netns.interfaces(_path(ns))}
    assert set(ifaces) == {"lo", "v0", "v1"}  # the namespace's links, not the host's
    lo, v0 = ifaces["lo"], ifaces["v0"]
    assert lo.index == 1 and not lo.up
    assert lo.addresses == ("10.250.0.2/24",)  # lo down: no ::1 yet
    assert v0.up and not ifaces["v1"].up
    assert v0.mac == "02:00:00:aa:bb:cc"
    assert v0.index == int(_ip("-n", ns, "-o", "link", "show", "v0").split(":")[0])
    assert "10.250.1.2/24" in v0.addresses
    assert "fd00:250::2/64" in v0.addresses
    assert ifaces["v1"].addresses == ()
    await netns.bring_up_loopback(_path(ns))
    lo = next(i for i in await netns.interfaces(_path(ns)) if i.name == "lo")
    assert lo.up
    assert {"127.0.0.1/8", "10.250.0.2/24", "::1/128"} <= set(lo.addresses)
    with pytest.raises(AttributeError):
        lo.up = False  # type: ignore[misc]


async def test_concurrent_namespaces_stay_separate(make_ns: Callable[[], str]) -> None:
    names = [make_ns() for _ in range(4)]
    for i, name in enumerate(names):
        _ip("-n", name, "addr", "add", f"10.251.{i}.1/24", "dev", "lo")
    results = await asyncio.gather(*(netns.interfaces(_path(n)) for n in names * 3))
    for k, ifaces in enumerate(results):
        [lo] = ifaces
        assert lo.addresses == (f"10.251.{k % len(names)}.1/24",)


def _all_threads_home() -> bool:
    """Every thread of this process, executor workers included, is in the host netns."""
    host = _host_identity()
    for task in os.listdir("/proc/self/task"):
        st = os.stat(f"/proc/self/task/{task}/ns/net")
        if (st.st_dev, st.st_ino) != host:
            return False
    return True


async def test_worker_threads_return_home(ns: str) -> None:
    await asyncio.gather(*(netns.interfaces(_path(ns)) for _ in range(8)))
    await asyncio.gather(*(netns.bring_up_loopback(_path(ns)) for _ in range(8)))
    assert _all_threads_home()


async def test_thread_restored_when_socket_creation_fails(
    ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, int]] = []

    def broken_iproute() -> None:
        st = os.stat("/proc/thread-self/ns/net")
        seen.append((st.st_dev, st.st_ino))
        raise OSError(24, "Too many open files")

    import pyroute2

    monkeypatch.setattr(pyroute2, "IPRoute", broken_iproute)  # netns imports it at use
    for _ in range(4):
        with pytest.raises(netns.NetnsError, match="cannot open netlink socket"):
            await netns.interfaces(_path(ns))
    # IPRoute() really was called inside the target, and every thread came back.
    ident = netns.check_netns(_path(ns))
    assert seen == [(ident.dev, ident.ino)] * 4
    assert _all_threads_home()


async def test_deleted_namespace(ns: str) -> None:
    path = _path(ns)
    _ip("netns", "del", ns)
    with pytest.raises(netns.NetnsError):
        await netns.interfaces(path)
    assert _absent(path)
