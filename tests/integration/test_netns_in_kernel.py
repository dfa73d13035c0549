"""Which namespace paths are opened without a path thread (`netns.in_kernel`).

Only where resolving the path can wait on nothing but the kernel: a name
under /run/netns reached without following a symlink, or /proc/PID/ns/net,
and the file then on nsfs by what statx says without asking its filesystem.
Anything else (a symlink on the way, another kind of file, any other place)
goes to a path thread, where a hung mount costs a thread, not the agent.
Real namespaces (`ip netns`)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cni_agent.node.netns import GONE, in_kernel, pin

pytestmark = pytest.mark.root


@pytest.fixture
def named() -> Iterator[str]:
    name = f"cnik{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _opened(path: str) -> int:
    fd = in_kernel(path)
    if fd >= 0:
        os.close(fd)
    return fd


def test_where_runtimes_put_namespaces_is_opened_on_the_loop(named: str) -> None:
    for path in (f"/run/netns/{named}", f"/var/run/netns/{named}", f"/proc/{os.getpid()}/ns/net"):
        assert _opened(path) >= 0, path
    fd = in_kernel(f"/run/netns/{named}")
    ns = pin(f"/run/netns/{named}", opath=fd)  # the same namespace a thread would pin
    try:
        with pin(f"/run/netns/{named}") as by_thread:
            assert ns.identity == by_thread.identity
    finally:
        ns.close()


def test_a_missing_name_is_answered_without_a_thread(named: str) -> None:
    assert in_kernel(f"/run/netns/{named}-gone") == GONE
    with pytest.raises(Exception, match="does not exist"):
        pin(f"/run/netns/{named}-gone", opath=GONE)


def test_anything_else_goes_to_a_path_thread(named: str, tmp_path: Path) -> None:
    link = Path(f"/run/netns/{named}-link")
    plain = Path(f"/run/netns/{named}-plain")
    link.symlink_to(f"/run/netns/{named}")  # a symlink: it could lead anywhere
    plain.write_text("")  # not a namespace: the thread says what it is
    try:
        assert _opened(str(link)) == -1
        assert _opened(str(plain)) == -1
        assert _opened(f"/run/netns/{named}/..") == -1
        assert _opened("/proc/self/ns/net") == -1  # the agent's own: the full check refuses it
        assert _opened(str(tmp_path)) == -1  # another place
        with pytest.raises(Exception, match="regular file"):
            pin(str(plain))
    finally:
        link.unlink()
        plain.unlink()
