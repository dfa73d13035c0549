"""Readiness scenarios, in the cnimgr mould: short intervals, a scripted plugin.

The monitor runs for real: files on disk, inotify, plugin processes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from cni_agent.cni.runtime import CNIRuntime
from cni_agent.readiness.monitor import Monitor, NetworkState
from tests.support.plugins import Control, conflist, install_plugin, write_conf

T = TypeVar("T")

FAST = {"startup_interval": 0.05, "interval": 0.1}


def plug_conf(name: str, control: Control, version: str = "1.1.0") -> bytes:
    return conflist(name, [{"type": "testplug", "control": str(control.path)}], version)


async def until(pred: Callable[[], Any], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout}s")
        await asyncio.sleep(0.01)


class Env:
    def __init__(self, tmp: Path, plugin_dir: Path, control: Control) -> None:
        self.tmp = tmp
        self.conf_dir = tmp / "net.d"
        self.plugin_dir = plugin_dir
        self.control = control
        self.runtime = CNIRuntime([str(plugin_dir)], str(tmp / "state"))
        self.monitors: list[Monitor] = []
        self.gc_runs = 0

    async def gc(self) -> None:
        self.gc_runs += 1

    async def start(self, **kw: Any) -> Monitor:
        opts = {**FAST, **kw}
        m = Monitor(self.runtime, str(self.conf_dir), on_ready=self.gc, **opts)
        self.monitors.append(m)
        await m.start()
        return m

    def write(self, filename: str, name: str, version: str = "1.1.0") -> Path:
        return write_conf(self.conf_dir, filename, plug_conf(name, self.control, version))


@pytest.fixture
async def env(tmp_path: Path, plugin_dir: Path, control: Control) -> AsyncIterator[Env]:
    e = Env(tmp_path, plugin_dir, control)
    yield e
    for m in e.monitors:
        await m.stop()


async def test_ready_at_start(env: Env) -> None:
    env.write("10-a.conflist", "alpha")
    m = await env.start()
    assert await m.wait_ready(5)
    assert m.state.status == "Network ready: default network alpha (1 network)"
    assert m.state.default_network == "alpha" and m.state.last_error == ""
    assert m.state.reason == ""
    assert env.control.commands().count("STATUS") >= 1


async def test_uninitialized_is_not_ready(env: Env) -> None:
    env.write("10-a.conflist", "alpha")
    m = Monitor(env.runtime, str(env.conf_dir))
    assert not m.ready and m.state.status.startswith("Starting")
    assert m.state.reason == "not_checked"


async def test_never_ready_reports_plugin_code_and_message(env: Env) -> None:
    env.control.set("STATUS", "fail", code=50, msg="daemon not running")
    env.write("10-a.conflist", "alpha")
    m = await env.start()
    assert not await m.wait_ready(0.3)
    assert m.state.last_error == (
        "network alpha: plugin testplug STATUS failed (code 50): daemon not running")
    assert m.state.status == "Network not ready: " + m.state.last_error
    assert m.state.reason == "status_failed"
    assert env.gc_runs == 0


async def test_becomes_ready_when_config_is_written_late(env: Env) -> None:
    m = await env.start(startup_interval=30)  # only the file event can make it ready
    assert not await m.wait_ready(0.1)
    assert "no valid CNI network configuration" in m.state.last_error
    assert "Has your network provider started?" in m.state.last_error
    assert m.state.reason == "no_network"
    env.write("10-a.conflist", "alpha")
    assert await m.wait_ready(2)


async def test_becomes_ready_when_plugin_is_installed_after_config(env: Env) -> None:
    os.unlink(env.plugin_dir / "testplug")
    env.write("10-a.conflist", "alpha")
    m = await env.start(startup_interval=30)
    await until(lambda: "no binary 'testplug'" in m.state.last_error)
    install_plugin(env.plugin_dir, "testplug")
    assert await m.wait_ready(2)


async def test_detects_unhealthy_and_self_heals(env: Env) -> None:
    env.write("10-a.conflist", "alpha")
    m = await env.start()
    assert await m.wait_ready(5)
    env.control.set("STATUS", "fail", code=51, msg="limited connectivity")
    await until(lambda: not m.ready)
    assert "(code 51): limited connectivity" in m.state.last_error
    env.control.clear("STATUS")
    assert await m.wait_ready(5)
    await until(lambda: env.gc_runs == 2)  # first ready, and the recovery


async def test_gc_runs_on_first_ready_and_recovery_not_while_healthy(env: Env) -> None:
    env.write("10-a.conflist", "alpha")
    m = await env.start()
    assert await m.wait_ready(5)
    polls = len(env.control.records())
    await until(lambda: len(env.control.records()) >= polls + 3)  # several healthy polls
    assert env.gc_runs == 1
    assert len(env.control.records()) >= polls + 3


async def test_flaps_200_times_with_waiters_and_nothing_leaks(env: Env) -> None:
    env.write("10-a.conflist", "alpha")
    m = await env.start(startup_interval=30, interval=30)  # driven by reload() only
    assert await m.wait_ready(5)
    changes: list[bool] = []
    m.subscribe(lambda s: changes.append(s.ready))
    tasks_before = len(asyncio.all_tasks())
    impatient = []
    for i in range(200):
        env.control.set("STATUS", "fail", code=50, msg=f"flap {i}")
        await m.reload()
        assert not m.ready
        patient = asyncio.ensure_future(m.wait_ready(10))
        impatient.append(asyncio.ensure_future(m.wait_ready(0.001)))
        env.control.clear("STATUS")
        await m.reload()
        assert m.ready
        assert await patient  # woken by the transition
    results = await asyncio.gather(*impatient)
    assert all(isinstance(r, bool) for r in results)
    assert changes == [False, True] * 200
    assert m.waiter_count == 0
    assert len(asyncio.all_tasks()) <= tasks_before + 1  # at most a GC task finishing


def returns_without_waiting(coro: Coroutine[Any, Any, T]) -> T:
    """The coroutine's value if it finishes without suspending once (so without
    waiting for anything: "at once" without a stopwatch, which a busy machine
    defeats); AssertionError if it would wait."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("it waited")


async def test_wait_ready_returns_at_once_when_ready(env: Env) -> None:
    env.write("10-a.conflist", "alpha")
    m = await env.start()
    assert await m.wait_ready(5)
    assert returns_without_waiting(m.wait_ready(0)) is True


class Clock:
    """The monitor's clock, moved by the test: a grace period is measured on
    it, not on how soon a loaded machine runs the test's next line."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def decided(env: Env, action: str, after: int) -> int:
    """Wait until a STATUS that did `action` answered (after record `after`)
    and the next STATUS began: a network's polls run one at a time, the next
    only once the last answer is decided. The record count then."""
    def seen() -> int:
        recs = env.control.records(None)
        ends = [i for i, r in enumerate(recs) if i >= after and r["phase"] == "end"
                and r["command"] == "STATUS" and r["action"] == action]
        if ends and any(r["phase"] == "start" and r["command"] == "STATUS"
                        for r in recs[ends[0] + 1:]):
            return len(recs)
        return 0

    await until(seen)
    return seen()


async def test_grace_period_holds_and_resets(env: Env) -> None:
    env.write("10-a.conflist", "alpha")
    clock = Clock()
    m = await env.start(interval=0.05, grace_period=10, clock=clock)
    assert await m.wait_ready(5)
    n = len(env.control.records(None))
    env.control.set("STATUS", "fail", code=50, msg="blip")
    n = await decided(env, "fail", n)  # the grace period begins
    clock.advance(9)
    n = await decided(env, "fail", n)
    assert m.ready  # 9 s into the 10 s grace period
    env.control.clear("STATUS")  # recovers: the grace timer resets
    n = await decided(env, "succeed", n)
    env.control.set("STATUS", "fail", code=50, msg="down for real")
    n = await decided(env, "fail", n)  # a new grace period begins
    clock.advance(9)  # 18 s after the first failure: over, had it not been reset
    n = await decided(env, "fail", n)
    assert m.ready  # a new failure starts a new grace period
    clock.advance(1.5)
    await until(lambda: not m.ready, timeout=5)
    assert "down for real" in m.state.last_error


async def test_shutdown_wakes_waiters_with_false(env: Env) -> None:
    env.control.set("STATUS", "fail", code=50, msg="x")
    env.write("10-a.conflist", "alpha")
    m = await env.start()
    waiters = [asyncio.ensure_future(m.wait_ready(30)) for _ in range(5)]
    await asyncio.sleep(0.05)
    await m.stop()
    assert await asyncio.gather(*waiters) == [False] * 5
    assert m.state.last_error == "shutting down" and not m.ready
    assert not await m.wait_ready(5)  # returns at once after shutdown
    assert m.waiter_count == 0


async def test_readers_never_wait_on_a_hanging_status(env: Env) -> None:
    env.write("10-a.conflist", "alpha")
    m = await env.start(interval=0.05)
    assert await m.wait_ready(5)
    env.control.set("STATUS", "succeed", sleep=1.0)

    def status_in_flight() -> bool:
        recs = env.control.records(None)
        ended = {r["pid"] for r in recs if r["phase"] == "end"}
        return any(r["phase"] == "start" and r["command"] == "STATUS" and r["pid"] not in ended
                   and r["start"] > t_set for r in recs)

    t_set = time.time()
    await until(status_in_flight)
    for _ in range(100):
        assert m.state.ready and m.ready
    assert returns_without_waiting(m.wait_ready(0)) is True


async def test_removed_default_moves_to_next_valid(env: Env) -> None:
    first = env.write("10-a.conflist", "alpha")
    env.write("20-b.conflist", "beta")
    m = await env.start()
    assert await m.wait_ready(5)
    assert m.state.default_network == "alpha" and m.state.networks == ("alpha", "beta")
    first.unlink()
    # The new default is ready once its own verdict is in (a STATUS under way
    # may finish first on a loaded machine): wait for that event, not a moment.
    await until(lambda: m.state.default_network == "beta" and m.ready)
    assert m.state.networks == ("beta",)


async def test_pinned_default_removed_and_recreated(env: Env) -> None:
    env.write("10-a.conflist", "alpha")
    pinned = env.write("20-b.conflist", "beta")
    m = await env.start(default_network="beta")
    assert await m.wait_ready(5)
    assert m.state.default_network == "beta"
    pinned.unlink()
    await until(lambda: not m.ready)
    assert m.state.last_error == (
        f'default network beta not found: expected a file in {env.conf_dir} with "name": "beta"')
    env.write("30-again.conflist", "beta")
    assert await m.wait_ready(2)
    assert m.state.default_network == "beta"


async def test_conf_dir_removed_and_recreated_20_times(env: Env) -> None:
    env.write("10-a.conflist", "alpha")
    m = await env.start(startup_interval=30, interval=30)  # file events only
    assert await m.wait_ready(5)
    for i in range(20):
        shutil.rmtree(env.conf_dir)
        await until(lambda: not m.ready, timeout=2)
        env.conf_dir.mkdir()
        env.write(f"{i:02d}-n.conflist", f"net{i}")
        await until(lambda i=i: m.ready and m.state.default_network == f"net{i}", timeout=2)


async def test_half_written_file_does_not_take_the_node_down(env: Env) -> None:
    env.write("20-good.conflist", "good")
    m = await env.start()
    assert await m.wait_ready(5)
    (env.conf_dir / "10-half.conflist").write_text('{"cniVersion": "1.1.0", "name": "ha')
    await until(lambda: "10-half.conflist" in m.state.status)
    assert m.ready and m.state.default_network == "good"
    assert "not valid JSON" in m.state.status
    assert m.state.invalid[0].source.endswith("10-half.conflist")


async def test_config_replaced_by_atomic_rename(env: Env) -> None:
    env.write("10-a.conflist", "alpha")
    m = await env.start(startup_interval=30, interval=30)
    assert await m.wait_ready(5)
    env.write("10-a.conflist", "renamed")  # write temp + rename
    await until(lambda: m.state.default_network == "renamed", timeout=2)


async def test_listeners_see_every_change_in_order(env: Env) -> None:
    seen: list[NetworkState] = []
    env.write("10-a.conflist", "alpha")
    m = Monitor(env.runtime, str(env.conf_dir), **FAST)
    env.monitors.append(m)
    m.subscribe(seen.append)
    await m.start()
    assert await m.wait_ready(5)
    env.control.set("STATUS", "fail", code=50, msg="x")
    await until(lambda: not m.ready)
    await m.stop()
    assert [s.ready for s in seen] == [True, False, False]
    assert seen[-1].last_error == "shutting down"


async def test_other_networks_failures_show_in_status_only(env: Env) -> None:
    env.write("10-a.conflist", "alpha")
    other = Control(env.tmp / "other.json")
    other.set("STATUS", "fail", code=50, msg="other broken")
    write_conf(env.conf_dir, "20-b.conflist", plug_conf("beta", other))
    m = await env.start()
    await until(lambda: "other broken" in m.state.status)
    assert m.ready and m.state.default_network == "alpha"


async def test_old_version_is_ready_when_valid_without_status(env: Env) -> None:
    env.write("10-a.conflist", "alpha", version="1.0.0")
    m = await env.start()
    assert await m.wait_ready(5)
    assert "STATUS" not in env.control.commands()


async def test_status_answers_during_a_drain_come_from_the_last_verdict(env: Env) -> None:
    """Shutting down, the public state is "shutting down"; a runtime's STATUS
    while ADDs are still served (the drain) gets the networks' own answers."""
    env.write("10-a.conflist", "alpha")
    env.write("20-b.conflist", "beta")
    m = await env.start()
    await until(lambda: m.unready_reason("beta") == "" and m.ready)
    m.begin_shutdown()
    assert m.unready_reason() == "shutting down" and m.unready_reason("beta") == "shutting down"
    assert m.unready_reason(serving=True) == "" and m.unready_reason("beta", serving=True) == ""
    assert "network gamma not found" in m.unready_reason("gamma", serving=True)


async def test_wait_decided_returns_with_the_first_verdict_or_its_bound(env: Env) -> None:
    env.control.set("STATUS", "succeed", sleep=0.5)
    env.write("10-a.conflist", "alpha")
    m = await env.start()
    assert m.unready_reason() == "not checked yet"
    await m.wait_decided(0.05)  # the bound: returns undecided
    assert m.unready_reason() == "not checked yet"
    await m.wait_decided(10)
    assert m.unready_reason() == "" and m.ready
    await m.wait_decided(10)  # decided: at once


async def test_each_reason_for_not_ready_has_its_name(env: Env) -> None:
    """The reason names (readiness/reasons.py) follow LastError's words: a
    pinned default with no file, with a refused file, and shutdown."""
    env.write("10-a.conflist", "alpha")
    m = await env.start(default_network="beta")
    await until(lambda: "default network beta not found" in m.state.last_error)
    assert m.state.reason == "default_not_found"
    write_conf(env.conf_dir, "20-b.conflist", conflist("beta", [{"type": "nosuchplugin"}]))
    await until(lambda: "default network beta is invalid" in m.state.last_error)
    assert m.state.reason == "default_invalid"
    env.write("20-b.conflist", "beta")
    assert await m.wait_ready(5)
    assert m.state.reason == ""
    m.begin_shutdown()
    assert m.state.reason == "shutting_down"
