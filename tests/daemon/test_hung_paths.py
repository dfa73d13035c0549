"""A caller's netns path on a hung mount (issue 12, item 5): the loop keeps
serving, the caller gets a named error within the bound, and a hostile caller
ties up at most the path worker's few threads."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.agent import Agent
from tests.support.dbusclient import SyncClient
from tests.support.hung import HungMount

pytestmark = pytest.mark.root
INVALID = "org.cniagent.Agent1.Error.InvalidArgument"
BUSY = "org.cniagent.Agent1.Error.Busy"
DEFAULT_THREADS, DEFAULT_TIMEOUT = 4, 5.0  # as docs/reliability.md says (node/blocking.py's defaults)


@pytest.fixture
def hung(tmp_path: Path) -> Iterator[HungMount]:
    mount = HungMount(tmp_path / "hung")
    yield mount
    mount.release()


def test_a_hung_netns_path_neither_stalls_the_agent_nor_piles_up_threads(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], hung: HungMount,
    netns: str,
) -> None:
    testnet()
    agent = make_agent()
    client = SyncClient(agent.bus.address)
    n = DEFAULT_THREADS + 2
    try:
        with ThreadPoolExecutor(n) as pool:
            stuck = [pool.submit(client.call, "Setup", "ssa{sv}", [f"h{i}", str(hung.where / f"ns{i}"), {}])
                     for i in range(n)]
            # Meanwhile the loop serves everyone else: these are answered while
            # every hung call is still waiting for its path (events, not a stopwatch).
            for _ in range(5):
                assert client.call("ListSandboxes")[0] is None
                assert client.call("Get", "ss", ["org.cniagent.Agent1", "Status"],
                                   interface="org.freedesktop.DBus.Properties")[0] is None
            assert not any(f.done() for f in stuck)
            results = [f.result(timeout=30) for f in stuck]
        for err, body in results:
            assert err == INVALID and body.startswith("netns: ") and (
                f"did not answer within {DEFAULT_TIMEOUT:g}s" in body), (err, body)
        # Every path thread is stuck now (the first four calls'; the other two
        # were queued and given up): more path work is refused, not queued.
        err, body = client.call("Setup", "ssa{sv}", ["more", str(hung.where / "more"), {}])
        assert err == BUSY and "have not answered yet" in body, (err, body)
        assert agent.proc is not None
        assert agent.proc.poll() is None
        # The mount recovers (here: fails fast); the stuck threads come back.
        hung.release()
        deadline = time.monotonic() + 10
        while (err := client.call("Setup", "ssa{sv}", ["fine", netns, {}])[0]) == BUSY:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert err is None
        assert client.call("Teardown", "ssa{sv}", ["fine", "", {}])[0] is None
    finally:
        client.close()
