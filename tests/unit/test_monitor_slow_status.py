"""One network's slow STATUS never delays another's verdict.

The monitor runs for real (files, inotify, the process executor, our scripted
plugin): a second network's STATUS takes ~4 s, and file events about the
default network must be decided while it is still in flight.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cni_agent.cni.runtime import CNIRuntime
from cni_agent.readiness.monitor import Monitor, NetworkState
from tests.support.plugins import Control, conflist, install_plugin, write_conf
from tests.unit.test_monitor import FAST, until

SLOW = 4.0  # the slow network's STATUS, as in the issue


class Env:
    def __init__(self, tmp: Path, plugin_dir: Path, control: Control) -> None:
        self.tmp = tmp
        self.conf_dir = tmp / "net.d"
        self.plugin_dir = plugin_dir
        self.control = control  # the default network's plugin (type testplug)
        self.slow = Control(tmp / "slow.json")  # the other network's (type slowplug)
        self.slow.set("STATUS", "succeed", sleep=SLOW)
        install_plugin(plugin_dir, "slowplug")
        self.runtime = CNIRuntime([str(plugin_dir)], str(tmp / "state"))
        self.monitors: list[Monitor] = []

    async def start(self, **kw: Any) -> Monitor:
        m = Monitor(self.runtime, str(self.conf_dir), **{**FAST, **kw})
        self.monitors.append(m)
        await m.start()
        return m

    def write_default(self, name: str = "alpha", control: Control | None = None) -> Path:
        ctl = control or self.control
        return write_conf(self.conf_dir, "10-a.conflist",
                          conflist(name, [{"type": "testplug", "control": str(ctl.path)}]))

    def write_slow(self) -> Path:
        return write_conf(self.conf_dir, "20-b.conflist",
                          conflist("beta", [{"type": "slowplug", "control": str(self.slow.path)}]))

    def slow_in_flight(self) -> set[int]:
        """Pids of the slow network's STATUS runs that have started and not ended."""
        recs = self.slow.records(None)
        ended = {r["pid"] for r in recs if r["phase"] == "end"}
        return {r["pid"] for r in recs
                if r["phase"] == "start" and r["command"] == "STATUS" and r["pid"] not in ended}


@pytest.fixture
async def env(tmp_path: Path, plugin_dir: Path, control: Control) -> AsyncIterator[Env]:
    e = Env(tmp_path, plugin_dir, control)
    yield e
    for m in e.monitors:
        await m.stop()


def fresh(env: Env) -> set[int]:
    """The slow STATUS runs in flight that began less than 1 s ago: each has at
    least SLOW - 1 s left, the window in which the events below must be decided."""
    starts = {r["pid"]: r["start"] for r in env.slow.records() if r["command"] == "STATUS"}
    return {pid for pid in env.slow_in_flight() if time.time() - starts.get(pid, 0) < 1}


async def slow_status_running(env: Env) -> set[int]:
    """A slow STATUS that has just begun (so "at once" is "while it runs", which
    its own records prove: no stopwatch, which a loaded machine defeats)."""
    await until(lambda: fresh(env), timeout=SLOW + 3)
    return fresh(env)


async def test_removing_the_default_is_seen_while_another_status_is_in_flight(env: Env) -> None:
    first = env.write_default()
    env.write_slow()
    m = await env.start(default_network="alpha")
    assert await m.wait_ready(SLOW + 2)
    running = await slow_status_running(env)

    first.unlink()
    await until(lambda: not m.ready, timeout=SLOW)
    assert m.state.last_error == (
        f'default network alpha not found: expected a file in {env.conf_dir} with "name": "alpha"')
    assert m.state.networks == ("beta",)
    assert running & env.slow_in_flight()  # decided while the slow STATUS still ran
    assert m.unready_reason("beta") == "network beta: not checked yet"


async def test_default_moving_to_an_unchecked_network_is_not_ready_until_it_answers(env: Env) -> None:
    first = env.write_default()
    env.write_slow()
    m = await env.start()
    assert await m.wait_ready(SLOW + 2)
    assert m.state.default_network == "alpha"
    running = await slow_status_running(env)

    first.unlink()  # the next valid network, beta, has not answered STATUS yet
    await until(lambda: m.state.default_network == "beta", timeout=SLOW)
    assert not m.ready and m.state.last_error == "network beta: not checked yet"
    assert running & env.slow_in_flight()
    assert await m.wait_ready(SLOW + 2)  # its answer is applied when it arrives
    assert m.state.default_network == "beta"


async def test_plugin_events_of_the_default_are_decided_while_another_status_is_in_flight(
    env: Env,
) -> None:
    env.write_default()
    env.write_slow()
    m = await env.start(default_network="alpha")
    assert await m.wait_ready(SLOW + 2)
    running = await slow_status_running(env)

    os.unlink(env.plugin_dir / "testplug")  # broken by a plugin-dir event
    # (A STATUS poll of alpha that starts as the file goes may fail first, with
    # the interpreter's own words: wait for the event's verdict, not the first.)
    await until(lambda: "default network alpha is invalid" in m.state.last_error,
                timeout=SLOW)
    assert not m.ready
    assert "no binary 'testplug'" in m.state.last_error
    assert running & env.slow_in_flight()  # decided while the slow STATUS still ran

    install_plugin(env.plugin_dir, "testplug")  # and fixed by one
    await until(lambda: m.ready, timeout=SLOW)
    assert m.state.default_network == "alpha"
    assert running & env.slow_in_flight()  # both


async def test_a_status_answer_about_a_replaced_config_is_not_applied(env: Env) -> None:
    old = Control(env.tmp / "old.json")
    old.set("STATUS", "fail", code=50, msg="answer about the old config", sleep=1.0)
    env.write_default(control=old)
    seen: list[NetworkState] = []
    m = await env.start()
    m.subscribe(seen.append)
    await until(lambda: any(r["command"] == "STATUS" for r in old.records()))

    olds = {r["pid"] for r in old.records() if r["command"] == "STATUS"}
    env.write_default()  # same network, new config: its plugin answers at once
    assert await m.wait_ready(5)
    await until(lambda: all(_gone(pid) for pid in olds))  # they can answer nothing now
    assert m.ready
    assert not any("old config" in s.status for s in seen)
    assert not [r for r in old.records("end") if r["command"] == "STATUS"]  # killed, never answered


async def test_stop_cancels_a_slow_status_and_leaves_nothing_running(env: Env) -> None:
    env.write_default()
    env.write_slow()
    m = await env.start()
    assert await m.wait_ready(SLOW + 2)
    running = await slow_status_running(env)
    tasks_before = {t for t in asyncio.all_tasks() if t.get_name().startswith("cni-agent-")}
    assert tasks_before

    await m.stop()
    assert not {t for t in asyncio.all_tasks() if t.get_name().startswith("cni-agent-")
                and not t.done()}
    # The executor killed (and reaped) the plugin when its poll was cancelled:
    # gone, and it never finished (stop did not wait for it).
    assert all(_gone(pid) for pid in running)
    assert not {r["pid"] for r in env.slow.records("end")} & running


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
