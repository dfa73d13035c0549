"""The tests' agents forked from one process (tests/support/forkserver.py) are
what an exec of `python -m cni_agent run` makes, in what the tests rely on."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agent import Agent, Bus
from tests.support.forkserver import ForkedPopen, ForkServer

pytestmark = pytest.mark.root


@pytest.fixture
def server() -> Iterator[ForkServer]:
    """This test's own server: what it holds is known."""
    s = ForkServer()
    yield s
    s.close()


def _agent(tmp_path: Path, bus: Bus, server: ForkServer | None, name: str, **config: object
           ) -> Agent:
    tmp = tmp_path / name
    tmp.mkdir()
    agent = Agent(tmp, bus, **config)
    agent.fork_server = server  # None: exec'd
    return agent


def _links(pid: int) -> dict[int, str]:
    fds = Path(f"/proc/{pid}/fd")
    return {int(fd.name): os.readlink(fd) for fd in fds.iterdir()}


def test_forked_agent_holds_only_its_own_descriptors(
        tmp_path: Path, system_bus: Bus, server: ForkServer) -> None:
    agent = _agent(tmp_path, system_bus, server, "forked").start()
    try:
        assert isinstance(agent.proc, ForkedPopen)
        links = _links(agent.proc.pid)
        # 0 is the test's stdin, 1 and 2 the agent's log, as Popen gives an exec'd one.
        assert links[0] == os.readlink("/proc/self/fd/0")
        assert links[1] == links[2] == str(agent.log_path)
        # Nothing of the server's: its socket, the status pipes (anonymous
        # inodes are alike in name only).
        assert server.pid is not None
        theirs = {link for link in _links(server.pid).values()
                  if link.startswith(("socket:", "pipe:"))}
        assert theirs
        assert not theirs & set(links.values()), (theirs, links)
        assert agent.prop("Status")  # it answers on the bus
    finally:
        assert agent.stop() == 0, agent.log()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_forked_agent_exits_as_an_exec_one(
        tmp_path: Path, system_bus: Bus, server: ForkServer, how: int) -> None:
    codes = {}
    for name, srv in (("exec", None), ("forked", server)):
        agent = _agent(tmp_path, system_bus, srv, name).start()
        codes[name] = agent.stop(how)
        assert agent.proc is not None and agent.proc.poll() == codes[name]
    assert codes["forked"] == codes["exec"] == (-signal.SIGKILL if how == signal.SIGKILL else 0)


def test_forked_agent_refuses_a_bad_config_as_an_exec_one(
        tmp_path: Path, system_bus: Bus, server: ForkServer) -> None:
    outcomes = {}
    for name, srv in (("exec", None), ("forked", server)):
        agent = _agent(tmp_path, system_bus, srv, name, log_level="loud")
        agent.start(wait=False)
        assert agent.proc is not None
        rc = agent.proc.wait(30)
        # The message, without the paths of each one's own config file.
        last = agent.log().strip().splitlines()[-1].replace(str(agent.config_path), "CONFIG")
        outcomes[name] = rc, last
        agent.stop()
    assert outcomes["forked"] == outcomes["exec"]
    assert outcomes["exec"][0] != 0 and "log_level" in outcomes["exec"][1]


def test_a_server_that_died_is_replaced_at_the_next_start(
        tmp_path: Path, system_bus: Bus, server: ForkServer) -> None:
    first = _agent(tmp_path, system_bus, server, "first").start()
    assert first.stop() == 0
    assert server.pid is not None
    dead = server.pid
    os.kill(dead, signal.SIGKILL)
    with pytest.raises(OSError, match="could not start an agent"):
        _agent(tmp_path, system_bus, server, "refused").start()
    second = _agent(tmp_path, system_bus, server, "second").start()
    assert server.pid not in (None, dead)
    assert second.stop() == 0
