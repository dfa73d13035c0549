"""sandboxes/capacity.py: data dirs read off the loop, one read per network at a
time, shared; a stranger's answer may be a second old; a hung data dir is
"unknown" in bounded time, never a stuck caller."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from cni_agent.cni import pool
from cni_agent.cni.config import NetworkConfigList, parse_list
from cni_agent.sandboxes import capacity
from cni_agent.sandboxes.capacity import Capacities


def net(tmp_path: Path, subnet: str = "10.1.0.0/29") -> NetworkConfigList:
    return parse_list(json.dumps({"cniVersion": "1.0.0", "name": "n", "plugins": [
        {"type": "bridge", "ipam": {"type": "host-local", "subnet": subnet,
                                    "dataDir": str(tmp_path)}}]}).encode())


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[threading.Event]:
    """Each read_capacity call, held until its event is set (on the reading thread)."""
    held: list[threading.Event] = []
    real = pool.read_capacity

    def slow(plan: pool.CapacityPlan) -> dict[str, Any]:
        gate = threading.Event()
        held.append(gate)
        gate.wait(10)
        return real(plan)

    monkeypatch.setattr(capacity, "read_capacity", slow)
    return held


async def test_concurrent_callers_share_one_read(tmp_path: Path,
                                                 reads: list[threading.Event]) -> None:
    caps = Capacities()
    n = net(tmp_path)
    callers = [asyncio.ensure_future(caps.of(n)) for _ in range(10)]
    await asyncio.sleep(0.1)
    assert len(reads) == 1
    reads[0].set()
    docs = await asyncio.gather(*callers)
    assert all(d == docs[0] for d in docs) and docs[0]["free"] == 5


async def test_a_reading_a_second_old_is_a_strangers_answer(
        tmp_path: Path, reads: list[threading.Event]) -> None:
    clock = Clock()
    caps = Capacities(clock=clock)
    n = net(tmp_path)
    first = asyncio.ensure_future(caps.of(n))
    await asyncio.sleep(0.05)
    reads[0].set()
    await first
    clock.now += 0.5
    await caps.of(n, max_age=1.0)  # kept
    assert len(reads) == 1
    clock.now += 1.0
    again = asyncio.ensure_future(caps.of(n, max_age=1.0))  # too old: read again
    await asyncio.sleep(0.05)
    assert len(reads) == 2
    reads[1].set()
    await again
    fresh = asyncio.ensure_future(caps.of(n))  # root's: now
    await asyncio.sleep(0.05)
    assert len(reads) == 3
    reads[2].set()
    await fresh


async def test_a_data_dir_that_does_not_answer_is_unknown_in_bounded_time(
        tmp_path: Path, reads: list[threading.Event]) -> None:
    caps = Capacities(timeout=0.2)
    n = net(tmp_path)
    doc = await caps.of(n)
    assert doc["capacity"] == "unknown"
    assert doc["reason"] == f"host-local's data dir {tmp_path}/n did not answer within 0.2s"
    assert await caps.full(n) == ""  # no hint from what is not known
    assert len(reads) == 1  # the second caller joined the read still under way
    reads[0].set()
    await asyncio.sleep(0.1)
    assert (await caps.of(n, max_age=60))["capacity"] == "known"  # the late answer is kept


async def test_a_reload_is_read_anew_and_no_pool_reads_nothing(tmp_path: Path) -> None:
    caps = Capacities()
    assert (await caps.of(net(tmp_path), max_age=60))["size"] == 5
    assert (await caps.of(net(tmp_path, "10.1.0.0/28"), max_age=60))["size"] == 13
    static = parse_list(json.dumps({"cniVersion": "1.0.0", "name": "s", "plugins": [
        {"type": "bridge", "ipam": {"type": "static", "addresses": []}}]}).encode())
    assert (await caps.of(static))["capacity"] == "none"
    caps.forget(set())
    assert not caps._last
