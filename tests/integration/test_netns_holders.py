"""How root reaches a namespace it knows only by identity (a member's, issue 44
item 6): through a process inside it, found among /proc/*/ns/net
(`netns.held_by_a_process`), the identity checked again after the open;
none once no process is in it. Real namespaces (`unshare -n`)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Iterator

import pytest

from cni_agent.node.netns import fd_identity, held_by_a_process

pytestmark = pytest.mark.root


@pytest.fixture
def inside() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(["unshare", "-n", "sleep", "60"], text=True)
    try:
        while os.readlink(f"/proc/{proc.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            assert proc.poll() is None
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_namespace_is_found_through_a_process_in_it_and_not_once_it_is_gone(
    inside: subprocess.Popen[str],
) -> None:
    fd = os.open(f"/proc/{inside.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        identity = fd_identity(fd)
    finally:
        os.close(fd)
    found = held_by_a_process(identity)
    assert found is not None
    with found:
        assert found.identity == identity
        assert found.path.startswith("/proc/") and found.path.endswith("/ns/net")
    inside.kill()
    inside.wait()
    assert held_by_a_process(identity) is None


def test_an_inode_alone_does_not_make_another_namespace_the_recorded_one(
    inside: subprocess.Popen[str],
) -> None:
    """A recorded identity whose kernel id (or cookie) differs is another
    namespace that reused the inode: not found, though the inode matches."""
    fd = os.open(f"/proc/{inside.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        identity = fd_identity(fd)
    finally:
        os.close(fd)
    assert identity.certain
    other = (dataclasses.replace(identity, nsid=identity.nsid + 1) if identity.nsid is not None
             else dataclasses.replace(identity, cookie=(identity.cookie or 0) + 1))
    assert held_by_a_process(other) is None
