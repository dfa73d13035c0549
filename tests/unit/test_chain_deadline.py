"""One deadline per ADD, DEL or CHECK chain: the arithmetic, on a clock the test moves.

The executor here takes a scripted time per (plugin, verb) and advances the
runtime's monotonic clock by it, or by the timeout it was given when that is
shorter (and then fails as the real executor does: `PluginTimeout`). So each
case is exact and takes no wall time; the real plugins and processes are in
tests/daemon/test_chain_deadlines.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

import cni_agent.cni.runtime as runtime_module
from cni_agent.cni.config import NetworkConfigList, parse_list
from cni_agent.cni.errors import PluginError, PluginTimeout
from cni_agent.cni.exec import Invocation
from cni_agent.cni.runtime import ChainDeadline, CNIRuntime, RuntimeConf, Timeouts

RESULT = {"cniVersion": "1.1.0", "interfaces": [{"name": "eth0"}],
          "ips": [{"address": "10.1.0.5/24", "interface": 0}]}
RT = RuntimeConf("c1", "", "eth0")


@dataclass
class Clock:
    now: float = 1000.0

    def monotonic(self) -> float:
        return self.now


@dataclass
class TimedExecutor:
    """Each (plugin, verb) takes `takes` seconds; records the timeout each run got."""

    clock: Clock
    takes: dict[tuple[str, str], float] = field(default_factory=dict)
    # (plugin, verb): fails with code 7 unless CNI_ARGS has IgnoreUnknown (after its time).
    strict_args: set[tuple[str, str]] = field(default_factory=set)
    given: list[tuple[str, str, float]] = field(default_factory=list)
    args: list[str] = field(default_factory=list)

    def find(self, plugin: str, dirs: object, verb: str) -> str:
        return f"/fake/{plugin}"

    async def execute(self, plugin: str, binary: str, inv: Invocation, stdin: bytes,
                      timeout: float) -> bytes:
        self.given.append((plugin, inv.command, timeout))
        self.args.append(inv.args)
        took = self.takes.get((plugin, inv.command), 0.0)
        if took > timeout:
            self.clock.now += timeout
            raise PluginTimeout(plugin, inv.command, timeout)
        self.clock.now += took
        if (plugin, inv.command) in self.strict_args and "IgnoreUnknown" not in inv.args:
            raise PluginError(plugin, inv.command, 7, "unknown args")
        if inv.command == "ADD":
            return json.dumps(json.loads(stdin).get("prevResult") or RESULT).encode()
        return b""

    def runs(self, verb: str) -> list[tuple[str, float]]:
        return [(p, t) for p, v, t in self.given if v == verb]


def chain(*types: str) -> NetworkConfigList:
    doc = {"cniVersion": "1.1.0", "name": "pods", "plugins": [{"type": t} for t in types]}
    return parse_list(json.dumps(doc).encode(), "/etc/cni/net.d/10-pods.conflist")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    # Only the runtime's clock: the event loop keeps the real one.
    monkeypatch.setattr(runtime_module, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


def make_runtime(tmp_path: Path, clock: Clock, **takes: float) -> tuple[CNIRuntime, TimedExecutor]:
    """`takes`: PLUGIN_VERB=seconds, e.g. b_ADD=4."""
    ex = TimedExecutor(clock, {(k.partition("_")[0], k.partition("_")[2]): v
                               for k, v in takes.items()})
    rt = CNIRuntime([], str(tmp_path / "state"), executor=ex,
                    timeouts=Timeouts(add=10, delete=6, check=3, status=2))
    return rt, ex


def test_the_deadline_is_one_budget_on_the_monotonic_clock() -> None:
    d = ChainDeadline.starting("ADD", "pods", 120, now=50.0)
    assert d.ends == 170.0
    assert d.left(now=50.0) == 120.0
    assert d.left(now=100.0) == 70.0
    assert d.left(now=170.0) == 0.0 and d.left(now=500.0) == 0.0  # never negative


def test_timeouts_name_the_chain_the_plugin_and_the_key() -> None:
    d = ChainDeadline.starting("ADD", "pods", 120, now=0.0)
    killed = d.timed_out("tuning", 7.25)
    assert isinstance(killed, PluginTimeout) and killed.timeout == 7.25
    assert str(killed) == ("plugin tuning ADD: timed out after 7.25s (process group killed): "
                           "the ADD chain of network pods ran out of its 120s (timeouts.add)")
    # What a whole 1s chain gave its first plugin, less the moment before it
    # started, reads as 1s: shown to 10 ms.
    first = ChainDeadline.starting("ADD", "pods", 1, now=0.0).timed_out("bridge", 0.9994)
    assert "timed out after 1s (process group killed)" in str(first) and first.timeout == 0.9994
    assert "after 0.25s" in str(d.timed_out("tuning", 0.2521))
    never = ChainDeadline.starting("DEL", "pods", 60, now=0.0).timed_out("portmap", 0.0)
    assert isinstance(never, PluginTimeout) and never.timeout == 0.0
    assert str(never) == ("plugin portmap DEL: not started: the DEL chain of network pods ran "
                          "out of its 60s (timeouts.del)")


async def test_each_plugin_of_an_add_gets_what_is_left(tmp_path: Path, clock: Clock) -> None:
    runtime, ex = make_runtime(tmp_path, clock, a_ADD=3, b_ADD=4, c_ADD=2)
    await runtime.add(chain("a", "b", "c"), RT)
    assert ex.runs("ADD") == [("a", 10), ("b", 7), ("c", 3)]


async def test_the_whole_add_chain_is_bounded_by_timeouts_add(tmp_path: Path, clock: Clock) -> None:
    # Each plugin alone is well within timeouts.add; the three together are not.
    runtime, ex = make_runtime(tmp_path, clock, a_ADD=4, b_ADD=4, c_ADD=4)
    start = clock.now
    with pytest.raises(PluginTimeout) as e:
        await runtime.add(chain("a", "b", "c"), RT)
    assert clock.now - start == 10  # timeouts.add, not three times it
    assert ex.runs("ADD") == [("a", 10), ("b", 6), ("c", 2)]
    assert str(e.value) == ("plugin c ADD: timed out after 2s (process group killed): "
                            "the ADD chain of network pods ran out of its 10s (timeouts.add)")
    assert runtime.cache.for_container("c1") == []


async def test_a_plugin_due_with_no_time_left_is_not_started(tmp_path: Path, clock: Clock) -> None:
    runtime, ex = make_runtime(tmp_path, clock, a_ADD=4, b_ADD=6)  # b ends on the deadline
    with pytest.raises(PluginTimeout) as e:
        await runtime.add(chain("a", "b", "c"), RT)
    assert ex.runs("ADD") == [("a", 10), ("b", 6)]  # c never ran
    assert e.value.plugin == "c" and e.value.timeout == 0
    assert "plugin c ADD: not started: the ADD chain of network pods ran out of its 10s" \
        in str(e.value)


async def test_the_rollback_of_a_timed_out_add_has_its_own_deadline(
        tmp_path: Path, clock: Clock) -> None:
    runtime, ex = make_runtime(tmp_path, clock, a_ADD=4, b_ADD=20, c_DEL=2)
    net = chain("a", "b", "c")
    with pytest.raises(PluginTimeout):
        await runtime.add(net, RT)
    # The DEL the caller sends next (the spec's rollback) starts with the whole timeouts.del.
    await runtime.delete(net, RT)
    assert ex.runs("DEL") == [("c", 6), ("b", 4), ("a", 4)]


async def test_the_whole_del_chain_is_bounded_and_not_retried_after_a_timeout(
        tmp_path: Path, clock: Clock) -> None:
    runtime, ex = make_runtime(tmp_path, clock, c_DEL=2, b_DEL=5)
    start = clock.now
    with pytest.raises(PluginTimeout) as e:
        await runtime.delete(chain("a", "b", "c"), RuntimeConf("c1", "", "eth0", (("K", "V"),)))
    assert clock.now - start == 6
    assert ex.runs("DEL") == [("c", 6), ("b", 4)]
    assert "ran out of its 6s (timeouts.del)" in str(e.value)
    # A timeout is not what the IgnoreUnknown retry is for: no second chain.
    assert ex.args == ["K=V", "K=V"]


async def test_the_ignore_unknown_retry_of_a_del_shares_its_deadline(
        tmp_path: Path, clock: Clock) -> None:
    runtime, ex = make_runtime(tmp_path, clock, c_DEL=2, b_DEL=3)
    ex.strict_args.add(("c", "DEL"))
    with pytest.raises(PluginTimeout):
        await runtime.delete(chain("a", "b", "c"), RuntimeConf("c1", "", "eth0", (("K", "V"),)))
    # c refused K=V after 2s; the retry (c again, then b) had the 4s left, not 6 more.
    assert ex.runs("DEL") == [("c", 6), ("c", 4), ("b", 2)]
    assert ex.args[1].startswith("IgnoreUnknown=1;")


async def test_the_whole_check_chain_is_bounded_by_timeouts_check(
        tmp_path: Path, clock: Clock) -> None:
    runtime, ex = make_runtime(tmp_path, clock, a_CHECK=2, b_CHECK=2)
    with pytest.raises(PluginTimeout) as e:
        await runtime.check(chain("a", "b", "c"), RT, prev_result=RESULT)
    assert ex.runs("CHECK") == [("a", 3), ("b", 1)]
    assert "ran out of its 3s (timeouts.check)" in str(e.value)


async def test_status_still_times_each_plugin(tmp_path: Path, clock: Clock) -> None:
    # STATUS, GC and VERSION are probes of one plugin each: timeouts.status is per plugin.
    runtime, ex = make_runtime(tmp_path, clock, a_STATUS=1.5, b_STATUS=1.5, c_STATUS=1.5)
    assert await runtime.status(chain("a", "b", "c")) is True
    assert ex.runs("STATUS") == [("a", 2), ("b", 2), ("c", 2)]
